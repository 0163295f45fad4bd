"""Fan-out of a step (DESIGN.md §13): how many distinct GPUs and nodes each token's executed
choices reach in each layer, and how many of those GPUs are not the token's source GPU.

Dimensions: `T` tokens, `L` layers, `K` top-k, `G` GPUs, `W = ceil(G / 64)` words of a GPU set.

A step's destinations are first marked as one GPU set per (token, layer), bits of `W` uint64
words (`mark`, any number of times: "none" marks each group of identical ranks' executed pairs,
"a2a" each token's source rank's choices); the sets are then tallied (`tally`). Sets marked by
different processes never share a bit for the same (token, layer) in either mode (a "none" rank
sets only its own GPU's bit; an "a2a" token is marked by its owner alone), so summing the sets
over processes is their union.
"""

from __future__ import annotations

import numpy as np

from ..base.compiled import JIT, jit, prange
from ..base.loops import row_chunks

FIELDS = ("tokens", "gpus", "nodes", "remote")  # the columns of `tally`


def empty(num_tokens: int, num_layers: int, num_gpus: int) -> np.ndarray:
    """No GPU marked yet: int64 `[T, L, W]` (int64, not uint64, so torch can all-reduce it)."""
    return np.zeros((num_tokens, num_layers, (num_gpus + 63) // 64), np.int64)


@jit(parallel=True, **JIT)
def _mark(gpu, sets):  # pragma: no cover - compiled
    T, L, K = gpu.shape
    for t in prange(T):
        for layer in range(L):
            for k in range(K):
                g = gpu[t, layer, k]
                if g >= 0:
                    sets[t, layer, g >> 6] |= np.int64(1) << np.int64(g & 63)


def mark(sets: np.ndarray, gpu: np.ndarray) -> None:
    """Add to `sets [T, L, W]` (`empty`) the GPU of every pair of `gpu [T, L, K]` (any integer
    dtype; negative: nowhere, e.g. padding or a pair this group does not execute)."""
    _mark(np.ascontiguousarray(gpu), sets)


@jit(parallel=True, **JIT)
def _tally(sets, src, per_node, chunks, out):  # pragma: no cover - compiled
    T, L, W = sets.shape
    for c in prange(chunks.shape[0] - 1):
        for t in range(chunks[c], chunks[c + 1]):
            for layer in range(L):
                gpus = 0
                nodes = 0
                last = -1
                home = False
                for w in range(W):
                    bits = sets[t, layer, w]
                    g = w * 64
                    while bits != 0:  # the set bits in rising order: nodes never decrease
                        if bits & 1:
                            gpus += 1
                            if g // per_node != last:
                                nodes += 1
                                last = g // per_node
                            if g == src[t]:
                                home = True
                        bits = (bits >> np.int64(1)) & np.int64(0x7FFFFFFFFFFFFFFF)
                        g += 1
                out[c, layer, 1] += gpus
                out[c, layer, 2] += nodes
                out[c, layer, 3] += gpus - (1 if home else 0)


def tally(sets: np.ndarray, tokens: np.ndarray, gpus_per_node: int,
          src: np.ndarray | None = None) -> np.ndarray:
    """The step's fan-out counts per layer, int64 `[L, 4]` (`FIELDS`): `tokens` (given, `[L]`:
    the tokens with at least one valid pair, the denominator of the means), the distinct GPUs
    and nodes of every (token, layer)'s set in `sets [T, L, W]` summed over tokens, and of
    those GPUs the ones other than the token's source GPU `src [T]` (None: every GPU counts,
    as "none" has no source)."""
    T, L, _ = sets.shape
    src = np.full(T, -1, np.int64) if src is None else np.ascontiguousarray(src, np.int64)
    chunks = row_chunks(T)
    out = np.zeros((len(chunks) - 1, L, 4), np.int64)
    _tally(sets, src, gpus_per_node, chunks, out)
    out = out.sum(0)
    out[:, 0] = tokens
    return out
