"""Contract tests over every registered policy, plus each policy's own formula.

Dimensions: `T` tokens, `K` top-k, `L` layers, `E` experts, `P` slots, `G` GPUs.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES, DispatchPolicy, resolve_policy
from eplbsim.dispatch.policies import DispatchContext, occurrence_index, ordinal_offset, static_table
from eplbsim.placement import VIEWS, Placement, full_view, sglang_0_5_14_view, rank_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks.checks import rank_invariance

def random_placement(gen, L, E, P, topo):
    """Every expert once, the P - E redundant slots random, slots shuffled."""
    p2l = torch.stack([torch.cat([torch.arange(E), torch.randint(0, E, (P - E,), generator=gen)])
                       [torch.randperm(P, generator=gen)] for _ in range(L)])
    return Placement(p2l, E, topo)


def random_ids(gen, T, K, E, pad_frac=0.2):
    ids = torch.randint(0, E, (T, K), generator=gen)
    return torch.where(torch.rand(T, K, generator=gen) < pad_frac, -1, ids)


def ctx_for(rank=0, step=0, layer=0, seed=0, device="cpu", **kw):
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    return DispatchContext(step, layer, rank, seed, gen, **kw)


def assert_contract(phys, ids, view, layer):
    """phys [T, K]: int64, -1 exactly at padding, else a candidate of the routed expert."""
    assert phys.shape == ids.shape and phys.dtype == torch.int64
    pad = ids < 0
    assert (phys[pad] == -1).all()
    cand = view.log2phy[layer][ids.clamp(min=0)]  # [T, K, R]
    assert ((cand == phys.unsqueeze(-1)).any(-1) | pad).all()


@st.composite
def cases(draw):
    G = draw(st.sampled_from([1, 2, 3, 4]))
    gpn = draw(st.sampled_from([g for g in (1, 2, 4) if G % g == 0]))
    E = draw(st.integers(1, 12))
    per_gpu = draw(st.integers(max(1, -(-E // G)), -(-E // G) + 3))
    L = draw(st.integers(1, 3))
    T = draw(st.integers(0, 40))
    K = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    return G, gpn, E, G * per_gpu, L, T, K, seed


def _layers_of(case):
    """`(G, seed, placement, [ids [T, K] per layer])` of a drawn case."""
    G, gpn, E, P, L, T, K, seed = case
    gen = torch.Generator().manual_seed(seed)
    placement = random_placement(gen, L, E, P, Topology(G, gpn))
    return G, seed, placement, [random_ids(gen, T, K, E) for _ in range(L)]


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("view_name", sorted(VIEWS))
@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_policy_contract(name, view_name, case):
    G, seed, placement, batches = _layers_of(case)
    policy = POLICIES[name]
    for layer, ids in enumerate(batches):
        before = ids.clone()
        for rank in range(G):
            view = rank_view(view_name, placement, rank)
            phys = policy(ids, view, ctx_for(rank, step=seed % 5, layer=layer))
            assert_contract(phys, ids, view, layer)
        assert torch.equal(ids, before), "a policy modified its input"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_runs_on_device_and_matches_cpu(name, device):
    gen = torch.Generator().manual_seed(0)
    placement = random_placement(gen, 2, 10, 16, Topology(4, 2))
    ids = random_ids(gen, 64, 4, 10)
    view = full_view(placement, 1)
    got = POLICIES[name](ids.to(device), view.to(device), ctx_for(1, 3, 1, device=device))
    assert got.device.type == torch.device(device).type
    assert_contract(got.cpu(), ids, view, 1)
    if name not in ("random", "lp", "sglang-lp"):  # CPU and CUDA generators draw differently
        want = POLICIES[name](ids, view, ctx_for(1, 3, 1))
        assert torch.equal(got.cpu(), want)


CLASSES = [(name, offset) for name in sorted(POLICIES) for offset in (False, True)]


@pytest.mark.parametrize("name, rank_offset",
                         [c for c in CLASSES if POLICIES[c[0]].invariant(c[1])])
@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_invariant_policies_agree_on_every_rank(name, rank_offset, case):
    G, seed, placement, batches = _layers_of(case)
    for layer, ids in enumerate(batches):
        outs = [POLICIES[name](ids, full_view(placement, r),
                               ctx_for(r, step=seed % 5, layer=layer, rank_offset=rank_offset))
                for r in range(G)]
        assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("name, rank_offset",
                         [c for c in CLASSES if not POLICIES[c[0]].invariant(c[1])])
def test_variant_policies_disagree_on_some_case_with_redundancy(name, rank_offset):
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        placement = random_placement(gen, 1, 6, 16, Topology(4, 2))
        ids = random_ids(gen, 400, 2, 6)  # enough pairs a block for lplb-atomic
        if POLICIES[name].spill is not None:  # its rule decides after the choice: in the step
            if not rank_invariance(name, ids, placement).invariant:
                return
            continue
        outs = [POLICIES[name](ids, full_view(placement, r),
                               ctx_for(r, rank_offset=rank_offset)) for r in range(4)]
        if any(not torch.equal(o, outs[0]) for o in outs):
            return
    pytest.fail(f"{name} (rank_offset={rank_offset}) never disagreed across ranks")


def test_every_policy_states_its_class_source_and_summary():
    for name, entry in POLICIES.items():
        assert entry.invariance() in ("invariant", "variant", "invariant unless --rank-offset",
                                      "a2a only")
        assert entry.source and entry.summary, name


@pytest.mark.parametrize("name", [n for n in sorted(POLICIES) if "none" not in POLICIES[n].modes])
def test_an_a2a_only_policy_is_refused_in_none_and_runs_in_a2a(name):
    from eplbsim.runspec import RunSpec
    with pytest.raises(InputError, match="runs only in a2a"):
        RunSpec.of(policy=name, mode="none")
    assert RunSpec.of(policy=name, mode="a2a").dispatch.mode == "a2a"
    assert POLICIES[name].invariance() == "a2a only"


def two_replica_placement():
    """E=2 on 2 GPUs (one node): expert 0 on slots 0 (GPU 0) and 2 (GPU 1); expert 1 on 1, 3."""
    return Placement(torch.tensor([[0, 1, 0, 1]]), 2, Topology(2))


def test_row_flat_hash_formulas():
    placement = two_replica_placement()
    view = full_view(placement)
    ids = torch.tensor([[0, 1], [0, 1], [1, 0], [-1, 0]])
    row = POLICIES["row"](ids, view, ctx_for())
    assert row.tolist() == [[0, 1], [2, 3], [1, 0], [-1, 2]]
    flat = POLICIES["flat"](ids, view, ctx_for())  # (row*2 + k) % 2 == k % 2
    assert flat.tolist() == [[0, 3], [0, 3], [1, 2], [-1, 2]]
    hashed = POLICIES["hash"](ids, view, ctx_for())  # equals row % 2 (odd multiplier)
    assert torch.equal(hashed, row)


def test_hash_differs_from_row_for_three_replicas():
    placement = Placement(torch.tensor([[0, 0, 0]]), 1, Topology(1))
    ids = torch.zeros(12, 1, dtype=torch.long)
    view = full_view(placement)
    hashed = POLICIES["hash"](ids, view, ctx_for()).squeeze(1)
    expect = (torch.arange(12) * 2654435769 % 2**32) % 3
    assert hashed.tolist() == expect.tolist()
    assert not torch.equal(hashed, POLICIES["row"](ids, view, ctx_for()).squeeze(1))


def test_vllms_deepseek_v4_dispatch_is_the_hash_policy():
    """vLLM PR #43339 (merged; DeepSeek-V4's MegaMoE EPLB), first revision of
    `vllm/models/deepseek_v4/nvidia/model.py`: `hashed = (token_indices * MULTIPLIER) &
    0xFFFFFFFF; replica = hashed % replica_counts.clamp(min=1)`, token index = the row in the
    batch; in review (2026-05-29) it was found "equivalent to the existing triton kernel" and
    the merged PR calls `eplb_map_to_physical_and_record`, the kernel `vllm:hash` runs
    (Knuth's 2654435769 in `fused_moe/eplb_triton.py`). So V4's dispatch is `hash`, no new
    policy: on a V4-Flash-shaped layer (256 experts, top-6) with 1 to 6 replicas an expert,
    the formula as written there gives `hash`'s replica for every pair, padding kept."""
    g = torch.Generator().manual_seed(43339)
    E, K, T = 256, 6, 300
    counts = torch.randint(1, 7, (E,), generator=g)  # [E] replicas of each expert
    phy2log = torch.repeat_interleave(torch.arange(E), counts)
    pad = (-phy2log.numel()) % 8
    phy2log = torch.cat([phy2log, torch.randint(0, E, (pad,), generator=g)])  # [P] on 8 GPUs
    placement = Placement(phy2log[None], E, Topology(8))
    view = full_view(placement)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    ids[5, 2] = -1
    token = torch.arange(T)[:, None].expand(T, K)  # [T, K] the row of each pair
    n = placement.logcnt[0][ids.clamp(min=0)]  # [T, K]
    replica = ((token * 2654435769) & 0xFFFFFFFF) % n.clamp(min=1)
    want = torch.where(ids >= 0, view.log2phy[0][ids.clamp(min=0), replica], -1)
    assert torch.equal(POLICIES["hash"](ids, view, ctx_for()), want)
    assert not torch.equal(POLICIES["row"](ids, view, ctx_for()), want)  # n of 3, 5, 6


def test_occurrence_index_counts_earlier_pairs_row_major():
    ids = torch.tensor([[3, 1], [1, 3], [-1, 1], [3, 2]])
    assert occurrence_index(ids).tolist() == [[0, 0], [1, 1], [0, 2], [2, 0]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-1, 5), min_size=0, max_size=60), st.integers(1, 4))
