"""Every metric, declared once: `Metric` and the registry `METRICS` (the package doc says what
a metric is), with the component functions and whole-run figures the entries name.

Dimensions: `L` layers, `P` physical slots, `c` steps of a chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..base.loops import summed
from ..cost.buffers import overflow
from ..cost.rebalance import layer_scale, model_bytes, model_ms, sync_stall_seconds
from ..placement.loads import balancedness, idle_replicas, nanmax_or_none, replica_skew
from ..ranks.fanout import FIELDS
from ..schedule.switch import phases
from ..schedule.transfers import transfer_kinds
from ..traces.layer_kinds import KINDS, learned_layers
from .counters import Chunk
from .gap import placement_gap
from .reductions import (WHOLE, mean, overhead, peak, ratio, root_ratio, shares, step_time,
                         throughput, total)


RATIO, TIME_FMT, COUNT, PERCENT = "ratio", "time", "count", "percent"  # how a table shows it


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


def _some(rows: Sequence[dict], key: str) -> bool:
    """Whether some row has a value for `key`."""
    return any(r.get(key) is not None for r in rows)


def _differs(rows: Sequence[dict], key: str, other: str | None = None) -> bool:
    """Whether some row's `key` differs, as a table shows it, from its `other` (None: from 1)."""
    def shown(value: Any) -> str:
        return "-" if value is None else f"{value:.4f}"
    return any(shown(r.get(key)) != shown(1.0 if other is None else r.get(other)) for r in rows)


def _corrupt(results: Any) -> bool:
    """Whether the run's output is wrong: some pair executed other than once (ranks that
    disagree, "none") or sent to a slot holding another expert ("a2a", while ranks switch)."""
    c = results.counters
    once = c.multiplicity_counts  # [S, L, 3]
    return bool(once[..., 0].sum() + once[..., 2].sum() + c.wrong.sum())


def _rebalances(results: Any) -> int:
    """Placements re-solved on the schedule (skipped rebalances excluded)."""
    return sum(s.rebalance is not None and not s.rebalance.skipped for s in results.segments)


def _moved_bytes(results: Any) -> int:
    """Bytes copied by every rebalance in the whole model, as the stalls count them: moved
    slots x the run's expert bytes (`RunSpec.expert_bytes`) x the model's layers each of the
    trace's stands for (`layer_scale`)."""
    slots = int(results.components["moved_slots"][0].sum())
    scale = layer_scale(results.spec.cost, results.true_load.shape[1])
    return model_bytes(slots, results.spec.expert_bytes(), scale)


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
        out.append((seg.start, model_ms(seconds, scale)))
    return out


def _stall_ms(results: Any) -> float:
    """Milliseconds serving stalled for every rebalance's copies, in all."""
    return sum(ms for _, ms in rebalance_stalls(results))


def _engine_moved(key: str) -> Callable[[Any], Any]:
    """A whole-run figure of the rebalances moved by the engine's own updater
    (`migration.replayed`), None under eplbsim's own migration model."""
    def figure(results: Any) -> Any:
        moves = results.engine_moves()
        return None if moves is None else moves["totals"][key]
    figure.__name__ = f"_{key}"
    return figure


def _cost_source(results: Any) -> str:
    """What the run's compute times come from (the measured table, for `measured`)."""
    return results.spec.cost.describe(results.spec.topology.gpus)


