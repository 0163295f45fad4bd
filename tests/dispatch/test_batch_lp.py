"""Per-batch LP dispatch: the fractions are valid and optimal, the quotas exact and optimal,
and the `lp` / `quota` policies in the rank model (DESIGN.md §3).

Dimensions: `T` tokens, `K` top-k, `E` experts, `R` max candidates, `P` slots, `G` GPUs.
"""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from eplbsim.base.errors import InputError
from eplbsim.dispatch import batch_lp
from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.batch_lp import gpu_load, integer_quotas, optimal_fractions, optimal_quotas
from eplbsim.dispatch.policies import DispatchContext, lp_fractions, lp_quotas, occurrence_index
from eplbsim.placement import Placement, full_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks import rank_groups
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize

from rank_helpers import step


def random_instance(seed, G=None, E=None, extra=None):
    """`(counts [E], log2phy [E, R], logcnt [E], slot_gpu [P], G)` of a random placement with
    skewed counts (some zero)."""
    gen = torch.Generator().manual_seed(seed)
    G = G or int(torch.randint(1, 5, (1,), generator=gen))
    E = E or int(torch.randint(2, 10, (1,), generator=gen))
    per_gpu = -(-E // G) + (int(torch.randint(0, 3, (1,), generator=gen)) if extra is None
                            else extra)
    P = G * per_gpu
    p2l = torch.cat([torch.arange(E), torch.randint(0, E, (P - E,), generator=gen)])
    placement = Placement(p2l[torch.randperm(P, generator=gen)].unsqueeze(0), E, Topology(G))
    weights = torch.rand(E, generator=gen) ** 3
    counts = torch.poisson(weights * 40, generator=gen).long()
    counts[torch.rand(E, generator=gen) < 0.15] = 0
    return counts, placement.log2phy[0], placement.logcnt[0], placement.slot_gpu, G


def max_load(split, inst):
    return float(gpu_load(split, *inst[1:]).max())


def split_model(counts, log2phy, logcnt, slot_gpu, G):
    """One variable per (expert, candidate) plus the max load z: (V, a_eq [E, V+1] rows = each
    expert's pairs, a_ub [G, V+1] rows = GPU load - z)."""
    E = len(counts)
    cand = [(e, j) for e in range(E) for j in range(int(logcnt[e]))]
    V = len(cand)
    a_eq = np.zeros((E, V + 1))
    a_ub = np.zeros((G, V + 1))
    a_ub[:, V] = -1
    for i, (e, j) in enumerate(cand):
        a_eq[e, i] = 1
        a_ub[int(slot_gpu[log2phy[e, j]]), i] = 1
    return V, a_eq, a_ub


def reference_lp(counts, log2phy, logcnt, slot_gpu, G):
    """The LP in another formulation: one variable per (expert, candidate), interior point."""
    V, a_eq, a_ub = split_model(counts, log2phy, logcnt, slot_gpu, G)
    res = linprog(np.eye(V + 1)[V], A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq,
                  b_eq=counts.numpy().astype(float), bounds=[(0, None)] * (V + 1),
                  method="highs-ipm")
    assert res.status == 0
    return res.fun


def integer_optimum(counts, log2phy, logcnt, slot_gpu, G):
    """The least max GPU load of any integer split (scipy milp)."""
    V, a_eq, a_ub = split_model(counts, log2phy, logcnt, slot_gpu, G)
    c = counts.numpy().astype(float)
    res = milp(np.eye(V + 1)[V], integrality=np.ones(V + 1),
               constraints=[LinearConstraint(a_eq, c, c), LinearConstraint(a_ub, -np.inf, 0)],
               bounds=Bounds(0, np.inf))
    assert res.status == 0
    return round(res.fun)


def even_split(inst):
    counts, log2phy, logcnt = inst[:3]
    valid = torch.arange(log2phy.shape[1]) < logcnt.unsqueeze(1)
    return counts.unsqueeze(1) * valid / logcnt.unsqueeze(1)


# ---------------------------------------------------------------------------------- fractions

