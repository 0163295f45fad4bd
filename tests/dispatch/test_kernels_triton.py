"""The Triton step kernels (`eplbsim.dispatch.kernels.triton_dispatch`) against the reference policies.

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` experts, `P` slots, `G` GPUs.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`,
set below before the kernels are defined); with CUDA they are compiled and the CPU cases skip.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

triton = pytest.importorskip("triton")

from eplbsim.dispatch.policies import DispatchContext, ordinal_policy, row_policy  # noqa: E402
from eplbsim.placement import Placement, full_view  # noqa: E402
from eplbsim.placement.topology import Topology  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

from eplbsim.dispatch.kernels import triton_dispatch as td  # noqa: E402

if INTERPRET != type(td._row_kernel).__name__.startswith("Interpreted"):
    td = importlib.reload(td)  # imported earlier under the other mode: redefine the kernels

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not INTERPRET, reason="Triton runs on CPU tensors only under TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")),
]
POISON = 0x5A5A5A5A5A  # garbage the kernels must overwrite everywhere


def random_placement(gen, L, E, P, G):
    """Every expert once, the P - E redundant slots random, slots shuffled."""
    p2l = torch.stack([torch.cat([torch.arange(E), torch.randint(0, E, (P - E,), generator=gen)])
                       [torch.randperm(P, generator=gen)] for _ in range(L)])
    return Placement(p2l, E, Topology(G))


def random_ids(gen, T, L, K, E, pad_frac, dtype, transposed):
    """[T, L, K] ids with -1 padding; `transposed` gives a non-contiguous view."""
    shape = (L, T, K) if transposed else (T, L, K)
    ids = torch.randint(0, E, shape, generator=gen)
    ids = torch.where(torch.rand(shape, generator=gen) < pad_frac, -1, ids).to(dtype)
    return ids.transpose(0, 1) if transposed else ids


def reference(policy, ids, view, step):
    """Stack of the per-layer reference calls: [T, L, K] int64."""
    L = ids.shape[1]
    return torch.stack([policy(ids[:, l], view, DispatchContext(step=step, layer=l))
                        for l in range(L)], dim=1)


def check(ids, placement, step, device, block=16, sub=8, subs=2):
    """Both kernels equal the reference on `device`, writing every element of a poisoned out."""
    view = full_view(placement)
    want_row = reference(row_policy, ids, view, step)
    want_ord = reference(ordinal_policy, ids, view, step)
    T, L, K = ids.shape
    dids = ids.to(device)
    dview = view.to(device)
    offsets = step + torch.arange(L, device=device)  # [L] the reference's step + layer
    out = torch.full((T, L, K), POISON, dtype=torch.int64, device=device)
    got = td.row_step_triton(dids, dview.log2phy, dview.logcnt, out=out, block=block)
    assert got is out
    assert torch.equal(got.cpu(), want_row)
    out.fill_(POISON)
    got = td.ordinal_step_triton(dids, dview.log2phy, dview.logcnt, offsets, out=out,
                                 sub=sub, subs=subs)
    assert got is out
    assert torch.equal(got.cpu(), want_ord)
    fresh = td.ordinal_step_triton(dids, dview.log2phy, dview.logcnt, offsets, sub=sub, subs=subs)
    assert fresh.dtype == torch.int64 and torch.equal(fresh.cpu(), want_ord)


@st.composite
def cases(draw):
    G = draw(st.sampled_from([1, 2, 4]))
    E = draw(st.integers(1, 13))
    per_gpu = draw(st.integers(-(-E // G), -(-E // G) + 3))
    return {
        "T": draw(st.integers(0, 40)), "L": draw(st.integers(1, 3)),
        "K": draw(st.integers(1, 4)), "E": E, "G": G, "P": G * per_gpu,
        "step": draw(st.integers(0, 50)), "pad": draw(st.sampled_from([0.0, 0.2, 0.9])),
        "dtype": draw(st.sampled_from([torch.int32, torch.int64])),
        "transposed": draw(st.booleans()), "block": draw(st.sampled_from([4, 16, 64])),
        "sub": draw(st.sampled_from([2, 4, 8, 16])), "subs": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**16))}


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=15 if INTERPRET else 20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_triton_kernels_match_reference(device, case):
    gen = torch.Generator().manual_seed(case["seed"])
    placement = random_placement(gen, case["L"], case["E"], case["P"], case["G"])
    ids = random_ids(gen, case["T"], case["L"], case["K"], case["E"], case["pad"],
                     case["dtype"], case["transposed"])
    check(ids, placement, case["step"], device, case["block"], case["sub"], case["subs"])


@pytest.mark.parametrize("device", DEVICES)
def test_triton_multi_tile_hot_experts(device):
    """Far more pairs than one tile, few experts (long runs crossing tiles), E = 5 not a power
    of two, duplicate ids within rows: the scan across tiles decides every occurrence index."""
    gen = torch.Generator().manual_seed(7)
    placement = random_placement(gen, 2, 5, 12, 4)
    ids = random_ids(gen, 150, 2, 4, 5, 0.1, torch.int32, False)
    ids[:, :, 1] = ids[:, :, 0]  # duplicates within a row
    check(ids, placement, 3, device, block=32, sub=16, subs=2)  # 600 pairs, 19 tiles a layer


@pytest.mark.parametrize("device", DEVICES)
def test_triton_all_padding_and_large_offsets(device):
    gen = torch.Generator().manual_seed(3)
    placement = random_placement(gen, 3, 6, 12, 2)
    view = full_view(placement).to(device)
    ids = torch.full((9, 3, 2), -1, dtype=torch.int64, device=device)
    out = td.ordinal_step_triton(ids, view.log2phy, view.logcnt, torch.arange(3), sub=4)
    assert (out == -1).all()
    assert (td.row_step_triton(ids, view.log2phy, view.logcnt, block=8) == -1).all()
    ids = random_ids(gen, 11, 3, 2, 6, 0.2, torch.int64, False)
    check(ids, placement, 2**40 + 5, device, sub=4, subs=3)  # offsets beyond int32


@pytest.mark.parametrize("device", DEVICES)
def test_triton_empty_step(device):
    placement = random_placement(torch.Generator().manual_seed(1), 2, 4, 8, 2)
    view = full_view(placement).to(device)
    ids = torch.empty((0, 2, 3), dtype=torch.int32, device=device)
    assert td.row_step_triton(ids, view.log2phy, view.logcnt).shape == (0, 2, 3)
    assert td.ordinal_step_triton(ids, view.log2phy, view.logcnt, torch.zeros(2)).shape == (0, 2, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_row_at_given_rows_is_row_step_by_step(device):
    """Several steps' tokens in one launch, each at its row within its own step (the window a
    replay on a device dispatches, `ranks.window`): the steps' own launches, concatenated."""
    gen = torch.Generator().manual_seed(5)
    placement = random_placement(gen, 2, 7, 12, 4)
    view = full_view(placement).to(device)
    steps = [random_ids(gen, T, 2, 3, 7, 0.2, torch.int32, False).to(device) for T in (5, 0, 9)]
    rows = torch.cat([torch.arange(len(s), device=device) for s in steps])
    want = torch.cat([td.row_step_triton(s, view.log2phy, view.logcnt, block=8) for s in steps])
    got = td.row_step_triton(torch.cat(steps), view.log2phy, view.logcnt, block=8, rows=rows)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="rows must be"):
        td.row_step_triton(torch.cat(steps), view.log2phy, view.logcnt, rows=rows[:3])


