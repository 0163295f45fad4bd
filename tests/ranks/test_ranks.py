"""The rank model: multiplicity, executed loads, agreement, a2a shares, rank generators, and
the one rank step run by one process or split over several through collectives.

Dimensions: `T` tokens, `L` layers, `K` top-k, `P` slots, `G` GPUs = ranks.
"""

import threading

import pytest
import torch

from eplbsim import ranks
from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.kernels import check_choices
from eplbsim.placement import Placement, full_view, sglang_0_5_14_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks import (MODES, Collectives, make_ranks, rank_context, rank_groups,
                           token_owners)
from eplbsim.ranks.moe import make_toy_moe

from rank_helpers import epoch, step

# Expert 0 on slots 0 (GPU 0) and 2 (GPU 1); expert 1 on slots 1 (GPU 0) and 3 (GPU 1).
PLACEMENT = Placement(torch.tensor([[0, 1, 0, 1]]), 2, Topology(2))
VIEWS = [full_view(PLACEMENT, r) for r in range(2)]


def fixed_choices(table):
    """A policy that makes rank r choose `table[r]` (a `[T, K]` list) for layer 0."""
    def policy(ids, view, ctx):
        return torch.tensor(table[ctx.rank])
    return policy


def test_none_counts_each_rank_executing_its_own_gpu():
    ids = torch.tensor([[0, 1], [1, -1]]).unsqueeze(1)
    policy = fixed_choices([
        [[0, 3], [1, -1]],  # rank 0 picks slot 0 (own GPU), slot 3 (GPU 1), slot 1 (own)
        [[2, 3], [1, -1]],  # rank 1 picks slot 2 (own), slot 3 (own), slot 1 (GPU 0)
    ])
    out = step(ids, VIEWS, policy)
    # pair (0,0): ranks 0 and 1 both execute -> 2; (0,1): only rank 1 -> 1; (1,0): rank 0 -> 1
    assert out.multiplicity.squeeze(1).tolist() == [[2, 1], [1, 0]]
    assert out.slot_load.tolist() == [[1, 1, 1, 1]]
    assert out.agreed.tolist() == [2] and out.valid.tolist() == [3]
    assert out.multiplicity_counts.tolist() == [[0, 2, 1]]


def test_none_drops_pairs_nobody_executes():
    out = step(torch.tensor([[[0]]]), VIEWS, fixed_choices([[[2]], [[0]]]))
    assert out.multiplicity.tolist() == [[[0]]] and out.slot_load.sum() == 0
    assert out.agreed.tolist() == [0] and out.multiplicity_counts.tolist() == [[1, 0, 0]]


def test_rank_groups_share_only_provably_identical_choices():
    placement = Placement(torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]]), 4, Topology(4, 2))
    full = [full_view(placement, r) for r in range(4)]
    assert rank_groups(full, POLICIES["row"]) == ((0, 1, 2, 3),)
    assert rank_groups(full, POLICIES["ordinal"]) == ((0, 1, 2, 3),)
    near = [sglang_0_5_14_view(placement, r) for r in range(4)]
    assert rank_groups(near, POLICIES["row"]) == ((0,), (1,), (2,), (3,))
    # each node holds every expert once, split over its two GPUs: both ranks of a node see
    # the same node-local slot for every expert, so their nearest views are equal
    mirrored = Placement(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), 4, Topology(4, 2))
    near = [sglang_0_5_14_view(mirrored, r) for r in range(4)]
    assert rank_groups(near, POLICIES["row"]) == ((0, 1), (2, 3))
    for name, entry in POLICIES.items():
        if not entry.rank_invariant:
            assert rank_groups(full, entry) == ((0,), (1,), (2,), (3,)), name


@pytest.mark.parametrize("name", ["static", "random", "row"])
def test_rank_variant_policies_are_never_short_circuited(monkeypatch, name):
    calls = []
    real = ranks.dispatch_step

    def spy(policy, ids, view, ctx, label, out=None):
        calls.append(ctx.rank)
        return real(policy, ids, view, ctx, label, out)

    monkeypatch.setattr(ranks, "dispatch_step", spy)
    placement = Placement(torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]]), 4, Topology(4, 2))
    views = [full_view(placement, r) for r in range(4)]
    ids = torch.randint(0, 4, (16, 1, 2), generator=torch.Generator().manual_seed(0))
    shared = step(ids, views, name)
    if name == "row":
        assert calls == [0]  # one computation serves all four identical ranks
        single = step(ids, views, name, groups=[[0], [1], [2], [3]])
        for field in ("multiplicity", "slot_load", "agreed", "multiplicity_counts"):
            assert torch.equal(getattr(shared, field), getattr(single, field))
    else:
        assert calls == [0, 1, 2, 3]


def test_a2a_rows_count_within_each_rank_share():
    seen = []

    def spy(ids, view, ctx):
        seen.append((ctx.rank, ids.shape[0], ctx.mode))
        return POLICIES["row"](ids, view, ctx)

    ids = torch.zeros(5, 1, 1, dtype=torch.long)  # [T, L, K]
    out = step(ids, VIEWS, spy, mode="a2a")
    assert seen == [(0, 3, "a2a"), (1, 2, "a2a")]
    # rows 0, 1, 2 of rank 0 and rows 0, 1 of rank 1 -> replicas 0 1 0 | 0 1 -> slots 0 2 0 0 2
    assert out.slot_load.tolist() == [[3, 0, 2, 0]]
    assert out.multiplicity.flatten().tolist() == [1] * 5 and out.agreed is None
    assert out.multiplicity_counts.tolist() == [[0, 5, 0]] and out.error is None