@pytest.mark.parametrize("seed", range(40))
def test_fractions_are_valid_and_optimal(seed):
    inst = random_instance(seed)
    counts, log2phy, logcnt = inst[:3]
    f = optimal_fractions(*inst)
    valid = torch.arange(log2phy.shape[1]) < logcnt.unsqueeze(1)
    assert f.dtype == torch.float64 and f.shape == log2phy.shape
    assert (f >= 0).all() and (f[~valid] == 0).all()
    assert torch.allclose(f.sum(1), torch.ones(len(counts), dtype=torch.float64))
    z = max_load(counts.unsqueeze(1) * f, inst)
    assert z == pytest.approx(reference_lp(*inst), rel=1e-7, abs=1e-7)
    assert z <= max_load(even_split(inst), inst) + 1e-7
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):  # no random split does better
        w = torch.rand(log2phy.shape, generator=gen, dtype=torch.float64) * valid
        assert z <= max_load(counts.unsqueeze(1) * w / w.sum(1, keepdim=True), inst) + 1e-7


def test_fractions_on_a_hand_example():
    # 2 GPUs, 2 slots each. Expert 0 on slots 0 (GPU 0) and 2 (GPU 1); expert 1 on slot 1
    # (GPU 0), expert 2 on slot 3 (GPU 1). Counts 10, 6, 1: GPU 0 carries 6 fixed, GPU 1 1,
    # so expert 0 splits 2.5 / 7.5 and both GPUs carry 8.5.
    inst = (torch.tensor([10, 6, 1]), torch.tensor([[0, 2], [1, -1], [3, -1]]),
            torch.tensor([2, 1, 1]), torch.tensor([0, 0, 1, 1]), 2)
    f = optimal_fractions(*inst)
    assert torch.allclose(f, torch.tensor([[0.25, 0.75], [1, 0], [1, 0]], dtype=torch.float64))
    q = optimal_quotas(*inst)
    assert q.tolist() == [[3, 7], [6, 0], [1, 0]]  # 2.5 / 7.5: the tie goes to replica 0
    assert gpu_load(q, *inst[1:]).tolist() == [9, 8]


def test_fractions_prefer_the_even_split_among_optimal_ones():
    """Where balance does not need it, no replica is starved (the second LP stage)."""
    p2l = torch.tensor([[0, 1, 0, 1]])  # both experts on both GPUs
    placement = Placement(p2l, 2, Topology(2))
    inst = (torch.tensor([8, 4]), placement.log2phy[0], placement.logcnt[0],
            placement.slot_gpu, 2)
    f = optimal_fractions(*inst)
    assert torch.allclose(f, torch.full((2, 2), 0.5, dtype=torch.float64))


def test_zero_count_and_single_gpu_experts_get_the_even_split():
    # expert 0: 2 replicas on GPU 0 only; expert 1: replicas on both GPUs, no pairs
    placement = Placement(torch.tensor([[0, 0, 1, 1, 2, 2]]), 3, Topology(2))
    inst = (torch.tensor([5, 0, 3]), placement.log2phy[0], placement.logcnt[0],
            placement.slot_gpu, 2)
    f = optimal_fractions(*inst)
    assert torch.allclose(f, torch.full((3, 2), 0.5, dtype=torch.float64))


def test_fractions_are_deterministic_and_cached_results_are_not_shared():
    inst = random_instance(3, G=4, E=9, extra=2)
    a = optimal_fractions(*inst)
    a.zero_()  # a caller mutating its result must not poison the cache
    batch_lp._cache.clear()
    b = optimal_fractions(*inst)
    batch_lp._cache.clear()
    assert torch.equal(b, optimal_fractions(*inst))
    assert torch.equal(b, optimal_fractions(*inst))
    assert not torch.equal(a, b)


def test_bad_inputs_are_input_errors():
    inst = random_instance(0, G=2, E=4, extra=1)
    with pytest.raises(InputError, match="num_gpus"):
        optimal_fractions(*inst[:4], 0)
    with pytest.raises(InputError, match="GPU outside"):
        optimal_fractions(*inst[:4], 1)
    with pytest.raises(InputError, match="non-negative"):
        optimal_fractions(-inst[0] - 1, *inst[1:])
    with pytest.raises(InputError, match="sum to 1"):
        integer_quotas(torch.tensor([3]), torch.tensor([[0.5, 0.2]]), torch.tensor([2]))
    with pytest.raises(InputError, match="sum to 1"):
        integer_quotas(torch.tensor([3]), torch.tensor([[0.5, 0.5]]), torch.tensor([1]))


# ------------------------------------------------------------------------------------- quotas

