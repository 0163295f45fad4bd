"""The rank model: multiplicity, executed loads, agreement, a2a shares, rank generators.

Dimensions: `T` tokens, `K` top-k, `P` slots, `G` GPUs = ranks.
"""

import pytest
import torch

from eplbsim.dispatch import POLICIES, DispatchContext
from eplbsim.errors import InputError
from eplbsim.placement import Placement, full_view
from eplbsim.ranks import (
    check_choices,
    dispatch_a2a,
    dispatch_none,
    drift_before_step,
    execute_a2a,
    execute_none,
    make_rank_generators,
    token_owners,
)
from eplbsim.topology import Topology

# Expert 0 on slots 0 (GPU 0) and 2 (GPU 1); expert 1 on slots 1 (GPU 0) and 3 (GPU 1).
PLACEMENT = Placement(torch.tensor([[0, 1, 0, 1]]), 2, Topology(2))


def test_execute_none_counts_each_rank_executing_its_own_gpu():
    ids = torch.tensor([[0, 1], [1, -1]])
    choices = torch.tensor([
        [[0, 3], [1, -1]],  # rank 0 picks slot 0 (own GPU), slot 3 (GPU 1), slot 1 (own)
        [[2, 3], [1, -1]],  # rank 1 picks slot 2 (own), slot 3 (own), slot 1 (GPU 0)
    ])
    out = execute_none(choices, ids, PLACEMENT)
    # pair (0,0): ranks 0 and 1 both execute -> 2; (0,1): only rank 1 -> 1; (1,0): rank 0 -> 1
    assert out.multiplicity.tolist() == [[2, 1], [1, 0]]
    assert out.slot_load.tolist() == [1, 1, 1, 1]
    assert out.agreed == 2 and out.valid == 3


def test_execute_none_drops_pairs_nobody_executes():
    ids = torch.tensor([[0]])
    choices = torch.tensor([[[2]], [[0]]])  # rank 0 sends to GPU 1, rank 1 to GPU 0
    out = execute_none(choices, ids, PLACEMENT)
    assert out.multiplicity.tolist() == [[0]] and out.slot_load.sum() == 0 and out.agreed == 0


def test_token_owners_contiguous_shares_first_ranks_take_one_more():
    assert torch.bincount(token_owners(10, 4), minlength=4).tolist() == [3, 3, 2, 2]
    owners = token_owners(10, 4)
    assert (owners.diff() >= 0).all()
    src = torch.tensor([1, 0, 1, 1])
    assert torch.equal(token_owners(4, 2, src), src)
    with pytest.raises(InputError, match="src_rank names rank 3"):
        token_owners(2, 2, torch.tensor([0, 3]))


def test_a2a_rows_count_within_each_rank_share():
    seen = []

    def spy(ids, view, ctx):
        seen.append((ctx.rank, ids.shape[0]))
        return POLICIES["row"](ids, view, ctx)

    ids = torch.tensor([[0], [0], [0], [0], [0]])
    views = [full_view(PLACEMENT, r) for r in range(2)]
    ctxs = [DispatchContext(rank=r, mode="a2a") for r in range(2)]
    phys = dispatch_a2a(ids, token_owners(5, 2), views, spy, ctxs)
    assert seen == [(0, 3), (1, 2)]
    assert phys.squeeze(1).tolist() == [0, 2, 0, 0, 2]  # local rows 0,1,2 | 0,1
    out = execute_a2a(phys, ids, PLACEMENT)
    assert out.multiplicity.tolist() == [[1]] * 5 and out.agreed is None


def test_a_policy_returning_a_wrong_slot_is_an_input_error():
    bad = lambda ids, view, ctx: torch.where(ids >= 0, 1, -1)  # noqa: E731  slot 1 holds 1
    views = [full_view(PLACEMENT, r) for r in range(2)]
    ctxs = [DispatchContext(rank=r) for r in range(2)]
    with pytest.raises(InputError, match="does not hold that expert"):
        dispatch_none(torch.tensor([[0]]), views, bad, ctxs)
    with pytest.raises(InputError, match="expected integer slots"):
        check_choices(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), PLACEMENT, 0, bad)


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
