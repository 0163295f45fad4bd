"""The toy MoE layer: exact output, and what multiplicity does to it."""

import math

import numpy as np
import pytest
import torch

from eplbsim.ranks import counting
from eplbsim.ranks.moe import (DEVICE_SUM_VALUES, GRID_BITS, all_reduced_error_terms,
                               device_square_sums, error_terms, grid_square_sums,
                               local_error_terms, make_toy_moe, pair_outputs, step_sums,
                               token_inputs)


def test_pair_outputs_match_the_definition_and_zero_padding():
    moe = make_toy_moe(2, 5, hidden=4, seed=1)
    x, gates = token_inputs(moe, step=3, ids_shape=(6, 2, 2))
    assert torch.allclose(gates.sum(-1), torch.ones(6, 2)) and (gates > 0).all()
    assert torch.equal(gates[:, 0], gates[:, 1])  # drawn gates: the same in every layer
    gates = gates[:, 1]
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
    x, gates = token_inputs(moe, 0, (64, 1, 4))
    gates = gates[:, 0]
    ids = torch.randint(0, 8, (64, 4), generator=torch.Generator().manual_seed(1))
    pairs = pair_outputs(moe, 0, ids, x, gates)  # [T, K, D]
    flat = pairs.reshape(-1, pairs.shape[-1])  # [T*K, D]
    forward = flat.sum(0)
    backward = torch.zeros_like(forward)
    for row in flat.flip(0):
        backward += row
    assert torch.equal(forward, backward)


def test_error_terms_ignore_zero_rows_and_sum_exactly():
    diff = torch.tensor([[[0.5, -0.25], [0.0, 0.0], [1e-3, 3.0]]], dtype=torch.float64)
    exact = torch.ones(1, 4, 2, dtype=torch.float64)
    assert torch.equal(error_terms(diff, exact), error_terms(diff[:, [2, 0]], exact))
    assert error_terms(diff, exact)[0, 1] == 8.0
    tiny = torch.tensor([[[1.0, 2.0 ** -30, 2.0 ** -30, 2.0 ** -30]]], dtype=torch.float64)
    assert error_terms(tiny, exact)[0, 0] == math.fsum((tiny * tiny).flatten().tolist())


def _grid_rows(rng, rows, n, top):
    """float64 `[rows, n]` multiples of 2**-GRID_BITS of magnitudes up to `top`, a third 0."""
    v = np.round(rng.standard_normal((rows, n)) * 10.0 ** rng.uniform(-7, np.log10(top), (rows, n))
                 * 2.0 ** GRID_BITS) / 2.0 ** GRID_BITS
    v[rng.random(v.shape) < 1 / 3] = 0.0
    return torch.from_numpy(np.clip(v, -top, top))


def test_grid_square_sums_are_math_fsum_or_decline():
    rng = np.random.default_rng(7)
    rows = _grid_rows(rng, 5, 4000, 100.0)
    rows[1] = 0.0
    rows[2, :3] = torch.tensor([127.0, -2.0 ** -GRID_BITS, 3 * 2.0 ** -GRID_BITS])
    got = grid_square_sums(rows)
    assert [float(g) for g in got] == [math.fsum(v * v for v in r.tolist()) for r in rows]
    assert grid_square_sums(rows[:, :0]).tolist() == [0.0] * 5
    off_grid = rows.clone()
    off_grid[0, 0] = 2.0 ** -(GRID_BITS + 1)
    large = rows.clone()
    large[3, 5] = 2.0 ** 7
    assert grid_square_sums(off_grid) is None and grid_square_sums(large) is None