def test_triton_rejects_bad_out_and_sub():
    placement = random_placement(torch.Generator().manual_seed(1), 1, 4, 8, 2)
    view = full_view(placement)
    ids = torch.zeros((3, 1, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="out must be"):
        td.row_step_triton(ids, view.log2phy, view.logcnt, out=torch.empty(3, 1, 2))
    with pytest.raises(ValueError, match="power of two"):
        td.ordinal_step_triton(ids, view.log2phy, view.logcnt, torch.zeros(1), sub=6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_cuda_default_blocks_deepseek_shape():
    """The production block sizes on the DeepSeek-V3 shape (E=256, K=8, P=288), a few layers,
    run twice: equal to the reference and identical from run to run."""
    gen = torch.Generator().manual_seed(11)
    L, T, K, E, P = 4, 3000, 8, 256, 288
    placement = random_placement(gen, L, E, P, 32)
    hot = torch.randint(0, 8, (T, L, K), generator=gen)  # skewed: a few hot experts
    ids = torch.where(torch.rand(T, L, K, generator=gen) < 0.5, hot,
                      torch.randint(0, E, (T, L, K), generator=gen))
    ids = torch.where(torch.rand(T, L, K, generator=gen) < 0.05, -1, ids).to(torch.int32)
    view = full_view(placement)
    dview = view.to("cuda")
    offsets = 9 + torch.arange(L, device="cuda")
    want = reference(ordinal_policy, ids, view, 9)
    first = td.ordinal_step_triton(ids.cuda(), dview.log2phy, dview.logcnt, offsets)
    second = td.ordinal_step_triton(ids.cuda(), dview.log2phy, dview.logcnt, offsets)
    assert torch.equal(first.cpu(), want) and torch.equal(second, first)
    got = td.row_step_triton(ids.cuda(), dview.log2phy, dview.logcnt)
    assert torch.equal(got.cpu(), reference(row_policy, ids, view, 9))
