"""CPU step kernels compiled with numba: one pass over a step's pairs, every layer at once.

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts, `R` max candidates.

Torch has no running-count primitive, so on the CPU `ordinal` would need a general sort (an
O(N log N) stable argsort, ~10x a gather); a compiled loop counts occurrences in one pass.
`ordinal` splits each layer's pairs into blocks: a per-block expert histogram, an exclusive scan
over blocks, then each block counts on from its base, so blocks run in parallel and the result
does not depend on the number of threads. `random` computes each pair's Philox block where it
needs one (`dispatch.streams`). Every kernel writes int64 `[T, L, K]`, -1 where the id is -1,
into a new array or the caller's scratch (`out`).

`StreamedViews` counts `random` in "none" for every rank at once without dispatching every
pair for every rank: only a rank whose GPU holds a replica of the pair's expert can execute it,
so only its draw decides the pair's multiplicity, and agreement is checked on those draws
first (two hosts that differ settle it), then rank by rank up to the first difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...base.compiled import JIT, jit, prange, threads
from ...base.loops import pair_table, row_chunks
from ...placement import View
from ..policies import (HASH_MULTIPLIER, DispatchContext, layer_draws, layer_offsets,
                        static_table)
from ..streams import DRAW, LANE_KEYS, Stream, lane_mod, philox, philox_lanes, split_key

@jit(parallel=True, **JIT)
def _row(ids, log2phy, logcnt, out, chunks):  # pragma: no cover - compiled
    """`row % n` without a division a pair: each chunk of rows keeps `t % n` for every
    candidate count `n <= R` and steps it on by one a row (R additions a row instead of L K
    divisions; with more candidates than that saves, the division)."""
    T, L, K = ids.shape
    R = log2phy.shape[2]
    stepped = R <= L * K
    for c in prange(chunks.shape[0] - 1):
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


@jit(parallel=True, **JIT)
def _ordinal(ids, log2phy, logcnt, offsets, out, num_blocks):  # pragma: no cover - compiled
    T, L, K = ids.shape
    E = logcnt.shape[1]
    rows = (T + num_blocks - 1) // num_blocks
    base = np.zeros((L, num_blocks + 1, E), np.int64)  # [L, B + 1, E] counts before block b
    for job in prange(L * num_blocks):
        layer, b = job // num_blocks, job % num_blocks
        for t in range(b * rows, min(T, (b + 1) * rows)):
            for k in range(K):
                e = ids[t, layer, k]
                if e >= 0:
                    base[layer, b + 1, e] += 1
    for layer in prange(L):
        for b in range(1, num_blocks + 1):
            for e in range(E):
                base[layer, b, e] += base[layer, b - 1, e]
    for job in prange(L * num_blocks):
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


@jit(parallel=True, **JIT)
def _drawn(ids, log2phy, logcnt, draws, out):  # pragma: no cover - compiled
    T, L, K = ids.shape
    for t in prange(T):
        for layer in range(L):
            for k in range(K):
                e = ids[t, layer, k]
                d = draws[layer, t * K + k]
                out[t, layer, k] = -1 if e < 0 else log2phy[layer, e, d % logcnt[layer, e]]


@jit(parallel=True, **JIT)
def _streamed(ids, log2phy, logcnt, k0, k1, shift, step, out):  # pragma: no cover - compiled
    T, L, K = ids.shape
    for t in prange(T):
        for layer in range(L):
            block = -1
            words = (np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0))
            for k in range(K):
                e = ids[t, layer, k]
                if e < 0:
                    out[t, layer, k] = -1
                    continue
                n = logcnt[layer, e]
                if n == 1:  # draw % 1 == 0: the draw is not needed
                    out[t, layer, k] = log2phy[layer, e, 0]
                    continue
                i = t * K + k
                if i >> 3 != block:  # one Philox block serves 8 consecutive pairs
                    block = i >> 3
                    words = philox(k0, k1, block, layer + shift, step, DRAW)
                out[t, layer, k] = log2phy[layer, e, lane_mod(words[(i & 7) >> 1], i, n)]


def _arrays(topk_ids: torch.Tensor, view: View,
            out: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """`(ids int32, log2phy, logcnt, out int64 [T, L, K])`: `out` the caller's when given
    (scratch it reuses from step to step: a fresh array of tens of MB costs more in page faults
    than the dispatch that fills it), else a new one."""
    ids = np.ascontiguousarray(topk_ids.numpy(), dtype=np.int32)  # one compiled signature
    if out is None:
        out = np.empty(ids.shape, np.int64)
    elif out.shape != ids.shape or out.dtype != np.int64:
        raise ValueError(f"out must be int64 {ids.shape}, got {out.dtype} {out.shape}")
    return ids, view.log2phy.numpy(), view.logcnt.numpy(), out


def row_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
             out: np.ndarray | None = None) -> torch.Tensor:
    """`row` for `[T, L, K]` ids in one pass (into `out`, when given: `_arrays`)."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view, out)
    _row(ids, log2phy, logcnt, out, row_chunks(ids.shape[0]))
    return torch.from_numpy(out)


