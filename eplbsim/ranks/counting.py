"""Compiled counting loops (numba, CPU): the passes over a step's pairs that the replay makes
besides dispatch, each one pass at memory speed.

Dimensions: `S` steps, `N` token rows, `T` tokens of a step, `L` layers, `K` top-k,
`E` logical experts, `P` physical slots, `G` GPUs, `D` hidden size of the toy MoE layer.

The loops the traces and the dispatch kernels share too (expert counts, duplicates, a table
looked up at every pair, row chunks) are in `loops`.

- `slot_counts`: pairs per (layer, slot) of choices `[T, L, K]` and valid pairs per layer.
- `Executed` / `execute`: what a group of ranks with identical choices executes, pair by pair,
  accumulated over the groups of a step; `pair_counts` then reads the per-layer counters.
- `table_loads`, `sent_loads`: pairs per (layer, slot) when each rank executes ("none", from
  expert counts) or sends ("a2a", from its rows) an expert's pairs to its table's slot.
- `layer_sums`: the toy MoE layer's exact output of every token and its output weighted by
  each pair's multiplicity, every layer (the definition of a pair's output is in `moe`).
- `square_sums`: the exactly rounded sum of squares of a float64 array per row (`math.fsum`);
  `error_squares` both of the toy MoE's error terms of a step in one pass, without its outputs.

Row chunks run in parallel, each into its own histogram, summed in chunk order: every count is
an integer sum and every toy-MoE sum is exact, so no result depends on the number of threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..base.compiled import JIT, jit, prange
from ..base.loops import expert_counts, row_chunks
from ..base.simd import LANES, pair_lanes

GRID_BITS = 24  # toy-MoE pair outputs are multiples of 1 / GRID (`moe` defines them)
GRID = float(2 ** GRID_BITS)
INV_GRID = 1.0 / GRID  # exact: a power of two


def slot_counts(phys: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs per (layer, slot) of choices `phys [T, L, K]` (-1 at padding), int64 `[L, P]`,
    and valid pairs per layer, int64 `[L]`."""
    hist = expert_counts(phys, row_chunks(phys.shape[0]), num_slots).sum(0)  # chunks summed
    return hist, hist.sum(1)


@dataclass
class Executed:
    """What the groups of one step executed so far, filled by `execute`.

    first: int64 `[T, L, K]` the first group's choices; agree: bool `[T, L, K]` pairs on which
    every group so far chose as the first; mult: int32 `[T, L, K]` times each pair was executed;
    hist: int64 `[C, L, P]` executed pairs per (row chunk, layer, slot); chunks: `[C + 1]`.
    """

    first: np.ndarray
    agree: np.ndarray
    mult: np.ndarray
    hist: np.ndarray
    chunks: np.ndarray

    @classmethod
    def start(cls, first: np.ndarray, num_slots: int) -> "Executed":
        """Nothing executed yet; `first [T, L, K]` the choices agreement is measured against."""
        T, L, _ = first.shape
        chunks = row_chunks(T)
        return cls(first, np.ones(first.shape, np.bool_), np.zeros(first.shape, np.int32),
                   np.zeros((len(chunks) - 1, L, num_slots), np.int64), chunks)

    @property
    def slot_load(self) -> np.ndarray:
        """Executed pairs per (layer, slot), int64 `[L, P]`."""
        return self.hist.sum(0)


@jit(parallel=True, **JIT)
def _execute(phys, member, slot_gpu, first, chunks, agree, mult, hist):  # pragma: no cover
    T, L, K = phys.shape
    for c in prange(chunks.shape[0] - 1):
        for t in range(chunks[c], chunks[c + 1]):
            for layer in range(L):
                for k in range(K):
                    p = phys[t, layer, k]
                    if p != first[t, layer, k]:
                        agree[t, layer, k] = False
                    if p >= 0 and member[slot_gpu[p]]:
                        mult[t, layer, k] += 1
                        hist[c, layer, p] += 1


def execute(done: Executed, phys: np.ndarray, member: np.ndarray, slot_gpu: np.ndarray) -> None:
    """Add one group's choices `phys [T, L, K]` (int64, -1 at padding) to `done`: its members
    (`member`, bool `[G]`) each execute the pairs whose slot lives on their own GPU
    (`slot_gpu`, int64 `[P]`)."""
    _execute(np.ascontiguousarray(phys), member, slot_gpu, done.first, done.chunks, done.agree,
             done.mult, done.hist)


