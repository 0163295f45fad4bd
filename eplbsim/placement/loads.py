"""Pure load reductions on tensors, below every metric and every trace summary: GPU loads and
their max / mean, top shares, Gini, balancedness, replica loads and skew, idle replicas,
multiplicity counts.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `R` max
replicas. Loads are counts of (token, slot) pairs; undefined values are NaN (per step and
layer) or None (in summaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import Placement


def gpu_loads(slot_load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Pairs per GPU: `[..., P]` -> float64 `[..., G]` (slot `p` on GPU `p // (P // G)`)."""
    *lead, P = slot_load.shape
    return slot_load.to(torch.float64).reshape(*lead, num_gpus, P // num_gpus).sum(-1)


def active_experts(slot_load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Distinct experts each GPU runs, the experts of its slots with load: `slot_load [..., L,
    P]` -> float64 `[..., L, G]` (a GPU running two replicas of one expert reads that expert's
    weights once: it counts once; an empty slot runs nothing). What a memory-bound decode
    step's weight reads follow."""
    G, E = placement.topology.num_gpus, placement.num_experts
    key = placement.slot_gpu * E + placement.phy2log.clamp(min=0)  # [L, P] (GPU, expert) of a slot
    ran = ((slot_load > 0) & placement.filled).to(torch.int8)
    seen = torch.zeros(*slot_load.shape[:-1], G * E, dtype=torch.int8)
    seen.scatter_reduce_(-1, key.expand(ran.shape), ran, reduce="amax")
    return seen.view(*slot_load.shape[:-1], G, E).sum(-1, dtype=torch.float64)


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
    `phy2log`) into `[..., L, E]`: one pass over the slots, no `[..., L, E, R]` array. Empty
    slots are no expert's replicas: they count nowhere."""
    *lead, L, P = slot_load.shape
    E = placement.num_experts
    index = placement.sink_index.to(slot_load.device).expand(*lead, L, P)  # empty -> bucket E
    loads = slot_load.to(torch.float64)
    shape = (*lead, L, E + 1)
    total = loads.new_zeros(shape).scatter_add_(-1, index, loads)[..., :E]
    peak = loads.new_full(shape, -math.inf).scatter_reduce_(-1, index, loads, "amax")[..., :E]
    idle = torch.zeros(shape, dtype=torch.int64, device=slot_load.device).scatter_add_(
        -1, index, (slot_load == 0).to(torch.int64))[..., :E]
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
    [T, L, K]`: int64 `[L, 3]` on their device."""
    m = multiplicity.masked_fill(~valid, -1)
    return torch.stack([(m == 0).sum((0, 2)), (m == 1).sum((0, 2)), (m >= 2).sum((0, 2))], 1)