def test_integer_quotas_largest_remainder_ties_to_the_lower_index():
    fractions = torch.tensor([[0.25, 0.25, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3, 0.0],
                              [0.1, 0.6, 0.3, 0.0]], dtype=torch.float64)
    q = integer_quotas(torch.tensor([2, 4, 10]), fractions, torch.tensor([3, 3, 3]))
    assert q.tolist() == [[1, 0, 1, 0], [2, 1, 1, 0], [1, 6, 3, 0]]


@pytest.mark.parametrize("seed", range(40))
def test_quotas_sum_to_counts_and_stay_within_rounding_of_the_lp(seed):
    inst = random_instance(seed)
    counts, log2phy, logcnt, slot_gpu, G = inst
    f = optimal_fractions(*inst)
    exact = counts.unsqueeze(1) * f
    lp_load = gpu_load(exact, *inst[1:])
    z = float(lp_load.max())
    for q in (integer_quotas(counts, f, logcnt), optimal_quotas(*inst)):
        assert q.dtype == torch.int64 and torch.equal(q.sum(1), counts)
        assert ((q - exact).abs() < 1 + 1e-6).all()  # floor or ceil of the real share
        # each GPU gains less than one pair per candidate replica it holds
        valid = torch.arange(log2phy.shape[1]) < logcnt.unsqueeze(1)
        held = torch.bincount(slot_gpu[log2phy[valid]], minlength=G)
        assert (gpu_load(q, *inst[1:]) < lp_load + held + 1e-6).all()
    best = optimal_quotas(*inst)
    assert max_load(best, inst) == math.ceil(z - 1e-6)


@pytest.mark.parametrize("seed", range(25))
def test_optimal_quotas_reach_the_integer_optimum(seed):
    inst = random_instance(100 + seed)
    assert max_load(optimal_quotas(*inst), inst) == integer_optimum(*inst)


def test_flow_rounding_repairs_what_largest_remainder_breaks():
    # 2 GPUs; experts 0 and 1 each on both (slot 0/1 on GPU 0, slots 2/3 on GPU 1), one pair
    # each: the LP splits both 0.5 / 0.5 and largest remainder rounds both up on replica 0,
    # GPU 0, load 2; the optimum is 1.
    placement = Placement(torch.tensor([[0, 1, 0, 1]]), 2, Topology(2))
    inst = (torch.tensor([1, 1]), placement.log2phy[0], placement.logcnt[0],
            placement.slot_gpu, 2)
    f = optimal_fractions(*inst)
    naive = integer_quotas(inst[0], f, inst[2])
    assert max_load(naive, inst) == 2
    best = optimal_quotas(*inst)
    assert max_load(best, inst) == 1 and torch.equal(best.sum(1), inst[0])


def test_plain_flow_safety_net_is_optimal():
    for seed in range(10):
        counts, log2phy, logcnt, slot_gpu, G = random_instance(200 + seed)
        gpu = batch_lp._candidate_gpus(log2phy.numpy(), logcnt.numpy(), slot_gpu.numpy())
        target = integer_optimum(counts, log2phy, logcnt, slot_gpu, G)
        q = batch_lp._plain_flow(counts.numpy(), gpu, gpu >= 0, G, target)
        assert q.sum(1).tolist() == counts.tolist()
        assert max_load(torch.from_numpy(q), (counts, log2phy, logcnt, slot_gpu, G)) == target


# ----------------------------------------------------------------------------------- policies

def small_placement():
    """E=4 on 4 GPUs (2 nodes), 2 slots each: experts 0 and 1 have 3 and 2 replicas."""
    return Placement(torch.tensor([[0, 1, 0, 2, 3, 1, 0, 3]]), 4, Topology(4, 2))