@jit(parallel=True, **JIT)
def _keyed(ids, log2phy, logcnt, hashed, out):  # pragma: no cover - compiled
    """Each pair's candidate by a key of its position: `(t * K + k) % n` (flat), or
    `((t * HASH_MULTIPLIER) mod 2**32) % n` (`hashed`: hash); -1 for padding."""
    T, L, K = ids.shape
    for t in prange(T):
        key = (t * HASH_MULTIPLIER) % 4294967296 if hashed else t * K
        for layer in range(L):
            for k in range(K):
                e = ids[t, layer, k]
                if e < 0:
                    out[t, layer, k] = -1
                else:
                    out[t, layer, k] = log2phy[layer, e,
                                               (key if hashed else key + k) % logcnt[layer, e]]


def flat_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
              out: np.ndarray | None = None) -> torch.Tensor:
    """`flat` for `[T, L, K]` ids in one pass: `(row * K + k) % n_e`."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view, out)
    _keyed(ids, log2phy, logcnt, False, out)
    return torch.from_numpy(out)


def hash_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
              out: np.ndarray | None = None) -> torch.Tensor:
    """`hash` for `[T, L, K]` ids in one pass: Knuth's hash of the row, `% n_e`."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view, out)
    _keyed(ids, log2phy, logcnt, True, out)
    return torch.from_numpy(out)


def ordinal_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
                 out: np.ndarray | None = None) -> torch.Tensor:
    """`ordinal` for `[T, L, K]` ids: per-layer offsets from (step, layer[, rank])."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view, out)
    L = ids.shape[1]
    offsets = layer_offsets(ctx, L).numpy()
    blocks = max(1, min(threads() * 2 // L, ids.shape[0] // 4096))
    _ordinal(ids, log2phy, logcnt, offsets, out, blocks)
    return torch.from_numpy(out)


def static_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
                out: np.ndarray | None = None) -> torch.Tensor:
    """`static`: the rank's fixed table `[L, E]`, looked up for every pair."""
    table = static_table(view, ctx.rank, ctx.seed).numpy()  # [L, E]
    ids, _, _, out = _arrays(topk_ids, view, out)
    return torch.from_numpy(pair_table(table, ids, -1, out))


def random_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
                out: np.ndarray | None = None) -> torch.Tensor:
    """`random`: each pair's draw from the stream, computed where it is needed (an expert with
    one candidate needs none); with a generator instead, one `randint(0, 65536)` batch of
    `T * K` draws per layer, in layer order."""
    ids, log2phy, logcnt, out = _arrays(topk_ids, view, out)
    T, L, K = ids.shape
    if ctx.draws_streamed:
        stream = ctx.stream
        _streamed(ids, log2phy, logcnt, *stream.words, stream.shift + ctx.layer, stream.step,
                  out)
    else:
        _drawn(ids, log2phy, logcnt, layer_draws(ctx, T * K, L, "cpu").numpy(), out)
    return torch.from_numpy(out)


EAGER_STREAMS = 128  # up to this many streams, a pair's first draw makes every stream's block


@jit(**JIT, inline="always")
def _choice(log2phy, logcnt, vclass, k0, k1, shifts, sid, r, layer, e, i, step, block,
            words):  # pragma: no cover - compiled
    """Rank `r`'s `random` slot for pair `i` of expert `e`: its stream's (`sid[r]`: key
    `(k0[s], k1[s])`, shift `shifts[s]`) draw, none when its view (`vclass[r]`) lists one
    candidate. The streams' last Philox blocks are kept in `words [4, S]`, `block` saying
    which (-1: none); a block serves 8 consecutive pairs. Up to `EAGER_STREAMS` streams
    (padded to a multiple of `LANE_KEYS`) every stream's block is made at once, as vector code
    (`block [1]`: a token's pairs draw from about 7 streams of 32, and 32 blocks at once cost
    less than 7 one at a time); beyond, each stream's alone (`block [S]`)."""
    v = vclass[r]
    n = logcnt[v, layer, e]
    if n == 1:
        return log2phy[v, layer, e, 0]
    s = sid[r]
    b = i >> 3
    if block.shape[0] == 1:
        if block[0] != b:
            philox_lanes(k0, k1, shifts, b, layer, step, DRAW, words)
            block[0] = b
    elif block[s] != b:
        words[0, s], words[1, s], words[2, s], words[3, s] = philox(
            k0[s], k1[s], b, np.uint64(layer) + shifts[s], step, DRAW)
        block[s] = b
    return log2phy[v, layer, e, lane_mod(words[(i & 7) >> 1, s], i, n)]


