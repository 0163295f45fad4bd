"""The policy checkers: every registered policy keeps its contract; rank invariance is measured
as the replay measures it; broken prototypes are named.

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` experts, `P` slots, `G` ranks.
"""

import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES, replica_slots
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.ranks.checks import check_policy, rank_invariance
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.solvers import solve
from eplbsim.traces.synth import synthesize

TRACE = synthesize("skewed", steps=2, tokens=48, layers=2, experts=16, top_k=4, seed=3)
PLACEMENT = solve("deepseek", TRACE.counts().sum(0), 24, Topology(4, 2))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_policy_keeps_its_contract(name):
    check_policy(name, TRACE.step(0), PLACEMENT)


@pytest.mark.parametrize("name", [n for n in sorted(POLICIES) if "none" in POLICIES[n].modes])
def test_rank_invariance_matches_the_replay(name):
    ids = TRACE.step(0)
    got = rank_invariance(name, ids, PLACEMENT)
    cfg = RunSpec.of(policy=name, gpus=4, gpus_per_node=2, redundant=8,
                       placement=PLACEMENT)
    one_step = type(TRACE).from_steps([ids], num_experts=16)
    assert got.agreement == replay(one_step, cfg).metrics["rank_agreement"]
    if POLICIES[name].rank_invariant:
        assert got.invariant and got.first is None
    if name in ("static", "random"):
        assert not got.invariant
        (t, layer, k), slots = got.first
        assert len(set(slots)) > 1 and len(slots) == 4


def test_the_nearest_view_breaks_row_and_shared_generators_fix_random():
    ids = TRACE.step(1)
    mapping = Placement(PLACEMENT.phy2log, PLACEMENT.num_experts, PLACEMENT.topology)  # no order
    assert not rank_invariance("row", ids, mapping, view="sglang-0.5.14").invariant
    assert rank_invariance("random", ids, PLACEMENT, rng="shared").invariant


def _wrong_slot(topk_ids, view, ctx):
    return (replica_slots(topk_ids, view, ctx.layer, torch.zeros_like(topk_ids)) + 1) % 24


def _in_place(topk_ids, view, ctx):
    topk_ids[0, 0] = 0
    return replica_slots(topk_ids, view, ctx.layer, torch.zeros_like(topk_ids))


def _crash(topk_ids, view, ctx):
    raise ZeroDivisionError("oops")


@pytest.mark.parametrize("policy, match", [
    (_wrong_slot, "_wrong_slot sent pair"),
    (_in_place, "_in_place modified the topk_ids"),
    (_crash, "_crash raised ZeroDivisionError on rank 0: oops"),
    (lambda ids, view, ctx: ids.float(), "returned torch.float32"),
])
def test_broken_prototypes_are_named(policy, match):
    with pytest.raises(InputError, match=match):
        check_policy(policy, TRACE.step(0), PLACEMENT)


def test_bad_ids_are_input_errors():
    with pytest.raises(InputError, match="outside"):
        check_policy("row", TRACE.step(0) + 100, PLACEMENT)
    with pytest.raises(InputError, match="1 layers"):
        check_policy("row", TRACE.step(0)[:, 0], PLACEMENT)
