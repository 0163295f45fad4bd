"""The rank model: multiplicity, executed loads, agreement, a2a shares, rank generators.

Dimensions: `T` tokens, `K` top-k, `P` slots, `G` GPUs = ranks.
"""

import pytest
import torch

from eplbsim.dispatch.policies import POLICIES, DispatchContext
from eplbsim.errors import InputError
from eplbsim import ranks
from eplbsim.placement import Placement, full_view, nearest_view
from eplbsim.ranks import (check_choices, drift_before_step, execute_a2a, execute_none,
                           make_rank_generators, rank_groups, token_owners)
from eplbsim.topology import Topology

# Expert 0 on slots 0 (GPU 0) and 2 (GPU 1); expert 1 on slots 1 (GPU 0) and 3 (GPU 1).
PLACEMENT = Placement(torch.tensor([[0, 1, 0, 1]]), 2, Topology(2))


def fixed_choices(table):
    """A policy that makes rank r choose `table[r]` (a `[T, K]` list) for layer 0."""
    def policy(ids, view, ctx):
        return torch.tensor(table[ctx.rank])
    return policy


def run_none(ids, policy, G=2):
    views = [full_view(PLACEMENT, r) for r in range(G)]
    ctxs = [DispatchContext(rank=r) for r in range(G)]
    return execute_none(ids.unsqueeze(1), views, policy, ctxs, rank_groups(views, policy))


def test_execute_none_counts_each_rank_executing_its_own_gpu():
    ids = torch.tensor([[0, 1], [1, -1]])
    policy = fixed_choices([
        [[0, 3], [1, -1]],  # rank 0 picks slot 0 (own GPU), slot 3 (GPU 1), slot 1 (own)
        [[2, 3], [1, -1]],  # rank 1 picks slot 2 (own), slot 3 (own), slot 1 (GPU 0)
    ])
    out = run_none(ids, policy)
    # pair (0,0): ranks 0 and 1 both execute -> 2; (0,1): only rank 1 -> 1; (1,0): rank 0 -> 1
    assert out.multiplicity.squeeze(1).tolist() == [[2, 1], [1, 0]]
    assert out.slot_load.tolist() == [[1, 1, 1, 1]]
    assert out.agreed.tolist() == [2] and out.valid.tolist() == [3]


def test_execute_none_drops_pairs_nobody_executes():
    out = run_none(torch.tensor([[0]]), fixed_choices([[[2]], [[0]]]))
    assert out.multiplicity.tolist() == [[[0]]] and out.slot_load.sum() == 0
    assert out.agreed.tolist() == [0]


def test_rank_groups_share_only_provably_identical_choices():
    placement = Placement(torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]]), 4, Topology(4, 2))
    full = [full_view(placement, r) for r in range(4)]
    assert rank_groups(full, POLICIES["row"]) == [[0, 1, 2, 3]]
    assert rank_groups(full, POLICIES["ordinal"]) == [[0, 1, 2, 3]]
    near = [nearest_view(placement, r) for r in range(4)]
    assert rank_groups(near, POLICIES["row"]) == [[0], [1], [2], [3]]
    # each node holds every expert once, split over its two GPUs: both ranks of a node see
    # the same node-local slot for every expert, so their nearest views are equal
    mirrored = Placement(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), 4, Topology(4, 2))
    near = [nearest_view(mirrored, r) for r in range(4)]
    assert rank_groups(near, POLICIES["row"]) == [[0, 1], [2, 3]]
    for name in ("static", "random"):
        assert rank_groups(full, POLICIES[name]) == [[0], [1], [2], [3]]
    custom = lambda ids, view, ctx: POLICIES["row"](ids, view, ctx)  # noqa: E731
    assert rank_groups(full, custom) == [[0], [1], [2], [3]], "unknown callables never share"


