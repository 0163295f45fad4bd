"""Token spill (eplbsim.dispatch.spill, eplbsim.ranks.spill): plans worked by hand, and the
contracts of every spill policy in the registry: a pair runs where its expert's weights are,
`spill` keeps every GPU within its capacity, ranks agree where the rule reads the global counts
and disagree where each reads its own, and the fetch metrics count what was fetched."""

import numpy as np
import pytest
import torch

from eplbsim import RunSpec, compare, replay, synthesize
from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.spill import Site, capacity, llep_moves, moonep_moves
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.ranks import MODES
from eplbsim.ranks.checks import rank_epoch, rank_invariance
from eplbsim.ranks.traffic import held_experts

SPILLS = sorted(name for name, entry in POLICIES.items() if entry.spill is not None)
GLOBAL = [name for name in SPILLS if not POLICIES[name].spill.local]


def one_each(num_gpus: int, per_node: int | None = None, extra: list[int] = ()) -> Placement:
    """Expert g on GPU g (one slot each), then `extra` replicas, one a GPU from GPU 0."""
    phy2log = torch.tensor([list(range(num_gpus)) + list(extra)])
    slots_per_gpu = 1 + (len(extra) > 0)
    if extra:  # slot g and slot G + g on GPU g
        order = [e for g in range(num_gpus) for e in (g, extra[g])]
        phy2log = torch.tensor([order])
    return Placement(phy2log, num_gpus, Topology(num_gpus, per_node or num_gpus))


def test_moonep_spreads_a_hot_gpu_over_the_others_worked_by_hand():
    """4 GPUs of one slot, 16 pairs: capacity 4; GPU 0's surplus of 6 goes 2 each to GPUs 1, 2,
    3 (equal room: the lowest first), each fetching expert 0; slot 0 keeps its first 4 pairs."""
    site = Site.of(one_each(4))
    counts = np.array([10, 2, 2, 2])
    assert capacity(16, 4) == 4
    assert moonep_moves(counts, site, 0) == [(0, 2, 5), (0, 2, 6), (0, 2, 7)]
    phys = torch.tensor([0] * 10 + [1, 1, 2, 2, 3, 3]).view(-1, 1, 1)  # [T, L, K]
    moves = POLICIES["spill"].spill.moves(counts[None], site)
    applied = moves.apply(phys, phys.clamp(min=0), site)  # slot p holds expert p
    run = applied.run.flatten().tolist()
    assert run == [0, 0, 0, 0, 5, 5, 6, 6, 7, 7, 1, 1, 2, 2, 3, 3]
    assert applied.counts.tolist() == [[4, 2, 2, 2, 0, 2, 2, 2]]  # [L, P + G]
    assert applied.marks[0, :, 0].tolist() == [False, True, True, True]  # expert 0 fetched


def test_moonep_fills_the_donors_node_first_and_a_receivers_own_replica():
    """2 nodes of 2 GPUs; GPU 0 (experts 0 and 1) holds all 9 pairs, capacity 3: GPU 1, on its
    node, is filled first though GPUs 2 and 3 across have as much room, with expert 1's pairs
    (the hottest); then GPU 2 (the lowest across) takes 3 of expert 0's. Each fetches."""
    # GPU g holds slots 2g, 2g + 1
    placement = Placement(torch.tensor([[0, 1, 2, 2, 3, 3, 3, 1]]), 4, Topology(4, 2))
    site = Site.of(placement)
    counts = np.array([3, 6, 0, 0, 0, 0, 0, 0])
    assert moonep_moves(counts, site, 0) == [(1, 3, 8 + 1), (0, 3, 8 + 2)]
    """One node of 2 GPUs, expert 1 on both: GPU 0's surplus of expert 1 runs on GPU 1's
    replica (slot 2), fetching nothing."""
    placement = Placement(torch.tensor([[0, 1, 1, 2]]), 3, Topology(2))
    assert moonep_moves(np.array([1, 5, 0, 0]), Site.of(placement), 0) == [(1, 3, 2)]


