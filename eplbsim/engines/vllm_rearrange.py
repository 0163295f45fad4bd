"""vLLM's own rebalance, run on simulated ranks (DESIGN.md §14): the weights moved by
`rebalance_execute.rearrange_expert_weights_inplace` (its per-layer `move_to_buffer` plan,
local copies into the buffers, point-to-point sends and receives through the communicator,
then `move_from_buffer`), over vLLM's `TorchDistNcclEplbCommunicator` (torch.distributed's
`batch_isend_irecv` on the EP group: what `create_eplb_communicator` picks for its default
"torch_nccl" backend, on the CPU group when the weights are on the CPU).

Dimensions: `G` ranks, `L` layers, `P` physical slots, `W` tensors a layer.

`move_rank` is what one rank runs; `group` is its EP group (`size()`, `rank()`); the world
behind `torch.distributed` answers its point-to-point calls (`migration.simdist.SimWorld` in one
process, or real processes). The maps the next step dispatches with are vLLM's
`compute_logical_maps` of the new placement (`VLLM.logical_maps`), as `eplb_state` commits them
after the move in its synchronous path.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.errors import InputError
from .identity import Identity
from .source import call
from .vllm import VLLM

REBALANCE = "vllm.distributed.eplb.rebalance_execute"
COMMUNICATOR = "vllm.distributed.eplb.eplb_communicator"


def modules(run: VLLM) -> tuple[Any, Any]:
    """vLLM's rebalance module and its communicator module, loaded from `run`'s source."""
    try:
        return run.modules.load(REBALANCE), run.modules.load(COMMUNICATOR)
    except InputError:
        raise
    except Exception as exc:  # a release whose modules do not load here: say why
        raise InputError(f"{run.label}: {REBALANCE} does not load ({type(exc).__name__}: "
                         f"{exc})") from None


def move_rank(run: VLLM, loaded: tuple[Any, Any], old: torch.Tensor, new: torch.Tensor,
              weights: list, group: Any, rank_mapping: dict[int, int] | None = None) -> None:
    """Rank `group.rank()`'s part of vLLM's rebalance from `old [L, P]` to `new [L, P]`: its
    weights `[L][W]` moved in place (module doc), with buffers shaped as its first layer's;
    `loaded` is `modules(run)`, loaded beforehand (ranks in threads import nothing);
    `rank_mapping` (old rank -> new rank) for elastic EP, as vLLM takes it."""
    rebalance, comm = loaded
    if not hasattr(rebalance, "rearrange_expert_weights_inplace"):
        raise InputError(f"{run.label}: {REBALANCE} has no rearrange_expert_weights_inplace")
    communicator = comm.TorchDistNcclEplbCommunicator(group)
    buffers = [torch.empty_like(t) for t in weights[0]]
    with run.as_rank(Identity(group.rank(), group.size()), "rearrange_expert_weights_inplace"):
        call(rebalance.rearrange_expert_weights_inplace, run.label,
             old_global_expert_indices=old, new_global_expert_indices=new,
             expert_weights=weights, expert_buffer=buffers, ep_group=group,
             communicator=communicator, rank_mapping=rank_mapping)
