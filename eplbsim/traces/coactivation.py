"""Co-activation: how often two experts are chosen by the same token, the structure a
placement for traffic exploits (DESIGN.md §13).

Dimensions: `S` steps, `N` token rows, `L` layers, `K` top-k, `E` logical experts, `G` groups
of a partition.

`coactivation(trace)` counts, per layer, the pairs of experts in one token's top-k, `[L, E, E]`
(symmetric; the diagonal holds each expert's pairs), and with `cross=True` each token's
experts of layer `l` against its experts of layer `l + 1`, `[L - 1, E, E]`: one compiled pass
over the ids, layers in parallel, each into its own counts (integer sums: no result depends on
the number of threads). `kept_share` says what share of a token's top-k a partition of the
experts into groups keeps in the group of the token's first expert; `grouped` is a greedy
partition into equal groups that keeps co-activated experts together.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.compiled import JIT, jit, prange
from ..base.errors import InputError


@jit(parallel=True, **JIT)
def _pairs(ids, shift, out):  # pragma: no cover - compiled
    N, L, K = ids.shape
    for layer in prange(L - shift):  # layer `layer`'s experts against layer `layer + shift`'s
        for t in range(N):
            for i in range(K):
                a = ids[t, layer, i]
                if a < 0:
                    continue
                for j in range(K):
                    b = ids[t, layer + shift, j]
                    if b >= 0:
                        out[layer, a, b] += 1


def coactivation(trace: Any, steps: Any = None, cross: bool = False) -> Any:
    """Pair counts of experts chosen by the same token: int64 `[L, E, E]`, symmetric, whose
    `[l, a, b]` is how many tokens chose both `a` and `b` in layer `l` and whose diagonal
    `[l, a, a]` is expert `a`'s routed pairs (padding, -1, counts nowhere). `steps`: the steps
    to count (an iterable of step indices, default every step). With `cross`, also the counts
    from layer `l` to `l + 1`, `[L - 1, E, E]` (`[l, a, b]`: tokens that chose `a` in layer `l`
    and `b` in layer `l + 1`), as the pair `(within, across)`."""
    chosen = range(trace.num_steps) if steps is None else list(steps)
    for s in chosen:
        if not 0 <= int(s) < trace.num_steps:
            raise InputError(f"step {s} is outside the trace's {trace.num_steps} steps")
    L, E = trace.num_layers, trace.num_experts
    within = np.zeros((L, E, E), np.int64)
    across = np.zeros((max(L - 1, 0), E, E), np.int64)
    for s in chosen:
        ids = np.ascontiguousarray(trace.step(int(s)).numpy())  # [T, L, K]
        _pairs(ids, 0, within)
        if cross and L > 1:
            _pairs(ids, 1, across)
    return (within, across) if cross else within


def kept_share(pairs: np.ndarray, group: np.ndarray) -> float:
    """The share of a token's other top-k choices in the group of each of its choices, under
    the partition `group [L, E]` (each layer's group of each expert), over every layer: the
    off-diagonal pair counts `pairs [L, E, E]` (`coactivation`) inside groups over all of
    them. A partition into one group keeps 1; a random one about `1 / G`."""
    same = group[:, :, None] == group[:, None, :]  # [L, E, E]
    off = pairs.astype(np.float64) * (1 - np.eye(pairs.shape[-1]))[None]
    total = off.sum()
    return float(off[same].sum() / total) if total > 0 else float("nan")


def grouped(pairs: np.ndarray, groups: int) -> np.ndarray:
    """Per layer, a partition of the `E` experts into `groups` groups of equal size (`E` a
    multiple of it) that keeps co-activated experts together: seeded with the most active
    unplaced expert, each group is filled greedily with the expert most co-activated with those
    already in it (the layer's pair counts `pairs [L, E, E]`, each over the geometric mean of
    the two experts' counts, so a hot expert, which pairs with everyone, does not pull every
    group). -> int64 `[L, E]`, each layer's group of each expert."""
    L, E = pairs.shape[0], pairs.shape[-1]
    if groups < 1 or E % groups:
        raise InputError(f"{E} experts do not split into {groups} equal groups")
    return np.stack([_grouped(pairs[layer].astype(np.float64), groups) for layer in range(L)])


def _grouped(w: np.ndarray, groups: int) -> np.ndarray:
    """`grouped` of one layer's pair counts `w [E, E]` -> `[E]`."""
    E = w.shape[0]
    load = np.diag(w).copy()
    scale = np.sqrt(np.maximum(load, 1.0))
    w = w / scale[:, None] / scale[None, :]
    np.fill_diagonal(w, 0.0)
    group = np.full(E, -1, np.int64)
    for g in range(groups):
        free = np.flatnonzero(group < 0)
        seed = free[np.argmax(load[free])]
        group[seed] = g
        pull = w[seed].copy()
        for _ in range(E // groups - 1):
            free = np.flatnonzero(group < 0)
            pick = free[np.argmax(pull[free])]
            group[pick] = g
            pull += w[pick]
    return group


def random_groups(num_layers: int, num_experts: int, groups: int, seed: int = 0) -> np.ndarray:
    """A seeded random partition of `num_experts` experts into `groups` equal groups in each
    of `num_layers` layers, int64 `[L, E]`: the baseline `grouped` is measured against."""
    if groups < 1 or num_experts % groups:
        raise InputError(f"{num_experts} experts do not split into {groups} equal groups")
    rng = np.random.default_rng(seed)
    out = np.empty((num_layers, num_experts), np.int64)
    for layer in range(num_layers):
        out[layer, rng.permutation(num_experts)] = np.arange(num_experts) // (num_experts // groups)
    return out