def test_llep_keeps_the_home_gpu_at_capacity_and_spills_chunks_of_at_least_m():
    """4 GPUs, 20 pairs: capacity int(1.1 x 5) = 5. Slot 0 (12 pairs) keeps 5; its 7 go in
    chunks of at least 3 (or the rest) to the least-loaded GPUs: GPU 3 (load 0) takes 5; no GPU
    has room for the last 2 (1 each), so the least loaded, GPU 1, takes them over capacity.
    Slot 1 (GPU 1, 2 assigned) then keeps 3 and its last pair, the rest, goes to GPU 2."""
    site = Site.of(one_each(4))
    counts = np.array([12, 4, 4, 0])
    assert llep_moves(counts, site, 0, min_chunk=3) == [(0, 5, 4 + 3), (0, 2, 4 + 1),
                                                        (1, 1, 4 + 2)]
    assert llep_moves(counts, site, 0, min_chunk=3, threshold=5.0) == []  # max / mean 2.4
    assert llep_moves(counts, site, 0, min_chunk=8) == [(0, 7, 4 + 3)]  # the rest, whole


@pytest.fixture(scope="module")
def skewed():
    return synthesize("skewed", steps=3, tokens=96, layers=2, experts=16, top_k=4, seed=3)


def _step(name: str, placement: Placement, ids: torch.Tensor, mode: str):
    epoch = rank_epoch(name, placement, "full", "independent", 0, 0, mode, ids.shape[-1])
    return MODES[mode](epoch, 0, ids), epoch


@pytest.mark.parametrize("mode", ["none", "a2a"])
@pytest.mark.parametrize("name", SPILLS)
def test_every_spilled_pair_runs_where_its_experts_weights_are(name, mode, skewed):
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=4)
    placement = replay(skewed, spec.replace(policy="ordinal")).segments[0].placement
    ids = skewed.step(0)
    out, epoch = _step(name, placement, ids, mode)
    valid = ids >= 0
    for places in out.choices:  # each rank's places ("a2a": its own pairs, -1 elsewhere)
        held = held_experts(placement.phy2log, places, ids)
        ran = places >= 0
        assert torch.equal(held[ran], ids.long()[ran])
    assert out.spilled.sum() > 0, "the skewed batch has a surplus to spill"
    executed = out.slot_load.sum(-1) + out.spilled.sum(-1)
    if POLICIES[name].invariant():
        assert torch.equal(executed, valid.sum((0, 2)))
        assert out.multiplicity_counts[:, 1].sum() == valid.sum()


@pytest.mark.parametrize("mode", ["none", "a2a"])
def test_spill_keeps_every_gpu_within_its_capacity(mode, skewed):
    for slack in (0.0, 0.25):
        spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=0, spill_slack=slack)
        res = replay(skewed, spec.replace(policy="spill", mode=mode))
        gpu = torch.zeros_like(res.counters.spilled).index_add_(
            2, res.segments[0].placement.slot_gpu.long(), res.slot_load.long())
        gpu += res.counters.spilled
        bound = torch.tensor([[capacity(int(v), 4, slack) for v in step]
                              for step in res.counters.valid])
        assert (gpu.amax(-1) <= bound).all()
        assert res.metrics["gpu_imbalance"] <= 1.0 + slack + 4 / int(res.counters.valid.min())


def test_the_naive_port_disagrees_where_the_global_rule_agrees(skewed):
    spec = RunSpec.of(gpus=4, redundant=4)
    placement = replay(skewed, spec.replace(policy="ordinal")).segments[0].placement
    ids = skewed.step(0)
    for name in GLOBAL:
        assert rank_invariance(name, ids, placement).invariant
    assert not rank_invariance("spill-local", ids, placement).invariant
    rows = {r.spec.dispatch.policy: r.metrics for r in compare(
        skewed, ["spill", "spill-local"], ["none"], spec.replace(redundant=0))}
    assert rows["spill"]["rank_agreement"] == 1.0 and rows["spill"]["output_rel_error"] < 1e-6
    assert rows["spill-local"]["rank_agreement"] < 1.0
    assert rows["spill-local"]["output_rel_error"] > 1e-3


