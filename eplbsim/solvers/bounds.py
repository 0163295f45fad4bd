"""Lower bounds on the max GPU load of any placement, and the water-filling replica counts.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes,
`X` items (experts of a sub-problem).
Slot `p` lives on GPU `p // (P // G)`; GPU `g` is on node `g // (G // N)`.

Loads are split evenly over an expert's replicas (the placement's promise), so a GPU's load is
the sum of `load_e / c_e` over the replicas it holds. Two facts bound every placement's max GPU
load from below: the GPUs share the total load (`>= total / G`), and some replica of each
expert carries `load_e / c_e` with `sum_e c_e = P`, where water-filling (each extra replica to
the expert with the highest load per replica) minimizes `max_e load_e / c_e`.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from ..base.errors import InputError
from ..placement.topology import Topology

# Enumerate group -> node partitions exactly up to this many (8 groups on 4 nodes: 105).
MAX_PARTITIONS = 10_000


def replicate(weight: np.ndarray, num_phy: int,
              max_replicas: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Water-filling replication, optionally with at most `max_replicas` replicas per expert.

    weight: float64 `[L, X]`, `num_phy >= X` (and `<= X * max_replicas`) ->
    (phy2log int64 `[L, num_phy]`, logcnt int64 `[L, X]`). Replica `i < X` is expert `i`;
    replica `i >= X` is a new replica of the expert with the highest `weight / logcnt` among
    those below the cap (lowest index on ties). Only the changed ratio is recomputed per step.
    """
    weight = np.asarray(weight, dtype=np.float64)
    num_layers, num_log = weight.shape
    if max_replicas is not None and num_phy > num_log * max_replicas:
        raise InputError(f"{num_phy} replicas of {num_log} experts need more than "
                         f"{max_replicas} replicas of some expert")
    layers = np.arange(num_layers)
    phy2log = np.empty((num_layers, num_phy), dtype=np.int64)  # [L, num_phy]
    phy2log[:, :num_log] = np.arange(num_log)
    logcnt = np.ones((num_layers, num_log), dtype=np.int64)  # [L, X]
    ratio = weight.copy()  # [L, X] load per replica, -inf once capped
    if max_replicas is not None and max_replicas <= 1:
        ratio[:] = -np.inf
    for slot in range(num_log, num_phy):
        hottest = np.argmax(ratio, axis=1)  # [L], first maximum = lowest index
        phy2log[:, slot] = hottest
        count = logcnt[layers, hottest] + 1  # [L]
        logcnt[layers, hottest] = count
        ratio[layers, hottest] = weight[layers, hottest] / count
        if max_replicas is not None:
            ratio[layers, hottest] = np.where(count >= max_replicas, -np.inf,
                                              ratio[layers, hottest])
    return phy2log, logcnt


def peak_gpu_load(load: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Max GPU load of placements `phy2log [L, P]` under the even split of `load [L, E]`: `[L]`
    (slot `p` on GPU `p // (P // G)`; an empty slot, -1, carries none)."""
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log)
    E = load.shape[1]
    sink = np.where(phy2log >= 0, phy2log, E)  # [L, P] an empty slot: column E, load 0
    counts = np.stack([np.bincount(row, minlength=E + 1) for row in sink])  # [L, E + 1]
    share = np.concatenate([load, np.zeros((len(load), 1))], 1) / np.maximum(counts, 1)
    per_slot = np.take_along_axis(share, sink, 1)  # [L, P]
    return per_slot.reshape(len(phy2log), num_gpus, -1).sum(-1).max(-1)


def water_fill_counts(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica counts by water-filling: int64 `[L, E]`, each row summing to `num_slots`.

    load: float64 `[L, E]`; starting from one replica each, every further replica goes to the
    expert with the highest `load / count` (lowest index on ties), as `replicate` does (and the
    deepseek solver with it). This minimizes `max_e load_e / count_e` over all counts with
    `count >= 1` and `sum = num_slots`.
    """
    return replicate(load, num_slots)[1]


def lower_bound(load: np.ndarray, num_slots: int, num_gpus: int) -> np.ndarray:
    """A lower bound on the max GPU load (even split) of every placement: float64 `[...]`.

    load: `[..., E]` pairs per logical expert; `max(total / G, max_e load_e / c_e)` with `c` the
    water-filling counts for `num_slots` slots. Holds for any placement, with or without
    anti-colocation or node constraints. Only the `m + 1` heaviest experts are water-filled
    (`m = num_slots - E` extra replicas): one of them keeps a single replica, so the max ratio
    is at least the load of every lighter expert, and a replica given to a lighter one could
    not lower it; the value is that of water-filling them all.
    """
    load = np.asarray(load, dtype=np.float64)
    lead, num_log = load.shape[:-1], load.shape[-1]
    flat = load.reshape(-1, num_log)  # [rows, E]
    extra = num_slots - num_log
    if extra + 1 < num_log:
        flat_top = -np.partition(-flat, extra, axis=1)[:, :extra + 1]  # [rows, m + 1] heaviest
    else:
        flat_top = flat
    ratio = (flat_top / water_fill_counts(flat_top, flat_top.shape[1] + extra)).max(1)
    return np.maximum(flat.sum(1) / num_gpus, ratio).reshape(lead)


def group_partitions(num_groups: int, num_nodes: int,
                     limit: int | None = None) -> np.ndarray | None:
    """All ways to split groups `0..num_groups-1` into `num_nodes` unlabeled blocks of equal
    size, as int64 `[partitions, N, num_groups / N]` (groups ascending in a block, blocks by
    their first group), or None when there are more than `limit` (default `MAX_PARTITIONS`)."""
    k = num_groups // num_nodes
    count = math.factorial(num_groups) // (math.factorial(k) ** num_nodes
                                           * math.factorial(num_nodes))
    if count > (MAX_PARTITIONS if limit is None else limit):
        return None
    return _partitions(num_groups, num_nodes).copy()


