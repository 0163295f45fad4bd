"""Pure metric functions on executed and promised loads (JSON keys of DESIGN.md §4).

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs,
`R` max replicas. Loads are counts of (token, slot) pairs; undefined values are NaN (per
(step, layer)) or None (in summaries).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from .placement import Placement
from .solvers.bounds import lower_bound

METRIC_KEYS = ("gpu_imbalance", "balancedness", "replica_skew_mean", "replica_skew_max",
               "replica_skew_cumulative", "idle_replica_frac", "placement_imbalance",
               "placement_gap",
               "rank_agreement", "multiplicity", "output_rel_error")
# Reported after METRIC_KEYS: the decomposition of gpu_imbalance (timeseries.factors) and the
# migration totals of the rebalance schedule.
OVER_TIME_KEYS = ("factor_solver", "factor_prediction", "factor_dispatch", "rebalances",
                  "moved_slots", "moved_bytes")


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
    """Load of each replica `[..., L, P] -> float64 [..., L, E, R]`, NaN past `logcnt`."""
    log2phy = placement.log2phy  # [L, E, R]
    L, E, R = log2phy.shape
    lead = slot_load.shape[:-2]
    index = log2phy.clamp(min=0).reshape(L, E * R).expand(*lead, L, E * R)
    loads = torch.gather(slot_load.to(torch.float64), -1, index).reshape(*lead, L, E, R)
    return loads.masked_fill(log2phy < 0, math.nan)


def replica_skew(slot_load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """max / mean replica load of each expert `[..., L, P] -> [..., L, E]`; NaN unless the
    expert has >= 2 replicas and nonzero load."""
    loads = replica_loads(slot_load, placement)
    peak = loads.nan_to_num(-math.inf).amax(-1)
    mean = loads.nanmean(-1)
    defined = (placement.logcnt >= 2) & (mean > 0)
    return torch.where(defined, peak / torch.where(defined, mean, 1.0), math.nan)


def idle_replicas(slot_load: torch.Tensor, true_load: torch.Tensor,
                  placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """(idle, eligible) replica counts, int64 `[..., L]`, for `[..., L, P]` executed and
    `[..., L, E]` routed loads: eligible replicas belong to experts with >= 2 replicas and at
    least `n_e` pairs; idle ones among them executed nothing."""
    loads = replica_loads(slot_load, placement)  # [..., L, E, R]
    eligible_expert = (placement.logcnt >= 2) & (true_load >= placement.logcnt)  # [..., L, E]
    eligible = eligible_expert.unsqueeze(-1) & ~loads.isnan()
    return (eligible & (loads == 0)).sum((-2, -1)), eligible.sum((-2, -1))


def nanmean_or_none(values: torch.Tensor) -> float | None:
    """Mean of the defined entries, None when there are none."""
    values = values[~values.isnan()]
    return float(values.mean()) if values.numel() else None


def nanmax_or_none(values: torch.Tensor) -> float | None:
    values = values[~values.isnan()]
    return float(values.max()) if values.numel() else None


def multiplicity_fractions(counts: Sequence[int]) -> dict[str, float | None]:
    """`{"0": f0, "1": f1, "2+": f2}` from pair counts with c = 0, 1, >= 2."""
    total = sum(counts)
    keys = ("0", "1", "2+")
    return {k: (c / total if total else None) for k, c in zip(keys, counts)}


def multiplicity_counts(multiplicity: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Pair counts with c = 0, 1, >= 2 per layer among `valid` pairs of `multiplicity
    [T, L, K]`: int64 `[L, 3]`."""
    m = multiplicity.masked_fill(~valid, -1)
    return torch.stack([(m == 0).sum((0, 2)), (m == 1).sum((0, 2)), (m >= 2).sum((0, 2))],
                       1).cpu()


def placement_gap(placement: Placement, load: torch.Tensor | np.ndarray) -> torch.Tensor:
    """How far a placement is from the best possible one on `load`: float64 `[..., L]`.

    load: `[..., L, E]` pairs per logical expert (torch or numpy). The placement's max GPU load under
    an even split (`Placement.expected_load`, summed per GPU) over `solvers.bounds.lower_bound`
    for the same slots and GPUs; 1.0 is optimal, NaN where the bound is 0 (no load).
    """
    load = torch.as_tensor(load).detach().cpu().to(torch.float64)  # [..., L, E]
    peak = gpu_loads(placement.expected_load(load), placement.topology.num_gpus).amax(-1)
    bound = torch.from_numpy(lower_bound(load.reshape(-1, load.shape[-1]).numpy(),
                                         placement.num_slots, placement.topology.num_gpus))
    bound = bound.view(load.shape[:-1])  # [..., L]
    return torch.where(bound > 0, peak / torch.where(bound > 0, bound, 1.0), math.nan)