def _fanout(chunk: Chunk, num: str, den: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns `num` over `den` of the chunk's fan-out counts (`Counters.fanout`, columns
    `fanout.FIELDS`), `[c, L]` each: the distinct GPUs (nodes) a token's executed choices
    reach, per token with a valid pair; the share of those GPUs that are not the token's
    source GPU."""
    counts = chunk.counters.fanout
    return counts[..., FIELDS.index(num)], counts[..., FIELDS.index(den)]


def _fetched_per_gpu(chunk: Chunk) -> tuple[torch.Tensor]:
    """The distinct experts a GPU fetched, the mean over GPUs, `[c, L]` (a spill policy's)."""
    return (chunk.counters.fetched.sum(-1).to(torch.float64).mean(-1),)


def _fetch_bytes(results: Any) -> int:
    """Bytes a spill policy's GPUs fetched in a step, all GPUs, the whole model: the run's
    fetched experts x the expert bytes (`RunSpec.expert_bytes`) x the model's layers each of the
    trace's stands for (`layer_scale`), over the steps."""
    steps = max(results.true_load.shape[0], 1)
    scale = layer_scale(results.spec.cost, results.true_load.shape[1])
    return model_bytes(int(results.counters.fetched.sum()) / steps,
                       results.spec.expert_bytes(), scale)


def _dispatch_cap(results: Any) -> int | None:
    """The most tokens a rank may dispatch a step (`CostPart.buffer_cap` for the run's physical
    slots), None when the run names no buffer."""
    return results.spec.cost.buffer_cap(results.segments[0].placement.num_slots)


def _peak_tokens(results: Any) -> int | None:
    """The most tokens one rank dispatched in one step (`Results.rank_tokens`)."""
    tokens = results.rank_tokens
    return None if tokens is None else (int(tokens.max()) if tokens.numel() else 0)


def _overflow_steps(results: Any) -> int | None:
    """Steps whose busiest rank dispatched more tokens than the cap (`cost.buffers.overflow`),
    None without a cap."""
    cap = _dispatch_cap(results)
    if cap is None or results.rank_tokens is None:
        return None
    return int(overflow(results.rank_tokens, cap).sum())


def _failure(key: str) -> Callable[[Any], Any]:
    """A whole-run figure of what dead ranks did (`Results.failure`, `replay.dead_ranks`),
    None when no rank died."""
    def figure(results: Any) -> Any:
        return None if results.failure is None else getattr(results.failure, key)
    figure.__name__ = f"_{key}"
    return figure


def _of_kind(key: str, kind: str) -> Callable[[Any], Any]:
    """A whole-run figure: metric `key` reduced over the layers of one kind alone ("hash":
    routed by token id, "learned": by the router; `Results.hash_layers`), as the run's figure
    is over all; None when the run has no hash-routed layer or none of that kind."""
    def figure(results: Any) -> Any:
        hashed = results.hash_layers
        L = results.true_load.shape[1]
        layers = list(hashed if kind == "hash" else learned_layers(L, hashed))
        if not hashed or not layers:
            return None
        value = float(METRICS[key].reduce(*(part[:, layers] for part in
                                            results.components[key]), dims=WHOLE))
        return None if math.isnan(value) else value
    figure.__name__ = f"_{key}_{kind}"
    return figure


def _step_tokens(chunk: Chunk) -> torch.Tensor:
    """Each step's tokens on every layer, `[c, L]`."""
    return chunk.counters.tokens.unsqueeze(1).expand(chunk.counters.valid.shape)


EXECUTED, COUNTERS, COST, SOLVED, SPILL = "executed", "counters", "cost", "solved", "spill"


DECOMPOSITION, TIME = frozenset({"decomposition"}), frozenset({"time"})


METRICS: dict[str, Metric] = {
    "gpu_imbalance": Metric("gpu_imb", lambda c: (c.imbalance,), needs=EXECUTED,
                            tables=frozenset({"main", "decomposition"})),
    "active_imbalance": Metric("active_imb", lambda c: (c.active_imbalance,), needs=EXECUTED,
                               tables=frozenset()),
    "gpu_imbalance_with_shared": Metric(
        "imb+shared", lambda c: (c.imbalance_with_shared,), needs=EXECUTED,
        shown=lambda rows: _some(rows, "gpu_imbalance_with_shared")),
    "balancedness": Metric("balanced", lambda c: (balancedness(c.gpu_load),), needs=EXECUTED),
    "fanout_gpus": Metric("fanout", lambda c: _fanout(c, "gpus", "tokens"), ratio, needs=COST,
                          shown=lambda rows: _some(rows, "fanout_gpus")),
    "fanout_nodes": Metric("nodes", lambda c: _fanout(c, "nodes", "tokens"), ratio, needs=COST,
                           shown=lambda rows: _some(rows, "fanout_nodes")
                           and _differs(rows, "fanout_nodes")),
    "remote_frac": Metric("remote", lambda c: _fanout(c, "remote", "gpus"), ratio, needs=COST,
                          modes=("a2a",), shown=lambda rows: _some(rows, "remote_frac")),
    "replica_skew_mean": Metric("skew_mean", _skew_parts, ratio, needs=EXECUTED),
    "replica_skew_max": Metric("skew_max", _skew_peak, peak, needs=EXECUTED),
    "replica_skew_cumulative": Metric("skew_cum", whole=_skew_cumulative, needs=EXECUTED),
    "idle_replica_frac": Metric(
        "idle", lambda c: idle_replicas(c.executed, c.routed, c.placement, c.replicas), ratio,
        needs=EXECUTED),
    "placement_imbalance": Metric("promise", lambda c: (c.promise,)),
    **{f"{key}_{kind}": Metric(f"{header}_{kind}", whole=_of_kind(key, kind), needs=needs,
                               shown=lambda rows, k=f"{key}_{kind}": _some(rows, k))
       for key, header, needs in (("gpu_imbalance", "gpu_imb", EXECUTED),
                                  ("placement_imbalance", "promise", None))
       for kind in KINDS},
    "placement_gap": Metric("gap", lambda c: (placement_gap(c.placement, c.routed),),
                            shown=lambda rows: _differs(rows, "placement_gap",
                                                        "placement_imbalance")),
    "executed_work": Metric("work", lambda c: (c.gpu_load.sum(-1), c.counters.valid), ratio,
                            needs=COUNTERS, shown=lambda rows: _differs(rows, "executed_work")),
    "output_corrupt": Metric("corrupt", whole=_corrupt, needs=COUNTERS, tables=frozenset()),
    "rank_agreement": Metric("agree", lambda c: (c.counters.agreed, c.counters.valid), ratio,
                             needs=COUNTERS, modes=("none",)),
    "multiplicity": Metric(("c=0", "c=1", "c>=2"),
                           lambda c: c.counters.multiplicity_counts.unbind(-1),
                           shares, needs=COUNTERS, subkeys=("0", "1", "2+")),
    "output_rel_error": Metric("out_err", lambda c: c.counters.error.unbind(-1), root_ratio,
                               needs=COUNTERS, modes=("none",)),
    "wrong_expert_frac": Metric("wrong", lambda c: (c.counters.wrong, c.counters.valid), ratio,
                                needs=COUNTERS, modes=("a2a",)),
    "spill_frac": Metric("spill", lambda c: (c.counters.spilled.sum(-1), c.counters.valid),
                         ratio, needs=SPILL, shown=lambda rows: _some(rows, "spill_frac")),
    "fetched_experts": Metric("fetched", _fetched_per_gpu, needs=SPILL,
                              shown=lambda rows: _some(rows, "fetched_experts")),
    "fetch_bytes": Metric("fetch_bytes", whole=_fetch_bytes, needs=SPILL, fmt=COUNT,
                          tables=frozenset()),
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
    **{key: Metric(header, whole=_engine_moved(key), needs=EXECUTED, fmt=fmt, tables=tables,
                   shown=lambda rows, key=key: _some(rows, key))
       for key, header, fmt, tables in (
           ("slot_mismatch", "slot_mis", RATIO, frozenset({"main"})),
           ("lost_experts", "lost", COUNT, frozenset({"main"})),
           ("map_mismatch", "map_mis", COUNT, DECOMPOSITION),
           ("moved_wrong_frac", "moved_wrong", RATIO, frozenset({"main"})),
           ("engine_copies_nvlink", "eng_nvlink", COUNT, DECOMPOSITION),
           ("engine_copies_rdma", "eng_rdma", COUNT, DECOMPOSITION),
           ("engine_p2p_ops", "eng_p2p", COUNT, DECOMPOSITION),
           ("engine_moved_bytes", "eng_bytes", COUNT, frozenset()),
           ("engine_cross_node_bytes", "eng_xnode_bytes", COUNT, frozenset()),
           ("first_wrong_step", "wrong_from", COUNT, frozenset({"main"})))},
    "dispatch_cap_tokens": Metric("cap", whole=_dispatch_cap, needs=COUNTERS, modes=("a2a",),
                                  fmt=COUNT, shown=lambda rows: _some(rows, "dispatch_cap_tokens")),
    "dispatch_peak_tokens": Metric("peak_tok", whole=_peak_tokens, needs=COUNTERS,
                                   modes=("a2a",), fmt=COUNT,
                                   shown=lambda rows: _some(rows, "dispatch_cap_tokens")),
    "buffer_overflow_steps": Metric("overflow", whole=_overflow_steps, needs=COUNTERS,
                                    modes=("a2a",), fmt=COUNT,
                                    shown=lambda rows: _some(rows, "dispatch_cap_tokens")),
    "lost_frac": Metric("lost_frac", whole=_failure("lost_frac"),
                        shown=lambda rows: _some(rows, "lost_frac")),
    "repair_copies": Metric("repairs", whole=_failure("copies"), fmt=COUNT,
                            shown=lambda rows: _some(rows, "lost_frac")),
    "repair_bytes": Metric("repair_bytes", whole=_failure("repair_bytes"), fmt=COUNT,
                           tables=frozenset()),
    "repair_disk_bytes": Metric("disk_bytes", whole=_failure("repair_disk_bytes"), fmt=COUNT,
                                tables=frozenset()),
    "repair_ms": Metric("repair_ms", whole=_failure("repair_ms"), fmt=TIME_FMT,
                        shown=lambda rows: _some(rows, "lost_frac")),
    "layer_us": Metric("layer_us", lambda c: (c.seconds["total"] * 1e6,), needs=COST,
                       tables=TIME, fmt=TIME_FMT),
    "moe_ms": Metric("moe_ms", lambda c: (c.ms("total"),), step_time, needs=COST, tables=TIME,
                     fmt=TIME_FMT),
    "compute_ms": Metric("compute_ms", lambda c: (c.ms("compute"),), step_time, needs=COST,
                         tables=TIME, fmt=TIME_FMT),
    "comm_ms": Metric("comm_ms", lambda c: (c.ms("comm"),), step_time, needs=COST, tables=TIME,
                      fmt=TIME_FMT),
    "fetch_ms": Metric("fetch_ms", lambda c: (c.ms("fetch"),), step_time, needs=COST,
                       tables=TIME, fmt=TIME_FMT, shown=lambda rows: _some(rows, "spill_frac")),
    "moe_ms_balanced": Metric("balanced_ms", lambda c: (c.ms("total_balanced"),), step_time,
                              needs=COST, tables=TIME, fmt=TIME_FMT),
    "imbalance_overhead": Metric(
        "overhead", lambda c: (c.seconds["total"], c.seconds["total_balanced"]), overhead,
        needs=COST, tables=TIME, fmt=PERCENT),
    "moe_tokens_per_s": Metric("tokens/s", lambda c: (_step_tokens(c), c.ms("total") / 1e3),
                               throughput, needs=COST, tables=TIME, fmt=COUNT),
    "rebalance_stall_ms": Metric("stall_ms", whole=_stall_ms, needs=COST, tables=TIME,
                                 fmt=TIME_FMT),
    "engine_stall_ms": Metric("eng_stall_ms", whole=_engine_moved("engine_stall_ms"),
                              needs=COST, tables=TIME, fmt=TIME_FMT,
                              shown=lambda rows: _some(rows, "engine_stall_ms")),
    "cost_source": Metric("cost_source", whole=_cost_source, needs=COST, tables=frozenset()),
}