@jit(parallel=True, **JIT)
def _pair_counts(ids, mult, agree, chunks, counts, agreed):  # pragma: no cover - compiled
    T, L, K = ids.shape
    for c in prange(chunks.shape[0] - 1):
        for t in range(chunks[c], chunks[c + 1]):
            for layer in range(L):
                for k in range(K):
                    if ids[t, layer, k] < 0:
                        continue
                    m = mult[t, layer, k]
                    counts[c, layer, min(m, 2)] += 1
                    if agree[t, layer, k]:
                        agreed[c, layer] += 1


def pair_counts(ids: np.ndarray, done: Executed) -> tuple[np.ndarray, np.ndarray]:
    """Valid pairs of `ids [T, L, K]` executed 0, 1 and >= 2 times, int64 `[L, 3]`, and those
    on which every group agreed, int64 `[L]`."""
    C, L = done.hist.shape[:2]
    counts = np.zeros((C, L, 3), np.int64)
    agreed = np.zeros((C, L), np.int64)
    _pair_counts(np.ascontiguousarray(ids), done.mult, done.agree, done.chunks, counts, agreed)
    return counts.sum(0), agreed.sum(0)


@jit(parallel=True, **JIT)
def _table_loads(tables, counts, executed, out):  # pragma: no cover - compiled
    G, L, E = tables.shape
    for layer in prange(L):  # each layer its own row of `out`
        for r in range(G):
            for e in range(E):
                if executed[r, layer, e]:
                    out[layer, tables[r, layer, e]] += counts[layer, e]


def table_loads(tables: np.ndarray, counts: np.ndarray, executed: np.ndarray,
                num_slots: int) -> np.ndarray:
    """Pairs per (layer, slot), int64 `[L, P]`, when every rank `r` holds the same pairs, `counts`
    int `[L, E]` of each (layer, expert), and executes those of expert `e` of layer `l` on slot
    `tables[r, l, e]` wherever `executed [G, L, E]`."""
    out = np.zeros((tables.shape[1], num_slots), np.int64)
    _table_loads(np.ascontiguousarray(tables), np.ascontiguousarray(counts),
                 np.ascontiguousarray(executed), out)
    return out


@jit(parallel=True, **JIT)
def _sent_loads(tables, ids, offsets, groups, out):  # pragma: no cover - compiled
    L, K = ids.shape[1], ids.shape[2]
    for c in prange(groups.shape[0] - 1):  # consecutive ranks, each group its own `out[c]`
        for r in range(groups[c], groups[c + 1]):
            table = tables[r]
            for t in range(offsets[r], offsets[r + 1]):
                for layer in range(L):
                    for k in range(K):
                        e = ids[t, layer, k]
                        if e >= 0:
                            out[c, layer, table[layer, e]] += 1


def sent_loads(tables: np.ndarray, ids: np.ndarray, offsets: np.ndarray,
               num_slots: int) -> np.ndarray:
    """Pairs per (layer, slot), int64 `[L, P]`, when rank `r` sends the pairs of its rows
    `offsets[r]:offsets[r + 1]` of `ids [T, L, K]` (-1 padding not sent) to the slots of its
    table `tables [G, L, E]`."""
    groups = row_chunks(tables.shape[0], 1)
    out = np.zeros((groups.shape[0] - 1, tables.shape[1], num_slots), np.int64)
    _sent_loads(np.ascontiguousarray(tables), np.ascontiguousarray(ids),
                np.ascontiguousarray(offsets, dtype=np.int64), groups, out)
    return out.sum(0)


@jit(**JIT, inline="always")
def _add_pair(flat_w, at, xt, g, out, out_at, weighted, m, weigh):  # pragma: no cover
    """One toy-MoE pair's output `v` (its expert matrix transposed at `flat_w[at:]`, the token's
    vector `xt [D]`, its gate `g`) added to `out[out_at:out_at + D]`, and `m * v` to
    `weighted` there when `weigh`: lanes in `LANES` blocks as vectors (`simd.pair_lanes`), the
    rest one by one, the same operations in the same order."""
    D = xt.shape[0]
    vector = D - D % LANES
    for i in range(0, vector, LANES):
        pair_lanes(flat_w, at + i, xt, g, GRID, out, out_at + i, weighted, m, weigh)
    for i in range(vector, D):  # float32, j in order, no fused multiply-add
        acc = flat_w[at + i] * xt[0]
        for j in range(1, D):
            acc += flat_w[at + j * D + i] * xt[j]
        v = np.rint(np.float64(acc * g) * GRID) * INV_GRID
        out[out_at + i] += v
        if weigh:
            weighted[out_at + i] += m * v


