"""Cluster topology: which GPU and node each physical slot lives on.

Dimensions: `P` physical slots, `G` GPUs = EP ranks, `N` nodes.
Slot `p` lives on GPU `p // (P // G)`; GPU `g` is on node `g // (G // N)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.errors import InputError
from ..base.limits import MAX_GPUS, MAX_SLOTS, check_at_most


@dataclass(frozen=True)
class Topology:
    """`num_gpus` EP ranks, `gpus_per_node` of them per node (`None`: all on one node)."""

    num_gpus: int
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or isinstance(self.num_gpus, bool) \
                or self.num_gpus < 1:
            raise InputError(f"the number of GPUs must be a positive integer, got {self.num_gpus!r}")
        check_at_most(self.num_gpus, MAX_GPUS, "the number of GPUs")
        gpn = self.gpus_per_node
        if gpn is not None and (not isinstance(gpn, int) or gpn < 1):
            raise InputError(f"GPUs per node must be a positive integer, got {gpn!r}")
        if gpn is None:
            object.__setattr__(self, "gpus_per_node", self.num_gpus)
        elif self.num_gpus % gpn:
            raise InputError(
                f"{self.num_gpus} GPUs cannot be split into nodes of {gpn} GPUs "
                f"(the number of GPUs must be divisible by GPUs per node)"
            )

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node

    def slots_per_gpu(self, num_slots: int) -> int:
        """`P // G`; raises InputError unless `G` divides `P`."""
        check_at_most(num_slots, MAX_SLOTS, "the number of physical slots")
        if num_slots < self.num_gpus or num_slots % self.num_gpus:
            raise InputError(
                f"{num_slots} physical slots cannot be spread evenly over {self.num_gpus} GPUs "
                f"(the number of slots must be a positive multiple of the number of GPUs)"
            )
        return num_slots // self.num_gpus

    def slot_gpu(self, num_slots: int) -> torch.Tensor:
        """GPU of every slot, int64 `[P]`."""
        return torch.arange(num_slots, dtype=torch.int64) // self.slots_per_gpu(num_slots)

    def slot_node(self, num_slots: int) -> torch.Tensor:
        """Node of every slot, int64 `[P]`."""
        return self.slot_gpu(num_slots) // self.gpus_per_node

    def node_of_gpu(self, gpu: int) -> int:
        return gpu // self.gpus_per_node
