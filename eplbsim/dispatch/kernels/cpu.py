"""CPU step kernels compiled with numba: one pass over a step's pairs, every layer at once.

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts, `R` max candidates.

Torch has no running-count primitive, so on the CPU `ordinal` would need a general sort (an
O(N log N) stable argsort, ~10x a gather); a compiled loop counts occurrences in one pass.
`ordinal` splits each layer's pairs into blocks: a per-block expert histogram, an exclusive scan
over blocks, then each block counts on from its base, so blocks run in parallel and the result
does not depend on the number of threads.
Every kernel writes int64 `[T, L, K]`, -1 where the id is -1.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ...counting import JIT, pair_table, row_chunks
from ..policies import DispatchContext, layer_draws, layer_offsets, static_table
from ...placement import View

@numba.jit(parallel=True, **JIT)
def _row(ids, log2phy, logcnt, out, chunks):  # pragma: no cover - compiled
    """`row % n` without a division a pair: each chunk of rows keeps `t % n` for every
    candidate count `n <= R` and steps it on by one a row (R additions a row instead of L K
    divisions; with more candidates than that saves, the division)."""
    T, L, K = ids.shape
    R = log2phy.shape[2]
    stepped = R <= L * K
    for c in numba.prange(chunks.shape[0] - 1):
        lo, hi = chunks[c], chunks[c + 1]
        mods = np.empty(R + 1, np.int64)  # mods[n] = t % n
        for n in range(1, R + 1):
            mods[n] = lo % n
        for t in range(lo, hi):
            for layer in range(L):
                for k in range(K):
                    e = ids[t, layer, k]
                    if e < 0:
                        out[t, layer, k] = -1
                    else:
                        n = logcnt[layer, e]
                        out[t, layer, k] = log2phy[layer, e, mods[n] if stepped else t % n]
            if stepped:
                for n in range(1, R + 1):
                    mods[n] += 1
                    if mods[n] == n:
                        mods[n] = 0


@numba.jit(parallel=True, **JIT)
def _ordinal(ids, log2phy, logcnt, offsets, out, num_blocks):  # pragma: no cover - compiled
    T, L, K = ids.shape
    E = logcnt.shape[1]
    rows = (T + num_blocks - 1) // num_blocks
    base = np.zeros((L, num_blocks + 1, E), np.int64)  # [L, B + 1, E] counts before block b
    for job in numba.prange(L * num_blocks):
        layer, b = job // num_blocks, job % num_blocks
        for t in range(b * rows, min(T, (b + 1) * rows)):
            for k in range(K):
                e = ids[t, layer, k]
                if e >= 0:
                    base[layer, b + 1, e] += 1
    for layer in numba.prange(L):
        for b in range(1, num_blocks + 1):
            for e in range(E):
                base[layer, b, e] += base[layer, b - 1, e]
    for job in numba.prange(L * num_blocks):
        layer, b = job // num_blocks, job % num_blocks
        off = offsets[layer]
        turn = np.empty(E, np.int64)  # [E] (occurrences before + offset) % n, stepped a pair
        for e in range(E):
            turn[e] = (base[layer, b, e] + off) % logcnt[layer, e]
        for t in range(b * rows, min(T, (b + 1) * rows)):
            for k in range(K):
                e = ids[t, layer, k]
                if e < 0:
                    out[t, layer, k] = -1
                else:
                    out[t, layer, k] = log2phy[layer, e, turn[e]]
                    turn[e] += 1
                    if turn[e] == logcnt[layer, e]:
                        turn[e] = 0


@numba.jit(parallel=True, **JIT)
def _drawn(ids, log2phy, logcnt, draws, out):  # pragma: no cover - compiled
    T, L, K = ids.shape
    for t in numba.prange(T):
        for layer in range(L):
            for k in range(K):
                e = ids[t, layer, k]
                d = draws[layer, t * K + k]
                out[t, layer, k] = -1 if e < 0 else log2phy[layer, e, d % logcnt[layer, e]]


def _arrays(topk_ids: torch.Tensor, view: View) -> tuple[np.ndarray, ...]:
    ids = np.ascontiguousarray(topk_ids.numpy(), dtype=np.int32)  # one compiled signature
    return ids, view.log2phy.numpy(), view.logcnt.numpy(), np.empty(ids.shape, np.int64)


def row_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`row` for `[T, L, K]` ids in one pass."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view)
    _row(ids, log2phy, logcnt, out, row_chunks(ids.shape[0]))
    return torch.from_numpy(out)


def ordinal_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`ordinal` for `[T, L, K]` ids: per-layer offsets from (step, layer[, rank])."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view)
    L = ids.shape[1]
    offsets = layer_offsets(ctx, L).numpy()
    blocks = max(1, min(numba.get_num_threads() * 2 // L, ids.shape[0] // 4096))
    _ordinal(ids, log2phy, logcnt, offsets, out, blocks)
    return torch.from_numpy(out)


def static_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`static`: the rank's fixed table `[L, E]`, looked up for every pair."""
    table = static_table(view, ctx.rank, ctx.seed).numpy()  # [L, E]
    return torch.from_numpy(pair_table(table, _arrays(topk_ids, view)[0], -1))


def random_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`random`: one `randint(0, 65536)` batch of `T * K` draws per layer, in layer order."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view)
    T, L, K = ids.shape
    _drawn(ids, log2phy, logcnt, layer_draws(ctx, T * K, L, "cpu").numpy(), out)
    return torch.from_numpy(out)