@jit(parallel=True, **JIT)
def _layer_sums(wt, x, gates, ids, mult, weigh, chunks, exact, weighted):  # pragma: no cover
    T, L, K = ids.shape
    E, D = wt.shape[1], x.shape[1]
    C = chunks.shape[0] - 1
    flat_w, flat_exact, flat_weighted = wt.reshape(-1), exact.reshape(-1), weighted.reshape(-1)
    for job in prange(L * C):
        layer, c = job // C, job % C
        for t in range(chunks[c], chunks[c + 1]):
            for k in range(K):
                e = ids[t, layer, k]
                if e >= 0:
                    m = np.float64(mult[t, layer, k]) if weigh else 1.0
                    _add_pair(flat_w, (layer * E + e) * D * D, x[t], gates[t, layer, k],
                              flat_exact, (layer * T + t) * D, flat_weighted, m, weigh)


def layer_sums(wt: np.ndarray, x: np.ndarray, gates: np.ndarray, ids: np.ndarray,
               mult: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The toy MoE on one step, every layer: `(exact, weighted)`, float64 `[L, T, D]` each: the
    sum of each token's pair outputs, and the same sum with each pair counted `mult` times
    (None: once, then `weighted` is `exact`).

    wt: float32 `[L, E, D, D]` the expert matrices transposed (`wt[l, e, j, i] = W[l, e, i, j]`);
    x: float32 `[T, D]`; gates: float32 `[T, L, K]` (each pair's gate weight); ids: int
    `[T, L, K]` (-1 padding adds nothing); mult: int `[T, L, K]`. A pair's output is
    `round(float64(float32(W_e x_t) * gate) * 2**24) / 2**24`, the float32 product summed over
    the hidden index in order (`moe` defines it); sums of these are exact in any order."""
    T, L, _ = ids.shape
    D = x.shape[1]
    exact = np.zeros((L, T, D), np.float64)
    weigh = mult is not None
    weighted = np.zeros((L, T, D), np.float64) if weigh else exact
    mult = np.ascontiguousarray(mult) if weigh else np.ones((1, 1, 1), np.int32)
    _layer_sums(np.ascontiguousarray(wt), np.ascontiguousarray(x), np.ascontiguousarray(gates),
                np.ascontiguousarray(ids), mult, weigh, row_chunks(T, 64), exact, weighted)
    return exact, weighted


@jit(**JIT)
def _fsum_squares(values, partials):  # pragma: no cover - compiled
    n = 0
    for v in values:  # Shewchuk's partials, as CPython's math.fsum keeps them
        x = v * v
        if x == 0.0:
            continue  # adds nothing to the exact sum
        i = 0
        for j in range(n):
            y = partials[j]
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                partials[i] = lo
                i += 1
            x = hi
        n = i
        if x != 0.0:
            partials[n] = x
            n += 1
    if n == 0:
        return 0.0
    n -= 1
    hi = partials[n]
    lo = 0.0
    while n > 0:
        x = hi
        n -= 1
        y = partials[n]
        hi = x + y
        lo = y - (hi - x)
        if lo != 0.0:
            break
    if n > 0 and ((lo < 0.0 and partials[n - 1] < 0.0) or (lo > 0.0 and partials[n - 1] > 0.0)):
        y = lo * 2.0  # round half to even across partials
        x = hi + y
        if y == x - hi:
            hi = x
    return hi


@jit(parallel=True, **JIT)
def _square_sums(rows, out):  # pragma: no cover - compiled
    # nonoverlapping partials: at most one per bit of float64's exponent range, or per value
    room = min(rows.shape[1], 2200) + 1
    for r in prange(rows.shape[0]):
        out[r] = _fsum_squares(rows[r], np.empty(room, np.float64))


@jit(**JIT, inline="always")
def _grid_square(v):  # pragma: no cover - compiled
    """`(m, ok)`: `v * v` rounded to float64 is `m / GRID**2`, an int64 below 2**62, when `ok`:
    `v` is a multiple of `1 / GRID` below 128 in magnitude (rounding such a square keeps it a
    multiple of `1 / GRID**2`: `moe.grid_square_sums`); else `m` is 0. Without a branch."""
    inside = abs(v) < 128.0
    w = v if inside else 0.0
    return np.int64(w * w * (GRID * GRID)), inside & (np.rint(v * GRID) == v * GRID)


@jit(parallel=True, **JIT)
def _grid_squares(rows, high, low, on_grid):  # pragma: no cover - compiled
    for r in prange(rows.shape[0]):
        hi, lo, ok = 0, 0, True
        for v in rows[r]:
            m, fits = _grid_square(v)
            ok &= fits
            hi += m >> 31
            lo += m & 0x7FFFFFFF
        high[r], low[r], on_grid[r] = hi, lo, ok


def grid_value(high: int, low: int) -> float:
    """`(high * 2**31 + low) / GRID**2`, correctly rounded (Python's int -> float): a sum of
    grid squares kept as high and low 31-bit parts (`square_sums`, `moe.grid_square_sums`)."""
    return math.ldexp(float((int(high) << 31) + int(low)), -2 * GRID_BITS)


@jit(parallel=True, **JIT)
def _error_squares(wt, x, gates, ids, mult, chunks, sums):  # pragma: no cover - compiled
    T, L, K = ids.shape
    E, D = wt.shape[1], x.shape[1]
    C = chunks.shape[0] - 1
    flat_w = wt.reshape(-1)
    for job in prange(L * C):
        layer, c = job // C, job % C
        exact, diff = np.empty(D, np.float64), np.empty(D, np.float64)  # one token's [D]
        dh, dl, eh, el, ok = 0, 0, 0, 0, True
        for t in range(chunks[c], chunks[c + 1]):
            for i in range(D):
                exact[i] = 0.0
                diff[i] = 0.0
            for k in range(K):
                e = ids[t, layer, k]
                if e >= 0:
                    _add_pair(flat_w, (layer * E + e) * D * D, x[t], gates[t, layer, k], exact,
                              0, diff, np.float64(mult[t, layer, k] - 1), True)
            for i in range(D):
                m, fits = _grid_square(diff[i])
                n, fits_too = _grid_square(exact[i])
                ok &= fits & fits_too
                dh += m >> 31
                dl += m & 0x7FFFFFFF
                eh += n >> 31
                el += n & 0x7FFFFFFF
        sums[job, 0], sums[job, 1], sums[job, 2], sums[job, 3] = dh, dl, eh, el
        sums[job, 4] = ok


def error_squares(wt: np.ndarray, x: np.ndarray, gates: np.ndarray, ids: np.ndarray,
                  mult: np.ndarray) -> np.ndarray | None:
    """The toy MoE's error terms of one step in one pass, without its `[L, T, D]` outputs:
    float64 `[L, 2]` of `(||Y - Y_exact||^2, ||Y_exact||^2)` per layer, `Y` counting pair
    `(t, k)` `mult[t, l, k]` times; each the exactly rounded sum of the squares, bit for bit
    `square_sums` of `layer_sums`' `weighted - exact` and of its `exact`. None when some
    output is not a multiple of `1 / GRID` below 128 in magnitude (`square_sums` then).

    wt, x, gates, ids: as `layer_sums`; mult: int `[T, L, K]`."""
    T, L, _ = ids.shape
    if T * x.shape[1] >= 2 ** 32:
        return None
    chunks = row_chunks(T, 64)
    C = chunks.shape[0] - 1
    sums = np.zeros((L * C, 5), np.int64)  # per (layer, chunk): error, norm (high, low); ok
    _error_squares(np.ascontiguousarray(wt), np.ascontiguousarray(x),
                   np.ascontiguousarray(gates), np.ascontiguousarray(ids),
                   np.ascontiguousarray(mult), chunks, sums)
    if not sums[:, 4].all():
        return None
    total = sums[:, :4].reshape(L, C, 4).sum(1).tolist()  # [L, 4], each below 2**63
    return np.array([[grid_value(a, b), grid_value(c, d)] for a, b, c, d in total],
                    np.float64).reshape(L, 2)


def square_sums(rows: np.ndarray) -> np.ndarray:
    """The exactly rounded sum of the squares (each rounded to float64) of each row of finite
    float64 `rows [R, n]`, float64 `[R]`: `math.fsum(v * v for v in row)` (its algorithm),
    rows in parallel. A row of multiples of `1 / GRID` below 128 in magnitude (toy-MoE
    output differences), with fewer than `2**32` values, is summed in integers instead, as
    `moe.grid_square_sums` does, at a fraction of the cost."""
    rows = np.ascontiguousarray(rows, dtype=np.float64)
    R, n = rows.shape
    high, low, on_grid = np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.bool_)
    _grid_squares(rows, high, low, on_grid)
    on_grid &= n < 2 ** 32
    out = np.empty(R, np.float64)
    if not on_grid.all():  # fsum for the other rows only
        off = np.flatnonzero(~on_grid)
        fsums = np.empty(off.size, np.float64)
        _square_sums(rows[off], fsums)
        out[off] = fsums
    for r in np.flatnonzero(on_grid).tolist():  # one correctly rounded int -> float each
        out[r] = grid_value(high[r], low[r])
    return out
