"""What the metrics read: the ranks' `Counters` of a run and `Chunk`s, stretches of steps on
one placement with their executed and routed loads, and the GPU work time prices.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `c` steps
of a chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Iterator, Sequence

import torch

from .. import cost
from ..cost.comm import layer_comm_seconds, spill_seconds
from ..cost.rebalance import layer_scale
from ..placement import Placement
from ..placement.loads import (ReplicaStats, active_experts, gpu_imbalance, gpu_loads,
                               max_over_mean, replica_skew, replica_stats)


SUMMARY_CHUNK = 128  # steps per chunk: per-expert intermediates stay small


@dataclass(frozen=True)
class Counters:
    """Per-(step, layer) counts of the rank model.

    agreed:       int64 `[S, L]` pairs on which all ranks chose the same slot (0 in "a2a")
    valid:        int64 `[S, L]` non-padding pairs
    multiplicity_counts: int64 `[S, L, 3]` valid pairs executed 0, 1, >= 2 times
    error:        float64 `[S, L, 2]` (||Y - Y_exact||^2, ||Y_exact||^2) of the toy layer
    drifted:      bool `[S, G]` ranks that consumed an extra batch of draws before the step
    tokens:       int64 `[S]` tokens of each step
    crossings:    int64 `[S, L, 2]` in "a2a" with a cost model: the busiest GPU's token
                  crossings of each layer's dispatch over NVLink and RDMA (else 0)
    wrong:        int64 `[S, L]` in "a2a": pairs sent to a slot holding another expert's
                  weights (ranks switching placements at different steps; else 0)
    shared:       float64 `[S, L, G]` tokens whose shared-expert work each GPU runs, when the
                  run counts it (`RunSpec.shared_work`); `[S, L, 0]` when it does not
    fanout:       int64 `[S, L, 4]` with a cost model: tokens with a valid pair, and the
                  distinct GPUs, nodes and GPUs other than the source one ("a2a") that their
                  executed choices reach, summed over tokens (`eplbsim.ranks.fanout`; else 0)
    spilled:      int64 `[S, L, G]` for a spill policy: pairs each GPU ran with fetched
                  weights (not in the slot loads); `[S, L, 0]` otherwise
    fetched:      int64 `[S, L, G, 2]` for a spill policy: distinct experts each GPU fetched
                  within its node and across nodes; `[S, L, 0, 2]` otherwise
    """

    agreed: torch.Tensor
    valid: torch.Tensor
    multiplicity_counts: torch.Tensor
    error: torch.Tensor
    drifted: torch.Tensor
    tokens: torch.Tensor
    crossings: torch.Tensor
    wrong: torch.Tensor
    shared: torch.Tensor
    fanout: torch.Tensor
    spilled: torch.Tensor
    fetched: torch.Tensor

    @classmethod
    def zeros(cls, num_steps: int, num_layers: int, num_ranks: int,
              shared: bool = False, spill: bool = False,
              device: torch.device | str = "cpu") -> "Counters":
        """All-zero counters for `S` steps, `L` layers and `G` ranks, filled step by step;
        `shared`: with room for the shared-expert work per GPU; `spill`: for the spilled pairs
        and fetched experts per GPU. `device`: where the counts of the steps' dispatch live
        while they are filled (a replay on a GPU keeps them there, `to` copies them once);
        `drifted` and `tokens`, known on the host, stay on the CPU."""
        S, L = num_steps, num_layers
        spill_gpus = num_ranks if spill else 0

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(zeros(S, L), zeros(S, L), zeros(S, L, 3), zeros(S, L, 2, dtype=torch.float64),
                   torch.zeros(S, num_ranks, dtype=torch.bool), torch.zeros(S, dtype=torch.int64),
                   zeros(S, L, 2), zeros(S, L),
                   zeros(S, L, num_ranks if shared else 0, dtype=torch.float64), zeros(S, L, 4),
                   zeros(S, L, spill_gpus), zeros(S, L, spill_gpus, 2))

    def to(self, device: torch.device | str) -> "Counters":
        """These counters with every tensor on `device` (itself where they are all there)."""
        return Counters(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def __repr__(self) -> str:
        S, L = self.valid.shape
        return f"Counters({S} steps x {L} layers, {int(self.valid.sum())} pairs)"

    def record(self, i: int | slice, outcome: Any, tokens: Any) -> None:
        """Put step `i`'s outcome (`ranks.StepOutcome`, whose counters have these names) in
        place: each counter it holds (None: not counted in this run, left 0), and the step's
        `tokens`; for a slice of steps, their outcome stacked (`ranks.window.WindowOutcome`)
        and their tokens (int64 `[W]`)."""
        self.tokens[i] = tokens
        for f in fields(self):
            value = getattr(outcome, f.name, None)
            if value is not None:
                getattr(self, f.name)[i] = value

    def steps(self, lo: int, hi: int) -> "Counters":
        """The counters of steps `[lo, hi)` (views)."""
        return Counters(**{f.name: getattr(self, f.name)[lo:hi] for f in fields(self)})

    def put(self, lo: int, part: "Counters") -> None:
        """Copy `part`, the counters of steps `[lo, lo + len)`, into these."""
        for f in fields(self):
            value = getattr(part, f.name)
            getattr(self, f.name)[lo:lo + value.shape[0]] = value


@dataclass(frozen=True, eq=False)
class Chunk:
    """Steps `[lo, hi)` on one placement: what every metric's components read.

    routed:    integer `[c, L, E]` routed pairs per logical expert (views of the run's loads)
    executed:  integer `[c, L, P]` executed pairs per slot, or None (counts only)
    counters:  the rank counters of these steps, or None (counts only)
    placement: the placement in service; best: the segment's best placement
    moved:     int64 `[c, L]` slots whose expert changed at each step (a rebalance)
    num_gpus:  `G`
    cost:      the run's `runspec.CostPart` when it names a cost model, else None
    mode:      the run's mode
    shared_work: each token's shared-expert work in routed pairs (`RunSpec.shared_work`; 0:
               not counted): in the time (`work`) and `imbalance_with_shared`, never in the
               balance figures, which count routed pairs
    expert_bytes: one expert's weights, what a spill policy's GPUs fetch (`RunSpec.expert_bytes`)
    gathers:   a spill policy's ranks all-gather their counts every layer ("a2a", not the
               naive port): priced in the fetch time
    """

    lo: int
    hi: int
    routed: torch.Tensor
    executed: torch.Tensor | None
    counters: Counters | None
    placement: Placement
    best: Placement
    moved: torch.Tensor
    num_gpus: int
    cost: Any = None
    mode: str = "none"
    shared_work: float = 0.0
    expert_bytes: int = 0
    gathers: bool = False

    @cached_property
    def seconds(self) -> dict[str, torch.Tensor]:
        """Every layer's time, float64 `[c, L]` each (`cost.layer_seconds`: `compute`,
        `compute_balanced`, `comm`, `total`, `total_balanced`) under the run's cost model, on
        the GPUs' whole work (`work`: the shared experts' too, when counted); `fetch`: a spill
        policy's weight fetches and count all-gather (`cost.comm.spill_seconds`), in `comm`
        too: the fetch waits for the layer's routing and shares the links with the dispatch."""
        c = self.cost
        shape, device = c.profiles()
        topology = self.placement.topology
        comm = layer_comm_seconds(self.mode, self.counters.tokens, self.counters.crossings,
                                  topology, shape, device)
        fetch = spill_seconds(self.counters.fetched, self.expert_bytes, self.gathers,
                              self.placement.num_slots, topology, device)
        times = cost.layer_seconds(*self.work, comm + fetch, shape, device, c.cost, c.overlap,
                                   c.cost_options, self.least_reads)
        return {**times, "fetch": fetch}

    @property
    def least_reads(self) -> torch.Tensor:
        """The experts' weights a GPU reads in the balanced reference (DESIGN.md §8), float64
        `[c, L]`: the step's routed experts, each read once, and the shared experts' as the
        run places them, spread evenly over the GPUs. It reads the routed loads, not the
        dispatch, so every policy on the same loads has the same reference."""
        routed = (self.routed > 0).sum(-1).to(torch.float64)
        if self.shared_work:
            routed = routed + shared_reads(self.counters, self.num_gpus, self.shared_work,
                                           self.mode).sum(-1)
        return routed / self.num_gpus

    @property
    def layer_scale(self) -> float:
        """The model's MoE layers each of the trace's layers stands for in time
        (`layer_scale`)."""
        return layer_scale(self.cost, self.routed.shape[1])

    def ms(self, kind: str) -> torch.Tensor:
        """`seconds[kind]` in milliseconds of the whole model: each trace layer's time times
        the model layers it stands for (`layer_scale`), `[c, L]`."""
        return self.seconds[kind] * (self.layer_scale * 1e3)

    @cached_property
    def gpu_load(self) -> torch.Tensor:
        """Executed routed pairs per GPU, float64 `[c, L, G]`: what every balance figure
        counts, whatever the cost settings (DESIGN.md §4)."""
        return _plus_spilled(gpu_loads(self.executed, self.num_gpus), self.counters)

    @cached_property
    def work(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`gpu_work` of these steps: `(pairs, active)`, float64 `[c, L, G]` each, the
        shared experts' work included when counted: what time is priced on."""
        return gpu_work(self.executed, self.counters, self.num_gpus, self.shared_work,
                        self.mode, self.gpu_load)

    @cached_property
    def imbalance(self) -> torch.Tensor:
        """Executed max / mean GPU load of the routed pairs, `[c, L]`."""
        return gpu_imbalance(self.gpu_load)

    @cached_property
    def active_imbalance(self) -> torch.Tensor:
        """Max / mean over GPUs of the distinct experts each runs (`active_experts`), `[c, L]`:
        the balance of a memory-bound decode step's weight reads."""
        return max_over_mean(_plus_fetched(active_experts(self.executed, self.placement),
                                           self.counters))

    @cached_property
    def imbalance_with_shared(self) -> torch.Tensor:
        """Executed max / mean GPU load with the shared experts' work, `[c, L]`; NaN when the
        run does not count it."""
        if not self.shared_work:
            return torch.full(self.gpu_load.shape[:-1], math.nan, dtype=torch.float64)
        return gpu_imbalance(self.work[0])

    @cached_property
    def promise(self) -> torch.Tensor:
        """The placement in service's even-split GPU imbalance on the routed loads, `[c, L]`."""
        return _promise(self.placement, self.routed, self.num_gpus)

    @cached_property
    def best_promise(self) -> torch.Tensor:
        """The best placement's even-split GPU imbalance, `[c, L]`."""
        return (self.promise if self.best is self.placement
                else _promise(self.best, self.routed, self.num_gpus))

    @cached_property
    def replicas(self) -> ReplicaStats:
        """What every expert's replicas executed, `[c, L, E]` each (`replica_stats`)."""
        return replica_stats(self.executed, self.placement)

    @cached_property
    def skew(self) -> torch.Tensor:
        """Replica skew of every expert, `[c, L, E]`, NaN where undefined."""
        return replica_skew(self.executed, self.placement, self.replicas)


def _promise(placement: Placement, routed: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """GPU imbalance of `placement`'s even split of `routed [..., L, E]`: `[..., L]`."""
    return gpu_imbalance(gpu_loads(placement.expected_load(routed), num_gpus))


def _plus_spilled(loads: torch.Tensor, counters: Counters | None) -> torch.Tensor:
    """Per-GPU pairs `loads [..., L, G]` plus those each ran with fetched weights
    (`Counters.spilled`, a spill policy's)."""
    if counters is None or not counters.spilled.shape[-1]:
        return loads
    return loads + counters.spilled


def _plus_fetched(active: torch.Tensor, counters: Counters | None) -> torch.Tensor:
    """Per-GPU distinct experts `active [..., L, G]` plus those each fetched
    (`Counters.fetched`: never one it holds)."""
    if counters is None or not counters.fetched.shape[-2]:
        return active
    return active + counters.fetched.sum(-1)


def gpu_work(executed: torch.Tensor, counters: Counters, num_gpus: int, shared_work: float,
             mode: str, routed_gpu: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """What each GPU computes in each (step, layer), the shared experts' work included when the
    run counts it (`shared_work` routed pairs a token, `Counters.shared` tokens a GPU):
    `(pairs, active)`, float64 `[..., L, G]` each, for `executed [..., L, P]` pairs per slot.
    `pairs`: its routed pairs (those a spill policy ran with fetched weights too) plus
    `shared_work x` its shared tokens; `active`: its slots with pairs and the experts it
    fetched, plus, where it runs shared work, the shared experts' weights (`shared_work` routed
    experts' worth, a `1 / G` share each in "none", tensor-parallel). `routed_gpu`: the
    routed pairs per GPU when the caller has them."""
    pairs = (_plus_spilled(gpu_loads(executed, num_gpus), counters) if routed_gpu is None
             else routed_gpu)
    active = _plus_fetched(gpu_loads(executed > 0, num_gpus), counters)
    if shared_work:
        pairs = pairs + shared_work * counters.shared
        active = active + shared_reads(counters, num_gpus, shared_work, mode)
    return pairs, active


def shared_reads(counters: Counters, num_gpus: int, shared_work: float,
                 mode: str) -> torch.Tensor:
    """The shared experts' weights each GPU reads, in routed experts, float64 `[..., L, G]`:
    `shared_work` where it runs shared tokens, a `1 / G` share of them in "none" (tensor
    parallel)."""
    share = 1.0 if mode == "a2a" else 1.0 / num_gpus
    return shared_work * share * (counters.shared > 0)


def chunks(slot_load: torch.Tensor | None, true_load: torch.Tensor,
           counters: Counters | None, segments: Sequence[Any], num_gpus: int,
           cost_part: Any = None, mode: str = "none", shared_work: float = 0.0,
           expert_bytes: int = 0, gathers: bool = False) -> Iterator[Chunk]:
    """The run cut into chunks of at most `SUMMARY_CHUNK` steps within each segment
    (`schedule.Segment`: `start`, `stop`, `placement`, `best`, `rebalance`), made one at a
    time (a chunk's cached intermediates go with it); `cost_part`, `mode`, `shared_work`,
    `expert_bytes` and `gathers` as `Chunk`'s (`shared_work` needs the counters)."""
    S, L, _ = true_load.shape
    for seg in segments:
        for lo in range(seg.start, seg.stop, SUMMARY_CHUNK):
            hi = min(seg.stop, lo + SUMMARY_CHUNK)
            moved = torch.zeros(hi - lo, L, dtype=torch.int64)
            if lo == seg.start and seg.rebalance is not None:
                moved[0] = torch.from_numpy(seg.rebalance.transfers.sum(1))
            yield Chunk(lo, hi, true_load[lo:hi], None if slot_load is None else slot_load[lo:hi],
                        None if counters is None else counters.steps(lo, hi), seg.placement,
                        seg.best, moved, num_gpus, cost_part, mode,
                        0.0 if counters is None else shared_work, expert_bytes, gathers)
