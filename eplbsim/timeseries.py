"""Metrics over time: per-(step, layer) components of every metric, the decomposition of the
executed imbalance, the per-step (or per-layer) time series, and the run summary built from the
same components.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs.

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
from typing import Any, Sequence

import numpy as np
import torch

from . import metrics as M
from .placement import Placement
from .schedule.plan import TRANSFER_KINDS, Segment

SUMMARY_CHUNK = 128  # steps summarized at a time: per-replica intermediates stay small
FACTORS = ("solver", "prediction", "dispatch")


@dataclass(frozen=True)
class Counters:
    """Per-(step, layer) counts of the rank model.

    agreed: int64 `[S, L]` pairs on which all ranks chose the same slot (0 in "a2a")
    valid:  int64 `[S, L]` non-padding pairs
    mult:   int64 `[S, L, 3]` pairs executed 0, 1, >= 2 times
    error:  float64 `[S, L, 2]` (||Y - Y_exact||^2, ||Y_exact||^2) of the toy layer ("none")
    drift:  bool `[S, G]` ranks that consumed an extra batch of draws before the step
    """

    agreed: torch.Tensor
    valid: torch.Tensor
    mult: torch.Tensor
    error: torch.Tensor
    drift: torch.Tensor

    @classmethod
    def zeros(cls, num_steps: int, num_layers: int, num_ranks: int) -> "Counters":
        """All-zero counters for `S` steps, `L` layers and `G` ranks, filled step by step."""
        S, L = num_steps, num_layers
        return cls(torch.zeros(S, L, dtype=torch.int64), torch.zeros(S, L, dtype=torch.int64),
                   torch.zeros(S, L, 3, dtype=torch.int64),
                   torch.zeros(S, L, 2, dtype=torch.float64),
                   torch.zeros(S, num_ranks, dtype=torch.bool))


@dataclass(frozen=True)
class Series:
    """Per-(step, layer) components of the load metrics, `[S, L]`, NaN where undefined.

    gpu_imbalance, balancedness: float64, on executed loads (NaN without them)
    placement_imbalance: float64, the promise of the placement in service on the true loads
    best_imbalance:      float64, the promise of the segment's best placement on the true loads
    placement_gap:       float64, the placement in service's max GPU load over the lower bound
    skew_sum, skew_max:  float64, sum and max of the defined replica skews over experts
    skew_count:          int64, experts with a defined replica skew (>= 2 replicas, load > 0)
    idle, eligible:      int64, idle replicas among the eligible ones (`metrics.idle_replicas`)
    """

    gpu_imbalance: torch.Tensor
    balancedness: torch.Tensor
    placement_imbalance: torch.Tensor
    best_imbalance: torch.Tensor
    placement_gap: torch.Tensor
    skew_sum: torch.Tensor
    skew_max: torch.Tensor
    skew_count: torch.Tensor
    idle: torch.Tensor
    eligible: torch.Tensor


def layer_series(slot_load: torch.Tensor | None, true_load: torch.Tensor,
                 segments: Sequence[Segment], num_gpus: int) -> Series:
    """The components of every step and layer, each segment judged with its own placements,
    in chunks of `SUMMARY_CHUNK` steps.

    slot_load: int `[S, L, P]` executed pairs, or None (counts only: nothing executed)
    true_load: int `[S, L, E]` routed pairs
    """
    S, L, _ = true_load.shape
    floats = {f.name: torch.full((S, L), math.nan, dtype=torch.float64) for f in fields(Series)}
    ints = {name: torch.zeros(S, L, dtype=torch.int64)
            for name in ("skew_count", "idle", "eligible")}
    out = {**floats, **ints}
    for seg in segments:
        for lo in range(seg.start, seg.stop, SUMMARY_CHUNK):
            hi = min(seg.stop, lo + SUMMARY_CHUNK)
            routed = true_load[lo:hi]  # [c, L, E]
            promised = _promise(seg.placement, routed, num_gpus)  # [c, L]
            out["placement_imbalance"][lo:hi] = promised
            out["best_imbalance"][lo:hi] = (promised if seg.best is seg.placement
                                            else _promise(seg.best, routed, num_gpus))
            out["placement_gap"][lo:hi] = M.placement_gap(seg.placement, routed)
            if slot_load is None:
                continue
            executed = slot_load[lo:hi]  # [c, L, P]
            gpu = M.gpu_loads(executed, num_gpus)  # [c, L, G]
            out["gpu_imbalance"][lo:hi] = M.gpu_imbalance(gpu)
            out["balancedness"][lo:hi] = M.balancedness(gpu)
            skew = M.replica_skew(executed, seg.placement)  # [c, L, E]
            defined = ~skew.isnan()
            out["skew_sum"][lo:hi] = skew.nan_to_num(0.0).sum(-1)
            out["skew_count"][lo:hi] = defined.sum(-1)
            peak = skew.nan_to_num(-math.inf).amax(-1)
            out["skew_max"][lo:hi] = torch.where(defined.any(-1), peak, math.nan)
            out["idle"][lo:hi], out["eligible"][lo:hi] = M.idle_replicas(executed, routed,
                                                                         seg.placement)
    return Series(**out)


def _promise(placement: Placement, routed: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """GPU imbalance of `placement`'s even split of `routed [..., L, E]`: `[..., L]`."""
    return M.gpu_imbalance(M.gpu_loads(placement.expected_load(routed), num_gpus))