def test_fetch_metrics_count_the_fetched_experts_and_their_bytes(skewed):
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=0, model="deepseek-v3",
                      cost="roofline")
    spilled = replay(skewed, spec.replace(policy="spill"))
    plain = replay(skewed, spec.replace(policy="ordinal"))
    c, m = spilled.counters, spilled.metrics
    assert m["spill_frac"] == pytest.approx(float(c.spilled.sum() / c.valid.sum()))
    assert 0 < m["spill_frac"] < 1
    assert m["fetched_experts"] == pytest.approx(float(c.fetched.sum()) / c.spilled.numel())
    layers_per_trace_layer = spec.cost.profiles()[0].moe_layers / skewed.num_layers
    expected = (float(c.fetched.sum()) / skewed.num_steps * spec.expert_bytes()
                * layers_per_trace_layer)
    assert m["fetch_bytes"] == pytest.approx(expected, rel=1e-6)
    assert m["fetch_ms"] > 0 and plain.metrics["fetch_ms"] == 0
    assert plain.metrics["spill_frac"] is None and plain.metrics["fetch_bytes"] is None
    # the balance it buys, and what it costs: fetched weights are read too
    assert m["gpu_imbalance"] < plain.metrics["gpu_imbalance"]
    assert m["comm_ms"] == pytest.approx(plain.metrics["comm_ms"] + m["fetch_ms"], rel=1e-6)


def test_the_compiled_step_plan_is_the_layer_by_layer_plan():
    rng = np.random.default_rng(5)
    placement = Placement(torch.from_numpy(np.stack([rng.permutation(12) for _ in range(4)])
                                           % 10), 10, Topology(4, 2))
    site = Site.of(placement)
    counts = rng.integers(0, 40, size=(4, 12)) * (rng.random((4, 12)) < 0.8)
    for slack in (0.0, 0.2):
        rule = POLICIES["spill"].spill
        fast = rule.moves(counts, site, slack)
        slow = type(rule)(rule.plan).moves(counts, site, slack)  # the same rule, layer by layer
        for name in ("layer", "slot", "start", "stop", "place"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
        assert len(fast) > 0


def test_one_pass_over_every_rank_equals_each_rank_moving_its_own_rows():
    """In "a2a" a rank moves its own pairs by their position among every rank's pairs on the
    slot; with rank order row order, one pass over the rows of all ranks does the same."""
    rng = np.random.default_rng(7)
    placement = Placement(torch.arange(12).remainder(10)[None].expand(3, 12), 10, Topology(4))
    site = Site.of(placement)
    phys = torch.from_numpy(rng.choice(12, size=(64, 3, 2), p=np.r_[[0.3], [0.7 / 11] * 11]))
    ids = placement.phy2log[torch.arange(3).view(1, -1, 1), phys]
    bounds = [0, 10, 30, 41, 64]  # four ranks' rows
    counts = [np.stack([np.bincount(phys[a:b, layer].flatten(), minlength=12)
                        for layer in range(3)]) for a, b in zip(bounds, bounds[1:])]
    moves = POLICIES["spill"].spill.moves(sum(counts), site)
    assert len(moves) > 0
    whole = moves.apply(phys.clone(), ids, site)
    earlier = np.zeros((3, 12), np.int64)
    for (a, b), here in zip(zip(bounds, bounds[1:]), counts):
        part = moves.apply(phys[a:b].clone(), ids[a:b], site, torch.from_numpy(earlier), here)
        assert torch.equal(part.run, whole.run[a:b])
        earlier += here