@functools.lru_cache(maxsize=16)
def _partitions(num_groups: int, num_nodes: int) -> np.ndarray:
    k = num_groups // num_nodes

    def split(rest: tuple[int, ...]):
        if not rest:
            yield ()
            return
        first, others = rest[0], rest[1:]
        for mates in itertools.combinations(others, k - 1):
            remaining = tuple(g for g in others if g not in mates)
            for tail in split(remaining):
                yield ((first, *mates), *tail)

    parts = np.array(list(split(tuple(range(num_groups)))), dtype=np.int64)
    return parts.reshape(-1, num_nodes, k)


def hierarchical_assignment(load: np.ndarray, num_slots: int, topology: Topology,
                            num_groups: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The group -> node assignment minimizing the hierarchical bound, found by enumeration.

    load: `[L, E]`; needs `num_groups % N == 0`. Each node gets `num_groups / N` groups
    (contiguous blocks of `E / num_groups` experts), `P / N` slots and `G / N` GPUs; a node's
    cost is its own `lower_bound` (its load over its GPUs, and its experts water-filled into its
    slots). -> (bound float64 `[L]` = min over assignments of the max node cost, group_node
    int64 `[L, num_groups]` an assignment attaining it, the first in enumeration order), or None
    when there are more than `MAX_PARTITIONS` assignments.
    """
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_experts = load.shape
    num_nodes = topology.num_nodes
    parts = group_partitions(num_groups, num_nodes)  # [parts, N, k]
    if parts is None:
        return None
    k = num_groups // num_nodes
    group_size = num_experts // num_groups
    blocks = list(itertools.combinations(range(num_groups), k))  # every k-subset of groups
    block_index = {b: i for i, b in enumerate(blocks)}
    experts = (np.array(blocks)[:, :, None] * group_size
               + np.arange(group_size)).reshape(len(blocks), -1)  # [blocks, E/N]
    cost = lower_bound(load[:, experts], num_slots // num_nodes,
                       topology.num_gpus // num_nodes)  # [L, blocks]
    part_blocks = np.array([[block_index[tuple(b)] for b in p] for p in parts.tolist()])
    part_cost = cost[:, part_blocks].max(-1)  # [L, parts]
    best = np.argmin(part_cost, axis=1)  # [L]
    group_node = np.empty((num_layers, num_groups), dtype=np.int64)
    nodes = np.broadcast_to(np.arange(num_nodes)[:, None], (num_nodes, k))  # [N, k]
    for layer in range(num_layers):
        group_node[layer, parts[best[layer]]] = nodes
    return part_cost[np.arange(num_layers), best], group_node


def hierarchical_lower_bound(load: np.ndarray, num_slots: int, topology: Topology,
                             num_groups: int) -> np.ndarray:
    """A lower bound on the max GPU load of every hierarchical placement: float64 `[L]`.

    Hierarchical placements keep each expert group (contiguous blocks of `E / num_groups`
    experts) on one node, with `num_groups / N` groups on every node (as the published
    hierarchical algorithm and `lpt-hier` do). A node holding groups `B` then carries at least
    its own `lower_bound` with `P / N` slots and `G / N` GPUs (perfect balance inside the node):
    `cost(B) = max(load(B) / (G / N), max_e load_e / c_e)`, `c` water-filled over `B`'s experts.

    Exact value `min over assignments of max over nodes of cost` when there are at most
    `MAX_PARTITIONS` assignments (8 groups on 4 nodes: 105). Otherwise a weaker valid bound, the
    max of: the global `lower_bound`; for each group `g`, `(load(g) + the k - 1 lightest other
    groups) / (G / N)`; and `g`'s experts water-filled into `P / N - (k - 1) * E / num_groups`
    slots (the other groups on its node need one slot per expert). Without the hierarchical
    constraint (`num_groups % N != 0`, or one node) it is `lower_bound`.
    """
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_experts = load.shape
    num_nodes, num_gpus = topology.num_nodes, topology.num_gpus
    if num_nodes == 1 or num_groups % num_nodes:
        return lower_bound(load, num_slots, num_gpus)
    exact = hierarchical_assignment(load, num_slots, topology, num_groups)
    if exact is not None:
        return exact[0]
    k = num_groups // num_nodes
    group_size = num_experts // num_groups
    gpus_per_node = num_gpus // num_nodes
    grouped = load.reshape(num_layers, num_groups, group_size)  # [L, groups, E/groups]
    group_load = grouped.sum(-1)  # [L, groups]
    lightest = np.sort(group_load, axis=1)[:, :k]  # [L, k] ascending
    # the k - 1 lightest groups other than g: drop g itself when it is among the k lightest
    others = np.where(group_load <= lightest[:, k - 1:k],
                      lightest.sum(1, keepdims=True) - group_load,
                      lightest[:, :k - 1].sum(1, keepdims=True))  # [L, groups]
    by_sum = ((group_load + others) / gpus_per_node).max(1)  # [L]
    slots = num_slots // num_nodes - (k - 1) * group_size
    flat = grouped.reshape(-1, group_size)
    ratio = (flat / water_fill_counts(flat, slots)).max(1).reshape(num_layers, -1).max(1)
    return np.maximum.reduce([lower_bound(load, num_slots, num_gpus), by_sum, ratio])