@jit(parallel=True, **JIT)
def _streamed_none(ids, log2phy, logcnt, vclass, k0, k1, shifts, eager, sid, step, slot_gpu,
                   hosts, nhosts, fixed, reps, chunks, hist, counts, agreed,
                   mult):  # pragma: no cover - compiled
    T, L, K = ids.shape
    S = k0.shape[0]
    for c in prange(chunks.shape[0] - 1):
        words = np.zeros((4, S), np.uint64)
        block = np.empty(1 if eager else S, np.int64)
        for t in range(chunks[c], chunks[c + 1]):
            for layer in range(L):
                for j in range(block.shape[0]):  # the blocks of another layer
                    block[j] = -1
                for k in range(K):
                    e = ids[t, layer, k]
                    if e < 0:
                        continue
                    f = fixed[layer, e]
                    if f >= 0:  # every rank's only candidate: one GPU executes it
                        hist[c, layer, f] += 1
                        counts[c, layer, 1] += 1
                        agreed[c, layer] += 1
                        mult[t, layer, k] = 1
                        continue
                    i = t * K + k
                    m = 0
                    first = -1  # the first choice seen: a host's, else the first rep's
                    same = True
                    for h in range(nhosts[layer, e]):  # only a replica's GPU can execute it
                        r = hosts[layer, e, h]
                        p = _choice(log2phy, logcnt, vclass, k0, k1, shifts, sid, r, layer, e,
                                    i, step, block, words)
                        own = np.int64(slot_gpu[p] == r)  # counted without a branch
                        m += own
                        hist[c, layer, p] += own
                        first = p if h == 0 else first
                        same &= p == first  # two hosts differ: no further draw is needed
                    mult[t, layer, k] = m
                    counts[c, layer, min(m, 2)] += 1
                    if same:  # every (view, stream) asked, up to the first difference
                        for j in range(reps.shape[0]):
                            q = _choice(log2phy, logcnt, vclass, k0, k1, shifts, sid, reps[j],
                                        layer, e, i, step, block, words)
                            if first < 0:
                                first = q
                            elif q != first:
                                same = False
                                break
                    agreed[c, layer] += same