def test_device_square_sums_are_math_fsum_or_nan_in_their_row():
    """Summed where the rows are and read back nowhere: each on-grid row's exactly rounded sum
    (large sums too, whose parts need the float64 carry), NaN only in a row that cannot be."""
    rng = np.random.default_rng(8)
    rows = _grid_rows(rng, 6, 30000, 120.0)
    rows[1] = 0.0
    rows[2, :3] = torch.tensor([127.0, -2.0 ** -GRID_BITS, 3 * 2.0 ** -GRID_BITS])
    rows[5] = 127.0 - 2.0 ** -GRID_BITS  # every square near 2**14: a sum of about 2**29
    want = [math.fsum(v * v for v in r.tolist()) for r in rows]
    assert device_square_sums(rows).tolist() == want
    assert device_square_sums(rows[:, :0]).tolist() == [0.0] * 6
    off = rows.clone()
    off[0, 0] = 2.0 ** -(GRID_BITS + 1)
    off[3, 5] = 2.0 ** 7
    got = device_square_sums(off).tolist()
    assert math.isnan(got[0]) and math.isnan(got[3])
    assert [g for i, g in enumerate(got) if i not in (0, 3)] == [
        w for i, w in enumerate(want) if i not in (0, 3)]
    wide = torch.zeros(2, DEVICE_SUM_VALUES)
    assert all(math.isnan(v) for v in device_square_sums(wide.double()).tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_error_terms_on_cuda_equal_the_cpu_ones():
    rng = np.random.default_rng(8)
    diff = _grid_rows(rng, 3, 6000, 50.0).reshape(3, 1000, 6)
    exact = _grid_rows(rng, 3, 6000, 5.0).reshape(3, 1000, 6)
    assert torch.equal(error_terms(diff.cuda(), exact.cuda()), error_terms(diff, exact))
    large = diff.clone()
    large[0, 0, 0] = 300.0  # beyond the grid method: summed on the CPU instead
    assert torch.equal(error_terms(large.cuda(), exact.cuda()), error_terms(large, exact))


def test_output_error_is_zero_at_multiplicity_one_and_one_when_doubled_or_dropped():
    moe = make_toy_moe(2, 3, hidden=8, seed=0)
    ids = torch.randint(0, 3, (10, 2, 2), generator=torch.Generator().manual_seed(0))  # [T, L, K]
    ones = torch.ones(10, 2, 2, dtype=torch.long)
    one_process = lambda t: t  # noqa: E731
    terms = all_reduced_error_terms(moe, 0, ids, ones, one_process)  # [L, 2]
    assert (terms[:, 0] == 0).all() and (terms[:, 1] > 0).all()
    for wrong in (2 * ones, 0 * ones):
        err = all_reduced_error_terms(moe, 0, ids, wrong, one_process)
        assert torch.allclose(err[:, 0] / err[:, 1], torch.ones(2, dtype=torch.float64))
    # padding pairs (executed 0 times by definition) add nothing
    padded = ids.clone()
    padded[3, 1, 1] = -1
    assert all_reduced_error_terms(moe, 0, padded, ones.masked_fill(padded < 0, 0),
                                   one_process)[:, 0].eq(0).all()


def test_partial_outputs_summed_by_the_all_reduce_give_the_same_bits():
    """Two processes each executing half the pairs, their partial outputs summed, measure the
    error exactly as one process executing all of them."""
    moe = make_toy_moe(1, 4, hidden=4, seed=3)
    ids = torch.randint(0, 4, (9, 1, 3), generator=torch.Generator().manual_seed(2))
    executed = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(3))
    half = executed // 2
    whole = all_reduced_error_terms(moe, 1, ids, executed, lambda t: t)
    partials = []
    for part in (half, executed - half):
        all_reduced_error_terms(moe, 1, ids, part, lambda t: partials.append(t) or t)
    summed = all_reduced_error_terms(moe, 1, ids, half, lambda t: partials[0] + partials[1])
    assert torch.equal(whole, summed)


@pytest.mark.parametrize("hidden", [3, 8, 12])
def test_one_pass_error_terms_equal_the_all_reduced_ones(hidden):
    """`local_error_terms` (one compiled pass, no `[L, T, D]` outputs) gives the general path's
    bits, padding and every multiplicity included: `math.fsum` of the squares of the error
    and of the exact output."""
    moe = make_toy_moe(3, 6, hidden=hidden, seed=hidden)
    gen = torch.Generator().manual_seed(hidden)
    ids = torch.randint(-1, 6, (300, 3, 4), generator=gen, dtype=torch.int32)  # [T, L, K]
    executed = torch.randint(0, 5, ids.shape, generator=gen, dtype=torch.int32)
    fused = local_error_terms(moe, 2, ids, executed)
    assert torch.equal(fused, all_reduced_error_terms(moe, 2, ids, executed, lambda t: t))
    exact, weighted = step_sums(moe, 2, ids, executed)
    for layer in range(3):
        diff = (weighted[layer] - exact[layer]).flatten().tolist()
        assert fused[layer, 0] == math.fsum(v * v for v in diff) > 0
        assert fused[layer, 1] == math.fsum(v * v for v in exact[layer].flatten().tolist())