def factors(series: Series) -> dict[str, torch.Tensor]:
    """The three factors of the executed imbalance (module doc): float64 `[S, L]` each, NaN
    where a step's layer carried no load; their product is `series.gpu_imbalance`."""
    return {"solver": series.best_imbalance,
            "prediction": series.placement_imbalance / series.best_imbalance,
            "dispatch": series.gpu_imbalance / series.placement_imbalance}


def summarize(series: Series, slot_load: torch.Tensor | None,
              segments: Sequence[Segment]) -> dict[str, Any]:
    """The load metrics of DESIGN.md §4 over all steps and layers, plus the mean of each
    decomposition factor (`factor_solver`, `factor_prediction`, `factor_dispatch`); None where
    undefined. `replica_skew_cumulative` sums executed loads over each stretch of steps on one
    placement (`slot_load [S, L, P]`; None without it)."""
    cumulative = [M.replica_skew(slot_load[start:stop].sum(0), placement).flatten()
                  for start, stop, placement in placement_epochs(segments)
                  ] if slot_load is not None else [torch.tensor([math.nan])]
    skews = int(series.skew_count.sum())
    eligible = int(series.eligible.sum())
    summary = {
        "gpu_imbalance": M.nanmean_or_none(series.gpu_imbalance),
        "balancedness": M.nanmean_or_none(series.balancedness),
        "replica_skew_mean": float(series.skew_sum.nansum()) / skews if skews else None,
        "replica_skew_max": M.nanmax_or_none(series.skew_max),
        "replica_skew_cumulative": M.nanmax_or_none(torch.cat(cumulative)),
        "idle_replica_frac": int(series.idle.sum()) / eligible if eligible else None,
        "placement_imbalance": M.nanmean_or_none(series.placement_imbalance),
        "placement_gap": M.nanmean_or_none(series.placement_gap),
    }
    for name, factor in factors(series).items():
        summary[f"factor_{name}"] = M.nanmean_or_none(factor)
    return summary


def summarize_ranks(counters: Counters, mode: str) -> dict[str, Any]:
    """rank_agreement, multiplicity and output_rel_error over all steps and layers; the first
    and last are None in "a2a", where each pair is dispatched once by construction."""
    valid = int(counters.valid.sum())
    err_sq, exact_sq = counters.error.sum((0, 1)).tolist()
    none_mode = mode == "none"
    return {
        "rank_agreement": int(counters.agreed.sum()) / valid if none_mode and valid else None,
        "multiplicity": M.multiplicity_fractions(counters.mult.sum((0, 1)).tolist()),
        "output_rel_error": math.sqrt(err_sq / exact_sq) if none_mode and exact_sq > 0 else None,
    }


def placement_epochs(segments: Sequence[Segment]) -> list[tuple[int, int, Placement]]:
    """`(start, stop, placement)` of each stretch of steps on one placement (consecutive
    segments that kept the placement, as a skipped rebalance does, are merged)."""
    epochs: list[tuple[int, int, Placement]] = []
    for seg in segments:
        if epochs and epochs[-1][2] is seg.placement:
            epochs[-1] = (epochs[-1][0], seg.stop, seg.placement)
        else:
            epochs.append((seg.start, seg.stop, seg.placement))
    return epochs


def migration_summary(segments: Sequence[Segment], expert_bytes: int) -> dict[str, Any]:
    """`rebalances` (placements re-solved, skips excluded), `moved_slots` (slots whose expert
    changed, over all rebalances and layers) and `moved_bytes` (those copies x `expert_bytes`)."""
    done = [s.rebalance for s in segments if s.rebalance is not None and not s.rebalance.skipped]
    moved = sum(r.moved_slots for r in done)
    return {"rebalances": len(done), "moved_slots": moved, "moved_bytes": moved * expert_bytes}