def test_occurrence_index_matches_brute_force(flat, K):
    flat = flat[: len(flat) // K * K]
    ids = torch.tensor(flat, dtype=torch.long).view(-1, K)
    want = [flat[:i].count(v) for i, v in enumerate(flat)]
    assert occurrence_index(ids).flatten().tolist() == want


def test_ordinal_splits_each_expert_within_one_pair_and_rotates():
    placement = Placement(torch.tensor([[0, 1, 0, 1, 0, 2]]), 3, Topology(3))
    view = full_view(placement)
    ids = torch.tensor([[0, 1]] * 7 + [[2, 0]])  # expert 0: 8 pairs over 3 replicas
    extra = []
    for step in range(3):
        phys = POLICIES["ordinal"](ids, view, ctx_for(step=step))
        load = torch.bincount(phys[ids == 0], minlength=6)[[0, 2, 4]]
        assert load.max() - load.min() <= 1 and load.sum() == 8
        extra.append(tuple(load.tolist()))
    assert len(set(extra)) == 3, "leftover pairs must rotate over replicas from step to step"


def test_ordinal_offset_adds_rank_only_in_a2a_when_asked():
    assert ordinal_offset(DispatchContext(step=3, layer=2, rank=5)) == 5
    assert ordinal_offset(DispatchContext(step=3, layer=2, rank=5, rank_offset=True)) == 5
    assert ordinal_offset(DispatchContext(step=3, layer=2, rank=5, mode="a2a",
                                          rank_offset=True)) == 10


def test_random_draws_one_value_per_pair_including_padding():
    placement = two_replica_placement()
    ids = torch.tensor([[0, -1], [1, 0], [-1, -1]])
    gen_a = torch.Generator().manual_seed(7)
    phys = POLICIES["random"](ids, full_view(placement), DispatchContext(generator=gen_a))
    gen_b = torch.Generator().manual_seed(7)
    draws = torch.randint(0, 65536, (6,), generator=gen_b).view(3, 2)
    want = torch.where(ids >= 0, full_view(placement).log2phy[0][ids.clamp(min=0), draws % 2], -1)
    assert torch.equal(phys, want)
    assert torch.equal(gen_a.get_state(), gen_b.get_state()), "must consume exactly T*K draws"


def test_random_without_generator_is_an_input_error():
    with pytest.raises(InputError, match="generator"):
        POLICIES["random"](torch.zeros(2, 1, dtype=torch.long),
                           full_view(two_replica_placement()), DispatchContext())


def test_static_prefers_local_then_node_then_spreads_leftover_ranks():
    # 2 nodes x 2 GPUs, 2 slots per GPU. Expert 0 on GPUs 0 and 1 (node 0) only.
    p2l = torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]])
    placement = Placement(p2l, 4, Topology(4, 2))
    tables = [static_table(full_view(placement, r), r, seed=0)[0] for r in range(4)]
    assert tables[0][0] == 0 and tables[1][0] == 2  # local replica on own GPU
    # ranks 2 and 3 (node 1) have no replica of expert 0 anywhere near: leftover, in rank
    # order they take a seeded permutation of its replicas {0, 2}, so together both.
    assert {int(tables[2][0]), int(tables[3][0])} == {0, 2}
    # expert 1 on GPU 0 (slot 1) and GPU 2 (slot 5): ranks 1 and 3 take their node's one
    assert [int(t[1]) for t in tables] == [1, 1, 5, 5]
    # the same on every call and from the nearest view
    again = [static_table(sglang_0_5_14_view(placement, r), r, seed=0)[0] for r in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(tables, again))


