"""Rebalance schedules: segment boundaries, initial placements, skipping, migration cost and
migration-aware solving, and clean errors for bad settings.

Dimensions: `S` steps, `L` layers, `E` experts, `P` slots, `G` GPUs.
"""


import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.placement import Placement, trivial_placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.schedule.plan import plan, transfer_counts
from eplbsim.solvers import solve
from eplbsim.traces.synth import synthesize

TOPO = Topology(4, 2)
CFG = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8)


def plan_of(loads, spec):
    """`plan` for the spec's schedule and solver on 24 slots of TOPO, one group."""
    return plan(loads, spec.schedule, spec.solver, TOPO, 24, 1, spec.solver.placement,
                spec.schedule.initial)


@pytest.fixture(scope="module")
def loads():
    trace = synthesize("drift", steps=30, tokens=128, layers=2, experts=16, top_k=4, seed=1,
                       period=20)
    return trace.counts()  # [S, L, E]


def test_transfer_counts_hand_example():
    # 4 GPUs, 2 per node, 2 slots per GPU; node 0 = GPUs 0, 1 and node 1 = GPUs 2, 3
    old = Placement([[0, 1, 2, 3, 4, 5, 0, 1]], 6, TOPO)
    new = Placement([[1, 0, 2, 3, 4, 3, 5, 1]], 6, TOPO)
    # slots 0, 1: their GPU held 1 and 0 (same GPU); slot 5 takes 3, which node 1 never held
    # (other node); slot 6 takes 5, held on GPU 2 of its node (same node)
    assert transfer_counts(old, new).tolist() == [[2, 1, 1]]
    assert transfer_counts(old, old).tolist() == [[0, 0, 0]]


def test_transfers_count_every_changed_slot(loads):
    a = solve("deepseek", loads[:10].sum(0), 24, TOPO)
    b = solve("lpt", loads[20:].sum(0), 24, TOPO)
    moves = transfer_counts(a, b)  # [L, 3]
    assert moves.shape == (2, 3) and (moves >= 0).all()
    assert moves.sum(1).tolist() == (a.phy2log != b.phy2log).sum(1).tolist()


def test_transfer_counts_needs_one_layout():
    a = trivial_placement(1, 4, 8, TOPO)
    with pytest.raises(InputError, match="cannot compare"):
        transfer_counts(a, trivial_placement(1, 4, 8, Topology(4)))


def test_schedule_boundaries_first_solve_after_the_window(loads):
    segments = plan_of(loads, CFG.replace(rebalance_every=7, window=10))
    assert [(s.start, s.stop) for s in segments] == [(0, 10), (10, 17), (17, 24), (24, 30)]
    assert segments[0].rebalance is None
    assert torch.equal(segments[0].placement.phy2log, trivial_placement(2, 16, 24, TOPO).phy2log)
    assert [s.rebalance.step for s in segments[1:]] == [10, 17, 24]


def test_window_longer_than_the_trace_never_rebalances(loads):
    (only,) = plan_of(loads, CFG.replace(rebalance_every=5, window=40))
    assert (only.start, only.stop, only.rebalance) == (0, 30, None)


def test_without_a_schedule_one_placement_solved_from_everything(loads):
    (only,) = plan_of(loads, CFG)
    assert only.best is only.placement
    want = solve("deepseek", loads.sum(0), 24, TOPO)
    assert torch.equal(only.placement.phy2log, want.phy2log)


def test_initial_placement_serves_until_the_first_rebalance(loads):
    initial = solve("lpt", loads.sum(0), 24, TOPO)
    segments = plan_of(loads, CFG.replace(rebalance_every=10, initial=initial))
    assert segments[0].placement is initial


@pytest.mark.parametrize("skip_above, skipped", [(0.0, True), (1.0, False)])
def test_skip_threshold(loads, skip_above, skipped):
    cfg = CFG.replace(rebalance_every=6, skip_above=skip_above)
    segments = plan_of(loads, cfg)
    decisions = [s.rebalance for s in segments[1:]]
    assert decisions and all(r.skipped == skipped for r in decisions)
    assert all(0 < r.balancedness <= 1 for r in decisions)
    if skipped:  # balancedness is always above 0: every rebalance keeps the placement
        assert all(s.placement is segments[0].placement for s in segments)
        assert all(r.moved_slots == 0 for r in decisions)
    res = replay(synthesize("skewed", steps=12, tokens=64, layers=2, experts=16, top_k=4),
                 cfg.replace(policy="ordinal"))
    assert len(res.epochs) == (1 if skipped else 2)
    assert res.metrics["rebalances"] == (0 if skipped else 1)


def test_migration_aware_solving_moves_fewer_experts(loads):
    cfg = CFG.replace(rebalance_every=5)
    aware = plan_of(loads, cfg)
    blind = plan_of(loads, cfg.replace(migration_aware=False))
    moved = [sum(s.rebalance.moved_slots for s in segs[2:]) for segs in (aware, blind)]
    assert moved[0] < moved[1]


def test_oracle_best_is_the_placement_it_solved(loads):
    segments = plan_of(loads, CFG.replace(rebalance_every=6, predictor="oracle"))
    assert all(s.best is s.placement for s in segments[1:])
    window = plan_of(loads, CFG.replace(rebalance_every=6))
    assert any(s.best is not s.placement for s in window[1:])


def test_plan_is_deterministic(loads):
    cfg = CFG.replace(rebalance_every=4, predictor="ema")
    a, b = plan_of(loads, cfg), plan_of(loads, cfg)
    for x, y in zip(a, b):
        assert torch.equal(x.placement.phy2log, y.placement.phy2log)
        assert np.array_equal(getattr(x.rebalance, "transfers", 0),
                              getattr(y.rebalance, "transfers", 0))


def _bad_shape(past, future, window, decay):
    return past.sum(0)[:, :3].double()


def _nan(past, future, window, decay):
    return torch.full(past.shape[1:], float("nan"))


def _negative(past, future, window, decay):
    return -past.sum(0).double()


def test_schedule_settings_without_a_schedule_are_input_errors(loads):
    with pytest.raises(InputError, match="window, predictor only apply with rebalance_every"):
        plan_of(loads, CFG.replace(window=5, predictor="oracle"))


@pytest.mark.parametrize("change, match", [
    (dict(rebalance_every=0), "rebalance_every"),
    (dict(rebalance_every=5, window=0), "window"),
    (dict(rebalance_every=5, decay=1.5), "decay"),
    (dict(rebalance_every=5, skip_above=2.0), "skip_above"),
    (dict(rebalance_every=5, predictor="psychic"), "predictor"),
    (dict(rebalance_every=5, predictor=_bad_shape), "_bad_shape returned shape"),
    (dict(rebalance_every=5, predictor=_nan), "_nan returned NaN"),
    (dict(rebalance_every=5, predictor=_negative), "_negative returned NaN, infinite or neg"),
    (dict(rebalance_every=5, initial=trivial_placement(3, 16, 24, TOPO)), "initial placement"),
    (dict(rebalance_every=5, initial=trivial_placement(2, 16, 24, Topology(4))), "laid out"),
    (dict(rebalance_every=5, initial=3), "must be a path to a JSON placement, got 3"),
])
def test_bad_settings_are_input_errors(loads, change, match):
    with pytest.raises(InputError, match=match):
        plan_of(loads, CFG.replace(**change))
    assert CFG.replace(rebalance_every=5, initial="trivial").schedule.initial is None