def skewed_ids(T, K, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(torch.tensor([0.5, 0.3, 0.1, 0.1]), T * K, replacement=True,
                            generator=gen).view(T, K)
    return torch.where(torch.rand(T, K, generator=gen) < 0.1, -1, ids)


def test_lp_draws_one_uniform_per_pair_and_follows_the_fractions():
    view = full_view(small_placement())
    ids = skewed_ids(4000, 2, 0)
    gen_a = torch.Generator().manual_seed(5)
    phys = POLICIES["lp"](ids, view, DispatchContext(generator=gen_a))
    gen_b = torch.Generator().manual_seed(5)
    torch.rand(ids.numel(), generator=gen_b, dtype=torch.float64)
    assert torch.equal(gen_a.get_state(), gen_b.get_state()), "must consume exactly T*K draws"
    frac = lp_fractions(ids, view, 0)
    counts = torch.bincount(ids[ids >= 0], minlength=4)
    for e in range(4):
        slots = view.log2phy[0, e, : int(view.logcnt[0, e])]
        got = torch.stack([(phys[ids == e] == s).sum() for s in slots]).double()
        want = frac[e, : len(slots)] * counts[e]
        assert ((got - want).abs() <= 5 * want.clamp(min=1).sqrt()).all()
        assert (got[want == 0] == 0).all(), "a replica with fraction 0 is never drawn"


def test_lp_without_generator_is_an_input_error():
    with pytest.raises(InputError, match="generator"):
        POLICIES["lp"](torch.zeros(2, 1, dtype=torch.long), full_view(small_placement()),
                       DispatchContext())


def test_quota_fills_the_optimal_quotas_in_occurrence_order():
    placement = small_placement()
    view = full_view(placement)
    ids = skewed_ids(37, 3, 1)
    phys = POLICIES["quota"](ids, view, DispatchContext())
    quotas = lp_quotas(ids, view, 0)
    occ = occurrence_index(ids)
    for e in range(4):
        n = int(view.logcnt[0, e])
        slots = view.log2phy[0, e, :n]
        got = torch.stack([(phys[ids == e] == s).sum() for s in slots])
        assert got.tolist() == quotas[e, :n].tolist()
        # occurrence order: replicas are filled one after the other
        replica = (phys[ids == e].unsqueeze(1) == slots).long().argmax(1)
        assert torch.equal(replica[occ[ids == e].argsort()].sort().values,
                           replica[occ[ids == e].argsort()])
    load = torch.bincount(placement.slot_gpu[phys[ids >= 0]], minlength=4)
    counts = torch.bincount(ids[ids >= 0], minlength=4)
    inst = (counts, view.log2phy[0], view.logcnt[0], placement.slot_gpu, 4)
    assert int(load.max()) == integer_optimum(*inst)


def test_quota_is_rank_invariant_and_shares_one_computation():
    placement = small_placement()
    views = [full_view(placement, r) for r in range(4)]
    ids = skewed_ids(50, 2, 2)
    outs = [POLICIES["quota"](ids, v, DispatchContext(step=3, rank=r,
                                                      generator=torch.Generator().manual_seed(r)))
            for r, v in enumerate(views)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert POLICIES["quota"].rank_invariant and not POLICIES["lp"].rank_invariant
    assert rank_groups(views, POLICIES["quota"]) == ((0, 1, 2, 3),)
    assert rank_groups(views, POLICIES["lp"]) == ((0,), (1,), (2,), (3,))
    # one computation for the group counts exactly as four would
    ids = skewed_ids(50, 2, 3).unsqueeze(1)  # [T, L=1, K]
    shared = step(ids, views, "quota", groups=[[0, 1, 2, 3]])
    single = step(ids, views, "quota", groups=[[0], [1], [2], [3]])
    assert torch.equal(shared.slot_load, single.slot_load)
    assert torch.equal(shared.multiplicity, single.multiplicity)
    assert torch.equal(shared.agreed, single.agreed)


# ------------------------------------------------------------------------------- rank model

@pytest.fixture(scope="module")
def skewed_runs():
    tr = synthesize("skewed", steps=4, tokens=96, layers=2, experts=16, top_k=4, seed=0)
    cfg = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8)
    return {p: replay(tr, cfg.replace(policy=p)).metrics for p in ("lp", "quota", "ordinal")}


def test_lp_with_independent_generators_corrupts_none_mode(skewed_runs):
    m = skewed_runs["lp"]
    assert m["rank_agreement"] < 1
    assert m["multiplicity"]["0"] + m["multiplicity"]["2+"] > 0
    assert m["output_rel_error"] > 1e-3


def test_quota_is_exact_and_balances_at_least_as_well_as_ordinal(skewed_runs):
    m = skewed_runs["quota"]
    assert m["rank_agreement"] == 1.0
    assert m["multiplicity"] == {"0": 0.0, "1": 1.0, "2+": 0.0}
    assert m["output_rel_error"] < 1e-6
    assert m["gpu_imbalance"] <= skewed_runs["ordinal"]["gpu_imbalance"]
