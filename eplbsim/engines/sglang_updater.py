"""SGLang's own rebalance, run on simulated ranks (DESIGN.md §14): the weights moved by
`expert_location_updater._update_expert_weights` (its temp buffers, its point-to-point plan and
`batch_isend_irecv`, its canary mode when `SGLANG_EXPERT_LOCATION_UPDATER_CANARY` is set), layer
chunk by layer chunk as `eplb_manager.EPLBManager.rebalance` hands them over, each chunk followed
by the map commit `ExpertLocationMetadata.update(new, update_layer_ids)`: the two steps of
`ExpertLocationUpdater.update`, called here directly because that method reads the global
metadata where a serving process keeps one (eplbsim keeps one a rank).

Dimensions: `G` ranks, `L` layers, `P` physical slots, `W` tensors a layer.

Each rank starts from the metadata `init_by_mapping` builds for the old placement and is handed
the one it builds for the new placement (`SGLang.startup`), as after a rebalance to a given
mapping. `move_rank` is what one rank runs; `world` answers its point-to-point calls: a
`migration.simdist.SimWorld` of threads in one process, or real `torch.distributed` processes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .sglang import SGLang


def metadata(run: SGLang, layout: Any, phy2log: torch.Tensor, ranks: Sequence[int]
             ) -> list[Any]:
    """`init_by_mapping` metadata of `phy2log [L, P]` for each of `ranks`."""
    return [run.startup(layout, phy2log, rank) for rank in ranks]


def move_rank(run: SGLang, layout: Any, old: Any, new: Any, weights: list,
              chunks: Sequence[Sequence[int]], rank: int) -> None:
    """Rank `rank`'s part of SGLang's rebalance: for each chunk of layer ids, its weights
    `[L][W]` moved in place by `_update_expert_weights` from `old`'s map to `new`'s, then `old`
    updated to `new` on those layers (module doc). The missing experts the updater returns
    (elastic EP, ranks lost) are none here: every rank is healthy."""
    updater = run.role("updater")
    mine = dict(enumerate(weights))
    with run.as_rank(layout, rank, "_update_expert_weights"):  # every channel answers `rank`
        for chunk in chunks:
            layers = [int(x) for x in chunk]
            updater._update_expert_weights(
                routed_experts_weights_of_layer=mine, old_expert_location_metadata=old,
                new_expert_location_metadata=new, update_layer_ids=layers,
                nnodes=layout.num_nodes, rank=rank)
            old.update(new, update_layer_ids=layers)
