"""A rebalance's weights moved by the engine's own updater, on ranks whose weights say whose
they are, and checked slot by slot (DESIGN.md §14).

Dimensions: `G` ranks, `L` layers, `E` logical experts, `P` physical slots, `W` tensors a
layer.

`migrate(engine, old, new, ...)` builds every rank's weights for the old placement
(`weights.rank_weights`), hands each rank's list to the engine's updater (`MIGRATIONS`: SGLang's
`expert_location_updater`, vLLM's `rearrange_expert_weights_inplace`), runs the ranks in one
process (`simdist.SimWorld`, threads answering torch.distributed's point-to-point calls) and
reads back what every slot holds (`weights.held`). `drop` leaves tensors out of the list the
engine is given while they stay in the weights (a tensor the updater is not told of: vLLM
#47588's shape). The result says:
- `holds [L, P]`: the expert each slot holds after the move (-1: nothing valid);
- `mismatch [L]`: slots not holding the expert the new map names (`slot_mismatch`);
- `lost`: `(layer, expert)` no slot holds;
- `sent`: the engine's point-to-point transfers `(source rank, destination rank, bytes)`,
  summed by `plan` into bytes by link class (same node over NVLink, across nodes over RDMA),
  operations, and the slowest rank's received bytes;
- `maps`: the engine's own maps after the commit (SGLang: every rank's updated
  `ExpertLocationMetadata`; vLLM: `compute_logical_maps` of the new placement).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from ..errors import InputError
from ..topology import Topology
from .simdist import SimWorld, simulated
from .weights import SHAPES, held, lost_experts, rank_weights, slot_mismatch

MIGRATIONS = {  # --migration: who moves the weights at a rebalance
    "eplbsim": "eplbsim's own migration model (moved slots priced by the cost model)",
    "sglang": "SGLang's expert_location_updater, then ExpertLocationMetadata.update",
    "vllm": "vLLM's rearrange_expert_weights_inplace over its torch.distributed communicator",
}


@dataclass
class Moved:
    """What one engine's move did (module doc)."""

    holds: torch.Tensor  # int64 [L, P]
    mismatch: torch.Tensor  # int64 [L]
    lost: list[tuple[int, int]]
    sent: list[tuple[int, int, int]]
    maps: Any = None
    weights: list = field(default_factory=list, repr=False)  # [G][L][W] after the move


def migrate(engine: str, old: torch.Tensor, new: torch.Tensor, num_experts: int,
            topology: Topology, sources: Any = (), shapes: Sequence[Sequence[int]] = SHAPES,
            chunks: Sequence[Sequence[int]] | None = None, drop: Sequence[int] = (),
            weights: list | None = None) -> Moved:
    """Move the weights of placement `old [L, P]` to `new [L, P]` with `engine`'s updater
    ("sglang" or "vllm", from `sources`), every rank of `topology` simulated in this process;
    `chunks` (SGLang) the layer ids each update call takes in turn (default: all at once);
    `drop` the indices of tensors left out of what the engine is given; `weights` the ranks'
    weights `[G][L][W]` to move in place (default: fresh ones holding `old`)."""
    from ..engines import adapter
    if engine not in ("sglang", "vllm"):
        raise InputError(f"unknown migration {engine!r}; the engines' own: sglang, vllm")
    old, new = old.long(), new.long()
    if old.shape != new.shape:
        raise InputError(f"old and new placements differ in shape: {tuple(old.shape)} and "
                         f"{tuple(new.shape)}")
    G = topology.num_gpus
    L, P = old.shape
    if weights is None:
        weights = rank_weights(old, num_experts, G, shapes)
    given = [[[t for i, t in enumerate(layer) if i not in set(drop)] for layer in rank]
             for rank in weights]
    if not given[0][0]:
        raise InputError("drop leaves the engine no tensor to move")
    world = SimWorld(G)
    run = adapter(engine, sources)
    if engine == "sglang":
        maps = _sglang(run, old, new, num_experts, topology, given, chunks, world)
    else:
        maps = _vllm(run, old, new, num_experts, given, world)
    holds = held(weights, num_experts)
    return Moved(holds, slot_mismatch(holds, new), lost_experts(holds, num_experts),
                 list(world.sent), maps, weights)


def _sglang(run: Any, old: torch.Tensor, new: torch.Tensor, num_experts: int,
            topology: Topology, given: list, chunks: Any, world: SimWorld) -> list:
    from ..engines.sglang import Layout
    from ..engines.sglang_updater import metadata, move_rank
    run.need("updater")
    L, P = old.shape
    layout = Layout(L, num_experts, P, topology.num_gpus, topology.num_nodes)
    ranks = range(topology.num_gpus)
    olds, news = metadata(run, layout, old, ranks), metadata(run, layout, new, ranks)
    chunks = [list(range(L))] if chunks is None else chunks
    updater = run.role("updater")
    with run.modules.active(), simulated(world, [updater]):
        world.run(lambda r: move_rank(run, layout, olds[r], news[r], given[r], chunks, r))
    return olds


def _vllm(run: Any, old: torch.Tensor, new: torch.Tensor, num_experts: int, given: list,
          world: SimWorld) -> tuple[torch.Tensor, torch.Tensor]:
    from ..engines.vllm_rearrange import modules, move_rank
    loaded = modules(run)
    group = SimpleNamespace(size=lambda: world.world_size, rank=world.get_rank)
    with run.modules.active(), simulated(world, loaded):
        world.run(lambda r: move_rank(run, loaded, old, new, given[r], group))
    return run.logical_maps(new, num_experts)


def plan(sent: Sequence[tuple[int, int, int]], topology: Topology) -> dict[str, int]:
    """The engine's transfers summed: `nvlink_bytes` (within a node), `rdma_bytes` (across
    nodes), `p2p_ops` (sends), and `max_recv_bytes` (the rank receiving the most)."""
    per_node = topology.gpus_per_node
    recv = [0] * topology.num_gpus
    out = {"nvlink_bytes": 0, "rdma_bytes": 0, "p2p_ops": len(sent), "max_recv_bytes": 0}
    for src, dst, nbytes in sent:
        out["nvlink_bytes" if src // per_node == dst // per_node else "rdma_bytes"] += nbytes
        recv[dst] += nbytes
    out["max_recv_bytes"] = max(recv, default=0)
    return out


__all__ = ["MIGRATIONS", "Moved", "SHAPES", "migrate", "plan"]
