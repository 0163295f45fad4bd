"""Placements (`phy2log`, the single source of truth) and the rank views derived from them.

Holds where experts live: the cluster (`topology`), placements and their views (here), the load
reductions on a placement (`loads`: GPU loads, max / mean, replica skew) and placement files in
and out (`io`). Takes in `phy2log [L, P]` and a `Topology`; gives out `Placement`, `View` and
load tensors. Imports `base` only.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs = EP ranks,
`R` max replicas of one expert.

- `phy2log [L, P]`: logical expert held by each slot, -1 for an empty slot (one that holds no
  expert, so that layers spending different numbers of redundant slots share one shape).
- `logcnt [L, E]`: replicas per expert (>= 1); empty slots count for no expert.
- `log2phy [L, E, R]`: replica slots of each expert in ascending physical id, padded with -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from ..base.errors import InputError
from ..base.registry import lookup
from .topology import Topology


@dataclass(frozen=True, eq=False)
class Placement:
    """A validated placement: `phy2log [L, P]` over `num_experts` experts on `topology`.

    Every expert has at least one replica in every layer and `G` divides `P`; a slot may be
    empty (-1: it holds no expert, receives no pair and carries no load), so layers with
    different numbers of redundant replicas keep one shape `[L, P]`. The maps below are
    derived on first use and never taken from a solver. `order`, when given, is the order in
    which a solver published each expert's replicas (`[L, E, R]`, -1 padded: what SGLang's
    ranks hold after `init_by_eplb`, at a rebalance or from counts at start-up; read by the
    `sglang` view); None for a placement given as a mapping (`init_by_mapping`).

    `partial` lets an expert have no replica (`lost`) and the slots be fewer than the experts:
    the survivors' placement after EP ranks die (DESIGN.md §16). A run masks a lost expert's
    pairs (-1) before dispatch (`replay.dead_ranks`), so no pair ever asks for it; the views
    list it with one candidate, -1 (`rank_view`), so a policy's arithmetic on padding never
    divides by zero.
    """

    phy2log: torch.Tensor
    num_experts: int
    topology: Topology
    order: torch.Tensor | None = None
    partial: bool = False

    def __post_init__(self) -> None:
        try:
            p2l = torch.as_tensor(self.phy2log)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(f"phy2log is not an integer array ({exc})") from None
        if p2l.is_floating_point() or p2l.dtype == torch.bool:
            raise InputError(f"phy2log must hold integers, got dtype {p2l.dtype}")
        if p2l.dim() != 2:
            raise InputError(f"phy2log must have shape [layers, slots], got {tuple(p2l.shape)}")
        L, P = p2l.shape
        E = self.num_experts
        if P < E and not self.partial:
            raise InputError(f"{P} physical slots are fewer than the {E} logical experts: "
                             f"every expert needs at least one slot")
        self.topology.slots_per_gpu(P)
        p2l = p2l.detach().to("cpu", torch.int64, copy=True)
        if p2l.numel() and (int(p2l.min()) < -1 or int(p2l.max()) >= E):
            raise InputError(f"phy2log holds expert ids outside [0, {E}) (-1: an empty slot)")
        counts = _replica_counts(p2l, E)
        if (counts == 0).any() and not self.partial:
            layer, expert = (counts == 0).nonzero()[0].tolist()
            raise InputError(f"expert {expert} has no replica in layer {layer} of the placement")
        object.__setattr__(self, "phy2log", p2l)
        if self.order is not None:
            object.__setattr__(self, "order", self._checked_order(self.order))

    def _checked_order(self, order: Any) -> torch.Tensor:
        """`order` as int64 `[L, E, R]`: each expert's replica slots in some order, -1 padded
        at the end; InputError otherwise."""
        order = torch.as_tensor(order).to("cpu", torch.int64)
        R = int(self.logcnt.max())
        if order.dim() != 3 or order.shape[:2] != self.logcnt.shape or order.shape[2] < R:
            raise InputError(f"a replica order must have shape [layers, experts, >= {R}], got "
                             f"{tuple(order.shape)}")
        order = order[..., :R]
        ranked = torch.where(order < 0, self.num_slots, order).sort(-1).values
        if not torch.equal(torch.where(ranked == self.num_slots, -1, ranked), self.log2phy) \
                or ((order < 0).long().diff(dim=-1) < 0).any():
            raise InputError("a replica order must list each expert's replica slots, then -1")
        return order.contiguous()

    def __repr__(self) -> str:
        t = self.topology
        return (f"Placement(L={self.num_layers}, E={self.num_experts}, P={self.num_slots} on "
                f"{t.num_gpus} GPUs ({t.gpus_per_node}/node), up to "
                f"{int(self.logcnt.max())} replicas of an expert)")

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @cached_property
    def filled(self) -> torch.Tensor:
        """Slots that hold an expert (not -1), bool `[L, P]`."""
        return self.phy2log >= 0

    @cached_property
    def has_empty(self) -> bool:
        """True when some slot of some layer is empty (-1)."""
        return not bool(self.filled.all())

    @cached_property
    def sink_index(self) -> torch.Tensor:
        """`phy2log` with each empty slot sent to a sink bucket `E`, int64 `[L, P]`: the index
        of a scatter of slot values into `E + 1` buckets, whose last is then dropped."""
        return torch.where(self.filled, self.phy2log, self.num_experts)

    @cached_property
    def logcnt(self) -> torch.Tensor:
        """Replicas per expert, int64 `[L, E]` (empty slots count for none)."""
        return _replica_counts(self.phy2log, self.num_experts)

    @cached_property
    def lost(self) -> torch.Tensor:
        """Experts with no replica, bool `[L, E]` (none unless `partial`)."""
        return self.logcnt == 0

    @cached_property
    def log2phy(self) -> torch.Tensor:
        """Replica slots of each expert in ascending physical id, -1 padded, int64 `[L, E, R]`
        (an empty slot is no expert's replica)."""
        L, P = self.phy2log.shape
        E = self.num_experts
        key = self.sink_index * P + torch.arange(P)  # empty slots sort last
        order = torch.argsort(key, dim=1)  # [L, P] slots by expert
        expert = torch.gather(self.sink_index, 1, order)  # [L, P] ascending, E for empty
        start = torch.cumsum(self.logcnt, 1) - self.logcnt  # [L, E] first index of each expert
        kept = expert < E  # [L, P] the filled slots, first in each row
        expert = expert.clamp(max=E - 1)
        replica = torch.arange(P) - torch.gather(start, 1, expert)  # [L, P]
        out = torch.full((L, E, int(self.logcnt.max())), -1, dtype=torch.int64)
        rows = torch.arange(L).view(L, 1).expand(L, P)
        out[rows[kept], expert[kept], replica[kept]] = order[kept]
        return out

    @cached_property
    def slot_gpu(self) -> torch.Tensor:
        """GPU of every slot, int64 `[P]`."""
        return self.topology.slot_gpu(self.num_slots)

    @cached_property
    def slot_node(self) -> torch.Tensor:
        """Node of every slot, int64 `[P]`."""
        return self.topology.slot_node(self.num_slots)

    def expected_load(self, load: torch.Tensor) -> torch.Tensor:
        """The placement's promise: each expert's load split evenly over its replicas.

        load: `[..., L, E]` pairs per logical expert -> `[..., L, P]` float64 load per slot
        (0 on an empty slot).
        """
        per_replica = load.to(torch.float64) / self.logcnt.to(torch.float64)
        per_replica = torch.cat([per_replica, per_replica.new_zeros(*per_replica.shape[:-1], 1)],
                                -1)  # [..., L, E + 1]: the sink bucket of empty slots is 0
        index = self.sink_index.expand(*per_replica.shape[:-1], self.num_slots)
        return torch.gather(per_replica, -1, index)


def _replica_counts(phy2log: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots holding each expert: int64 `[L, P]` ids in `[-1, E)` -> int64 `[L, E]` (an empty
    slot, -1, counts for none)."""
    filled = phy2log >= 0
    return torch.zeros(phy2log.shape[0], num_experts, dtype=torch.int64).scatter_add_(
        1, phy2log.clamp(min=0), filled.to(torch.int64))


def empty_layers(phy2log: Any) -> list[int]:
    """The layers of `phy2log [L, P]` (array-like) with an empty slot (-1), ascending."""
    return (torch.as_tensor(phy2log) < 0).any(-1).nonzero().flatten().tolist()


def refuse_empty_slots(phy2log: Any, what: str, which: str = "the placement") -> None:
    """InputError in one line when `phy2log [L, P]` (a Placement's or array-like) has an empty
    slot, for `what` (an engine's file or code) that requires every slot to hold an expert, equal
    slots in every layer, as SGLang and vLLM do; the line names `which` placement and the
    layers with empty slots (the first 8)."""
    if isinstance(phy2log, Placement):
        phy2log = phy2log.phy2log
    layers = empty_layers(phy2log)
    if layers:
        shown = ", ".join(map(str, layers[:8])) + (f" and {len(layers) - 8} more"
                                                   if len(layers) > 8 else "")
        raise InputError(f"{what} requires every slot to hold an expert, equal slots in every "
                         f"layer; {which} has empty slots (-1) in layer"
                         f"{'s' if len(layers) > 1 else ''} {shown}")


def trivial_placement(num_layers: int, num_experts: int, num_slots: int,
                      topology: Topology, filled: int | None = None) -> Placement:
    """Slot `p` holds logical expert `p % E` in every layer; with `filled`, the slots from
    `filled` on are empty (-1)."""
    slots = torch.arange(num_slots)
    p2l = torch.where(slots < (num_slots if filled is None else filled), slots % num_experts, -1)
    return Placement(p2l.expand(num_layers, num_slots), num_experts, topology)


# Dimension legend for views: `L` layers, `E` experts, `R` max candidates.
@dataclass(frozen=True, eq=False)
class View:
    """What one rank knows of a placement: candidate replicas per expert.

    log2phy:   int64 `[L, E, R]` candidate slots in ascending physical id, -1 padded
    logcnt:    int64 `[L, E]` number of candidates (>= 1)
    placement: the full placement the view was derived from
    rank:      the rank whose view this is (None for the rank-independent full view)
    """

    log2phy: torch.Tensor
    logcnt: torch.Tensor
    placement: Placement
    rank: int | None = None

    def __repr__(self) -> str:
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        return f"View({who}, up to {self.log2phy.shape[-1]} candidates, of {self.placement!r})"

    def to(self, device: torch.device | str) -> "View":
        return View(self.log2phy.to(device), self.logcnt.to(device), self.placement, self.rank)


def full_view(placement: Placement, rank: int | None = None, mode: str = "none") -> View:
    """Every replica of every expert in ascending slot id, the same on every rank and mode."""
    return View(placement.log2phy, placement.logcnt, placement, rank)


def sglang_0_5_14_view(placement: Placement, rank: int, mode: str = "none") -> View:
    """SGLang 0.5.14's (and 0.5.15's) candidate lists on `rank`, before its fix (DESIGN.md
    §3), equal to the engine's own (`eplbsim engines conform --engine-source sglang==0.5.14`);
    the same in every mode. A placement a solver published: every replica in its order (as
    `sglang_view`). A placement given as a mapping, for each expert: the lowest-id replica on
    this rank's GPU if any; else the lowest-id replica on its node if any; else all
    replicas."""
    if placement.order is not None:
        return View(placement.order, placement.logcnt, placement, rank)
    on_gpu, on_node = _local(placement, rank)
    return _narrowed(placement, rank, on_gpu, _first_where(placement.log2phy, on_node))


def sglang_0_5_16_view(placement: Placement, rank: int, mode: str = "none") -> View:
    """SGLang 0.5.16's candidate lists on `rank`, the last release before its fix (PR
    #32962), equal to the engine's own: `sglang_view`, but a placement given as a mapping is
    narrowed as with an a2a backend in every mode, so ranks without one choose from different
    lists."""
    return sglang_view(placement, rank, "a2a")


def sglang_view(placement: Placement, rank: int, mode: str = "none") -> View:
    """SGLang 0.5.23's candidate lists on `rank` (0.5.17's on), equal to the engine's own
    (`eplbsim engines conform`). A placement a solver published (it has an `order`, as after
    `init_by_eplb`): every replica in that order, on every rank and in every mode. A placement
    given as a mapping (`init_by_mapping`):

    Without an a2a backend (mode "none") every replica, in ascending slot id. With one ("a2a"),
    per expert: the lowest-id replica on the rank's GPU if any; else the lowest-id one on its
    node when the node holds some but not all of the expert's replicas; else all replicas.
    """
    if placement.order is not None:
        return View(placement.order, placement.logcnt, placement, rank)
    if mode == "none":
        return full_view(placement, rank)
    return _nearest(placement, rank)


def _nearest(placement: Placement, rank: int) -> View:
    """Per expert: the lowest-id replica on `rank`'s GPU if any; else the lowest-id one on its
    node when the node holds some but not all of the expert's replicas; else all replicas."""
    on_gpu, on_node = _local(placement, rank)
    same_node = on_node.sum(-1)  # [L, E]
    narrows = (same_node > 0) & (same_node < placement.logcnt)
    return _narrowed(placement, rank, on_gpu,
                     torch.where(narrows, _first_where(placement.log2phy, on_node), -1))


def _local(placement: Placement, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which replicas of `log2phy [L, E, R]` are on `rank`'s GPU and on its node: bool
    `[L, E, R]` each; InputError for a rank outside the topology."""
    topo = placement.topology
    if not 0 <= rank < topo.num_gpus:
        raise InputError(f"rank {rank} is outside [0, {topo.num_gpus})")
    log2phy = placement.log2phy
    valid = log2phy >= 0
    safe = log2phy.clamp(min=0)
    return (valid & (placement.slot_gpu[safe] == rank),
            valid & (placement.slot_node[safe] == topo.node_of_gpu(rank)))


def _narrowed(placement: Placement, rank: int, on_gpu: torch.Tensor,
              fallback: torch.Tensor) -> View:
    """`rank`'s view keeping, per expert, only its first replica on the rank's GPU, else the
    slot `fallback [L, E]` names, else (-1) every replica."""
    log2phy = placement.log2phy  # [L, E, R]
    gpu_first = _first_where(log2phy, on_gpu)  # [L, E], -1 when none
    single = torch.where(gpu_first >= 0, gpu_first, fallback)  # [L, E]
    narrowed = torch.full_like(log2phy, -1)
    narrowed[..., 0] = single
    out = torch.where((single >= 0).unsqueeze(-1), narrowed, log2phy)
    cnt = torch.where(single >= 0, torch.ones_like(placement.logcnt), placement.logcnt)
    return View(out, cnt, placement, rank)


def atom_view(placement: Placement, rank: int, mode: str = "none") -> View:
    """ROCm ATOM's per-rank dispatch lists (`_build_rank_dispatch_map` in
    `atom/model_ops/eplb.py` @ 05c3036dd41f, ATOM #1210), in every mode: per expert, the
    lowest-id replica on the rank's GPU if any (ATOM takes the first in its replica order;
    both are on the GPU, so the GPU loads agree), else every replica (ATOM's -1 sentinel: the
    rank spreads its tokens over the replicas by a hash of the token index). Rank-variant in
    "none" mode, as the engine builds it."""
    on_gpu, _ = _local(placement, rank)
    return _narrowed(placement, rank, on_gpu, torch.full_like(placement.logcnt, -1))


def _first_where(log2phy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The first (lowest-id) slot of `log2phy [L, E, R]` where `mask`, -1 where none: `[L, E]`."""
    idx = torch.argmax(mask.to(torch.int8), dim=-1, keepdim=True)
    first = torch.gather(log2phy, -1, idx).squeeze(-1)
    return torch.where(mask.any(-1), first, torch.full_like(first, -1))


# name -> `(placement, rank, mode) -> View`
VIEWS: dict[str, Callable[[Placement, int, str], View]] = {
    "full": full_view,
    "sglang": sglang_view,
    "sglang-0.5.14": sglang_0_5_14_view,
    "sglang-0.5.16": sglang_0_5_16_view,
    "atom": atom_view,
}


def rank_view(view: str | Callable[[Placement, int], View], placement: Placement,
              rank: int, mode: str = "none") -> View:
    """The view of `rank` in `mode`, by registry name, or a callable's `(placement, rank)`; of a
    `partial` placement, each lost expert with one candidate, -1 (`Placement`)."""
    made = view(placement, rank) if callable(view) else \
        lookup(VIEWS, view, "view")(placement, rank, mode)
    if not placement.partial:
        return made
    return View(made.log2phy, made.logcnt.clamp(min=1), placement, rank)  # lost: one -1


def as_placement(obj: Any, num_experts: int, topology: Topology) -> Placement:
    """A Placement from a Placement or a `[L, P]` array-like."""
    return obj if isinstance(obj, Placement) else Placement(obj, num_experts, topology)
