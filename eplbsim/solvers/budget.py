"""`budget`: per-layer redundancy under one memory budget (DESIGN.md §15, after CRAFT, arXiv
2603.28768: layers differ in skew, so redundant slots go where they cut the max GPU load most).

Dimensions: `L` layers, `E` logical experts, `P` slots of the budget (`E + R`), `W` slots of
the placement (`widened`), `G` GPUs, `K` redundancy levels a layer may take.

The run's `R = P - E` redundant slots a layer are a budget of `R x L` for the model. A layer may
take `r` of them for `r` in `0, u, 2u, ..., W - E` (`u = G` when `G` divides `R x L`, else 1),
`W = P + G x ceil(R / G)` (twice the mean, rounded up to whole slots a GPU), so every layer keeps
one shape `[W]`: a layer holding fewer replicas has empty slots (-1). For every layer and level
the replicas are water-filled and packed as `lpt` does (largest replica first onto the
least-loaded GPU with a free slot, then improving swaps; empty slots weigh nothing), and the
level is priced at that packing's max GPU load: the mean over the steps of each step's, when the
replay gives the per-step loads (`history`), else on the summed loads. A dynamic programme over
the layers then picks the levels, summing to `R x L`, of the least total: the sum of the layers'
times when each is bound by its busiest GPU. Where CRAFT spends slots greedily by marginal
gain, this is exact for the packings priced. Equal redundancy (`lpt` with `R` in every layer, laid out on
the first `P / G` slots of each GPU) is taken instead when it is strictly better, so `budget`
never prices above `lpt` on the loads it is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..placement.topology import Topology
from .bounds import replicate
from .lpt import _check_anti, lpt, pack_items


def widened(num_experts: int, num_slots: int, topology: Topology) -> int:
    """`W`, the slots a layer of a `budget` placement has for a budget of `num_slots` (module
    doc): `P + G x ceil((P - E) / G)`."""
    G = topology.num_gpus
    return num_slots + G * -(-(num_slots - num_experts) // G)


def levels(load: np.ndarray, width: int, step: int, num_gpus: int,
           anti: bool) -> np.ndarray:
    """Every layer packed at every redundancy level `0, step, ...` up to `W - E`, phy2log int64
    `[K, L, W]` with -1 at the empty slots, for `load [L, E]`."""
    L, E = load.shape
    ks = range(0, width - E + 1, step)
    items = np.empty((len(ks), L, width), np.int64)
    weight = np.zeros((len(ks), L, width))
    pads = np.arange(E, width)  # weightless items, one expert id each (ids < W)
    for i, r in enumerate(ks):
        replicas, counts = replicate(load, E + r, num_gpus if anti else None)  # [L, E + r]
        items[i, :, :E + r] = replicas
        items[i, :, E + r:] = pads[:width - E - r]
        weight[i, :, :E + r] = np.take_along_axis(load / counts, replicas, 1)
    slot_item = pack_items(weight.reshape(-1, width), items.reshape(-1, width), num_gpus, anti)
    phy2log = np.take_along_axis(items, slot_item.reshape(items.shape), 2)
    return np.where(phy2log < E, phy2log, -1)


def peak_loads(phy2log: np.ndarray, loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """Each layer's max GPU load under `phy2log [L, W]` (-1: empty), each expert's load split
    evenly over its replicas, the mean over the steps of `loads [S, L, E]`: float64 `[L]`."""
    S, L, E = loads.shape
    counts = np.stack([np.bincount(row[row >= 0], minlength=E) for row in phy2log])  # [L, E]
    share = np.concatenate([loads / np.maximum(counts, 1), np.zeros((S, L, 1))], 2)
    index = np.broadcast_to(np.where(phy2log >= 0, phy2log, E), (S, L, phy2log.shape[1]))
    per_slot = np.take_along_axis(share, index, 2)  # [S, L, W]
    return per_slot.reshape(S, L, num_gpus, -1).sum(-1).max(-1).mean(0)


def spend(cost: np.ndarray, units: int) -> np.ndarray:
    """The level of every layer, int64 `[L]`, summing to `units`, that minimises the summed
    `cost [K, L]` (level `k` of layer `l` costs `cost[k, l]`): a dynamic programme over the
    layers (ties: the lowest levels of the first layers)."""
    K, L = cost.shape
    dp = np.full(units + 1, np.inf)
    dp[0] = 0.0
    choice = np.zeros((L, units + 1), np.int64)
    b = np.arange(units + 1)
    for layer in range(L):
        before = np.where(b[:, None] >= np.arange(K), dp[np.maximum(b[:, None] - np.arange(K), 0)],
                          np.inf)  # [B, K]: dp[b - k]
        total = before + cost[:, layer]
        choice[layer] = total.argmin(1)
        dp = total.min(1)
    picked = np.empty(L, np.int64)
    left = units
    for layer in range(L - 1, -1, -1):
        picked[layer] = choice[layer, left]
        left -= picked[layer]
    return picked


def budget(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
           history: Any = None, anti_colocation: bool = False) -> tuple[np.ndarray, dict]:
    """Per-layer redundancy under one memory budget (module doc).

    load:            float64 `[L, E]` pairs per logical expert
    num_slots:       `P = E + R`: `R` redundant slots a layer on average, `R x L` in all
    topology:        the cluster; num_groups: ignored
    history:         float `[S, L, E]` the per-step loads `load` sums (the replay gives them):
                     a level is then priced at its mean per-step max GPU load, what a step's
                     time follows; None: at its max GPU load on `load`
    anti_colocation: no GPU holds two replicas of one expert (InputError when impossible)
    Returns `(phy2log int64 [L, W], {"redundant_per_layer": [L] list})`, `W = widened(E, P,
    topology)`, -1 at the empty slots.
    """
    load = np.asarray(load, dtype=np.float64)
    L, E = load.shape
    G = topology.num_gpus
    priced = load[None] if history is None else np.asarray(history, dtype=np.float64)
    width, spare = widened(E, num_slots, topology), num_slots - E
    if anti_colocation:
        _check_anti(E, num_slots, G)
    top = width - E if not anti_colocation else min(width - E, E * (G - 1))
    step = G if spare * L % G == 0 and top % G == 0 else 1
    placed = levels(load, E + top, step, G, anti_colocation)  # [K, L, E + top]
    cost = np.stack([peak_loads(level, priced, G) for level in placed])  # [K, L]
    picked = spend(cost, spare * L // step)
    layers = np.arange(L)
    phy2log = _laid_out(placed[picked, layers], width, G)
    equal = _laid_out(lpt(load, num_slots, topology, anti_colocation=anti_colocation), width, G)
    if peak_loads(equal, priced, G).sum() < cost[picked, layers].sum():
        return equal, {"redundant_per_layer": [spare] * L}
    return phy2log, {"redundant_per_layer": (picked * step).tolist()}


def _laid_out(phy2log: np.ndarray, width: int, num_gpus: int) -> np.ndarray:
    """`phy2log [L, P]` on `width` slots: each GPU's `P / G` slots first among its `W / G`, the
    rest empty (-1), int64 `[L, W]`."""
    L, P = phy2log.shape
    out = np.full((L, num_gpus, width // num_gpus), -1, np.int64)
    out[:, :, :P // num_gpus] = phy2log.reshape(L, num_gpus, -1)
    return out.reshape(L, width)