def migration_rows(segments: Sequence[Segment], expert_bytes: int) -> list[dict[str, Any]]:
    """One row per rebalance point: `step`, `skipped`, `balancedness` (of the placement in
    service on the forecast), `moved_slots`, copies by source (`same_gpu`, `same_node`,
    `cross_node`), `bytes` (all copies) and `cross_node_bytes`, for experts of `expert_bytes`."""
    rows = []
    for seg in segments:
        r = seg.rebalance
        if r is None:
            continue
        kinds = dict(zip(TRANSFER_KINDS, r.transfers.sum(0).tolist()))
        rows.append({"step": r.step, "skipped": r.skipped,
                     "balancedness": None if math.isnan(r.balancedness) else r.balancedness,
                     "moved_slots": r.moved_slots, **kinds,
                     "bytes": r.moved_slots * expert_bytes,
                     "cross_node_bytes": kinds["cross_node"] * expert_bytes})
    return rows


def time_series(series: Series, counters: Counters | None, segments: Sequence[Segment],
                mode: str, per_layer: bool = False) -> dict[str, np.ndarray]:
    """Every metric per step (`per_layer`: per step and layer), as columns of equal length.

    Columns: `step` (and `layer`), `pairs` (routed non-padding pairs), the load metrics of
    `summarize` except `replica_skew_cumulative` (a whole-run figure), the three
    `factor_*` columns, `rank_agreement`, `multiplicity_0/1/2+` and `output_rel_error` (NaN in
    "a2a" or without counters), and `moved_slots` (slots changed by a rebalance at that step).
    Per step, ratios of counts are summed over layers first (e.g. agreed / valid pairs); the
    per-(step, layer) ratios are averaged over layers, maxima maximised.
    """
    S, L = series.placement_imbalance.shape
    moved = torch.zeros(S, L, dtype=torch.int64)
    for seg in segments:
        if seg.rebalance is not None and seg.rebalance.step < S:
            moved[seg.rebalance.step] = torch.from_numpy(seg.rebalance.transfers.sum(1))
    none_mode = mode == "none" and counters is not None
    nan = torch.full((S, L), math.nan, dtype=torch.float64)
    agreed = counters.agreed if none_mode else nan
    valid = counters.valid if counters is not None else torch.zeros(S, L, dtype=torch.int64)
    mult = counters.mult if counters is not None else torch.zeros(S, L, 3, dtype=torch.int64)
    error = counters.error if none_mode else torch.full((S, L, 2), math.nan,
                                                        dtype=torch.float64)
    reduce = _by_layer if per_layer else _by_step
    mean, total, peak = reduce("mean"), reduce("sum"), reduce("max")
    columns: dict[str, torch.Tensor] = {
        "pairs": total(valid),
        "gpu_imbalance": mean(series.gpu_imbalance),
        "balancedness": mean(series.balancedness),
        "replica_skew_mean": _ratio(total(series.skew_sum), total(series.skew_count)),
        "replica_skew_max": peak(series.skew_max),
        "idle_replica_frac": _ratio(total(series.idle), total(series.eligible)),
        "placement_imbalance": mean(series.placement_imbalance),
        "placement_gap": mean(series.placement_gap),
        **{f"factor_{k}": mean(v) for k, v in factors(series).items()},
        "rank_agreement": _ratio(total(agreed), total(valid)),
        **{f"multiplicity_{k}": _ratio(total(mult[..., i]), total(mult.sum(-1)))
           for i, k in enumerate(("0", "1", "2+"))},
        "output_rel_error": _ratio(total(error[..., 0]), total(error[..., 1])).sqrt(),
        "moved_slots": total(moved),
    }
    index = {"step": torch.arange(S)} if not per_layer else {
        "step": torch.arange(S).repeat_interleave(L), "layer": torch.arange(L).repeat(S)}
    return {k: v.numpy() for k, v in {**index, **columns}.items()}


def _by_step(how: str):
    """`[S, L] -> [S]`: NaN-aware mean or max over layers, or a plain sum."""
    def reduce(x: torch.Tensor) -> torch.Tensor:
        if how == "sum":
            return x.sum(1)
        if how == "mean":
            return x.nanmean(1)
        return torch.where(x.isnan().all(1), math.nan, x.nan_to_num(-math.inf).amax(1))
    return reduce


def _by_layer(how: str):
    """`[S, L] -> [S * L]` in step-major order."""
    return lambda x: x.flatten()


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den as float64, NaN where den is 0."""
    num, den = num.to(torch.float64), den.to(torch.float64)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), math.nan)
