"""Migration-aware placement: lay a new placement out so that as few slots as possible change.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes,
`S = P / G` slots per GPU.

Permuting whole nodes, GPUs within a node, or slots within a GPU changes no GPU's load (every
GPU has `S` slots) and keeps every expert group on one node, so `align_to_previous` searches
exactly those permutations: nodes to previous nodes and then GPUs to previous GPUs by
maximum overlap (`scipy.optimize.linear_sum_assignment`), then every expert that already sat in a
slot of its GPU keeps that slot.

An empty slot (-1) is no expert's: it overlaps nothing, carries no load, and a slot left empty
copies nothing (`moved_slots` counts the slots that receive a copy); `warm_start` fills the
previous placement's empty slots first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..base.errors import InputError
from ..placement import Placement
from ..placement.topology import Topology
from .bounds import peak_gpu_load


def moved_slots(previous: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """Slots that receive a copy when `previous [L, P]` turns into `phy2log [L, P]`, those
    whose expert changes and that `phy2log` does not leave empty: int64 `[L]`."""
    previous, phy2log = np.asarray(previous), np.asarray(phy2log)
    return ((previous != phy2log) & (phy2log >= 0)).sum(-1)


def _overlap(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """`[A, B]` replicas in common between groups of slots `new [A, X]` and `old [B, X]`
    (empty slots, -1, are in common with nothing)."""
    def counts(groups: np.ndarray) -> np.ndarray:  # [A, E]
        out = np.zeros((groups.shape[0], num_experts + 1), dtype=np.int64)  # -1: column E
        np.add.at(out, (np.arange(groups.shape[0])[:, None], groups), 1)
        return out[:, :num_experts]
    return np.minimum(counts(new)[:, None, :], counts(old)[None, :, :]).sum(-1)


def _match(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """For groups `new [A, X]`, `old [A, X]`: order[i] = the new group placed at old position i,
    maximising the replicas left in place."""
    from scipy.optimize import linear_sum_assignment  # scipy loads on first use

    rows, cols = linear_sum_assignment(_overlap(new, old, num_experts), maximize=True)
    order = np.empty(len(rows), dtype=np.int64)
    order[cols] = rows
    return order


def _keep_slots(new_gpu: np.ndarray, old_gpu: np.ndarray) -> np.ndarray:
    """The experts of `new_gpu [S]`, reordered so each one that `old_gpu [S]` already had at a
    slot stays at that slot; the rest (empty slots, -1, too) fill the remaining slots in their
    order."""
    out = np.empty_like(new_gpu)
    kept = np.zeros(len(new_gpu), dtype=bool)
    left = list(new_gpu)
    for i, e in enumerate(old_gpu):
        if e >= 0 and e in left:
            left.remove(e)
            out[i], kept[i] = e, True
    out[~kept] = left
    return out


def align_to_previous(phy2log: np.ndarray, previous: np.ndarray, topology: Topology,
                      num_experts: int) -> np.ndarray:
    """`phy2log [L, P]` laid out to change as few slots of `previous [L, P]` as possible, by
    permuting nodes, GPUs within nodes and slots within GPUs (every GPU's load unchanged)."""
    phy2log, previous = np.asarray(phy2log), np.asarray(previous)
    if previous.shape != phy2log.shape:
        raise InputError(f"the previous placement has shape {previous.shape}; the new one is "
                         f"{phy2log.shape}: both must be [layers, slots]")
    L, P = phy2log.shape
    G, N = topology.num_gpus, topology.num_nodes
    S, per_node = P // G, G // N
    out = np.empty_like(phy2log)
    for layer in range(L):
        new = phy2log[layer].reshape(N, per_node, S)
        old = previous[layer].reshape(N, per_node, S)
        node_order = _match(new.reshape(N, -1), old.reshape(N, -1), num_experts)
        for n_old, n_new in enumerate(node_order):
            gpu_order = _match(new[n_new], old[n_old], num_experts)
            for g_old, g_new in enumerate(gpu_order):
                slot = (n_old * per_node + g_old) * S
                out[layer, slot:slot + S] = _keep_slots(new[n_new, g_new], old[n_old, g_old])
    return out


def warm_start(load: np.ndarray, previous: np.ndarray, counts: np.ndarray, topology: Topology,
               target: np.ndarray, within_node: bool = False,
               separate: bool = False) -> np.ndarray:
    """Repair `previous [L, P]` for new loads `[L, E]` and replica `counts [L, E]`, changing
    few slots: drop surplus replicas from the most-loaded GPUs, put missing ones into the freed
    slots on the least-loaded GPUs (largest first), then swap replicas between the most-loaded
    GPU and another while that lowers the maximum, until it is at most `target [L]` (the max GPU
    load the caller will accept). `within_node`: swaps and new replicas stay on the node that
    already holds the expert (groups stay on their node). `separate`: no step puts a second
    replica of an expert on a GPU (surplus replicas go first from GPUs holding two, a new one
    only to a GPU without one, no swap brings one); the previous placement's own pairs may
    remain. `previous`'s empty slots (-1) are free from the start; slots `counts` leaves over
    stay empty. Every expert that stays on its GPU stays in its slot. Returns phy2log int64
    `[L, P]`."""
    L, P = previous.shape
    G = topology.num_gpus
    S = P // G
    gpu_of = np.arange(P) // S  # [P]
    node_of = gpu_of // topology.gpus_per_node  # [P]
    out = np.array(previous, dtype=np.int64)
    for layer in range(L):
        slots = out[layer]  # [P] view
        weight = np.append(load[layer] / counts[layer], 0.0)  # [E + 1] a replica's load;
        # weight[-1] = 0: an empty slot's
        have = np.bincount(slots[slots >= 0], minlength=load.shape[1])
        gpu_load = np.bincount(gpu_of, weight[slots], minlength=G)
        free = np.nonzero(slots < 0)[0].tolist()  # empty already
        dropped = []
        for e in np.nonzero(have > counts[layer])[0]:  # surplus: drop from the busiest GPUs
            mine = np.nonzero(slots == e)[0]
            paired = np.bincount(gpu_of[mine], minlength=G)[gpu_of[mine]] > 1  # [mine]
            paired &= separate  # with `separate`, those on a GPU holding two of e go first
            drop = mine[np.lexsort((-gpu_load[gpu_of[mine]], ~paired))]
            dropped.extend(drop[:have[e] - counts[layer, e]].tolist())
        for p in dropped:
            gpu_load[gpu_of[p]] -= weight[slots[p]]
            slots[p] = -1
        free.extend(dropped)
        need = np.repeat(np.arange(load.shape[1]), np.maximum(counts[layer] - have, 0))
        for e in need[np.argsort(-weight[need], kind="stable")]:  # largest replicas first
            open_slots = np.array([p for p in free if slots[p] < 0])
            if within_node:
                home = np.isin(node_of[open_slots], node_of[slots == e])
                open_slots = open_slots[home] if home.any() else open_slots
            if separate:
                apart = ~np.isin(gpu_of[open_slots], gpu_of[slots == e])
                open_slots = open_slots[apart] if apart.any() else open_slots
            p = open_slots[np.argmin(gpu_load[gpu_of[open_slots]])]
            slots[p] = e
            gpu_load[gpu_of[p]] += weight[e]
        _swap_down(slots, weight, gpu_load, gpu_of, node_of if within_node else None,
                   target[layer], separate)
        for g in range(G):  # an expert that left its GPU and came back takes its old slot
            out[layer, g * S:(g + 1) * S] = _keep_slots(slots[g * S:(g + 1) * S],
                                                        previous[layer, g * S:(g + 1) * S])
    return out


def _swap_down(slots: np.ndarray, weight: np.ndarray, gpu_load: np.ndarray, gpu_of: np.ndarray,
               node_of: np.ndarray | None, target: float, separate: bool = False) -> None:
    """In place: swap a replica of the most-loaded GPU with one elsewhere (or move it to an
    empty slot, -1, whose `weight[-1]` is 0), the swap that lowers the pair's larger load the
    most, while the maximum exceeds `target` and a swap lowers it. `separate`: no swap puts an
    expert on a GPU that already holds it."""
    while True:
        top = int(np.argmax(gpu_load))
        peak = gpu_load[top]
        if peak <= target:
            return
        mine = np.nonzero(gpu_of == top)[0]  # [S]
        other = np.nonzero(gpu_of != top)[0]
        if node_of is not None:
            other = other[node_of[other] == node_of[mine[0]]]
        w_mine, w_other = weight[slots[mine]], weight[slots[other]]
        delta = w_mine[:, None] - w_other[None, :]  # [S, X] load leaving `top`
        after = np.maximum(peak - delta, gpu_load[gpu_of[other]][None, :] + delta)
        after[slots[mine][:, None] == slots[other][None, :]] = np.inf
        if separate:
            on_top = np.isin(slots[other], slots[mine]) & (slots[other] >= 0)  # [X]
            there = (slots[mine][:, None] == slots[None, :]) & (slots[None, :] >= 0)  # [S, P]
            held = np.zeros((len(mine), gpu_of.max() + 1), dtype=bool)  # [S, G]
            np.logical_or.at(held, (np.nonzero(there)[0], gpu_of[np.nonzero(there)[1]]), True)
            after[:, on_top] = np.inf  # b's expert already sits on top
            after[held[:, gpu_of[other]]] = np.inf  # a's expert already sits on b's GPU
        i, j = np.unravel_index(np.argmin(after), after.shape)
        if not after[i, j] < peak - 1e-12 * max(peak, 1.0):
            return
        a, b = mine[i], other[j]
        gpu_load[top] -= delta[i, j]
        gpu_load[gpu_of[b]] += delta[i, j]
        slots[a], slots[b] = slots[b], slots[a]


def check_previous(prev: np.ndarray, phy2log: np.ndarray, num_experts: int,
                   topology: Topology) -> None:
    """InputError unless `prev` is a placement of the shape of `phy2log [L, P]` over
    `num_experts` experts and `topology`."""
    if prev.shape != phy2log.shape:
        raise InputError(f"the previous placement has shape {prev.shape}; expected "
                         f"[layers, slots] = {phy2log.shape}")
    Placement(torch.as_tensor(prev), num_experts, topology)  # validates ids and coverage


def fewest_moves(load: np.ndarray, phy2log: np.ndarray, prev: np.ndarray, topology: Topology,
                 num_groups: int, tolerance: float, separate: bool,
                 info: dict[str, Any]) -> np.ndarray:
    """Per layer, the fewer-moves choice between the fresh solve `phy2log [L, P]` laid out over
    `prev [L, P]` and `prev` repaired by `warm_start`, when the latter's max GPU load is within
    `tolerance` of the former's and it keeps the solver's rules: `separate` (the solver puts no
    two replicas of an expert on one GPU, `anti_colocation` or by its nature) and the fresh
    layer has no such pair, then neither may the repaired one. Records `moved_slots` (total),
    `moved_slots_per_layer` and `fresh_moved_slots` in `info`."""
    L, E = load.shape
    check_previous(prev, phy2log, E, topology)
    if not 0 <= tolerance < 1:
        raise InputError(f"migration_tolerance must lie in [0, 1), got {tolerance}")
    fresh = align_to_previous(phy2log, prev, topology, E)
    counts = np.stack([np.bincount(row[row >= 0], minlength=E) for row in fresh])  # [L, E]
    peak = peak_gpu_load(load, fresh, topology.num_gpus)
    within_node = num_groups > 1 and num_groups % topology.num_nodes == 0
    warm = warm_start(load, prev, counts, topology, peak * (1 + tolerance), within_node,
                      separate)
    ok = peak_gpu_load(load, warm, topology.num_gpus) <= peak * (1 + tolerance) + 1e-9
    if separate:
        ok &= colocation_free(warm, topology) | ~colocation_free(fresh, topology)
    use_warm = ok & (moved_slots(prev, warm) < moved_slots(prev, fresh))
    out = np.where(use_warm[:, None], warm, fresh)
    per_layer = moved_slots(prev, out)
    info.update(moved_slots=int(per_layer.sum()), moved_slots_per_layer=per_layer.tolist(),
                fresh_moved_slots=int(moved_slots(prev, fresh).sum()))
    return out


def colocation_free(phy2log: np.ndarray, topology: Topology) -> np.ndarray:
    """Per layer: no GPU holds two replicas of one expert (two empty slots, -1, are none),
    bool `[L]`."""
    L, P = phy2log.shape
    per_gpu = np.sort(phy2log.reshape(L, topology.num_gpus, -1), -1)
    return ~((np.diff(per_gpu, axis=-1) == 0) & (per_gpu[..., 1:] >= 0)).any((1, 2))
