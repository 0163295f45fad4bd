"""Triton step kernels for the `row` and `ordinal` policies: every layer of a step in one call.

Dimensions: `T` tokens in the step, `L` layers, `K` top-k, `E` logical experts, `R` max
candidates of one expert, `M = T * K` (token, slot) pairs of one layer, `B` pairs of a sub-block
(a power of two), `NB` histogram bins (`next_power_of_2(E + 1)`: the E experts and one bin for
padding).

Both kernels are bit-identical to stacking the reference policies of `eplbsim.dispatch` over the
layers, and both take `topk_ids [T, L, K]` as it is (any strides, int32 or int64): the pairs of
layer `l` are `topk_ids[:, l, :]` in row-major order, read in place rather than transposed.
`phys [T, L, K]` int64 is written contiguously. Nothing in eplbsim imports this module at import
time; callers import it where Triton is installed (on CUDA, or on CPU tensors under
`TRITON_INTERPRET=1`).

row — one pass. Each program takes `BLOCK` pairs of one layer: pair `j` is token `t = j // K`,
slot `k = j % K`; it loads the id, gathers `n = logcnt[l, e]` and `log2phy[l, e, t % n]`, stores
the slot (-1 at padding).

ordinal — `replica = (occurrence index + offsets[l]) % n_e`, where the occurrence index of a pair
is the number of earlier pairs of its layer (row-major over `[T, K]`) with the same id. A layer's
pairs are cut into tiles of `TILE = SUBS * B` pairs, a tile into `SUBS` sub-blocks of `B`:

1. `_ordinal_hist_kernel`, one program per (tile, layer): the tile's per-expert histogram
   `hist [L, n_tiles, E]` (int32), summed over its sub-blocks with `tl.histogram`.
2. torch, between launches: `base = cumsum(hist, dim=1) - hist`, the exclusive scan across tiles:
   pairs of expert `e` in all earlier tiles of the layer.
3. `_ordinal_kernel`, one program per (tile, layer): carries `running [NB]` = `base` of the tile,
   then for each sub-block in order: sorts the keys `bin * B + position` (`tl.sort`, so equal ids
   stay in position order); in sorted order the `i`-th key of expert `e` has occurrence index
   `running[e] + i - first[e]`, `first` = exclusive cumsum of the sub-block's histogram (both read
   with `tl.gather`); gathers `logcnt` and `log2phy`, stores each slot back at the pair's own
   position; adds the sub-block's histogram to `running`.

Determinism: every count is an integer histogram or an integer prefix sum in a fixed order; no
atomic hands out positions, so the result does not depend on scheduling and is the same on every
run, device and rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BLOCK = 1024  # pairs per program of the row kernel
ORDINAL_SUB = 1024  # B: pairs sorted together (a power of two)
ORDINAL_SUBS = 8  # sub-blocks per tile: TILE = 8192 pairs, hist costs 4*E/8192 bytes a pair
_INT32_MAX = 2**31 - 1


@triton.jit
def _row_kernel(ids_ptr, log2phy_ptr, logcnt_ptr, out_ptr, rows_ptr,
                M, E, R, stride_t, stride_l, stride_k, LK,
                K: tl.constexpr, BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Program (block b, layer l): pairs j in [b * BLOCK, (b + 1) * BLOCK) of layer l; token
    `t`'s row is `rows[t]` when `HAS_ROWS` (several steps' tokens), else `t`."""
    l = tl.program_id(1)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] pair index within the layer
    live = j < M
    t = j // K
    k = j - t * K
    e = tl.load(ids_ptr + t * stride_t + l * stride_l + k * stride_k, mask=live, other=-1)
    e = e.to(tl.int32)
    valid = live & (e >= 0)
    row = l * E + tl.where(valid, e, 0)  # [BLOCK] row of (l, e) in logcnt [L, E]
    n = tl.load(logcnt_ptr + row, mask=valid, other=1).to(tl.int32)
    if HAS_ROWS:
        r = tl.load(rows_ptr + t, mask=valid, other=0).to(tl.int32)
    else:
        r = t
    phys = tl.load(log2phy_ptr + row * R + r % n, mask=valid, other=-1)
    tl.store(out_ptr + t * LK + l * K + k, tl.where(valid, phys, -1), mask=live)


