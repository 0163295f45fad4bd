"""Rebalancing in time (`schedule.switch`): sync and async schedules, ranks switching at
different steps, and what the replay counts of it (wrong-expert pairs in "a2a", disagreement and
multiplicity in "none").

Dimensions: `S` steps, `T` tokens, `L` layers, `E` experts, `K` top-k, `P` slots, `G` GPUs.
"""

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay, run_steps
from eplbsim.runspec import RunSpec
from eplbsim.schedule.plan import Segment
from eplbsim.schedule.switch import held_experts, phases
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace

TOPO = Topology(2)
OLD = Placement(torch.tensor([[0, 1]]), 2, TOPO)  # GPU 0 holds expert 0, GPU 1 expert 1
NEW = Placement(torch.tensor([[1, 0]]), 2, TOPO)  # swapped


def _swap_trace(e0_pairs, e1_pairs):
    """Three steps of `e0_pairs` tokens routed to expert 0 and `e1_pairs` to expert 1 (top-1)."""
    ids = torch.tensor([0] * e0_pairs + [1] * e1_pairs).view(-1, 1, 1).repeat(3, 1, 1)
    T = e0_pairs + e1_pairs
    return Trace(ids, torch.tensor([0, T, 2 * T, 3 * T]), 2)


def _swap_segments(switch):
    """OLD serves step 0; NEW from step 1, rank `r` switching at `switch[r]`."""
    return (Segment(0, 1, OLD, OLD, None),
            Segment(1, 3, NEW, NEW, None, None if switch is None else np.array(switch)))


def _swap_run(mode, switch, fast=True):
    spec = RunSpec.of(gpus=2, redundant=0, policy="row", mode=mode)
    return run_steps(_swap_trace(3, 5), spec, _swap_segments(switch), fast=fast)


def test_phases_split_a_segment_at_each_ranks_switch():
    got = phases(_swap_segments([1, 2]))
    assert [(lo, hi, p is NEW) for lo, hi, p, _ in got] == [(0, 1, False), (1, 2, True),
                                                          (2, 3, True)]
    assert got[0][3] is None and got[2][3] is None
    assert got[1][3][0] is NEW and got[1][3][1] is OLD
    assert held_experts(got[1][3]).tolist() == [[1, 1]]  # GPU 0 has NEW's expert 1, GPU 1 OLD's
    together = phases(_swap_segments(None))
    assert [(lo, hi) for lo, hi, _, serving in together if serving is None] == [(0, 1), (1, 3)]


@pytest.mark.parametrize("fast", [True, False])
def test_a2a_pairs_reach_the_wrong_expert_only_while_ranks_disagree(fast):
    # step 1: rank 0 serves NEW, rank 1 OLD; both GPUs hold expert 1 (module doc of switch).
    # Rank 0 sends expert 0 to slot 1 (expert 1 there), rank 1 sends it to slot 0 (expert 1
    # there): every expert-0 pair is wrong, every expert-1 pair right.
    _, counters = _swap_run("a2a", [1, 2], fast)
    assert counters.wrong[:, 0].tolist() == [0, 3, 0]
    assert counters.valid[:, 0].tolist() == [8, 8, 8]
    _, together = _swap_run("a2a", None, fast)
    assert together.wrong.sum() == 0


@pytest.mark.parametrize("fast", [True, False])
def test_none_ranks_drop_and_double_pairs_while_they_disagree(fast):
    # step 1: rank 0 (NEW) puts expert 0 on GPU 1 and expert 1 on its own GPU 0; rank 1 (OLD)
    # puts expert 0 on GPU 0 and expert 1 on its own GPU 1: expert-0 pairs run nowhere,
    # expert-1 pairs twice, and the ranks agree on no pair.
    slot_load, counters = _swap_run("none", [1, 2], fast)
    assert counters.multiplicity_counts[1, 0].tolist() == [3, 0, 5]
    assert counters.agreed[:, 0].tolist() == [8, 0, 8]
    assert slot_load[1, 0].tolist() == [5, 5]
    assert counters.error[1, 0, 0] > 0
    _, together = _swap_run("none", None, fast)
    assert together.multiplicity_counts[:, 0, 1].tolist() == [8, 8, 8]
    assert (together.agreed[:, 0] == 8).all()


def _drift(**schedule):
    trace = synthesize("drift", seed=3, steps=24, tokens=96, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=4, rebalance_every=6, **schedule)
    return trace, spec


@pytest.mark.parametrize("policy", ["row", "ordinal"])
def test_async_with_every_rank_switching_together_counts_no_corruption(policy):
    trace, spec = _drift(rebalance_mode="async", copy_steps=3)
    for mode in ("none", "a2a"):
        m = replay(trace, spec.replace(policy=policy, mode=mode)).metrics
        assert m["rebalances"] > 0 and m["moved_slots"] > 0 and m["hazard_steps"] == 0
        assert m["multiplicity"]["1"] == 1.0
        if mode == "none":
            assert m["rank_agreement"] == 1.0 and m["output_rel_error"] == 0.0
        else:
            assert m["wrong_expert_frac"] == 0.0


def test_async_serves_the_old_placement_until_the_copies_land():
    trace, spec = _drift()
    sync = replay(trace, spec).segments
    later = replay(trace, spec.replace(rebalance_mode="async", copy_steps=2)).segments
    assert [s.start for s in later] == [0] + [s.start + 2 for s in sync[1:]]
    assert [s.stop for s in later[:-1]] == [s.start for s in later[1:]]
    assert all(a.placement is not None and torch.equal(a.placement.phy2log, b.placement.phy2log)
               for a, b in zip(later, sync))


def test_async_with_a_switch_delay_corrupts_both_modes_reproducibly():
    trace, spec = _drift(rebalance_mode="async", switch_delay=3, policy="row")
    none = replay(trace, spec).metrics
    a2a = replay(trace, spec.replace(mode="a2a")).metrics
    assert none["hazard_steps"] > 0 and none["hazard_steps"] == a2a["hazard_steps"]
    assert none["rank_agreement"] < 1 and none["multiplicity"]["1"] < 1
    assert a2a["wrong_expert_frac"] > 0 and a2a["multiplicity"]["1"] == 1.0
    again = replay(trace, spec.replace(mode="a2a")).metrics
    assert again["wrong_expert_frac"] == a2a["wrong_expert_frac"]
    other = replay(trace, spec.replace(mode="a2a", seed=5)).segments
    assert any(s.switch is not None and not np.array_equal(s.switch, t.switch)
               for s, t in zip(replay(trace, spec).segments, other))


def test_async_stalls_nothing_and_sync_stalls_for_moves():
    trace, spec = _drift(cost="roofline", model="olmoe-1b-7b", device_profile="h100-sxm")
    assert replay(trace, spec).metrics["rebalance_stall_ms"] > 0
    assert replay(trace, spec.replace(rebalance_mode="async")).metrics[
        "rebalance_stall_ms"] == 0.0


@pytest.mark.parametrize("values, match", [
    ({"rebalance_mode": "async"}, "only apply with rebalance_every"),
    ({"rebalance_every": 4, "switch_delay": 1}, "only apply with rebalance_mode async"),
    ({"rebalance_every": 4, "rebalance_mode": "async", "copy_steps": 3, "switch_delay": 2},
     "at most rebalance_every"),
    ({"rebalance_every": 4, "rebalance_mode": "later"}, "unknown rebalance mode"),
])
def test_switch_settings_that_do_not_go_together_are_refused(values, match):
    with pytest.raises(InputError, match=match):
        RunSpec.of(**values)
