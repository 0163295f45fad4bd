"""The ground the rank step (`ranks.MODES`) stands on: the EP ranks of a group and their
counter-based streams (`Rank`, `make_ranks`, `rank_context`), which of them provably choose
alike (`rank_groups`), how the processes of a group combine tensors (`Collectives`, `LOCAL`),
and the `Epoch`, what the steps served by one placement share for the ranks a process holds
(with a table policy's tables counted once for it, `Table`).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs = EP ranks, `W`
processes of a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..base import loops
from ..base.errors import InputError
from ..dispatch import DispatchContext, DispatchPolicy
from ..dispatch.kernels.cpu import StreamedViews
from ..dispatch.observe import observed_groups
from ..dispatch.spill import Site
from ..dispatch.streams import Stream, coin_hits, stream_key
from ..placement import Placement, View
from . import counting
from .moe import ToyMoE, device_square_sums, square_sums

RNG_RELATIONS = ("independent", "shared", "drift")


@dataclass(frozen=True)
class Collectives:
    """How the processes of a group combine tensors: `all_reduce` sums a tensor over them,
    `all_gather` stacks one from each, `[...] -> [W, ...]` in rank order."""

    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    all_gather: Callable[[torch.Tensor], torch.Tensor]


# One process holding every rank: nothing to combine.
LOCAL = Collectives(all_reduce=lambda t: t, all_gather=lambda t: t.unsqueeze(0))


@dataclass(frozen=True, eq=False)
class Rank:
    """One EP rank's own state across the run: its id, the key of its counter-based stream
    (`dispatch.streams`: random and the torch-drawing policies draw from it) and, for the rng
    relation "drift", the key of its coin, which before each step decides with probability
    `drift_p` whether the rank consumes one extra batch of draws: from then on its draws sit one
    layer further along the stream (its shift, the coin's hits so far)."""

    rank: int
    key: int
    coin: int | None = None
    drift_p: float = 0.0
    _shifts: list = field(default_factory=list, repr=False)  # cache: cumulative hits [S']

    def drifted(self, step: int) -> bool:
        """Whether the rank's coin hit before step `step`."""
        return self.shift(step) > (self.shift(step - 1) if step else 0)

    def shift(self, step: int) -> int:
        """The coin's hits before steps `0 .. step` (0 without a coin)."""
        if self.coin is None:
            return 0
        if not self._shifts or len(self._shifts[0]) <= step:  # extended by doubling
            stop = max(step + 1, 2 * len(self._shifts[0]) if self._shifts else 64)
            self._shifts[:] = [np.cumsum(coin_hits(self.coin, self.drift_p, stop))]
        return int(self._shifts[0][step])

    def stream(self, step: int) -> Stream:
        """Where the rank draws in step `step`."""
        return Stream(self.key, step, self.shift(step))


def make_ranks(relation: str, seed: int, num_ranks: int, ranks: Sequence[int] | None = None,
               drift_p: float = 0.0) -> tuple[Rank, ...]:
    """Ranks whose streams are related as `independent` (rank `r` keyed from `(seed, r)`),
    `shared` (all keyed from `seed`) or `drift` (as shared, plus coins keyed from
    `(seed, r, 1)` hitting with probability `drift_p`). `ranks` (default all) picks whose to
    make: a real rank makes only its own, equal to the simulation's rank."""
    if relation not in RNG_RELATIONS:
        raise InputError(f"unknown rng relation {relation!r}; choose one of "
                         f"{', '.join(RNG_RELATIONS)}")
    return tuple(Rank(r, stream_key(seed, r) if relation == "independent" else stream_key(seed),
                      stream_key(seed, r, 1) if relation == "drift" else None, drift_p)
                 for r in (range(num_ranks) if ranks is None else ranks))


def rank_context(step: int, rank: Rank, mode: str, seed: int,
                 rank_offset: bool | None, tp: int = 1) -> DispatchContext:
    """The context `rank` dispatches step `step` with (layer 0; step kernels set the layer)."""
    return DispatchContext(step=step, layer=0, rank=rank.rank, seed=seed,
                           stream=rank.stream(step), mode=mode, rank_offset=rank_offset, tp=tp)


def rank_groups(views: Sequence[View], policy: DispatchPolicy,
                rank_offset: bool | None = None,
                contexts: Sequence[DispatchContext] | None = None,
                top_k: int = 1) -> tuple[tuple[int, ...], ...]:
    """Positions of `views` whose choices are provably identical, in order: for a policy
    rank-invariant under `rank_offset` (`DispatchPolicy.invariant`), ranks with equal views;
    for one whose invariance is observed (`DispatchPolicy.observed`, given the ranks'
    `contexts` in "none" and the trace's `top_k`), ranks of equal inputs when its calls draw
    nothing (`dispatch.observe.observed_groups`); for every other one, one rank a group."""
    if policy.observed is not None and contexts is not None and contexts[0].mode == "none":
        return observed_groups(views, contexts, policy, top_k)
    if not policy.invariant(rank_offset):
        return tuple((i,) for i in range(len(views)))
    groups: list[list[int]] = []
    for i, view in enumerate(views):
        for group in groups:
            first = views[group[0]]
            if torch.equal(first.log2phy, view.log2phy) and torch.equal(first.logcnt,
                                                                        view.logcnt):
                group.append(i)
                break
        else:
            groups.append([i])
    return tuple(map(tuple, groups))


@dataclass(frozen=True, eq=False, kw_only=True)
class Epoch:
    """What the steps served by one placement share, for the ranks this process holds.

    name, policy: the policy's reported name and its registry entry
    placement:    the placement in service; `views[i]` is what `ranks[i]` knows of it
    groups:       positions in `ranks` with provably identical choices (`rank_groups`)
    num_ranks:    `G`, the group's ranks over every process
    mode, seed, rank_offset: the run's dispatch settings
    moe:          the toy MoE layer whose output error "none" measures (None: not measured)
    comm:         how this process's counts combine with the others'
    keep_choices: return every held rank's choices (the checkers read them)
    fast:         count with compiled loops where that is possible (`ranks`)
    count_links:  count each step's fan-out (`fanout`: the GPUs and nodes each token's executed
                  choices reach) and, in "a2a", its token crossings between GPUs and nodes
                  (what the cost model's communication reads)
    slot_experts: int64 `[L, P]` the expert whose weights each slot holds (-1: nothing
                  valid), when a pair may run on a slot holding another expert than its own
                  (`migration.replayed.serving_stretches`): ranks serving different placements
                  (a switch in progress, `schedule.switch`: `views[i]` is then of the placement
                  rank `i` serves, `placement` the new one), what an engine's updater left
                  (`--migration`), old weights under new maps (`--map-lead`), or the serving
                  placement itself for a policy that reroutes (`DispatchPolicy.reroutes`). "a2a"
                  counts the pairs sent to a slot holding another expert, and "none" computes
                  each executed pair with the weights of the slot it ran on (the output error
                  then counts a wrong slot's output). None when every pair runs on a slot
                  holding its expert
    shared:       count where each token's shared-expert work runs (`StepOutcome.shared`)
    tp:           the attention tensor-parallel size (`DispatchContext.tp`)
    spill_slack:  a spill policy's capacity above exact balance (`dispatch.spill.capacity`)
    resident:     the replay keeps the steps' counts on their device (`replay.dispatch_steps`):
                  "none" sums the toy layer's error squares there too (`moe.device_square_sums`,
                  NaN where it cannot be exact there: the replay redoes those steps without)
    """

    name: str
    policy: DispatchPolicy
    placement: Placement
    ranks: tuple[Rank, ...]
    views: tuple[View, ...]
    groups: tuple[tuple[int, ...], ...]
    num_ranks: int
    mode: str
    seed: int = 0
    rank_offset: bool | None = None
    moe: ToyMoE | None = None
    comm: Collectives = LOCAL
    keep_choices: bool = False
    fast: bool = False
    count_links: bool = False
    slot_experts: torch.Tensor | None = None
    shared: bool = False
    tp: int = 1
    spill_slack: float = 0.0
    resident: bool = False

    def drifted(self, step: int) -> torch.Tensor:
        """Whether each held rank's coin hit before step `step`, bool `[len(ranks)]` (CPU)."""
        return torch.tensor([rank.drifted(step) for rank in self.ranks], dtype=torch.bool)

    def context(self, step: int, i: int) -> DispatchContext:
        """The context held rank `i` dispatches step `step` with (`rank_context`)."""
        return rank_context(step, self.ranks[i], self.mode, self.seed, self.rank_offset, self.tp)

    @property
    def device(self) -> torch.device:
        """The device the epoch's views (and so its collectives' tensors) live on."""
        return self.views[0].log2phy.device

    def counts_fast(self, device: torch.device) -> bool:
        """Whether this epoch's steps on `device` are counted by the compiled loops."""
        return (self.fast and device.type == "cpu" and self.comm is LOCAL
                and len(self.ranks) == self.num_ranks and not self.keep_choices
                and self.slot_experts is None
                and (self.policy.spill is None or self.mode == "a2a" or len(self.groups) == 1))

    @cached_property
    def site(self) -> Site:
        """What a spill policy's plan reads of the placement (`dispatch.spill.Site`)."""
        return Site.of(self.placement)

    @cached_property
    def place_gpu(self) -> torch.Tensor:
        """The GPU of every place a pair may run at, int64 `[P + G]`: each slot's, then GPU `g`
        for place `P + g` (fetched weights, `dispatch.spill`)."""
        return torch.cat([self.placement.slot_gpu.long(), torch.arange(self.num_ranks)])

    @property
    def num_places(self) -> int:
        """Places a pair may run at: `P`, and `P + G` for a spill policy (`place_gpu`)."""
        extra = self.num_ranks if self.policy.spill is not None else 0
        return self.placement.num_slots + extra

    def gpu_of(self, phys: torch.Tensor) -> torch.Tensor:
        """The GPU of each place `phys [...]` (slots, or `place_gpu`'s places for a spill
        policy), int64 `[...]`, -1 where `phys` is -1."""
        gpus = self._on(phys.device)["gpus"]
        return torch.where(phys >= 0, gpus[phys.clamp(min=0)], -1)

    def members(self, device: torch.device) -> list[torch.Tensor]:
        """For each group of `groups`, bool `[G + 1]` on `device`: True at the GPUs of its
        ranks (index -1, padding's GPU, never)."""
        return self._on(device)["members"]

    def _on(self, device: torch.device) -> dict[str, Any]:
        """What the steps index on `device`, copied there once an epoch (a copy a step would
        be a host round trip a step): the places' GPUs and the groups' members."""
        key = str(device)
        if key not in self._device_tables:
            gpus = self.place_gpu if self.policy.spill is not None else self.placement.slot_gpu
            members = torch.zeros(len(self.groups), self.num_ranks + 1, dtype=torch.bool)
            for n, group in enumerate(self.groups):
                members[n, [self.ranks[i].rank for i in group]] = True
            self._device_tables[key] = {"gpus": gpus.long().to(device),
                                        "members": list(members.to(device))}
        return self._device_tables[key]

    @cached_property
    def _device_tables(self) -> dict[str, dict[str, Any]]:
        return {}

    @property
    def squares(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """How the toy layer's error squares are summed: on the device for a `resident`
        replay (`moe.device_square_sums`), else exactly on the host (`moe.square_sums`)."""
        return device_square_sums if self.resident else square_sums

    @property
    def executes_once(self) -> bool:
        """Whether every valid pair of a step is provably executed exactly once in "none":
        one group of identical ranks holding every rank, in this one process, each pair on
        a slot of its own expert (`fast` then leaves the toy layer's exact norm to the caller,
        as the compiled counts do)."""
        return (self.fast and self.comm is LOCAL and len(self.groups) == 1
                and len(self.ranks) == self.num_ranks and self.slot_experts is None)

    @cached_property
    def _scratch(self) -> list[np.ndarray]:
        return []

    def scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        """An int64 array of `shape`, the same memory at every step of the epoch (what a step's
        fast count consumes before the next: a fresh array of tens of MB a step costs more in
        page faults than the dispatch that fills it)."""
        n = int(np.prod(shape))
        if not self._scratch or self._scratch[0].size < n:
            self._scratch[:] = [np.empty(n, np.int64)]
        return self._scratch[0][:n].reshape(shape)

    @cached_property
    def streamed(self) -> StreamedViews:
        """The views arranged for counting a streamed policy (`DispatchPolicy.streamed`)."""
        return StreamedViews.of(list(self.views), self.placement.slot_gpu)

    @cached_property
    def table(self) -> "Table":
        """The policy's tables counted once for the epoch (policies with a `table`)."""
        return Table.of(self)


@dataclass(frozen=True, eq=False)
class Table:
    """A table policy's choices for one epoch, counted per (layer, expert) once.

    tables:    int32 `[G, L, E]` each rank's table (`DispatchPolicy.table`), ranks in order
    executed:  bool `[G, L, E]` the rank's table slot is on its own GPU (it executes the pairs
               in "none")
    times:     int32 `[L, E]` ranks that execute an expert's pairs in "none" (`c` of each pair)
    agree:     bool `[L, E]` every rank chooses the same slot for the expert
    num_slots: `P`
    """

    tables: np.ndarray
    executed: np.ndarray
    times: np.ndarray
    agree: np.ndarray
    num_slots: int

    @classmethod
    def of(cls, epoch: Epoch) -> "Table":
        """Every rank's table of `epoch` (every rank held, in rank order), counted."""
        tables = torch.stack([epoch.policy.table(view, epoch.context(0, i)).cpu()
                              for i, view in enumerate(epoch.views)]).numpy().astype(np.int32)
        G = tables.shape[0]
        executed = epoch.placement.slot_gpu.numpy()[tables] == np.arange(G).reshape(G, 1, 1)
        return cls(tables, executed, executed.sum(0, dtype=np.int32),
                   (tables == tables[0]).all(0), epoch.placement.num_slots)

    def sent_loads(self, ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """"a2a" pairs per (layer, slot), int64 `[L, P]`, of a step's ids `[T, L, K]` whose
        rank `r` owns rows `offsets[r]:offsets[r + 1]`: each rank sends its pairs of an expert
        to its table's slot, where they are executed once."""
        return counting.sent_loads(self.tables, ids, offsets, self.num_slots)

    def count(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(slot_load [L, P], counts [L, 3], agreed [L])`, int64, of a step's ids
        `[T, L, K]`, from its expert counts alone."""
        n = loops.expert_counts(ids, np.array([0, ids.shape[0]]), self.times.shape[1])[0]
        slot_load = counting.table_loads(self.tables, n, self.executed, self.num_slots)
        c = self.times  # [L, E]
        counts = np.stack([(n * (c == 0)).sum(1), (n * (c == 1)).sum(1),
                           (n * (c >= 2)).sum(1)], 1)
        return slot_load, counts, (n * self.agree).sum(1)

    def multiplicity(self, ids: np.ndarray) -> np.ndarray:
        """Times each pair of `ids [T, L, K]` is executed, int32 `[T, L, K]` (0 at padding)."""
        return loops.pair_table(self.times, ids)