def test_static_is_rank_variant_with_redundancy():
    placement = two_replica_placement()
    ids = torch.tensor([[0, 1]])
    outs = [POLICIES["static"](ids, full_view(placement, r), ctx_for(r)) for r in range(2)]
    assert not torch.equal(outs[0], outs[1])


def test_resolve_policy_by_name_entry_and_callable():
    assert resolve_policy("row") == ("row", POLICIES["row"])
    assert resolve_policy(POLICIES["quota"]) == ("quota", POLICIES["quota"])
    custom = lambda ids, view, ctx: ids  # noqa: E731
    name, entry = resolve_policy(custom)
    assert name == "<lambda>" and entry.fn is custom and not entry.rank_invariant
    assert not entry.kernels, "an unregistered callable has no kernel"
    mine = DispatchPolicy(custom, rank_invariant=True)
    assert resolve_policy(mine) == ("<lambda>", mine)
    with pytest.raises(InputError, match="unknown policy 'nope'.*ordinal"):
        resolve_policy("nope")


def test_trtllm_counts_within_blocks_of_1024_and_adds_block_and_rank():
    placement = two_replica_placement()  # expert 0 on slots 0 and 2
    ids = torch.zeros(1100, 1, dtype=torch.int64)
    got = POLICIES["trtllm"](ids, full_view(placement, 0), ctx_for(0))[:, 0]
    i = torch.arange(1100)
    replica = torch.where(i < 1024, i % 2, (i - 1024 + 1) % 2)
    assert torch.equal(got, torch.where(replica == 0, 0, 2))
    shifted = POLICIES["trtllm"](ids, full_view(placement, 1), ctx_for(1, rank_offset=True))
    assert torch.equal(shifted[:, 0], torch.where(replica == 0, 2, 0))  # rank 1: one further


