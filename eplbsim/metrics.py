"""Metrics, each declared once in `METRICS`, and the pure functions they are built from.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs,
`R` max replicas, `c` steps of a chunk. Loads are counts of (token, slot) pairs; undefined
values are NaN (per step and layer) or None (in summaries).

A :class:`Metric` is either
- per-(step, layer) components, a function of a :class:`Chunk` (a stretch of steps on one
  placement: executed and routed loads, the rank counters) returning `[c, L]` tensors, and a
  reduction over any of the two axes (`mean`, `peak`, `total`, `ratio`, `root_ratio`,
  `shares`), so the same entry gives the run's figure, one per step, or one per (step, layer);
- or a figure only the whole run defines (`whole`, a function of the `Results`).
The summary (`Results.metrics`), rows, JSON, CSV, text tables and time series all iterate
`METRICS` in order: adding a metric is one function and one entry. Keys are DESIGN.md §4's,
then the decomposition of the executed imbalance (`factor_*`, below) and the migration totals.

One definition of balance: `gpu_imbalance`, `balancedness`, the promise, the gap, the factors
and every per-layer figure count routed (token, slot) pairs, whatever the cost settings. Time
(`moe_ms` and the rest) prices each GPU's whole work: its routed pairs plus, when the run counts
them (`RunSpec.shared_work`), the shared experts' tokens it runs; `gpu_imbalance_with_shared` is
that work's max / mean, defined only when the run counts them.

Decomposition, per (step, layer), of the executed `gpu_imbalance` into three factors whose
product it is:
  solver     = the segment's best placement's promise on the true loads (`Segment.best`)
  prediction = the promise of the placement in service / the best one's (1 when they agree)
  dispatch   = the executed imbalance / the promise of the placement in service (1 when the
               policy splits every expert's pairs evenly over its replicas)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from . import cost
from .cost.comm import layer_comm_seconds
from .cost.rebalance import sync_stall_seconds
from .counting import summed
from .placement import Placement
from .schedule.migration import transfer_kinds
from .schedule.switch import phases
from .solvers.bounds import lower_bound

RATIO, TIME_FMT, COUNT, PERCENT = "ratio", "time", "count", "percent"  # how a table shows it
SUMMARY_CHUNK = 128  # steps per chunk: per-expert intermediates stay small
WHOLE, PER_STEP, PER_LAYER = (0, 1), (1,), ()  # the axes of `[S, L]` a reduction sums over


def gpu_loads(slot_load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Pairs per GPU: `[..., P]` -> float64 `[..., G]` (slot `p` on GPU `p // (P // G)`)."""
    *lead, P = slot_load.shape
    return slot_load.to(torch.float64).reshape(*lead, num_gpus, P // num_gpus).sum(-1)


def max_over_mean(load: torch.Tensor) -> torch.Tensor:
    """max / mean over the last axis `[..., X] -> [...]`; NaN where the mean is 0."""
    mean = load.mean(-1)
    return torch.where(mean > 0, load.amax(-1) / mean, math.nan)


def top_share(load: torch.Tensor, k: int) -> torch.Tensor:
    """Fraction of the load carried by the `k` most loaded experts: `[..., E] -> float64
    [...]` (k/E when all are equal); NaN where there is no load."""
    load = load.to(torch.float64)
    total = load.sum(-1)
    top = load.topk(min(k, load.shape[-1]), dim=-1).values.sum(-1)
    return torch.where(total > 0, top / torch.where(total > 0, total, 1.0), math.nan)


def gini(load: torch.Tensor) -> torch.Tensor:
    """Gini coefficient of expert loads `[..., E] -> float64 [...]`: 0 when every expert is
    equally loaded, `1 - 1/E` when one carries everything; NaN where there is no load.
    (Mean absolute difference over all pairs of experts, over twice the mean.)"""
    x = load.to(torch.float64).sort(-1).values
    E = x.shape[-1]
    rank = torch.arange(1, E + 1, dtype=torch.float64)
    total = x.sum(-1)
    g = (2 * (rank * x).sum(-1) / torch.where(total > 0, total, 1.0) - (E + 1)) / E
    return torch.where(total > 0, g, math.nan)


def gpu_imbalance(gpu_load: torch.Tensor) -> torch.Tensor:
    """max / mean GPU load `[..., G] -> [...]` (1.0 is perfect); NaN where nothing ran."""
    return max_over_mean(gpu_load)


def balancedness(gpu_load: torch.Tensor) -> torch.Tensor:
    """mean / max GPU load `[..., G] -> [...]` (the serving engines' figure); NaN where idle."""
    peak = gpu_load.amax(-1)
    return torch.where(peak > 0, gpu_load.mean(-1) / peak, math.nan)


def replica_loads(slot_load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Load of each replica `[..., L, P] -> float64 [..., L, E, R]`, NaN past `logcnt` (replica
    `j` of expert `e` is slot `log2phy[l, e, j]`), for looking at replicas one by one; the
    metrics reduce over them with `replica_stats` instead."""
    log2phy = placement.log2phy  # [L, E, R]
    L, E, R = log2phy.shape
    lead = slot_load.shape[:-2]
    index = log2phy.clamp(min=0).reshape(L, E * R).expand(*lead, L, E * R)
    loads = torch.gather(slot_load.to(torch.float64), -1, index).reshape(*lead, L, E, R)
    return loads.masked_fill(log2phy < 0, math.nan)


@dataclass(frozen=True)
class ReplicaStats:
    """What every expert's replicas executed, `[..., L, E]` each (`replica_stats`).

    peak: float64 the most any one replica executed; total: float64 all its replicas together;
    idle: int64 how many of its replicas executed nothing.
    """

    peak: torch.Tensor
    total: torch.Tensor
    idle: torch.Tensor


def replica_stats(slot_load: torch.Tensor, placement: Placement) -> ReplicaStats:
    """Executed loads `[..., L, P]` reduced over each expert's replicas (its slots in
    `phy2log`) into `[..., L, E]`: one pass over the slots, no `[..., L, E, R]` array."""
    *lead, L, P = slot_load.shape
    index = placement.phy2log.to(slot_load.device).expand(*lead, L, P)
    loads = slot_load.to(torch.float64)
    shape = (*lead, L, placement.num_experts)
    total = loads.new_zeros(shape).scatter_add_(-1, index, loads)
    peak = loads.new_full(shape, -math.inf).scatter_reduce_(-1, index, loads, "amax")
    idle = torch.zeros(shape, dtype=torch.int64, device=slot_load.device).scatter_add_(
        -1, index, (slot_load == 0).to(torch.int64))
    return ReplicaStats(peak, total, idle)


def replica_skew(slot_load: torch.Tensor, placement: Placement,
                 stats: ReplicaStats | None = None) -> torch.Tensor:
    """max / mean replica load of each expert `[..., L, P] -> [..., L, E]`; NaN unless the
    expert has >= 2 replicas and nonzero load. `stats`: `replica_stats(slot_load, placement)`
    when the caller has it."""
    stats = replica_stats(slot_load, placement) if stats is None else stats
    logcnt = placement.logcnt.to(slot_load.device)
    mean = stats.total / logcnt  # its logcnt replicas' mean
    defined = (logcnt >= 2) & (mean > 0)
    return torch.where(defined, stats.peak / torch.where(defined, mean, 1.0), math.nan)


def idle_replicas(slot_load: torch.Tensor, true_load: torch.Tensor, placement: Placement,
                  stats: ReplicaStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(idle, eligible) replica counts, int64 `[..., L]`, for `[..., L, P]` executed and
    `[..., L, E]` routed loads: eligible replicas belong to experts with >= 2 replicas and at
    least `n_e` pairs; idle ones among them executed nothing. `stats`: as `replica_skew`'s."""
    stats = replica_stats(slot_load, placement) if stats is None else stats
    logcnt = placement.logcnt.to(slot_load.device)
    eligible = (logcnt >= 2) & (true_load >= logcnt)  # [..., L, E]
    return (stats.idle * eligible).sum(-1), (logcnt * eligible).sum(-1)


def nanmean_or_none(values: torch.Tensor) -> float | None:
    """Mean of the defined entries, None when there are none."""
    values = values[~values.isnan()]
    return float(values.mean()) if values.numel() else None


def nanmax_or_none(values: torch.Tensor) -> float | None:
    values = values[~values.isnan()]
    return float(values.max()) if values.numel() else None


def multiplicity_counts(multiplicity: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Pair counts with c = 0, 1, >= 2 per layer among `valid` pairs of `multiplicity
    [T, L, K]`: int64 `[L, 3]`."""
    m = multiplicity.masked_fill(~valid, -1)
    return torch.stack([(m == 0).sum((0, 2)), (m == 1).sum((0, 2)), (m >= 2).sum((0, 2))],
                       1).cpu()


def placement_gap(placement: Placement, load: torch.Tensor | np.ndarray) -> torch.Tensor:
    """How far a placement is from the best possible one on `load`: float64 `[..., L]`.

    load: `[..., L, E]` pairs per logical expert (torch or numpy). The placement's max GPU load
    under an even split (`Placement.expected_load`, summed per GPU) over
    `solvers.bounds.lower_bound` for the same slots and GPUs; 1.0 is optimal, NaN where the
    bound is 0 (no load).
    """
    load = torch.as_tensor(load).detach().cpu().to(torch.float64)  # [..., L, E]
    peak = gpu_loads(placement.expected_load(load), placement.topology.num_gpus).amax(-1)
    bound = torch.from_numpy(lower_bound(load.reshape(-1, load.shape[-1]).numpy(),
                                         placement.num_slots, placement.topology.num_gpus))
    bound = bound.view(load.shape[:-1])  # [..., L]
    return torch.where(bound > 0, peak / torch.where(bound > 0, bound, 1.0), math.nan)


def placement_report(placement: Placement, load: torch.Tensor) -> dict[str, Any]:
    """What a placement promises on `load [L, E]`: `placement_imbalance` (mean over layers of
    the even split's max / mean GPU load), `placement_gap` (mean over layers) and
    `placement_gap_per_layer` (`[L]`)."""
    promised = gpu_loads(placement.expected_load(load), placement.topology.num_gpus)
    gap = placement_gap(placement, load)
    return {"placement_imbalance": nanmean_or_none(gpu_imbalance(promised)),
            "placement_gap": nanmean_or_none(gap), "placement_gap_per_layer": gap.tolist()}


# ----------------------------------------------------------------------------- what ranks count

@dataclass(frozen=True)
class Counters:
    """Per-(step, layer) counts of the rank model.

    agreed:       int64 `[S, L]` pairs on which all ranks chose the same slot (0 in "a2a")
    valid:        int64 `[S, L]` non-padding pairs
    multiplicity: int64 `[S, L, 3]` valid pairs executed 0, 1, >= 2 times
    error:        float64 `[S, L, 2]` (||Y - Y_exact||^2, ||Y_exact||^2) of the toy layer
    drift:        bool `[S, G]` ranks that consumed an extra batch of draws before the step
    tokens:       int64 `[S]` tokens of each step
    crossings:    int64 `[S, L, 2]` in "a2a" with a cost model: the busiest GPU's token
                  crossings of each layer's dispatch over NVLink and RDMA (else 0)
    wrong:        int64 `[S, L]` in "a2a": pairs sent to a slot holding another expert's
                  weights (ranks switching placements at different steps; else 0)
    shared:       float64 `[S, L, G]` tokens whose shared-expert work each GPU runs, when the
                  run counts it (`RunSpec.shared_work`); `[S, L, 0]` when it does not
    """

    agreed: torch.Tensor
    valid: torch.Tensor
    multiplicity: torch.Tensor
    error: torch.Tensor
    drift: torch.Tensor
    tokens: torch.Tensor
    crossings: torch.Tensor
    wrong: torch.Tensor
    shared: torch.Tensor

    @classmethod
    def zeros(cls, num_steps: int, num_layers: int, num_ranks: int,
              shared: bool = False) -> "Counters":
        """All-zero counters for `S` steps, `L` layers and `G` ranks, filled step by step;
        `shared`: with room for the shared-expert work per GPU."""
        S, L = num_steps, num_layers
        return cls(torch.zeros(S, L, dtype=torch.int64), torch.zeros(S, L, dtype=torch.int64),
                   torch.zeros(S, L, 3, dtype=torch.int64),
                   torch.zeros(S, L, 2, dtype=torch.float64),
                   torch.zeros(S, num_ranks, dtype=torch.bool), torch.zeros(S, dtype=torch.int64),
                   torch.zeros(S, L, 2, dtype=torch.int64), torch.zeros(S, L, dtype=torch.int64),
                   torch.zeros(S, L, num_ranks if shared else 0, dtype=torch.float64))

    def __repr__(self) -> str:
        S, L = self.valid.shape
        return f"Counters({S} steps x {L} layers, {int(self.valid.sum())} pairs)"

    def steps(self, lo: int, hi: int) -> "Counters":
        """The counters of steps `[lo, hi)` (views)."""
        return Counters(**{f.name: getattr(self, f.name)[lo:hi] for f in fields(self)})

    def put(self, lo: int, part: "Counters") -> None:
        """Copy `part`, the counters of steps `[lo, lo + len)`, into these."""
        for f in fields(self):
            value = getattr(part, f.name)
            getattr(self, f.name)[lo:lo + value.shape[0]] = value


# ----------------------------------------------------------------------------- chunks

@dataclass(frozen=True, eq=False)
class Chunk:
    """Steps `[lo, hi)` on one placement: what every metric's components read.

    routed:    integer `[c, L, E]` routed pairs per logical expert (views of the run's loads)
    executed:  integer `[c, L, P]` executed pairs per slot, or None (counts only)
    counters:  the rank counters of these steps, or None (counts only)
    placement: the placement in service; best: the segment's best placement
    moved:     int64 `[c, L]` slots whose expert changed at each step (a rebalance)
    num_gpus:  `G`
    cost:      the run's `spec.CostPart` when it names a cost model, else None
    mode:      the run's mode
    shared_work: each token's shared-expert work in routed pairs (`RunSpec.shared_work`; 0:
               not counted): in the time (`work`) and `imbalance_with_shared`, never in the
               balance figures, which count routed pairs
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

    @cached_property
    def seconds(self) -> dict[str, torch.Tensor]:
        """Every layer's time, float64 `[c, L]` each (`cost.layer_seconds`: `compute`,
        `compute_balanced`, `comm`, `total`, `total_balanced`) under the run's cost model, on
        the GPUs' whole work (`work`: the shared experts' too, when counted)."""
        c = self.cost
        shape, device = c.profiles()
        comm = layer_comm_seconds(self.mode, self.counters.tokens, self.counters.crossings,
                                  self.placement.topology, shape, device)
        return cost.layer_seconds(*self.work, comm, shape, device, c.cost, c.overlap,
                                  c.cost_options)

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
        return gpu_loads(self.executed, self.num_gpus)

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


def layer_scale(cost: Any, num_layers: int) -> float:
    """How many of the model's MoE layers each of a trace's `num_layers` layers stands for when
    time is priced (`cost`, a `spec.CostPart`): `moe_layers / L` of its model shape, so a step's
    time is the whole model's, whatever layers the trace recorded."""
    return cost.profiles()[0].moe_layers / num_layers


def _promise(placement: Placement, routed: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """GPU imbalance of `placement`'s even split of `routed [..., L, E]`: `[..., L]`."""
    return gpu_imbalance(gpu_loads(placement.expected_load(routed), num_gpus))


def gpu_work(executed: torch.Tensor, counters: Counters, num_gpus: int, shared_work: float,
             mode: str, routed_gpu: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """What each GPU computes in each (step, layer), the shared experts' work included when the
    run counts it (`shared_work` routed pairs a token, `Counters.shared` tokens a GPU):
    `(pairs, active)`, float64 `[..., L, G]` each, for `executed [..., L, P]` pairs per slot.
    `pairs`: its routed pairs plus `shared_work x` its shared tokens; `active`: its slots with
    pairs plus, where it runs shared work, the shared experts' weights (`shared_work` routed
    experts' worth, a `1 / G` share each in "none", tensor-parallel). `routed_gpu`:
    `gpu_loads(executed, num_gpus)` when the caller has it."""
    pairs = gpu_loads(executed, num_gpus) if routed_gpu is None else routed_gpu
    active = gpu_loads(executed > 0, num_gpus)
    if shared_work:
        share = 1.0 if mode == "a2a" else 1.0 / num_gpus
        pairs = pairs + shared_work * counters.shared
        active = active + shared_work * share * (counters.shared > 0)
    return pairs, active


def chunks(slot_load: torch.Tensor | None, true_load: torch.Tensor,
           counters: Counters | None, segments: Sequence[Any], num_gpus: int,
           cost_part: Any = None, mode: str = "none", shared_work: float = 0.0
           ) -> Iterator[Chunk]:
    """The run cut into chunks of at most `SUMMARY_CHUNK` steps within each segment
    (`schedule.Segment`: `start`, `stop`, `placement`, `best`, `rebalance`), made one at a
    time (a chunk's cached intermediates go with it); `cost_part`, `mode` and `shared_work`
    as `Chunk`'s (`shared_work` needs the counters)."""
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
                        0.0 if counters is None else shared_work)


# ----------------------------------------------------------------------------- reductions
# Each takes components `[S, L]` and `dims`, the axes to reduce: WHOLE, PER_STEP or PER_LAYER.

def mean(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """Mean of the defined (non-NaN) entries; NaN where there are none."""
    if not dims:
        return x.to(torch.float64)
    if dims == WHOLE:
        values = x[~x.isnan()]
        return values.mean() if values.numel() else torch.tensor(math.nan, dtype=torch.float64)
    return x.nanmean(dims)


def peak(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """Max of the defined entries; NaN where there are none."""
    if not dims:
        return x
    defined = (~x.isnan()).sum(dims) > 0
    return torch.where(defined, x.nan_to_num(-math.inf).amax(dims), math.nan)


def total(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """Plain sum (integers stay integers)."""
    return x.sum(dims) if dims else x


def _divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den as float64, NaN where den is 0."""
    num, den = num.to(torch.float64), den.to(torch.float64)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), math.nan)


def ratio(num: torch.Tensor, den: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """sum(num) / sum(den): a pooled ratio of counts; NaN where the denominator is 0."""
    return _divide(total(num, dims=dims), total(den, dims=dims))


def root_ratio(num: torch.Tensor, den: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """sqrt(sum(num) / sum(den)): a relative norm from squared norms."""
    return ratio(num, den, dims=dims).sqrt()


def step_time(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """A step's time is the sum of its layers': summed over layers, then the mean over steps."""
    x = x.to(torch.float64)
    if 1 in dims:
        x = x.sum(1)
    return x.mean(0) if 0 in dims else x


def overhead(num: torch.Tensor, den: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """sum(num) / sum(den) - 1: the pooled excess of a time over its reference."""
    return ratio(num, den, dims=dims) - 1


def throughput(tokens: torch.Tensor, seconds: torch.Tensor, *,
               dims: tuple[int, ...]) -> torch.Tensor:
    """Tokens over time: `tokens [S, L]` is each step's tokens on every layer (counted once per
    step), `seconds` each layer's time."""
    n = tokens.to(torch.float64)
    n = n.mean(1) if 1 in dims else n
    return _divide(n.sum(0) if 0 in dims else n, total(seconds, dims=dims))


def shares(*counts: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Each count's share of their sum, float64 `[..., n]`; NaN where the sum is 0."""
    sums = [total(c, dims=dims) for c in counts]
    whole = sum(sums)
    return torch.stack([_divide(part, whole) for part in sums], -1)


# ----------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Metric:
    """One metric (module doc).

    header:  its column header in text tables (a tuple, one per sub-key, for `subkeys`)
    parts:   `Chunk -> tuple of [c, L] tensors`, the per-(step, layer) components; or None
    reduce:  `(*components, dims) -> tensor`, over the axes `dims` of `[S, L]`
    whole:   `Results -> value`, for a figure only the whole run defines (then no parts)
    needs:   what the components read besides routed loads and placements: "executed" (a
             dispatch ran) or "counters" (the rank counters); None when absent (counts only)
    modes:   the modes it is defined in (None: every mode)
    tables:  the text tables showing it ("main", "decomposition")
    subkeys: for a metric whose value is a dict (`multiplicity`), its keys; flat columns
             (CSV, time series) are `KEY_SUB`
    fmt:     how a text table shows its values: `RATIO` (4 decimals), `TIME_FMT` (4
             significant digits), `COUNT` (whole, with thousands separators), `PERCENT`
    shown:   `rows -> bool`, whether its column says something in a table of these rows (e.g.
             not when every value is 1); None: always shown
    """

    header: str | tuple[str, ...]
    parts: Callable[[Chunk], tuple[torch.Tensor, ...]] | None = None
    reduce: Callable[..., torch.Tensor] = mean
    whole: Callable[[Any], Any] | None = None
    needs: str | None = None
    modes: tuple[str, ...] | None = None
    tables: frozenset[str] = frozenset({"main"})
    subkeys: tuple[str, ...] | None = None
    fmt: str = RATIO
    shown: Callable[[Sequence[dict]], bool] | None = None

    def columns(self, key: str) -> list[tuple[str, str, str | None]]:
        """`(header, row key, sub-key)` of its columns in a text table."""
        if self.subkeys is None:
            return [(self.header, key, None)]
        return [(h, key, sub) for h, sub in zip(self.header, self.subkeys)]

    def flat_keys(self, key: str) -> list[str]:
        """Its column names in flat tables (CSV, time series)."""
        return [key] if self.subkeys is None else [f"{key}_{sub}" for sub in self.subkeys]


def _skew_parts(chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    skew = chunk.skew
    return skew.nan_to_num(0.0).sum(-1), (~skew.isnan()).sum(-1)


def _skew_peak(chunk: Chunk) -> tuple[torch.Tensor]:
    skew = chunk.skew
    top = skew.nan_to_num(-math.inf).amax(-1)
    return (torch.where((~skew.isnan()).any(-1), top, math.nan),)


def _skew_cumulative(results: Any) -> float | None:
    """Max replica skew over (layer, expert) on executed loads summed over each stretch of
    steps on one placement (exposes slow bias that per-step figures hide)."""
    skews = [replica_skew(summed(results.slot_load[start:stop], 0), placement).flatten()
             for start, stop, placement in results.epochs]
    return nanmax_or_none(torch.cat(skews))


def _differs(rows: Sequence[dict], key: str, other: str | None = None) -> bool:
    """Whether some row's `key` differs, as a table shows it, from its `other` (None: from 1)."""
    def shown(value: Any) -> str:
        return "-" if value is None else f"{value:.4f}"
    return any(shown(r.get(key)) != shown(1.0 if other is None else r.get(other)) for r in rows)


def _corrupt(results: Any) -> bool:
    """Whether the run's output is wrong: some pair executed other than once (ranks that
    disagree, "none") or sent to a slot holding another expert ("a2a", while ranks switch)."""
    c = results.counters
    return bool(c.multiplicity[..., 0].sum() + c.multiplicity[..., 2].sum() + c.wrong.sum())


def _rebalances(results: Any) -> int:
    """Placements re-solved on the schedule (skipped rebalances excluded)."""
    return sum(s.rebalance is not None and not s.rebalance.skipped for s in results.segments)


def _moved_bytes(results: Any) -> int:
    """Bytes copied by every rebalance: moved slots x the run's expert bytes
    (`RunSpec.expert_bytes`)."""
    return int(results.components["moved_slots"][0].sum()) * results.spec.expert_bytes()


def _hazard_steps(results: Any) -> int:
    """Steps on which the ranks serve different placements (`schedule.switch`: async
    rebalances whose ranks switch at different steps)."""
    return sum(hi - lo for lo, hi, _, serving in phases(results.segments) if serving is not None)


def rebalance_stalls(results: Any) -> list[tuple[int, float]]:
    """`(step, milliseconds)` of every rebalance that moved experts when serving stalls until
    its copies land (`sync`, `cost.rebalance.sync_stall_seconds`; none for `async`, whose
    copies go on while the old placement serves), experts of the cost model's shape;
    `results.spec` must name a cost model. The trace's layers stand for the model's MoE layers
    (`layer_scale`), as in every time metric."""
    segments = results.segments
    spec = results.spec
    if spec.schedule.rebalance_mode != "sync":
        return []
    device = spec.cost.profiles()[1]
    scale = layer_scale(spec.cost, results.true_load.shape[1])
    out = []
    for before, seg in zip(segments, segments[1:]):
        if seg.rebalance is None or seg.rebalance.skipped:
            continue
        placement = seg.placement
        seconds = sync_stall_seconds(transfer_kinds(before.placement, placement),
                                     placement.slot_gpu.numpy(), placement.topology.num_gpus,
                                     spec.expert_bytes(), device)
        out.append((seg.start, seconds * scale * 1e3))
    return out


def _stall_ms(results: Any) -> float:
    """Milliseconds serving stalled for every rebalance's copies, in all."""
    return sum(ms for _, ms in rebalance_stalls(results))


def _cost_source(results: Any) -> str:
    """What the run's compute times come from (the measured table, for `measured`)."""
    return results.spec.cost.describe(results.spec.topology.gpus)


def _step_tokens(chunk: Chunk) -> torch.Tensor:
    """Each step's tokens on every layer, `[c, L]`."""
    return chunk.counters.tokens.unsqueeze(1).expand(chunk.counters.valid.shape)


EXECUTED, COUNTERS, COST, SOLVED = "executed", "counters", "cost", "solved"
DECOMPOSITION, TIME = frozenset({"decomposition"}), frozenset({"time"})

METRICS: dict[str, Metric] = {
    "gpu_imbalance": Metric("gpu_imb", lambda c: (c.imbalance,), needs=EXECUTED,
                            tables=frozenset({"main", "decomposition"})),
    "gpu_imbalance_with_shared": Metric(
        "imb+shared", lambda c: (c.imbalance_with_shared,), needs=EXECUTED,
        shown=lambda rows: any(r.get("gpu_imbalance_with_shared") is not None for r in rows)),
    "balancedness": Metric("balanced", lambda c: (balancedness(c.gpu_load),), needs=EXECUTED),
    "replica_skew_mean": Metric("skew_mean", _skew_parts, ratio, needs=EXECUTED),
    "replica_skew_max": Metric("skew_max", _skew_peak, peak, needs=EXECUTED),
    "replica_skew_cumulative": Metric("skew_cum", whole=_skew_cumulative, needs=EXECUTED),
    "idle_replica_frac": Metric(
        "idle", lambda c: idle_replicas(c.executed, c.routed, c.placement, c.replicas), ratio,
        needs=EXECUTED),
    "placement_imbalance": Metric("promise", lambda c: (c.promise,)),
    "placement_gap": Metric("gap", lambda c: (placement_gap(c.placement, c.routed),),
                            shown=lambda rows: _differs(rows, "placement_gap",
                                                        "placement_imbalance")),
    "executed_work": Metric("work", lambda c: (c.executed.sum(-1), c.counters.valid), ratio,
                            needs=COUNTERS, shown=lambda rows: _differs(rows, "executed_work")),
    "output_corrupt": Metric("corrupt", whole=_corrupt, needs=COUNTERS, tables=frozenset()),
    "rank_agreement": Metric("agree", lambda c: (c.counters.agreed, c.counters.valid), ratio,
                             needs=COUNTERS, modes=("none",)),
    "multiplicity": Metric(("c=0", "c=1", "c>=2"), lambda c: c.counters.multiplicity.unbind(-1),
                           shares, needs=COUNTERS, subkeys=("0", "1", "2+")),
    "output_rel_error": Metric("out_err", lambda c: c.counters.error.unbind(-1), root_ratio,
                               needs=COUNTERS, modes=("none",)),
    "wrong_expert_frac": Metric("wrong", lambda c: (c.counters.wrong, c.counters.valid), ratio,
                                needs=COUNTERS, modes=("a2a",)),
    "factor_solver": Metric("solver", lambda c: (c.best_promise,), needs=SOLVED,
                            tables=DECOMPOSITION),
    "factor_prediction": Metric("prediction", lambda c: (c.promise / c.best_promise,),
                                needs=SOLVED, tables=DECOMPOSITION),
    "factor_dispatch": Metric("dispatch", lambda c: (c.imbalance / c.promise,),
                              needs=EXECUTED, tables=DECOMPOSITION),
    "rebalances": Metric("rebalances", whole=_rebalances, tables=DECOMPOSITION),
    "moved_slots": Metric("moved_slots", lambda c: (c.moved,), total, tables=DECOMPOSITION),
    "moved_bytes": Metric("moved_bytes", whole=_moved_bytes, tables=frozenset()),
    "hazard_steps": Metric("hazard", whole=_hazard_steps, tables=DECOMPOSITION),
    "layer_us": Metric("layer_us", lambda c: (c.seconds["total"] * 1e6,), needs=COST,
                       tables=TIME, fmt=TIME_FMT),
    "moe_ms": Metric("moe_ms", lambda c: (c.ms("total"),), step_time, needs=COST, tables=TIME,
                     fmt=TIME_FMT),
    "compute_ms": Metric("compute_ms", lambda c: (c.ms("compute"),), step_time, needs=COST,
                         tables=TIME, fmt=TIME_FMT),
    "comm_ms": Metric("comm_ms", lambda c: (c.ms("comm"),), step_time, needs=COST, tables=TIME,
                      fmt=TIME_FMT),
    "moe_ms_balanced": Metric("balanced_ms", lambda c: (c.ms("total_balanced"),), step_time,
                              needs=COST, tables=TIME, fmt=TIME_FMT),
    "imbalance_overhead": Metric(
        "overhead", lambda c: (c.seconds["total"], c.seconds["total_balanced"]), overhead,
        needs=COST, tables=TIME, fmt=PERCENT),
    "moe_tokens_per_s": Metric("tokens/s", lambda c: (_step_tokens(c), c.ms("total") / 1e3),
                               throughput, needs=COST, tables=TIME, fmt=COUNT),
    "rebalance_stall_ms": Metric("stall_ms", whole=_stall_ms, needs=COST, tables=TIME,
                                 fmt=TIME_FMT),
    "cost_source": Metric("cost_source", whole=_cost_source, needs=COST, tables=frozenset()),
}


# ----------------------------------------------------------------------------- evaluation

def components(chunked: Iterable[Chunk], num_steps: int, num_layers: int, present: set[str],
               metrics: dict[str, Metric] | None = None
               ) -> dict[str, tuple[torch.Tensor, ...] | None]:
    """Every per-(step, layer) metric's components over the run, `[S, L]` each, assembled from
    the chunks in order, every metric of a chunk before the next (so memory holds one chunk's
    intermediates, not the run's); None for a metric that needs what the run lacks (`present`
    holds "executed", "counters" and "cost" when the run has them)."""
    chosen = {key: metric for key, metric in (METRICS if metrics is None else metrics).items()
              if metric.parts is not None}
    out: dict[str, tuple[torch.Tensor, ...] | None] = {
        key: None for key, metric in chosen.items()
        if metric.needs is not None and metric.needs not in present}
    for chunk in chunked:
        for key, metric in chosen.items():
            if key in out and out[key] is None:
                continue
            values = metric.parts(chunk)
            if key not in out:
                out[key] = tuple(torch.empty((num_steps, num_layers), dtype=v.dtype)
                                 for v in values)
            for dst, v in zip(out[key], values):
                dst[chunk.lo:chunk.hi] = v
    return {key: out.get(key) for key in chosen}


def _plain(value: torch.Tensor) -> float | int | None:
    """A 0-d tensor as a Python number, None for NaN."""
    if value.is_floating_point():
        number = float(value)
        return None if math.isnan(number) else number
    return int(value)


def _defined(metric: Metric, results: Any) -> bool:
    """Whether `metric` is defined for `results`: its mode ran and what it needs is there."""
    return ((metric.modes is None or results.spec.dispatch.mode in metric.modes)
            and (metric.needs is None or metric.needs in results.present))


def summary(results: Any, metrics: dict[str, Metric] | None = None) -> dict[str, Any]:
    """The value of every metric over the whole run of `results` (a `Results`), in order:
    None where undefined (another mode, or what it needs is absent); a `subkeys` metric as a
    dict."""
    out: dict[str, Any] = {}
    for key, metric in (METRICS if metrics is None else metrics).items():
        if not _defined(metric, results):
            out[key] = None
        elif metric.whole is not None:
            out[key] = metric.whole(results)
        else:
            value = metric.reduce(*results.components[key], dims=WHOLE)
            out[key] = (_plain(value) if metric.subkeys is None else
                        {sub: _plain(v) for sub, v in zip(metric.subkeys, value)})
    return out


def time_series(results: Any, per_layer: bool = False,
                metrics: dict[str, Metric] | None = None) -> dict[str, np.ndarray]:
    """Every per-(step, layer) metric per step (`per_layer`: per step and layer), as columns of
    equal length: `step` (and `layer`), `pairs` (routed non-padding pairs), then each metric's
    flat columns; NaN where undefined. Per step, pooled ratios sum counts over layers first;
    means average the layers' values, maxima maximise them."""
    S, L, _ = results.true_load.shape
    dims = PER_LAYER if per_layer else PER_STEP
    rows = S * L if per_layer else S
    columns = ({"step": torch.arange(S)} if not per_layer else
               {"step": torch.arange(S).repeat_interleave(L), "layer": torch.arange(L).repeat(S)})
    columns["pairs"] = total(summed(results.true_load, -1), dims=dims)
    for key, metric in (METRICS if metrics is None else metrics).items():
        if metric.parts is None:
            continue
        names = metric.flat_keys(key)
        if _defined(metric, results):
            value = metric.reduce(*results.components[key], dims=dims)
        else:
            value = torch.full((rows, len(names)), math.nan, dtype=torch.float64)
        value = value.reshape(rows, len(names))
        for i, name in enumerate(names):
            columns[name] = value[:, i]
    return {k: v.flatten().numpy() for k, v in columns.items()}
