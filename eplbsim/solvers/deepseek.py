"""DeepSeek's hierarchical expert-parallel load balancer (EPLB), written from its description.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.
Slot `p` lives on GPU `p // (P // G)`; GPU `g` is on node `g // (G // N)`.

Hierarchical variant (used when the number of expert groups is a multiple of `N`):
  1. pack expert groups (contiguous blocks of `E / num_groups` experts) onto nodes, balancing
     the groups' summed loads;
  2. on each node, replicate its `E / N` experts into `P / N` slots, each new replica going to
     the expert with the highest load per replica;
  3. pack each node's replicas onto its `G / N` GPUs, balancing load per replica.
Otherwise the global variant runs the same with one group on one node.

Tie-breaking (deterministic): items are packed in descending load, equal loads in ascending
item index (stable sort); an item goes to the least-loaded pack that still has room, equal pack
loads to the lowest pack index; a new replica goes to the expert with the highest load per
replica, equal ratios to the lowest expert index; when each pack takes one item, item `i` goes to
pack `i`.

Option `anti_colocation` (no GPU holds two replicas of one expert): step 2 gives no expert more
replicas than its node has GPUs (the next replica goes to the highest load per replica among
the experts below that cap), and in step 3 an item may only go to a pack with room that holds no
replica of the same expert. InputError when that is impossible (a GPU has more slots than its
node has experts) or when the greedy packing gets stuck. Without the option the results are
those of the published algorithm computed in float64, which are vLLM's `DefaultEplbPolicy`'s
(float32 loads, float64 pack sums), except where vLLM's unstable sort orders equal loads
otherwise (its numpy argsort), and DeepSeek's `eplb.py`'s (deepseek-ai/EPLB, commit 57919718)
except where two packs' loads tie: `eplb.py` casts the loads to float32 and sums each pack in
float32, so at an exact tie its rounding, not the lowest index, picks the pack. On
`[[10, 8, 7, 5, 4, 3, 2, 1], [4, 9, 3, 8, 2, 7, 1, 6]]`, 16 slots, 4 GPUs, GPUs 2 and 3 both
reach 49/6 (`10/3 + 5/2 + 7/3` and `3 + 8/3 + 5/2`) before the first replica of load 2:
float32 makes GPU 2 the lighter, float64 GPU 3, so experts 4 and 6 trade GPUs and their
replica order differs; this twin gives vLLM's answer there (`tests/solvers/test_peers.py`).
"""

from __future__ import annotations

import numpy as np

from ..base.errors import InputError
from ..placement.topology import Topology
from .bounds import replicate


class PackingStuck(InputError):
    """`balanced_packing` with labels found no open pack for an item: row `row`, label `label`."""

    def __init__(self, row: int, label: int) -> None:
        super().__init__(f"anti-colocation packing is stuck in row {row}: no pack with room "
                         f"holds no item labelled {label}")
        self.row, self.label = row, label