def test_a2a_takes_the_trace_s_source_ranks():
    seen = []

    def spy(ids, view, ctx):
        seen.append((ctx.rank, ids.flatten().tolist()))
        return POLICIES["row"](ids, view, ctx)

    ids = torch.tensor([0, 1, 1, 0]).view(4, 1, 1)
    step(ids, VIEWS, spy, mode="a2a", src_rank=torch.tensor([1, 0, 1, 1]))
    assert seen == [(0, [1]), (1, [0, 1, 0])]
    with pytest.raises(InputError, match="names rank 2, but there are only 2 GPUs"):
        step(ids, VIEWS, spy, mode="a2a", src_rank=torch.tensor([0, 2, 0, 0]))


def test_a_policy_returning_a_wrong_slot_is_an_input_error():
    bad = lambda ids, view, ctx: torch.where(ids >= 0, 1, -1)  # noqa: E731  slot 1 holds 1
    with pytest.raises(InputError, match="does not hold that expert"):
        step(torch.tensor([[[0]]]), VIEWS, bad)
    with pytest.raises(InputError, match="expected integer slots"):
        check_choices(torch.zeros(2, 1, 2), torch.zeros(2, 1, 2, dtype=torch.long), PLACEMENT,
                      "bad")


def test_rank_streams_relations():
    def draws(rs, step=0):
        return [r.stream(step).draws(8, 0, "cpu")[0].tolist() for r in rs]

    ind = draws(make_ranks("independent", 3, 4))
    assert len({tuple(d) for d in ind}) == 4
    assert ind == draws(make_ranks("independent", 3, 4)), "seeded: same every run"
    assert draws(make_ranks("independent", 3, 4, ranks=[2])) == [ind[2]], "a real rank's own"
    assert draws(make_ranks("independent", 3, 4), 1) != ind, "each step draws anew"
    shared = draws(make_ranks("shared", 3, 4))
    assert all(d == shared[0] for d in shared)
    with pytest.raises(InputError, match="unknown rng relation"):
        make_ranks("chaos", 0, 2)


def test_drift_shifts_a_rank_one_batch_along_its_stream_per_coin_hit():
    drifting, shared = make_ranks("drift", 0, 6, drift_p=0.5), make_ranks("shared", 0, 6)
    hits = [[rank.drifted(s) for s in range(40)] for rank in drifting]
    assert 0 < sum(map(sum, hits)) < 6 * 40
    for rank, ref, hit in zip(drifting, shared, hits):
        for s in range(40):
            shift = sum(hit[:s + 1])
            assert rank.shift(s) == shift and rank.stream(s).shift == shift
            # the drifted rank's layer 0 is where the others draw layer `shift`
            assert torch.equal(rank.stream(s).draws(16, 0, "cpu"),
                               ref.stream(s).draws(16, shift, "cpu"))
    assert not any(r.drifted(s) for r in make_ranks("shared", 0, 3) for s in range(40))
    late = make_ranks("drift", 0, 6, drift_p=0.5)[1]
    assert late.shift(300) == drifting[1].shift(300), "counter-based: any step, any order"


def test_contexts_are_built_in_one_place():
    rank = make_ranks("independent", 7, 4)[3]
    ctx = rank_context(5, rank, "a2a", 7, True)
    assert (ctx.step, ctx.layer, ctx.rank, ctx.seed, ctx.mode, ctx.rank_offset) == (
        5, 0, 3, 7, "a2a", True)
    assert ctx.stream == rank.stream(5) and ctx.generator is None


class ThreadGroup:
    """`W` threads standing in for the processes of a group: each one's collectives meet the
    others' at a barrier, so the rank step runs split over them as over real processes."""

    def __init__(self, world):
        self.world, self.barrier = world, threading.Barrier(world)
        self.slots = [None] * world

    def collectives(self, me):
        def exchange(tensor):
            self.barrier.wait()
            self.slots[me] = tensor.clone()
            self.barrier.wait()
            out = torch.stack(self.slots)
            self.barrier.wait()
            return out
        return Collectives(all_reduce=lambda t: exchange(t).sum(0).to(t.dtype),
                           all_gather=exchange)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["static", "random", "row", "ordinal", "quota"])
def test_the_step_split_over_processes_equals_one_process(mode, name):
    """Every rank in its own 'process' (a thread with its collectives) counts exactly what one
    process holding every rank counts: the contract the real ranks rely on."""
    placement = Placement(torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]] * 2), 4, Topology(4, 2))
    views = [full_view(placement, r) for r in range(4)]
    ids = torch.randint(-1, 4, (21, 2, 2), generator=torch.Generator().manual_seed(2))
    moe = make_toy_moe(2, 4, hidden=4, seed=1)
    whole = step(ids, views, name, mode=mode, s=3, moe=moe, seed=5)
    group = ThreadGroup(4)
    parts = [None] * 4

    def run(r):
        parts[r] = step(ids, [views[r]], name, mode=mode, s=3, moe=moe, seed=5,
                        comm=group.collectives(r), ranks=[make_ranks("independent", 5, 4)[r]])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for part in parts:
        for field in ("slot_load", "multiplicity", "multiplicity_counts", "valid", "drifted",
                      "agreed", "error"):
            a, b = getattr(whole, field), getattr(part, field)
            assert (a is None and b is None) or torch.equal(a, b), (field, a, b)


def test_token_owners_split_contiguously():
    assert token_owners(5, 2).tolist() == [0, 0, 0, 1, 1]
    assert token_owners(2, 4).tolist() == [0, 1]
    assert epoch("row", VIEWS).num_ranks == 2