def test_ascend_sends_every_pair_to_the_ranks_own_replica():
    placement = two_replica_placement()
    ids = torch.tensor([[0, 1], [1, 0]])
    for rank in (0, 1):
        got = POLICIES["ascend"](ids, full_view(placement, rank), ctx_for(rank))
        assert torch.equal(got, torch.tensor([[0, 1], [1, 0]]) + 2 * rank)


def test_ascend_fixed_adds_tp_rank_dp_rank_and_expert_only_with_attention_tp():
    # 4 ranks, tp 2: (tp_rank + dp_rank) of ranks 0..3 is 0, 1, 1, 2
    placement = Placement(torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1]]), 3, Topology(4))
    view = full_view(placement)
    ids = torch.tensor([[0, 1, 2]])
    for rank, base in enumerate((0, 1, 1, 2)):
        got = POLICIES["ascend-fixed"](ids, view, ctx_for(rank, tp=2))
        n = view.logcnt[0][ids]
        want = view.log2phy[0][ids, (base + ids) % n]
        assert torch.equal(got, want)
        old = POLICIES["ascend"](ids, view, ctx_for(rank, tp=2))
        assert torch.equal(POLICIES["ascend-fixed"](ids, view, ctx_for(rank)), old)  # tp 1


@pytest.mark.parametrize("name, offset, agrees", [
    ("sglang-lp", False, False), ("lp-golden", False, True),
    ("trtllm", False, True), ("trtllm", True, False)])
def test_engine_policies_in_none_mode_agree_or_corrupt_as_classed(name, offset, agrees):
    from eplbsim.replay import replay
    from eplbsim.runspec import RunSpec
    from eplbsim.traces.synth import synthesize
    trace = synthesize("skewed", seed=1, steps=3, tokens=128, layers=2, experts=16, top_k=4)
    m = replay(trace, RunSpec.of(gpus=4, redundant=8, policy=name, rank_offset=offset)).metrics
    if agrees:
        assert m["rank_agreement"] == 1.0 and m["output_rel_error"] == 0.0
    else:
        assert m["rank_agreement"] < 1 and m["output_rel_error"] > 1e-3
