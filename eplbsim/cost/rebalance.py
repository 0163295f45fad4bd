"""What a rebalance costs in time (DESIGN.md §8, `sync`: serving stalls until the copies land).

Dimensions: `L` layers, `P` slots, `G` GPUs.
"""

from __future__ import annotations

import numpy as np

from .devices import DeviceProfile


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
