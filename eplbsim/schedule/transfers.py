"""What a rebalance moves: expert copies by where they come from, and their bytes.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from ..cost.rebalance import model_bytes
from ..placement import Placement

TRANSFER_KINDS = ("same_gpu", "same_node", "cross_node")
MIGRATION_FIELDS = ("step", "skipped", "balancedness", "moved_slots", *TRANSFER_KINDS, "bytes",
                    "cross_node_bytes")  # the keys of a `migration_rows` row, in order


def transfer_counts(old: Placement, new: Placement) -> np.ndarray:
    """Expert copies needed to turn `old` into `new`: int64 `[L, 3]` per layer, by where the
    nearest old replica of a changed slot's new expert sits (`transfer_kinds`)."""
    kinds = transfer_kinds(old, new)
    return np.stack([(kinds == k).sum(1) for k in range(len(TRANSFER_KINDS))], 1)


def transfer_kinds(old: Placement, new: Placement) -> np.ndarray:
    """Where each slot's copy comes from when `old` turns into `new`, int64 `[L, P]`: -1 for
    a slot whose expert is unchanged or that `new` leaves empty (it copies nothing), else the
    index in `TRANSFER_KINDS` of the nearest old replica of its new expert: on the slot's GPU,
    on its node, or only on other nodes (every expert has a replica in `old`, so some source
    always exists; a slot filled from empty is a copy like any other)."""
    old_p2l, new_p2l = old.phy2log, new.phy2log  # [L, P]
    if old_p2l.shape != new_p2l.shape or old.topology != new.topology:
        raise InputError(f"cannot compare placements of shapes {tuple(old_p2l.shape)} on "
                         f"{old.topology} and {tuple(new_p2l.shape)} on {new.topology}")
    L, P = old_p2l.shape
    E, G, N = old.num_experts, old.topology.num_gpus, old.topology.num_nodes
    gpu, node = old.slot_gpu, old.slot_node  # [P]
    layer = torch.arange(L).view(L, 1).expand(L, P)
    held_gpu = torch.zeros(L, G, E + 1, dtype=torch.bool)  # bucket E: empty slots
    held_gpu[layer, gpu.expand(L, P), old.sink_index] = True  # [L, G, E + 1] held on a GPU
    held_node = held_gpu.view(L, N, G // N, E + 1).any(2)  # [L, N, E + 1]
    on_gpu = held_gpu[layer, gpu.expand(L, P), new.sink_index]
    on_node = held_node[layer, node.expand(L, P), new.sink_index]
    kinds = torch.where(on_gpu, 0, torch.where(on_node, 1, 2))
    return torch.where((old_p2l != new_p2l) & new.filled, kinds, -1).numpy()


def migration_rows(segments: Sequence[Any], expert_bytes: int,
                   scale: float = 1.0) -> list[dict[str, Any]]:
    """One row per rebalance point of `segments` (`plan.Segment`): `step`, `skipped`,
    `balancedness` (of the placement in service on the forecast), `moved_slots`, copies by
    source (`same_gpu`, `same_node`, `cross_node`), `bytes` (all copies) and
    `cross_node_bytes`, for experts of `expert_bytes`. Slots and copies are the segments'
    layers'; the bytes are the whole model's (`cost.rebalance.model_bytes`, `scale` its
    `layer_scale`), on the scale of the stalls."""
    rows = []
    for seg in segments:
        r = seg.rebalance
        if r is None:
            continue
        kinds = dict(zip(TRANSFER_KINDS, r.transfers.sum(0).tolist()))
        rows.append({"step": r.step, "skipped": r.skipped,
                     "balancedness": None if math.isnan(r.balancedness) else r.balancedness,
                     "moved_slots": r.moved_slots, **kinds,
                     "bytes": model_bytes(r.moved_slots, expert_bytes, scale),
                     "cross_node_bytes": model_bytes(kinds["cross_node"], expert_bytes, scale)})
    return rows