@dataclass(frozen=True, eq=False)
class StreamedViews:
    """Every rank's view of one placement, arranged for counting `random` in "none" from the
    draws that decide something: a pair is executed only by a rank whose GPU holds a replica of
    its expert (its draw alone says whether), and the ranks agree unless two of them with
    different streams or views differ (the hosts' choices compared first, then one rank of each
    distinct (view, stream), stopping at the first difference).

    log2phy: int32 `[V, L, E, R]` (padded with -1) and logcnt int32 `[V, L, E]`: the distinct
             views (one copy each: small enough to stay in cache), rank `r`'s `vclass[r]`
    hosts:   int32 `[L, E, H]` the ranks whose view lists a slot on their own GPU, `nhosts
             [L, E]` how many
    fixed:   int64 `[L, E]` the slot of an expert every view lists alone, the same; else -1
    slot_gpu: int64 `[P]`
    """

    log2phy: np.ndarray
    logcnt: np.ndarray
    vclass: np.ndarray
    hosts: np.ndarray
    nhosts: np.ndarray
    fixed: np.ndarray
    slot_gpu: np.ndarray

    @classmethod
    def of(cls, views: "list[View]", slot_gpu: torch.Tensor) -> "StreamedViews":
        """The arrangement of `views` (one per rank, in rank order) over `slot_gpu [P]`."""
        G = len(views)
        R = max(v.log2phy.shape[-1] for v in views)
        L, E = views[0].logcnt.shape
        distinct: list[tuple[np.ndarray, np.ndarray]] = []
        vclass = np.zeros(G, np.int64)
        for r, v in enumerate(views):
            lists = np.full((L, E, R), -1, np.int32)
            lists[..., :v.log2phy.shape[-1]] = v.log2phy.cpu().numpy()
            count = v.logcnt.cpu().numpy().astype(np.int32)
            same = [j for j, (a, n) in enumerate(distinct)
                    if np.array_equal(a, lists) and np.array_equal(n, count)]
            if not same:
                distinct.append((lists, count))
            vclass[r] = same[0] if same else len(distinct) - 1
        log2phy = np.stack([a for a, _ in distinct])  # [V, L, E, R]
        logcnt = np.stack([n for _, n in distinct])  # [V, L, E]
        gpu = slot_gpu.cpu().numpy().astype(np.int64)
        listed = np.arange(R) < logcnt[..., None]  # [V, L, E, R]
        on = np.where(log2phy >= 0, gpu[log2phy.clip(0)], -1)[vclass]  # [G, L, E, R]
        hosting = ((on == np.arange(G).reshape(G, 1, 1, 1)) & listed[vclass]).any(-1)
        nhosts = hosting.sum(0).astype(np.int32)  # [L, E]
        hosts = np.argsort(~hosting, axis=0, kind="stable")[:max(1, int(nhosts.max()))]
        single = (logcnt == 1).all(0) & (log2phy[..., 0] == log2phy[:1, ..., 0]).all(0)
        return cls(log2phy, logcnt, vclass,
                   np.ascontiguousarray(hosts.transpose(1, 2, 0)).astype(np.int32), nhosts,
                   np.where(single, log2phy[0, ..., 0], -1).astype(np.int64), gpu)

    def count(self, ids: np.ndarray, streams: "list[Stream]"
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`(slot_load [L, P], counts [L, 3], agreed [L], mult [T, L, K])` (int64, int64,
        int64, int32) of one step's ids `[T, L, K]` (any integer dtype), rank `r` drawing from
        `streams[r]` (all of one step)."""
        distinct: dict[tuple[int, int], int] = {}  # (key, shift) -> stream index
        sid = np.array([distinct.setdefault((s.key, s.shift), len(distinct)) for s in streams],
                       np.int64)
        eager = 1 < len(distinct) <= EAGER_STREAMS  # else one at a time (`_choice`)
        S = -(-len(distinct) // LANE_KEYS) * LANE_KEYS if eager else len(distinct)
        keys = np.zeros((2, S), np.uint64)  # padded with unused streams
        keys[:, :len(distinct)] = np.array([split_key(key) for key, _ in distinct],
                                           np.uint64).reshape(-1, 2).T
        shifts = np.zeros(S, np.uint64)
        shifts[:len(distinct)] = [shift for _, shift in distinct]
        seen: dict[tuple[int, int], int] = {}
        for r in range(len(streams)):  # one representative of equal (view, stream)
            seen.setdefault((int(self.vclass[r]), int(sid[r])), r)
        reps = np.array(sorted(seen.values()), np.int64)
        T, L, _ = ids.shape
        chunks = row_chunks(T)
        C = len(chunks) - 1
        hist = np.zeros((C, L, len(self.slot_gpu)), np.int64)
        counts = np.zeros((C, L, 3), np.int64)
        agreed = np.zeros((C, L), np.int64)
        mult = np.zeros(ids.shape, np.int32)
        _streamed_none(np.ascontiguousarray(ids), self.log2phy, self.logcnt, self.vclass,
                       keys[0], keys[1], shifts, eager, sid, streams[0].step, self.slot_gpu,
                       self.hosts, self.nhosts, self.fixed, reps, chunks, hist, counts, agreed,
                       mult)
        return hist.sum(0), counts.sum(0), agreed.sum(0), mult


@jit(parallel=True, **JIT)
def _bad_choices(phys, ids, phy2log, reroutes, first):  # pragma: no cover - compiled
    T, L, K = ids.shape
    P = phy2log.shape[1]
    for t in prange(T):
        first[t] = -1
        for j in range(L * K - 1, -1, -1):  # backwards: the first bad pair is written last
            layer, k = j // K, j % K
            e, p = ids[t, layer, k], phys[t, layer, k]
            if (p != -1 if e < 0 else
                    p < 0 or p >= P or phy2log[layer, p] < 0
                    or (not reroutes and phy2log[layer, p] != e)):
                first[t] = j


def first_bad_choice(phys: torch.Tensor, topk_ids: torch.Tensor, phy2log: torch.Tensor,
                     reroutes: bool) -> tuple[int, int, int] | None:
    """`(token, layer, k)` of the first pair of CPU `phys [T, L, K]` that is not a slot of its
    routed expert in `phy2log [L, P]` (any filled slot in range when `reroutes`; never an empty
    one, -1) or not -1 at padding
    (`kernels.check_choices`' rule, in one compiled pass); None when every pair is right.
    `phys` and `topk_ids` may be of any integer dtype (compiled for each: no copies)."""
    ids = np.ascontiguousarray(topk_ids.numpy())  # any integer dtype: compiled for each
    chosen = np.ascontiguousarray(phys.numpy())
    first = np.empty(ids.shape[0], np.int64)  # per token: its first bad pair, layer * K + k
    _bad_choices(chosen, ids, np.ascontiguousarray(phy2log.numpy()), reroutes, first)
    rows = np.flatnonzero(first >= 0)
    if not len(rows):
        return None
    t = int(rows[0])
    layer, k = divmod(int(first[t]), ids.shape[2])
    return t, layer, k