def test_one_pass_error_terms_leave_outputs_off_the_grid_to_the_general_path():
    """An output of 128 or more: `counting.error_squares` says None, and `local_error_terms`
    still gives the general path's terms."""
    moe = make_toy_moe(1, 2, hidden=8, seed=0)
    ids = torch.zeros(4, 1, 1, dtype=torch.int32)
    twice = torch.full((4, 1, 1), 2, dtype=torch.int32)
    x, gates = token_inputs(moe, 0, (4, 1, 1))
    args = (x.numpy(), gates.numpy(), ids.numpy(), twice.numpy())
    assert counting.error_squares(moe.transposed, *args) is not None
    assert counting.error_squares(moe.transposed * 1e4, *args) is None
    moe.__dict__["weights"] = moe.weights * 1e4  # (its cached matrices, scaled)
    moe.__dict__["transposed"] = moe.transposed * 1e4
    assert torch.equal(local_error_terms(moe, 0, ids, twice),
                       all_reduced_error_terms(moe, 0, ids, twice, lambda t: t))


def test_inputs_are_seeded():
    a, b = make_toy_moe(1, 2, seed=5), make_toy_moe(1, 2, seed=5)
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(token_inputs(a, 2, (3, 1, 1))[0], token_inputs(b, 2, (3, 1, 1))[0])
    assert not torch.equal(token_inputs(a, 2, (3, 1, 1))[0], token_inputs(a, 3, (3, 1, 1))[0])


def test_cpu_loops_and_torch_pair_outputs_give_the_same_sums():
    """The CPU's compiled definition (`counting.layer_sums`) and the torch one used on CUDA agree
    bit for bit on a step large enough for torch's batched product."""
    moe = make_toy_moe(3, 16, hidden=8, seed=4)
    rng = np.random.default_rng(5)
    ids = torch.from_numpy(np.stack([[rng.permutation(16)[:4] for _ in range(3)]
                                     for _ in range(512)])).to(torch.int16)  # [T, L, K]
    ids[7, 1, 2] = -1
    executed = torch.from_numpy(rng.integers(0, 3, ids.shape))
    exact, weighted = step_sums(moe, 2, ids, executed)
    x, gates = token_inputs(moe, 2, (512, 3, 4))
    for layer in range(3):
        pairs = pair_outputs(moe, layer, ids[:, layer], x, gates[:, layer])
        assert torch.equal(exact[layer], pairs.sum(1))
        assert torch.equal(weighted[layer], (pairs * executed[:, layer].unsqueeze(-1)).sum(1))


def test_a_traces_gating_weights_are_the_gates_each_layer_its_own():
    """Where the trace holds gating weights the toy MoE weighs each pair by its own weight, on
    the CPU loops and on the torch path alike: a pair of weight 0 adds nothing, so executing
    it twice is no error, while the same slip on a weighted pair is."""
    from eplbsim.traces.trace import Trace
    ids = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], dtype=torch.int32)  # [T=2, L=2, K=2]
    weights = torch.tensor([[[0.75, 0.0], [0.5, 0.5]], [[0.3, 0.7], [1.0, 0.25]]])
    trace = Trace(ids, torch.tensor([0, 2]), 4, topk_weights=weights)
    moe = make_toy_moe(2, 4, hidden=4, seed=1, trace=trace)
    x, gates = token_inputs(moe, 0, tuple(ids.shape))
    assert torch.equal(gates, weights)
    zero_twice = torch.ones(2, 2, 2, dtype=torch.int64)
    zero_twice[0, 0, 1] = 2  # the pair of weight 0
    assert local_error_terms(moe, 0, ids, zero_twice)[:, 0].tolist() == [0.0, 0.0]
    zero_twice[1, 1, 1] = 2  # a pair of weight 0.25 in layer 1
    terms = local_error_terms(moe, 0, ids, zero_twice)
    assert terms[0, 0] == 0 and terms[1, 0] > 0
    assert torch.equal(terms, all_reduced_error_terms(moe, 0, ids, zero_twice, lambda t: t))
    pairs = pair_outputs(moe, 1, ids[:, 1], x, gates[:, 1])
    want = 0.25 * moe.weights[1, 0] @ x[1]
    assert torch.allclose(pairs[1, 1], want.double(), rtol=0, atol=2.0 ** -GRID_BITS)
    plain = make_toy_moe(2, 4, hidden=4, seed=1)
    assert not torch.equal(token_inputs(plain, 0, tuple(ids.shape))[1], weights)
