"""What a rebalance costs in time (DESIGN.md §8, `sync`: serving stalls until the copies land),
and its copies in bytes, both for the whole model.

Dimensions: `L` layers, `P` slots, `G` GPUs.

A trace records `L` of the model's MoE layers; each stands for `layer_scale` of them, so a
rebalance's bytes (`model_bytes`) and stall (`model_ms`) are the whole model's, on the scale of
every time metric.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .devices import DeviceProfile


def layer_scale(cost: Any, num_layers: int) -> float:
    """How many of the model's MoE layers each of a trace's `num_layers` layers stands for when
    time is priced (`cost`, a `runspec.CostPart`): `moe_layers / L` of its model shape, so a
    step's time is the whole model's, whatever layers the trace recorded."""
    return cost.profiles()[0].moe_layers / num_layers


def model_bytes(copies: float, expert_bytes: int, scale: float) -> int:
    """Bytes of `copies` expert copies of the trace's layers in the whole model: `scale` its
    `layer_scale`, each copy `expert_bytes`, rounded to whole bytes."""
    return round(copies * expert_bytes * scale)


def model_ms(seconds: float, scale: float) -> float:
    """A stall of `seconds` over the trace's layers in milliseconds of the whole model (`scale`
    its `layer_scale`)."""
    return seconds * scale * 1e3


def sync_stall_seconds(kinds: np.ndarray, slot_gpu: np.ndarray, num_gpus: int,
                       expert_bytes: int, device: DeviceProfile) -> float:
    """Seconds serving stalls while one rebalance's copies land, from each slot's copy source
    `kinds [L, P]` (`schedule.transfers.transfer_kinds`: -1 none, 0 same GPU, 1 same node,
    2 another node) on GPUs `slot_gpu [P]`, every layer at once: each receiving GPU takes its
    same-GPU copies over HBM (read and written), then its same-node bytes over NVLink and its
    other-node bytes over RDMA; the slowest GPU decides (0 when nothing moves)."""
    per_gpu = np.zeros((num_gpus, 3))
    for kind in range(3):
        np.add.at(per_gpu[:, kind], np.broadcast_to(slot_gpu, kinds.shape)[kinds == kind], 1)
    return copies_stall_seconds(per_gpu, expert_bytes, device)


def copies_stall_seconds(per_gpu: np.ndarray, expert_bytes: int, device: DeviceProfile) -> float:
    """Seconds serving stalls while each GPU receives `per_gpu [G, 3]` expert copies from the
    same GPU (over HBM, read and written), its node (NVLink) and other nodes (RDMA): the
    slowest GPU decides (0 when nothing moves)."""
    seconds = np.asarray(per_gpu, np.float64) * expert_bytes / np.array(
        [device.hbm / 2, device.nvlink, device.rdma])
    return float(seconds.sum(1).max(initial=0.0))
