"""Tests of eplbsim.solvers.exact: the MILP placement, its proven bound and its limits.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplbsim.base.errors import InputError
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.solvers import SOLVERS, solve, solve_with_info
from eplbsim.solvers.exact import MAX_INTEGER_VARIABLES, exact

EXAMPLE = [[600, 560, 120, 120, 20, 10, 10, 10]]  # 16 slots on 8 GPUs: optimum 590 / 3
INFO_KEYS = {"objective", "bound", "optimal", "status", "seconds", "gap", "nodes"}


def _max_gpu_load(placement: Placement, load) -> np.ndarray:
    """Max over GPUs of the even-split promise, per layer: `[L]`."""
    slot = placement.expected_load(torch.as_tensor(np.asarray(load, dtype=np.float64)))  # [L, P]
    return slot.reshape(slot.shape[0], placement.topology.num_gpus, -1).sum(-1).amax(-1).numpy()


def _colocated(placement: Placement) -> bool:
    """Does some GPU hold two replicas of one expert?"""
    L = placement.num_layers
    per_gpu = placement.phy2log.reshape(L, placement.topology.num_gpus, -1)  # [L, G, P/G]
    return bool((per_gpu.sort(-1).values.diff(dim=-1) == 0).any())


def test_registered():
    assert SOLVERS["exact"] is exact


def test_reaches_and_proves_the_example_optimum():
    placement, info = solve_with_info("exact", EXAMPLE, 16, Topology(8))
    assert set(info) == INFO_KEYS
    assert all(len(v) == 1 for v in info.values())
    assert info["objective"][0] == pytest.approx(590 / 3, abs=1e-6)
    assert info["optimal"] == [True] and info["status"] == ["optimal"]
    assert 590 / 3 - 1e-6 <= info["bound"][0] <= info["objective"][0] + 1e-9
    assert _max_gpu_load(placement, EXAMPLE)[0] == pytest.approx(info["objective"][0])
    assert info["seconds"][0] < 30
    per_gpu = placement.phy2log.reshape(8, 2)  # each GPU's slots in expert order
    assert torch.equal(per_gpu, per_gpu.sort(-1).values)
    # the published algorithm: 232 on the same instance
    assert _max_gpu_load(solve("deepseek", EXAMPLE, 16, Topology(8)), EXAMPLE)[0] == \
        pytest.approx(232)


def test_anti_colocation_on_the_example():
    placement, info = solve_with_info("exact", EXAMPLE, 16, Topology(8), anti_colocation=True)
    assert not _colocated(placement)
    assert info["optimal"] == [True]
    assert info["objective"][0] >= 590 / 3 - 1e-6


def test_anti_colocation_costs_balance_when_it_binds():
    # 2 slots per GPU: free, expert 1 fills a GPU alone (59 | 44 + 6); apart, the best is
    # {1, 2} | {0, 2}: 59 + 3 = 62
    load = [[44.0, 59.0, 6.0]]
    free, info_free = solve_with_info("exact", load, 4, Topology(2))
    anti, info_anti = solve_with_info("exact", load, 4, Topology(2), anti_colocation=True)
    assert _colocated(free) and not _colocated(anti)
    assert info_free["objective"] == pytest.approx([59.0])
    assert info_anti["objective"] == pytest.approx([62.0])
    assert info_free["optimal"] == info_anti["optimal"] == [True]


def _brute_force(load: np.ndarray, P: int, G: int) -> float:
    """The optimum max GPU load over all `E ** P` slot assignments covering every expert."""
    E = load.size
    best = np.inf
    for p2l in itertools.product(range(E), repeat=P):
        count = np.bincount(p2l, minlength=E)
        if (count == 0).any():
            continue
        per_slot = load[list(p2l)] / count[list(p2l)]
        best = min(best, per_slot.reshape(G, -1).sum(1).max())
    return float(best)


@pytest.mark.parametrize("E,P,G,seed", [(3, 6, 3, 0), (3, 6, 2, 1), (4, 8, 4, 2), (2, 6, 3, 3),
                                        (4, 6, 2, 4)])
def test_matches_brute_force(E, P, G, seed):
    rng = np.random.default_rng(seed)
    load = np.round(rng.random(E) * np.exp(2 * rng.standard_normal(E)) * 100)  # [E]
    _, info = solve_with_info("exact", load[None, :], P, Topology(G))
    assert info["optimal"] == [True]
    assert info["objective"][0] == pytest.approx(_brute_force(load, P, G), rel=1e-6)


@st.composite
def small_instances(draw):
    """(load [L, E], P, topology, num_groups) with E <= 6, G <= 4 and a few spare slots."""
    gpn = draw(st.sampled_from([1, 2, 4]))
    G = gpn * draw(st.integers(1, 4 // gpn))
    groups = draw(st.sampled_from([1, 2, 3]))
    E = groups * draw(st.integers(1, 6 // groups))
    P = G * draw(st.integers(-(-E // G), -(-E // G) + 2))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    L = draw(st.integers(1, 2))
    load = rng.random((L, E)) * np.exp(draw(st.sampled_from([0.0, 1.0, 2.5]))
                                       * rng.standard_normal((L, E))) * 1000
    if seed % 2:
        load = np.round(load)  # integer counts with ties
    return load, P, Topology(G, gpn), groups


@settings(max_examples=25, deadline=None)
@given(instance=small_instances())
def test_never_worse_than_deepseek(instance):
    load, P, topo, groups = instance
    placement, info = solve_with_info("exact", load, P, topo, groups, node_limit=100)
    ours = _max_gpu_load(placement, load)
    assert np.allclose(ours, info["objective"])
    total = load.sum(1) / topo.num_gpus
    assert (np.array(info["bound"]) >= total * (1 - 1e-9)).all()
    assert (np.array(info["bound"]) <= ours * (1 + 1e-9) + 1e-9).all()
    global_ds = _max_gpu_load(solve("deepseek", load, P, Topology(topo.num_gpus)), load)
    assert (ours <= global_ds * (1 + 1e-9) + 1e-9).all()
    if all(info["optimal"]):  # the global optimum is a lower bound for hierarchical placements
        ds = _max_gpu_load(solve("deepseek", load, P, topo, groups), load)
        assert (ours <= ds * (1 + 1e-9) + 1e-9).all()


def test_several_layers_and_zero_load():
    load = np.array([[0.0, 0.0, 0.0, 0.0], [40.0, 10.0, 10.0, 0.0]])
    placement, info = solve_with_info("exact", load, 8, Topology(4))
    assert set(info) == INFO_KEYS and all(len(v) == 2 for v in info.values())
    assert info["objective"] == pytest.approx([0.0, 50 / 3])  # brute force
    assert info["optimal"] == [True, True]
    assert (placement.logcnt >= 1).all()


def test_too_large_is_an_input_error():
    with pytest.raises(InputError, match=r"too large.*64 experts x 65 replica counts x 16 GPUs"):
        solve("exact", np.ones((1, 64)), 128, Topology(16))
    assert 64 * 65 * 16 > MAX_INTEGER_VARIABLES


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "5", True])
def test_time_limit_must_be_positive(bad):
    with pytest.raises(InputError, match="time_limit"):
        solve("exact", np.ones((1, 4)), 4, Topology(2), time_limit=bad)


def test_anti_colocation_impossible():
    with pytest.raises(InputError, match="anti_colocation is impossible"):
        solve("exact", np.ones((1, 3)), 8, Topology(2), anti_colocation=True)


def test_unknown_option_is_rejected():
    with pytest.raises(InputError, match="no option nodes.*anti_colocation"):
        solve("exact", np.ones((1, 4)), 4, Topology(2), nodes=2)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "5", True])
def test_node_limit_must_be_a_positive_count(bad):
    with pytest.raises(InputError, match="node_limit"):
        solve("exact", np.ones((1, 4)), 4, Topology(2), node_limit=bad)


def test_time_limit_returns_a_placement():
    rng = np.random.default_rng(7)
    load = rng.integers(0, 100, size=(1, 12)).astype(np.float64)
    placement, info = solve_with_info("exact", load, 16, Topology(8), time_limit=0.5)
    assert info["status"][0] in ("optimal", "budget")
    assert info["bound"][0] <= info["objective"][0] + 1e-9
    assert _max_gpu_load(placement, load)[0] == pytest.approx(info["objective"][0])


def test_a_work_budget_gives_the_same_placement_every_run_and_reports_its_gap():
    """A hard instance (near-equal loads, 2 slots a GPU) stopped by its node budget: the same
    placement and numbers on every run (no wall clock in them), the gap it proved reported."""
    rng = np.random.default_rng(0)
    load = rng.random((1, 12)) * 100 + 100
    runs = [solve_with_info("exact", load, 16, Topology(8), node_limit=60) for _ in range(2)]
    (first, info), (again, info2) = runs
    assert torch.equal(first.phy2log, again.phy2log)
    assert info["status"] == ["budget"] and not info["optimal"][0]
    assert 0 < info["nodes"][0] <= 61 and info["nodes"] == info2["nodes"]
    gap = (info["objective"][0] - info["bound"][0]) / info["objective"][0]
    assert info["gap"][0] == pytest.approx(gap) and gap > 0
    assert info["objective"] == info2["objective"] and info["bound"] == info2["bound"]


def test_solve_says_the_gap_each_layer_proved_and_its_budget_in_help(tmp_path, capsys):
    from eplbsim.cli import main
    from eplbsim.solvers.exact import NODE_LIMIT
    path = tmp_path / "load.json"
    path.write_text("[[600, 560, 120, 120, 20, 10, 10, 10]]")
    assert main(["solve", "--load", str(path), "--slots", "16", "--gpus", "8", "--solver",
                 "exact", "-o", "node_limit=40"]) == 0
    out = capsys.readouterr().out
    assert "(budget, proven gap " in out and "40 nodes)" in out
    assert main(["solve", "--help"]) == 0
    assert f"default {NODE_LIMIT} branch-and-bound nodes" in " ".join(
        capsys.readouterr().out.split())
