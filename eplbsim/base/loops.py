"""Compiled loops over routing ids (numba, CPU) that the traces, the dispatch kernels and the
rank step share, each one pass at memory speed.

Dimensions: `N` token rows, `T` tokens of a step, `L` layers, `K` top-k, `E` logical experts,
`S` steps.

- `summed`: a sum of int32 counts over one dimension, in int64, without a whole int64 copy.
- `row_chunks`: the row chunks a parallel loop splits its rows into.
- `expert_counts`: routed pairs per (step, layer, expert) of ids `[N, L, K]` (any row ranges).
- `first_duplicate`: the first token row that routes an expert twice in a layer;
  `counts_and_first_duplicate` both, and the first id out of range, in one pass.
- `pair_table`: a per-(layer, expert) table looked up at every pair.

Row chunks run in parallel, each into its own histogram, summed in chunk order: every count is
an integer sum, so no result depends on the number of threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .compiled import JIT, jit, prange, threads


def summed(counts: torch.Tensor, dim: int) -> torch.Tensor:
    """`counts.sum(dim)`, int64, of integer counts on the CPU without the int64 copy of the
    whole tensor that torch makes to sum an int32 one (numpy accumulates in small buffers)."""
    if counts.device.type != "cpu" or counts.dtype == torch.int64:
        return counts.sum(dim)
    return torch.from_numpy(counts.numpy().sum(dim, dtype=np.int64))


def row_chunks(rows: int, least: int = 256) -> np.ndarray:
    """Bounds of the row chunks the parallel loops split `rows` rows into, int64 `[C + 1]`:
    a few per thread, none much smaller than `least` rows."""
    count = max(1, min(4 * threads(), rows // least))
    return np.linspace(0, rows, count + 1).astype(np.int64)


@jit(parallel=True, **JIT)
def _expert_counts(ids, offsets, out):  # pragma: no cover - compiled
    S = offsets.shape[0] - 1
    L, K = ids.shape[1], ids.shape[2]
    for s in prange(S):
        for t in range(offsets[s], offsets[s + 1]):
            for layer in range(L):
                for k in range(K):
                    e = ids[t, layer, k]
                    if e >= 0:
                        out[s, layer, e] += 1


def expert_counts(ids: np.ndarray, offsets: np.ndarray, num_experts: int,
                  dtype: Any = np.int64) -> np.ndarray:
    """Routed pairs per (step, layer, expert), `dtype` `[S, L, E]` (numpy or torch dtype), of
    ids `[N, L, K]` (any integer dtype, ids in `[-1, E)`, -1 not counted) whose step `s` is
    rows `offsets[s]:offsets[s + 1]`; steps in parallel."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if isinstance(dtype, torch.dtype):
        dtype = torch.empty(0, dtype=dtype).numpy().dtype
    out = np.zeros((offsets.shape[0] - 1, ids.shape[1], num_experts), dtype)
    _expert_counts(np.ascontiguousarray(ids), offsets, out)
    return out


@jit(parallel=True, **JIT)
def _duplicates(ids, chunks, found):  # pragma: no cover - compiled
    N, L, K = ids.shape
    for c in prange(chunks.shape[0] - 1):
        found[c] = -1
        for t in range(chunks[c], chunks[c + 1]):
            for layer in range(L):
                for a in range(K):
                    e = ids[t, layer, a]
                    for b in range(a + 1, K):
                        if e >= 0 and ids[t, layer, b] == e and found[c] < 0:
                            found[c] = t * L + layer
            if found[c] >= 0:
                break


def first_duplicate(ids: np.ndarray) -> tuple[int, int, int] | None:
    """`(row, layer, expert)` of the first token row of `ids [N, L, K]` that routes one expert
    twice in a layer (its lowest such layer and expert; padding -1 repeats freely), or None."""
    N, L, _ = ids.shape
    chunks = row_chunks(N, 1024)
    found = np.empty(len(chunks) - 1, np.int64)
    _duplicates(np.ascontiguousarray(ids), chunks, found)
    return _duplicate_at(ids, found)


@jit(parallel=True, **JIT)
def _counts_and_duplicates(ids, offsets, out, found, bad):  # pragma: no cover - compiled
    S = offsets.shape[0] - 1
    L, K, E = ids.shape[1], ids.shape[2], out.shape[2]
    for s in prange(S):
        seen = np.zeros(E, np.int64)  # the (row, layer) + 1 that last routed each expert
        found[s] = -1
        bad[s] = -1
        for t in range(offsets[s], offsets[s + 1]):
            for layer in range(L):
                stamp = t * L + layer + 1
                for k in range(K):
                    e = ids[t, layer, k]
                    if e >= 0 and e < E:
                        out[s, layer, e] += 1
                        if seen[e] == stamp and found[s] < 0:
                            found[s] = stamp - 1
                        seen[e] = stamp
                    elif e != -1 and bad[s] < 0:
                        bad[s] = (stamp - 1) * K + k


def counts_and_first_duplicate(ids: np.ndarray, offsets: np.ndarray, num_experts: int,
                               dtype: Any = np.int64
                               ) -> tuple[np.ndarray, tuple[int, int, int] | None,
                                          tuple[int, int, int] | None]:
    """`expert_counts` and `first_duplicate` of the same ids in one pass over them (a trace's
    bytes read once), which also finds the first id outside `[-1, E)` in row, layer, slot
    order: `(counts [S, L, E], (row, layer, expert) or None, (row, layer, k) or None)`; the
    counts are meaningless when there is such an id."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if isinstance(dtype, torch.dtype):
        dtype = torch.empty(0, dtype=dtype).numpy().dtype
    ids = np.ascontiguousarray(ids)
    out = np.zeros((offsets.shape[0] - 1, ids.shape[1], num_experts), dtype)
    found = np.empty(offsets.shape[0] - 1, np.int64)
    bad = np.empty(offsets.shape[0] - 1, np.int64)
    _counts_and_duplicates(ids, offsets, out, found, bad)
    wrong = bad[bad >= 0]
    where = None
    if wrong.size:
        row_layer, k = divmod(int(wrong[0]), ids.shape[2])
        where = (*divmod(row_layer, ids.shape[1]), k)
    return out, _duplicate_at(ids, found), where


def _duplicate_at(ids: np.ndarray, found: np.ndarray) -> tuple[int, int, int] | None:
    """`(row, layer, expert)` of the first `row * L + layer` in `found` (-1: none in that part;
    parts in row order), its lowest repeated expert; None when there is none."""
    hits = found[found >= 0]
    if not hits.size:
        return None
    row, layer = divmod(int(hits[0]), ids.shape[1])
    ordered = np.sort(ids[row, layer])
    same = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    return row, layer, int(ordered[1:][same][0])




@jit(parallel=True, **JIT)
def _pair_table(table, ids, fill, out):  # pragma: no cover - compiled
    T, L, K = ids.shape
    for t in prange(T):
        for layer in range(L):
            for k in range(K):
                e = ids[t, layer, k]
                out[t, layer, k] = fill if e < 0 else table[layer, e]


def pair_table(table: np.ndarray, ids: np.ndarray, fill: int = 0,
               out: np.ndarray | None = None) -> np.ndarray:
    """`table [L, E]` looked up at every pair of `ids [T, L, K]`, `[T, L, K]` of the table's
    dtype (into `out` when given), `fill` at padding."""
    out = np.empty(ids.shape, table.dtype) if out is None else out
    _pair_table(np.ascontiguousarray(table), np.ascontiguousarray(ids), fill, out)
    return out