@triton.jit
def _ordinal_hist_kernel(ids_ptr, hist_ptr, M, E, n_tiles, stride_t, stride_l, stride_k,
                         K: tl.constexpr, SUB: tl.constexpr, SUBS: tl.constexpr,
                         NB: tl.constexpr):
    """Program (tile c, layer l): hist[l, c, e] = pairs of expert e among the tile's pairs."""
    c = tl.program_id(0)
    l = tl.program_id(1)
    counts = tl.zeros([NB], dtype=tl.int32)  # [NB]
    for s in range(SUBS):
        j = (c * SUBS + s) * SUB + tl.arange(0, SUB)  # [SUB]
        live = j < M
        t = j // K
        k = j - t * K
        e = tl.load(ids_ptr + t * stride_t + l * stride_l + k * stride_k, mask=live, other=-1)
        e = e.to(tl.int32)
        counts += tl.histogram(tl.where(live & (e >= 0), e, E), NB).to(tl.int32)
    bins = tl.arange(0, NB)
    tl.store(hist_ptr + (l * n_tiles + c) * E + bins, counts, mask=bins < E)


@triton.jit
def _ordinal_kernel(ids_ptr, log2phy_ptr, logcnt_ptr, base_ptr, offsets_ptr, out_ptr,
                    M, E, R, n_tiles, stride_t, stride_l, stride_k, LK,
                    K: tl.constexpr, SUB: tl.constexpr, SUBS: tl.constexpr, NB: tl.constexpr):
    """Program (tile c, layer l): the slots of the tile's pairs, sub-block by sub-block."""
    c = tl.program_id(0)
    l = tl.program_id(1)
    bins = tl.arange(0, NB)
    # [NB] pairs of each expert before the current sub-block (0 in the padding bins)
    running = tl.load(base_ptr + (l * n_tiles + c) * E + bins, mask=bins < E, other=0)
    offset = tl.load(offsets_ptr + l)  # int64 scalar
    pos = tl.arange(0, SUB)  # [SUB]
    for s in range(SUBS):
        start = (c * SUBS + s) * SUB
        j = start + pos
        live = j < M
        t = j // K
        k = j - t * K
        e = tl.load(ids_ptr + t * stride_t + l * stride_l + k * stride_k, mask=live, other=-1)
        e = e.to(tl.int32)
        ebin = tl.where(live & (e >= 0), e, E)  # [SUB] padding and out-of-range -> bin E
        counts = tl.histogram(ebin, NB).to(tl.int32)  # [NB]
        first = tl.cumsum(counts, 0) - counts  # [NB] first sorted index of each bin
        key = tl.sort(ebin * SUB + pos)  # [SUB] by expert, then by position
        se = key // SUB  # [SUB] expert (bin) in sorted order
        sp = key - se * SUB  # [SUB] its position in the sub-block
        occ = pos + tl.gather(running - first, se, 0)  # [SUB] occurrence index in the layer
        svalid = se < E
        row = l * E + tl.where(svalid, se, 0)  # [SUB] row of (l, e) in logcnt [L, E]
        n = tl.load(logcnt_ptr + row, mask=svalid, other=1)  # int64
        replica = (occ.to(tl.int64) + offset) % n
        phys = tl.load(log2phy_ptr + row.to(tl.int64) * R + replica, mask=svalid, other=-1)
        sj = start + sp
        st = sj // K
        sk = sj - st * K
        tl.store(out_ptr + st * LK + l * K + sk, tl.where(svalid, phys, -1), mask=sj < M)
        running += counts


