"""Metrics, each declared once in `METRICS`, and the pure functions they are built from.

Holds `METRICS` (`declared`), their reductions, the chunks they read (`Counters`,
`Chunk`), the placement gap and the evaluation (summary, time series). Takes in counted loads
and `Results`; gives out figures. Imports `base`, `placement`, `cost`, `solvers` (the lower
bound), `traces` (which layers are hash-routed), `ranks` (the fan-out fields) and `schedule`
(phases and transfers).

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

By concern: `declared` (the `Metric` type and the registry), `reductions` (what components go
through), `chunks` (what components read: `Counters`, `Chunk`), `gap` (a placement against the
bound), `evaluation` (summary and time series); the pure load functions they share with the
trace summaries live below both, in `eplbsim.placement.loads`, and are re-exported here.
"""

from __future__ import annotations

from ..cost.rebalance import layer_scale
from ..placement.loads import (ReplicaStats, balancedness, gini, gpu_imbalance, gpu_loads,
                               idle_replicas, max_over_mean, multiplicity_counts, nanmax_or_none,
                               nanmean_or_none, replica_loads, replica_skew, replica_stats,
                               top_share)
from .counters import SUMMARY_CHUNK, Chunk, Counters, chunks, gpu_work
from .declared import (COST, COUNT, COUNTERS, DECOMPOSITION, EXECUTED, METRICS, PERCENT, RATIO,
                       SOLVED, SPILL, TIME, TIME_FMT, Metric, rebalance_stalls)
from .evaluation import components, summary, time_series
from .gap import placement_gap, placement_report
from .reductions import (PER_LAYER, PER_STEP, WHOLE, mean, overhead, peak, ratio, root_ratio,
                         shares, step_time, throughput, total)

__all__ = ["COST", "COUNT", "COUNTERS", "DECOMPOSITION", "EXECUTED", "METRICS", "PERCENT",
           "PER_LAYER", "PER_STEP", "RATIO", "SOLVED", "SPILL", "SUMMARY_CHUNK", "TIME", "TIME_FMT",
           "WHOLE", "Chunk", "Counters", "Metric", "ReplicaStats", "balancedness", "chunks",
           "components", "gini", "gpu_imbalance", "gpu_loads", "gpu_work", "idle_replicas",
           "layer_scale", "max_over_mean", "mean", "multiplicity_counts", "nanmax_or_none",
           "nanmean_or_none", "overhead", "peak", "placement_gap", "placement_report", "ratio",
           "rebalance_stalls", "replica_loads", "replica_skew", "replica_stats", "root_ratio",
           "shares", "step_time", "summary", "throughput", "time_series", "top_share", "total"]
