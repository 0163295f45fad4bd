"""`atom-naive` and `atom-biased`: twins of ROCm ATOM's two EPLB placement policies
(`--eplb-placement-policy {naive,biased}`, ATOM #1210), written from
`atom/model_ops/eplb.py` (`_placement_naive`, `_placement_biased`, commit 05c3036dd41f).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `S = P / G` slots a
GPU, `H = (P - E) // G` hot experts.

Both run ATOM's global path on every layer (its hierarchical path, per node, runs only when a
deployment enables it with groups and nodes; not twinned: groups are ignored here). Loads are
read as float32, as ATOM casts them.

`atom-naive` (ATOM's default):
  1. replicate: each of the `P - E` extra replicas goes to the expert with the highest load per
     replica (float64 quotient of the float32 loads), the lowest id on a tie;
  2. pack: the replicas, listed expert by expert, each weighing its expert's float32 load over
     its float32 replica count, in descending weight (the earlier listed on a tie), each into
     the GPU with a free slot that has the least load, then the fewest replicas, then the lowest
     id; a GPU's slots hold its replicas in the order they arrived.

`atom-biased` ("the top-K fully replicated"): the `H` hottest experts (descending load, lower id
on a tie) get one replica on every GPU, in the first `H` slots of each GPU in ascending id; the
other experts get one replica each, the slots left over go to them by step 1's rule, and their
replicas fill the remaining `S - H` slots of each GPU by step 2's rule (descending weight, then
expert id, then replica index). With `H = 0` it is `atom-naive`. Where every expert is hot
and slots are left over (ATOM raises there), those slots replicate every expert by step 1's
rule, its copies on every GPU counted, and `H` is at most `E` (eplbsim's choices). ATOM keeps the old placement
when the hot set is unchanged (a migration shortcut); `solve(previous=...)` does eplbsim's own.
"""

from __future__ import annotations

import numpy as np

from ..placement.topology import Topology


def atom_naive(load: np.ndarray, num_slots: int, topology: Topology,
               num_groups: int = 1) -> np.ndarray:
    """ATOM's naive placement: greedy replication, largest-first packing (module doc).
    `load [L, E]` -> phy2log int64 `[L, P]`; `num_groups` is ignored (ATOM's global path)."""
    weight = np.asarray(load, np.float32)
    return np.stack([_naive(row, num_slots, topology.num_gpus) for row in weight])


def atom_biased(load: np.ndarray, num_slots: int, topology: Topology,
                num_groups: int = 1) -> np.ndarray:
    """ATOM's biased placement: the hottest `(P - E) // G` experts on every GPU, the rest
    replicated and packed as `atom-naive` does (module doc). `load [L, E]` -> phy2log int64
    `[L, P]`; `num_groups` is ignored (ATOM's global path)."""
    weight = np.asarray(load, np.float32)
    G = topology.num_gpus
    hot = (num_slots - weight.shape[1]) // G
    if hot <= 0:
        return atom_naive(load, num_slots, topology)
    return np.stack([_biased(row, num_slots, G, hot) for row in weight])


def _naive(weight: np.ndarray, num_slots: int, num_gpus: int) -> np.ndarray:
    """One layer of `atom_naive`: float32 `weight [E]` -> phy2log `[P]`."""
    counts = _replicated(weight, np.ones(len(weight), np.int64), num_slots - len(weight))
    experts = np.repeat(np.arange(len(weight)), counts)  # [P] expert by expert
    per = (weight[experts] / counts[experts].astype(np.float32)).astype(np.float64)
    return _packed(experts, per, num_gpus, num_slots // num_gpus)


def _biased(weight: np.ndarray, num_slots: int, num_gpus: int, hot: int) -> np.ndarray:
    """One layer of `atom_biased` with `hot` fully replicated experts: phy2log `[P]`."""
    per_gpu = num_slots // num_gpus  # >= hot, as hot * G <= P - E
    E = len(weight)
    hot = min(hot, E)
    order = sorted(range(E), key=lambda e: (-float(weight[e]), e))
    hot_set = np.zeros(E, bool)
    hot_set[order[:hot]] = True
    cold = np.flatnonzero(~hot_set)
    free = num_slots - hot * num_gpus  # >= E > len(cold)
    # every expert hot (ATOM's `max` over no cold expert raises): the free slots replicate
    # them all by the same rule, counting their copies on every GPU
    pool, held = (cold, 0) if cold.size else (np.arange(E), num_gpus)
    counts = _replicated(weight[pool], np.full(len(pool), max(held, 1), np.int64),
                         free - len(cold))
    placed = counts - held  # [len(pool)] replicas in the free slots
    replica = np.concatenate([np.arange(c) for c in placed])  # [free] index within the expert
    experts = np.repeat(pool, placed)
    per = weight[experts].astype(np.float64) / np.repeat(counts, placed)
    order = np.lexsort((replica, experts, -per))  # descending weight, then expert, replica
    cold_slots = _packed(experts[order], per[order], num_gpus, per_gpu - hot, presorted=True)
    hot_ids = np.flatnonzero(hot_set)
    return np.concatenate([np.concatenate([hot_ids, gpu])
                           for gpu in cold_slots.reshape(num_gpus, -1)])


def _replicated(weight: np.ndarray, counts: np.ndarray, extra: int) -> np.ndarray:
    """`counts [E]` after `extra` replicas, each to the highest float64 `weight / count`
    (the lowest index on a tie)."""
    w = weight.astype(np.float64)
    for _ in range(extra):
        counts[int(np.argmax(w / counts))] += 1
    return counts


def _packed(experts: np.ndarray, per: np.ndarray, num_gpus: int, capacity: int,
            presorted: bool = False) -> np.ndarray:
    """Largest-first packing of replicas `experts [X]` weighing `per [X]` into `num_gpus`
    GPUs of `capacity` slots each: the GPU with a free slot of least load, then fewest
    replicas, then lowest id. `presorted`: already in packing order (else descending weight,
    the earlier on a tie). -> the experts laid out GPU by GPU, `[G * capacity]`."""
    order = np.arange(len(experts)) if presorted else np.lexsort((np.arange(len(per)), -per))
    loads = np.zeros(num_gpus)
    held: list[list[int]] = [[] for _ in range(num_gpus)]
    for i in order:
        best = min((g for g in range(num_gpus) if len(held[g]) < capacity),
                   key=lambda g: (loads[g], len(held[g]), g))
        held[best].append(int(experts[i]))
        loads[best] += per[i]
    return np.array([e for gpu in held for e in gpu], np.int64)