def _prepare(ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
             out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes, put the maps on the ids' device (contiguous int64), allocate `out`."""
    if ids.dim() != 3:
        raise ValueError(f"topk_ids must be [T, L, K], got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {ids.dtype}")
    T, L, K = ids.shape
    if log2phy.dim() != 3 or log2phy.shape[0] != L or tuple(logcnt.shape) != log2phy.shape[:2]:
        raise ValueError(f"log2phy [L, E, R] and logcnt [L, E] do not match L={L}: "
                         f"{tuple(log2phy.shape)}, {tuple(logcnt.shape)}")
    if ids.numel() > _INT32_MAX or log2phy.numel() > _INT32_MAX:
        raise ValueError("the Triton kernels index with int32: split steps over 2**31 entries")
    log2phy = log2phy.to(ids.device, torch.int64).contiguous()  # [L, E, R]
    logcnt = logcnt.to(ids.device, torch.int64).contiguous()  # [L, E]
    if out is None:
        out = torch.empty((T, L, K), dtype=torch.int64, device=ids.device)
    elif (tuple(out.shape) != (T, L, K) or out.dtype != torch.int64
          or out.device != ids.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous int64 [T, L, K] = {(T, L, K)} tensor on "
                         f"{ids.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return log2phy, logcnt, out


def row_step_triton(ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, *,
                    out: torch.Tensor | None = None, block: int = ROW_BLOCK,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """`row` for every layer of a step: `out[t, l, k] = log2phy[l, e, t % logcnt[l, e]]`.

    ids:     int32/int64 `[T, L, K]` logical ids in [-1, E), -1 = padding (any strides)
    log2phy: int64 `[L, E, R]` candidate slots, ascending, -1 padded
    logcnt:  int64 `[L, E]` candidates per expert (>= 1)
    out:     optional contiguous int64 `[T, L, K]` buffer, fully overwritten
    block:   pairs per program (a power of two)
    rows:    optional `[T]` non-negative row of each token within its own step, when `ids` are
             several steps' tokens concatenated (`t % ...` becomes `rows[t] % ...`)
    returns  int64 `[T, L, K]`, -1 at padding; equal to `dispatch.row_policy` layer by layer
             (step by step, with `rows`).
    """
    log2phy, logcnt, out = _prepare(ids, log2phy, logcnt, out)
    T, L, K = ids.shape
    M = T * K  # pairs per layer
    if M == 0 or L == 0:
        return out
    if rows is not None and (tuple(rows.shape) != (T,) or rows.device != ids.device):
        raise ValueError(f"rows must be [T] = [{T}] on {ids.device}, got {tuple(rows.shape)} "
                         f"on {rows.device}")
    E, R = log2phy.shape[1], log2phy.shape[2]
    grid = (triton.cdiv(M, block), L)
    _row_kernel[grid](ids, log2phy, logcnt, out, out if rows is None else rows.contiguous(),
                      M, E, R, *ids.stride(), L * K, K=K, BLOCK=block,
                      HAS_ROWS=rows is not None)
    return out


def ordinal_step_triton(ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                        offsets: torch.Tensor, *, out: torch.Tensor | None = None,
                        sub: int = ORDINAL_SUB, subs: int = ORDINAL_SUBS) -> torch.Tensor:
    """`ordinal` for every layer of a step, deterministic (no atomics hand out positions).

    ids:     int32/int64 `[T, L, K]` logical ids in [-1, E), -1 = padding (any strides)
    log2phy: int64 `[L, E, R]` candidate slots, ascending, -1 padded
    logcnt:  int64 `[L, E]` candidates per expert (>= 1)
    offsets: int64 `[L]` non-negative start offset of each layer (the reference's step + layer)
    out:     optional contiguous int64 `[T, L, K]` buffer, fully overwritten
    sub:     B, pairs sorted together (a power of two); subs: sub-blocks per tile
    returns  int64 `[T, L, K]`: `log2phy[l, e, (occ + offsets[l]) % logcnt[l, e]]`, occ = earlier
             pairs of layer l (row-major over `[T, K]`) with the same id; -1 at padding.
    """
    log2phy, logcnt, out = _prepare(ids, log2phy, logcnt, out)
    T, L, K = ids.shape
    M = T * K  # pairs per layer
    if M == 0 or L == 0:
        return out
    if sub < 1 or sub & (sub - 1) or subs < 1:
        raise ValueError(f"sub must be a power of two and subs positive, got {sub}, {subs}")
    E, R = log2phy.shape[1], log2phy.shape[2]
    if (E + 1) * sub > _INT32_MAX:
        raise ValueError(f"sort keys (E + 1) * sub = {(E + 1) * sub} overflow int32")
    offsets = torch.as_tensor(offsets).to(ids.device, torch.int64).contiguous()  # [L]
    if tuple(offsets.shape) != (L,):
        raise ValueError(f"offsets must be [L] = [{L}], got {tuple(offsets.shape)}")
    NB = triton.next_power_of_2(E + 1)
    n_tiles = triton.cdiv(M, sub * subs)
    grid = (n_tiles, L)
    hist = torch.empty((L, n_tiles, E), dtype=torch.int32, device=ids.device)  # [L, tiles, E]
    _ordinal_hist_kernel[grid](ids, hist, M, E, n_tiles, *ids.stride(),
                               K=K, SUB=sub, SUBS=subs, NB=NB)
    base = torch.cumsum(hist, dim=1, dtype=torch.int32) - hist  # [L, tiles, E] exclusive scan
    _ordinal_kernel[grid](ids, log2phy, logcnt, base, offsets, out, M, E, R, n_tiles,
                          *ids.stride(), L * K, K=K, SUB=sub, SUBS=subs, NB=NB)
    return out