def balanced_packing(weight: np.ndarray, num_packs: int,
                     label: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pack `X` weighted items into `num_packs` packs of exactly `X / num_packs` items each.

    weight: float64 `[L, X]` -> (pack int64 `[L, X]`, rank_in_pack int64 `[L, X]`), where
    `rank_in_pack` is the order in which the item was added to its pack (0 first).
    Greedy: items by descending weight (stable), each to the lightest pack with room (lowest
    index on ties). With one item per pack, item `i` goes to pack `i`.
    label: optional non-negative int64 `[L, X]`; an item may then only go to a pack that holds
    no item with its label (PackingStuck, an InputError, when no pack with room qualifies).
    """
    num_layers, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        pack = np.tile(np.arange(num_items, dtype=np.int64), (num_layers, 1))  # [L, X]
        return pack, np.zeros_like(pack)
    order = np.argsort(-weight, axis=1, kind="stable")  # [L, X] items, heaviest first
    layers = np.arange(num_layers)
    pack_weight = np.zeros((num_layers, num_packs))  # [L, packs]
    pack_count = np.zeros((num_layers, num_packs), dtype=np.int64)  # [L, packs]
    pack = np.empty((num_layers, num_items), dtype=np.int64)  # [L, X]
    rank = np.empty((num_layers, num_items), dtype=np.int64)  # [L, X]
    if label is not None:
        # [L, packs, labels]: does the pack hold an item with the label
        holds = np.zeros((num_layers, num_packs, int(label.max()) + 1), dtype=bool)
    for step in range(num_items):
        item = order[:, step]  # [L]
        is_open = pack_count < per_pack  # [L, packs]
        if label is not None:
            item_label = label[layers, item]  # [L]
            is_open &= ~holds[layers, :, item_label]
            stuck = ~is_open.any(axis=1)
            if stuck.any():
                row = int(np.argmax(stuck))
                raise PackingStuck(row, int(item_label[row]))
        open_weight = np.where(is_open, pack_weight, np.inf)  # [L, packs]
        chosen = np.argmin(open_weight, axis=1)  # [L], first minimum = lowest pack index
        pack[layers, item] = chosen
        rank[layers, item] = pack_count[layers, chosen]
        pack_weight[layers, chosen] += weight[layers, item]
        pack_count[layers, chosen] += 1
        if label is not None:
            holds[layers, chosen, item_label] = True
    return pack, rank


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations `[L, X]`."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.arange(perm.shape[1], dtype=perm.dtype)[None, :], axis=1)
    return inv


def hierarchical(load: np.ndarray, num_slots: int, num_groups: int, num_nodes: int,
                 num_gpus: int, anti_colocation: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Hierarchical EPLB; requires `num_groups % num_nodes == 0` and the divisibilities of
    `E` by `num_groups`, `P` by `num_gpus`, `num_gpus` by `num_nodes`.

    load: float64 `[L, E]` pairs per logical expert -> (phy2log int64 `[L, P]`, each expert's
    slots in replica order int64 `[L, E, R]`: the original first, then the replicas in the
    order replication made them, as the published algorithm's `log2phy`).
    anti_colocation: see the module docstring; InputError when it cannot be honoured.
    """
    num_layers, num_experts = load.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_experts // num_nodes
    phy_per_node = num_slots // num_nodes
    slots_per_gpu = num_slots // num_gpus
    gpus_per_node = num_gpus // num_nodes
    if anti_colocation and slots_per_gpu > log_per_node:
        raise InputError(f"anti_colocation is impossible: each GPU holds {slots_per_gpu} slots "
                         f"but only {log_per_node} experts may be placed on it (those of its "
                         f"node), so some GPU would hold two replicas of one expert")

    # 1. groups onto nodes
    group_load = load.reshape(num_layers, num_groups, group_size).sum(-1)  # [L, groups]
    group_node, group_rank = balanced_packing(group_load, num_nodes)  # [L, groups]
    # middle logical id: node-major, groups by rank in pack, experts in group order
    group_first = (group_node * groups_per_node + group_rank) * group_size  # [L, groups]
    log2mlog = (group_first[:, :, None] + np.arange(group_size)).reshape(num_layers, -1)  # [L, E]
    mlog2log = _inverse(log2mlog)  # [L, E]

    # 2. replicate within each node; rows are (layer, node)
    mlog_load = np.take_along_axis(load, mlog2log, axis=1).reshape(-1, log_per_node)  # [L*N, E/N]
    phy2mlog, mlogcnt = replicate(  # [L*N, P/N], [L*N, E/N]
        mlog_load, phy_per_node, gpus_per_node if anti_colocation else None)

    # 3. replicas onto the node's GPUs
    phy_load = np.take_along_axis(mlog_load / mlogcnt, phy2mlog, axis=1)  # [L*N, P/N]
    try:
        gpu, gpu_rank = balanced_packing(phy_load, gpus_per_node,  # [L*N, P/N]
                                         phy2mlog if anti_colocation else None)
    except PackingStuck as stuck:
        layer, node = divmod(stuck.row, num_nodes)
        expert = int(mlog2log[layer, node * log_per_node + stuck.label])
        raise InputError(f"deepseek cannot honour anti_colocation: in layer {layer}, its greedy "
                         f"packing left a replica of expert {expert} with no GPU (of node {node}) "
                         f"that has a free slot and holds no replica of it; try the exact "
                         f"solver or fewer slots") from None
    phy2pphy = gpu * slots_per_gpu + gpu_rank  # [L*N, P/N] node-local slot of each replica
    pphy2mlog = np.take_along_axis(phy2mlog, _inverse(phy2pphy), axis=1)  # [L*N, P/N]
    # each slot's replica rank: how many replicas of its expert replication made before it
    pphy_rank = np.take_along_axis(_occurrences(phy2mlog), _inverse(phy2pphy), axis=1)

    # 4. back to global ids
    node_offset = (np.arange(num_nodes, dtype=np.int64) * log_per_node)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + node_offset).reshape(
        num_layers, -1)  # [L, P]
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)  # [L, P]
    return phy2log, replica_order(phy2log, pphy_rank.reshape(num_layers, -1), num_experts)


def _occurrences(items: np.ndarray) -> np.ndarray:
    """How many earlier entries of each row equal each entry, int64 like `items [L, X]`."""
    out = np.empty_like(items)
    for row in range(items.shape[0]):
        seen: dict[int, int] = {}
        for i, item in enumerate(items[row].tolist()):
            out[row, i] = seen.get(item, 0)
            seen[item] = out[row, i] + 1
    return out


def replica_order(phy2log: np.ndarray, rank: np.ndarray, num_experts: int) -> np.ndarray:
    """Each expert's slots by replica rank `rank [L, P]`, -1 padded: int64 `[L, E, R]` (the
    lists a serving engine publishes after its solver, `Placement.order`)."""
    L, P = phy2log.shape
    order = np.full((L, num_experts, int(rank.max()) + 1), -1, dtype=np.int64)
    layers = np.repeat(np.arange(L), P)
    order[layers, phy2log.reshape(-1), rank.reshape(-1)] = np.tile(np.arange(P), L)
    return order


def deepseek(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
             anti_colocation: bool = False) -> tuple[np.ndarray, dict]:
    """DeepSeek EPLB: hierarchical when `num_groups % N == 0`, else global (one group, one node).

    load: float64 `[L, E]` pairs per logical expert, `num_slots` = `P` -> (phy2log int64
    `[L, P]`, {"order": each expert's slots in replica order `[L, E, R]`}).
    anti_colocation: no GPU holds two replicas of one expert (module docstring); InputError
    when it cannot be honoured.
    """
    load = np.asarray(load, dtype=np.float64)
    num_nodes, num_gpus = topology.num_nodes, topology.num_gpus
    anti = bool(anti_colocation)
    if num_groups % num_nodes == 0:
        phy2log, order = hierarchical(load, num_slots, num_groups, num_nodes, num_gpus, anti)
    else:
        phy2log, order = hierarchical(load, num_slots, 1, 1, num_gpus, anti)
    return phy2log, {"order": order}
