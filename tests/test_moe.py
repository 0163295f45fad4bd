"""The toy MoE layer: exact output, and what multiplicity does to it."""

import torch

from eplbsim.moe import (GRID_BITS, error_terms, make_toy_moe, output_error_terms, pair_outputs,
                         token_inputs)


def test_pair_outputs_match_the_definition_and_zero_padding():
    moe = make_toy_moe(2, 5, hidden=4, seed=1)
    x, gates = token_inputs(moe, step=3, num_tokens=6, top_k=2)
    assert torch.allclose(gates.sum(-1), torch.ones(6)) and (gates > 0).all()
    ids = torch.tensor([[0, 4], [1, -1], [2, 3], [4, 4], [-1, -1], [3, 0]])
    out = pair_outputs(moe, 1, ids, x, gates)
    t, k = 2, 1
    want = gates[t, k] * moe.weights[1, ids[t, k]] @ x[t]
    assert out.dtype == torch.float64
    assert torch.allclose(out[t, k], want.double(), rtol=0, atol=2.0 ** -GRID_BITS)
    assert (out[1, 1] == 0).all() and (out[4] == 0).all()
    scaled = out * 2.0 ** GRID_BITS
    assert torch.equal(scaled, scaled.round())  # on the grid


def test_sums_of_pair_outputs_do_not_depend_on_the_order():
    """What an all-reduce over ranks relies on: any order of summation gives the same bits."""
    moe = make_toy_moe(1, 8, seed=2)
    x, gates = token_inputs(moe, 0, 64, 4)
    ids = torch.randint(0, 8, (64, 4), generator=torch.Generator().manual_seed(1))
    pairs = pair_outputs(moe, 0, ids, x, gates)  # [T, K, D]
    flat = pairs.reshape(-1, pairs.shape[-1])  # [T*K, D]
    forward = flat.sum(0)
    backward = torch.zeros_like(forward)
    for row in flat.flip(0):
        backward += row
    assert torch.equal(forward, backward)


def test_error_terms_ignore_zero_rows():
    diff = torch.tensor([[0.5, -0.25], [0.0, 0.0], [1e-3, 3.0]], dtype=torch.float64)
    exact = torch.ones(4, 2, dtype=torch.float64)
    assert error_terms(diff, exact) == error_terms(diff[[2, 0]], exact)
    assert error_terms(diff, exact)[1] == 8.0


def test_output_error_is_zero_at_multiplicity_one_and_one_when_doubled_or_dropped():
    moe = make_toy_moe(1, 3, hidden=8, seed=0)
    x, gates = token_inputs(moe, 0, 10, 2)
    ids = torch.randint(0, 3, (10, 2), generator=torch.Generator().manual_seed(0))
    pairs = pair_outputs(moe, 0, ids, x, gates)
    ones = torch.ones(10, 2, dtype=torch.long)
    valid = ones.bool()
    err, exact = output_error_terms(pairs, ones, valid)
    assert err == 0.0 and exact > 0
    assert abs(output_error_terms(pairs, 2 * ones, valid)[0] / exact - 1) < 1e-12
    assert abs(output_error_terms(pairs, 0 * ones, valid)[0] / exact - 1) < 1e-12
    # a padding pair (executed 0 times by definition) adds nothing
    padded = valid.clone()
    padded[3, 1] = False
    assert output_error_terms(pairs, ones.masked_fill(~padded, 0), padded)[0] == 0.0


def test_inputs_are_seeded():
    a, b = make_toy_moe(1, 2, seed=5), make_toy_moe(1, 2, seed=5)
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(token_inputs(a, 2, 3, 1)[0], token_inputs(b, 2, 3, 1)[0])
    assert not torch.equal(token_inputs(a, 2, 3, 1)[0], token_inputs(a, 3, 3, 1)[0])