@pytest.mark.parametrize("name", ["static", "random", "row"])
def test_rank_variant_policies_are_never_short_circuited(monkeypatch, name):
    calls = []
    real = ranks.dispatch_step

    def spy(policy, ids, view, ctx):
        calls.append(ctx.rank)
        return real(policy, ids, view, ctx)

    monkeypatch.setattr(ranks, "dispatch_step", spy)
    placement = Placement(torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]]), 4, Topology(4, 2))
    views = [full_view(placement, r) for r in range(4)]
    ctxs = [DispatchContext(rank=r, generator=torch.Generator().manual_seed(r))
            for r in range(4)]
    policy = POLICIES[name]
    ids = torch.randint(0, 4, (16, 1, 2), generator=torch.Generator().manual_seed(0))
    shared = execute_none(ids, views, policy, ctxs, rank_groups(views, policy))
    if name == "row":
        assert calls == [0]  # one computation serves all four identical ranks
        single = execute_none(ids, views, policy, ctxs, [[0], [1], [2], [3]])
        assert torch.equal(shared.multiplicity, single.multiplicity)
        assert torch.equal(shared.slot_load, single.slot_load)
        assert torch.equal(shared.agreed, single.agreed)
    else:
        assert calls == [0, 1, 2, 3]


def test_a2a_rows_count_within_each_rank_share():
    seen = []

    def spy(ids, view, ctx):
        seen.append((ctx.rank, ids.shape[0]))
        return POLICIES["row"](ids, view, ctx)

    ids = torch.tensor([[0], [0], [0], [0], [0]]).unsqueeze(1)  # [T, L, K]
    views = [full_view(PLACEMENT, r) for r in range(2)]
    ctxs = [DispatchContext(rank=r, mode="a2a") for r in range(2)]
    out = execute_a2a(ids, token_owners(5, 2), views, spy, ctxs)
    assert seen == [(0, 3), (1, 2)]
    # rows 0, 1, 2 of rank 0 and rows 0, 1 of rank 1 -> replicas 0 1 0 | 0 1 -> slots 0 2 0 0 2
    assert out.slot_load.tolist() == [[3, 0, 2, 0]]
    assert out.multiplicity.flatten().tolist() == [1] * 5 and out.agreed is None


def test_a_policy_returning_a_wrong_slot_is_an_input_error():
    bad = lambda ids, view, ctx: torch.where(ids >= 0, 1, -1)  # noqa: E731  slot 1 holds 1
    with pytest.raises(InputError, match="does not hold that expert"):
        run_none(torch.tensor([[0]]), bad)
    with pytest.raises(InputError, match="expected integer slots"):
        check_choices(torch.zeros(2, 1, 2), torch.zeros(2, 1, 2, dtype=torch.long), PLACEMENT,
                      bad)


def test_rank_generators_relations():
    def draws(gens):
        return [torch.randint(0, 65536, (8,), generator=g).tolist() for g in gens.generators]

    ind = draws(make_rank_generators("independent", 3, 4))
    assert len({tuple(d) for d in ind}) == 4
    assert ind == draws(make_rank_generators("independent", 3, 4)), "seeded: same every run"
    shared = draws(make_rank_generators("shared", 3, 4))
    assert all(d == shared[0] for d in shared)
    with pytest.raises(InputError, match="unknown rng relation"):
        make_rank_generators("chaos", 0, 2)


def test_drift_consumes_one_extra_batch_on_heads_only():
    gens = make_rank_generators("drift", 0, 6, drift_p=0.5)
    drifted = drift_before_step(gens, [5] * 6)
    assert 0 < sum(drifted) < 6  # seed 0 gives a mix (checked, deterministic)
    ref = make_rank_generators("shared", 0, 6)
    for gen, ref_gen, hit in zip(gens.generators, ref.generators, drifted):
        if hit:
            torch.randint(0, 65536, (5,), generator=ref_gen)
        assert torch.equal(gen.get_state(), ref_gen.get_state())
    assert drift_before_step(make_rank_generators("shared", 0, 3), [1] * 3) == [False] * 3
