"""Results of a run, and their forms: rows, text tables, JSON, CSV (no plotting).

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs.

A row is `Results.row()`: every setting of the run (`RunSpec.labels`: policy, mode, view, rng,
..., solver, ..., gpus, ...) and then every metric of `metrics.METRICS`, with `multiplicity` as
`{"0": f0, "1": f1, "2+": f2}` and None where a metric is undefined. Flat rows (CSV, sweep
tables) spread a dict-valued metric into `KEY_SUB` columns and options into `PREFIX.NAME`
columns. Time series are columns of equal length (`Results.time_series()`); migration rows come
from `Results.migrations()`.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .. import metrics as M
from ..base.errors import InputError
from ..base.files import atomic_file
from ..base.registry import name_of
from ..cost.catalog import model_note
from ..cost.catalog import model_origin as origin_of
from ..cost.rebalance import layer_scale
from ..dispatch import ENGINE_POLICIES, POLICIES, resolve_policy
from ..engines import as_sources, auto_algorithm, engine_code
from ..engines import label as engine_label
from ..metrics import METRICS, Counters
from ..placement import Placement
from ..runspec import MIN_REDUNDANT, Options, RunSpec, knobs, label
from ..schedule.plan import Segment, epochs
from ..schedule.transfers import MIGRATION_FIELDS, migration_rows
from ..traces import RunTrace
from ..traces.counts import CountsTrace
from ..traces.steps import describe_selection, flag_steps, flag_words

COUNTS_ONLY_POLICY = "(even split)"  # the policy a counts-only run reports: no dispatch ran
FLAG_SCAN_IDS = 2**28  # a run's header scans a trace of at most this many ids for warm-up steps


@dataclass(frozen=True, eq=False)
class Results:
    """What one run counted, and everything derived from it.

    spec:      the run's settings
    slot_load: int32 `[S, L, P]` executed pairs per slot (int64 for steps of 2**31 tokens or
               more: `Trace.load_dtype`); None for counts only (no dispatch)
    true_load: `[S, L, E]` routed pairs per logical expert, int32 likewise (int64 for counts)
    segments:  the schedule's segments in step order (`schedule.Segment`)
    counters:  the per-(step, layer) rank counts (`metrics.Counters`); None for counts only
    warnings:  what the run warns of (`run_warnings`), as `replay` and `compare` told their
               caller; shown when the results are printed
    rank_tokens: int64 `[S, G]` tokens each rank dispatches in "a2a" (`ranks.dispatched`), what
               its dispatch buffer must hold; None for counts only
    hash_layers: the layers routed by token id (`traces.layer_kinds`), whose figures the
               metrics of each kind (`*_hash`, `*_learned`) show apart; empty when none is
    failure:   what dead ranks did (`dead_ranks.Failure`: the run is then the survivors' from
               the failure on), None when no rank died
    Derived on first use: `components` (every metric per step and layer), `metrics` (their
    values over the run, in `METRICS` order).
    """

    spec: RunSpec
    slot_load: torch.Tensor | None
    true_load: torch.Tensor
    segments: tuple[Segment, ...]
    counters: Counters | None
    warnings: tuple[str, ...] = ()
    rank_tokens: torch.Tensor | None = None
    hash_layers: tuple[int, ...] = ()
    failure: Any = None

    @property
    def present(self) -> set[str]:
        """What the run has beyond routed loads: "executed", "counters", "cost" when both are
        there and the spec names a cost model, "spill" when its policy spills, and "solved" when its placements were solved
        (not one given placement)."""
        have = {k for k, v in ((M.EXECUTED, self.slot_load), (M.COUNTERS, self.counters))
                if v is not None}
        if len(have) == 2 and self.spec.cost.cost is not None:
            have.add(M.COST)
        if self.counters is not None and self.counters.spilled.shape[-1]:
            have.add(M.SPILL)
        return have | ({M.SOLVED} if self.spec.solver.placement is None else set())

    @property
    def epochs(self) -> list[tuple[int, int, Placement]]:
        """`(start, stop, placement)` of each stretch of steps on one placement."""
        return epochs(self.segments)

    @cached_property
    def components(self) -> dict[str, tuple[torch.Tensor, ...] | None]:
        """Every per-(step, layer) metric's components, `[S, L]` each (`metrics.components`)."""
        S, L, _ = self.true_load.shape
        spec = self.spec
        chunked = M.chunks(self.slot_load, self.true_load, self.counters, self.segments,
                           spec.topology.gpus, spec.cost, spec.dispatch.mode,
                           spec.shared_work(), spec.expert_bytes(), spec.spill_gathers())
        return M.components(chunked, S, L, self.present)

    @cached_property
    def metrics(self) -> dict[str, Any]:
        """Every metric over the whole run (`metrics.summary`)."""
        return M.summary(self)

    @property
    def policy(self) -> str:
        return COUNTS_ONLY_POLICY if self.slot_load is None else self.spec.labels()["policy"]

    @property
    def solver(self) -> str:
        """The solver's name, or "given" when a placement served every step."""
        if self.spec.solver.placement is not None:
            return "given"
        return name_of(self.spec.solver.solver)

    def row(self) -> dict[str, Any]:
        """The run's settings, then its metrics: one table row. A counts-only run reports the
        policy "(even split)" and "-" for every other dispatch setting."""
        labels = self.spec.labels()
        engine = engine_code((self.spec.dispatch.policy, self.spec.solver.solver),
                     self.spec.dispatch.engine_source)
        if engine is not None:
            labels["engine"] = engine
        d = self.spec.dispatch
        if d.policy == "sglang:auto" and self.segments:
            labels["picked"] = auto_algorithm(self.segments[0].placement, d.mode,
                                              d.engine_source, d.engine_args or "")
        if self.slot_load is None:
            labels.update({name: "-" for _, name, _ in knobs(("dispatch",))},
                          policy=COUNTS_ONLY_POLICY)
        if self.failure is not None:  # the survivors' run: its labels say who died
            f = self.failure
            labels.update(fail_ranks=list(f.dead), fail_at=f.at, recovery=f.recovery)
        return {**labels, **self.metrics}

    def time_series(self, per_layer: bool = False) -> dict[str, np.ndarray]:
        """Every per-(step, layer) metric per step (or per step and layer):
        `metrics.time_series` columns."""
        return M.time_series(self, per_layer)

    def migrations(self) -> Rows:
        """One row per rebalance point: `schedule.transfers.migration_rows`, with its columns
        named even when there is none; its bytes are the whole model's, as the stalls are."""
        scale = layer_scale(self.spec.cost, self.true_load.shape[1])
        return Rows(migration_rows(self.segments, self.spec.expert_bytes(), scale),
                    MIGRATION_FIELDS)

    def engine_moves(self) -> dict[str, Any] | None:
        """The run's rebalances as its `--migration` engine's updater moved them
        (`migration.replayed.engine_moves`); None under eplbsim's own migration model."""
        from ..migration.replayed import engine_moves
        return engine_moves(self)

    def to_pandas(self, series: bool = False, per_layer: bool = False) -> Any:
        """A pandas DataFrame: the run's row with flat columns (`flat_row`, as the CSV), or with
        `series` its time series (`time_series(per_layer)`). Needs pandas (the `notebooks`
        extra)."""
        pd = _pandas()
        return pd.DataFrame(self.time_series(per_layer)) if series else \
            pd.DataFrame([flat_row(self.row())])

    def __repr__(self) -> str:
        S, L, P = (*self.true_load.shape[:2], self.segments[0].placement.num_slots)
        shown = ", ".join(f"{k} {_cell(v, METRICS[k].fmt)}" for k in REPR_METRICS
                          if (v := self.metrics.get(k)) is not None)
        return (f"Results({self.policy}, {self.spec.dispatch.mode}: {S} steps x {L} layers, "
                f"P={P}; {shown})" + "".join(f"\nwarning: {w}" for w in self.warnings))


REPR_METRICS = ("gpu_imbalance", "replica_skew_max", "rank_agreement", "moe_ms")  # in a repr


class Comparison(list):
    """The Results of one comparison (`replay.compare`), in order: a list that shows itself as
    the run command's tables (the time table too when a cost model prices it) with what the
    run warns of (`warnings`, as `run_warnings`), and turns into a DataFrame."""

    def __init__(self, results: Iterable[Results] = (), warnings: Sequence[str] = ()) -> None:
        super().__init__(results)
        self.warnings = tuple(warnings)

    def rows(self) -> list[dict[str, Any]]:
        """Every run's row (`Results.row`)."""
        return [r.row() for r in self]

    def to_pandas(self) -> Any:
        """A pandas DataFrame, one row per run with flat columns (`flat_row`, as the CSV)."""
        return _pandas().DataFrame([flat_row(row) for row in self.rows()])

    def __repr__(self) -> str:
        if not self:
            return "Comparison([])"
        rows = self.rows()
        lines = [f"warning: {w}" for w in self.warnings] + [format_table(rows)]
        lines += table_notes(rows)
        if self[0].spec.cost.cost is not None:
            lines += ["", time_report(self[0].spec, rows, self[0].true_load.shape[1])]
        return "\n".join(lines)


def _pandas() -> Any:
    """pandas, or an ImportError saying how to install it."""
    try:
        import pandas
    except ImportError:
        raise ImportError("to_pandas needs pandas: pip install pandas (or the notebooks "
                          "extra, pip install 'eplbsim[notebooks]')") from None
    return pandas


# ----------------------------------------------------------------------------- text tables

MIGRATION_COLUMNS = tuple((key, key, None) for key in (
    "step", "skipped", "balancedness", "moved_slots", "same_gpu", "same_node", "cross_node",
    "bytes"))


def _cell(value: Any, fmt: str = M.RATIO) -> str:
    """One table cell: `-` for None, a float as its metric's `fmt` says (`Metric.fmt`)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if fmt == M.TIME_FMT:  # 4 significant digits, never in exponent form
            digits = 3 - math.floor(math.log10(abs(value))) if value else 0
            return f"{value:.{max(digits, 0)}f}"
        if fmt == M.COUNT:
            return f"{value:,.0f}"
        if fmt == M.PERCENT:
            return f"{value:+.1%}"
        return f"{value:.3g}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


def table_columns(rows: Sequence[dict[str, Any]], table: str = "main") -> tuple[tuple, int]:
    """`(columns, labels)` for `format_table`: `policy`, `mode` and every other setting whose
    value differs between the rows, then the columns of every metric shown in `table`
    ("main", "decomposition" or "time") that says something about these rows
    (`Metric.shown`)."""
    settings = [k for k in (rows[0] if rows else {}) if k not in METRICS
                and k not in ("speedup", "picked")  # `picked`: a note says it
                and not (k == "engine_source" and "engine" in rows[0])]  # `engine` names it
    shown = [k for k in settings if k in ("policy", "mode") or len(
        {json.dumps(r.get(k), sort_keys=True, default=str) for r in rows}) > 1]
    columns = [(k, k, None) for k in shown]
    for key, metric in METRICS.items():
        if table in metric.tables and (metric.shown is None or metric.shown(rows)):
            columns += metric.columns(key)
    return tuple(columns), len(shown)


def format_table(rows: Iterable[dict[str, Any]], columns: tuple | None = None,
                 labels: int | None = None) -> str:
    """A fixed-width text table, one line per row; `-` where a value is undefined.

    columns: `(header, row key, sub-key or None)` triples, default `table_columns(rows)`; the
    first `labels` columns are left-aligned, the rest right-aligned. A metric's values are
    shown as its `Metric.fmt` says."""
    rows = list(rows)
    if columns is None:
        columns, shown = table_columns(rows)
        labels = shown if labels is None else labels
    labels = 2 if labels is None else labels
    header = [h for h, _, _ in columns]
    fmts = [METRICS[key].fmt if key in METRICS else M.RATIO for _, key, _ in columns]
    body = [[_cell(row.get(key) if sub is None else (row.get(key) or {}).get(sub), fmt)
             for (_, key, sub), fmt in zip(columns, fmts)] for row in rows]
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    lines = ["  ".join(c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths))) for line in [header] + body]
    return "\n".join(lines)


def table_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the main table's rows need said beside them: the dispatch algorithm each
    `sglang:auto` row ran (the release's pick, `picked`), and what `gpu_imb` counts when some
    ranks executed pairs other than once (the `work` column)."""
    picks = dict.fromkeys(f"sglang:auto: {r.get('engine', 'sglang')} picked {r['picked']} "
                          f"in {r['mode']}" for r in rows if "picked" in r)
    notes = [*picks, *_identical(rows)]
    if not M.METRICS["executed_work"].shown(rows):
        return notes
    return [*notes, "work: pairs executed over pairs routed. gpu_imb counts executed work, "
            "so a pair executed twice (c>=2) weighs twice and a dropped one (c=0) not at all: "
            "a policy whose ranks disagree can look balanced while its output is wrong."]


def _identical(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line for each set of policies whose rows agree in every metric in some mode: "vllm:hash
    gives the same numbers as row in every column (none, a2a)": on this trace and placement
    they choose alike (a row's hash keeps its parity, and with two replicas of an expert that
    is all a choice reads; a release whose dynamic dispatch falls back to its static one), so
    the equal rows are not taken for one row shown twice."""
    same: dict[tuple[str, ...], list[str]] = {}
    groups: dict[tuple[str, Any], list[str]] = {}
    for r in rows:
        values = json.dumps({k: r.get(k) for k in METRICS}, sort_keys=True, default=str)
        name = r["policy"] + (f" ({r['engine']})" if r.get("engine") else "")
        groups.setdefault((r["mode"], values), []).append(name)
    for (mode, _), names in groups.items():
        if len(names) > 1:
            same.setdefault(tuple(names), []).append(mode)
    return [f"{', '.join(names[1:])} give{'s' if len(names) == 2 else ''} the same numbers as "
            f"{names[0]} in every column ({', '.join(modes)}): they choose alike on this trace "
            f"and placement" for names, modes in same.items()]


def describe(trace: RunTrace, spec: RunSpec, asked: RunSpec | None = None,
             policies: Sequence[Any] = (), sources: int = 1) -> str:
    """One line: the trace's sizes (and the steps selected), the run's topology, slots,
    solver or given placement, view, rng and seed, the model and where it came from when time
    is priced, the shared experts counted or the model is not the default (given, or named by
    the trace, as `--json` names it), the shared experts when counted, and the engine code
    that ran.
    `asked`: the spec as given, before the slots were fitted to the trace (`RunSpec.fit`) and
    the shared experts shared by a comparison of `policies` (`RunSpec.sharing`), so the line
    can say where each came from. `sources`: the engine source sets the run compares (with
    more than one, the rows name the engine code, not this line)."""
    source = trace.meta.get("scenario") or trace.meta.get("source") or "trace"
    topo = spec.topology.topology()
    P = trace.num_experts + spec.topology.redundant
    selected = describe_selection(trace.meta)
    d = spec.dispatch
    failed = asked is not None and bool(asked.topology.fail_ranks)
    chose = (asked if failed else spec).solver  # the survivors serve a recovery of its placement
    decided = (f"placement {label(chose.placement)}" if chose.placement is not None
               else f"solver {name_of(chose.solver)}"
               + ("" if chose.solve_from == "all" else f" from the {chose.solve_from} steps")) \
        + (f", then recovery {asked.topology.recovery} on the survivors" if failed else "")
    counts_only = isinstance(trace, CountsTrace)
    steps = (f"counts only, {plural(trace.num_steps, 'step')}" if counts_only else
             step_words(trace))
    return (f"{source}: {steps}{f' ({selected})' if selected else ''}, "
            f"{layer_words(trace.num_layers, trace.meta.get('model_layers'))}, "
            f"E={trace.num_experts}{'' if counts_only else f', K={trace.top_k}'} | "
            f"{topo.num_gpus} GPUs ({topo.gpus_per_node}/node), P={P} slots"
            f"{_slot_words(spec, asked, trace)}, {decided}"
            + ("" if counts_only else f", {_view_words(spec, policies)}, rng {d.rng}, "
                                      f"seed {d.seed}")
            + (f", {_model_words(trace, spec, asked)}"
               if spec.cost.cost is not None or spec.shared_work()
               or not model_origin(trace.meta, asked).startswith("the default") else "")
            + ("" if counts_only else _shared_words(spec, asked, policies))
            + (_engine_words(spec, policies) if sources == 1 else ""))


def plural(count: int, noun: str) -> str:
    """"1 layer", "4 layers"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def step_words(trace: RunTrace) -> str:
    """"32 steps x 512 tokens" when every step holds as many tokens, else "129 steps of 33.8
    tokens on average" (3 significant digits)."""
    sizes = trace.tokens_per_step
    if len(sizes) and int(sizes.min()) == int(sizes.max()):
        return f"{plural(trace.num_steps, 'step')} x {plural(int(sizes[0]), 'token')}"
    mean = trace.num_tokens / max(trace.num_steps, 1)
    return f"{plural(trace.num_steps, 'step')} of {mean:.3g} tokens on average"


def layer_words(num_layers: int, model_layers: Sequence[int] | None) -> str:
    """"4 layers", or with the model's own layer numbers (`meta["model_layers"]`) when they
    are not the trace's positions: "1 layer (the model's 8)", "2 layers (the model's 3, 7)"."""
    words = plural(num_layers, "layer")
    if model_layers is None or list(model_layers) == list(range(num_layers)):
        return words
    shown = ", ".join(map(str, list(model_layers)[:8])) + (", ..." if num_layers > 8 else "")
    return f"{words} (the model's {shown})"


def _view_words(spec: RunSpec, policies: Sequence[Any]) -> str:
    """"view full", or what the rows of the engines' own dispatch read instead (each engine
    builds its own replica lists from the placement, whatever `--view` says)."""
    names = [*policies] or [spec.dispatch.policy]
    engines = [p for p in names if isinstance(p, str) and p in ENGINE_POLICIES]
    view = f"view {name_of(spec.dispatch.view)}"
    if not engines:
        return view
    if len(engines) == len(names):
        return "view: each engine's own replica lists"
    return f"{view} (the engines' rows: each engine's own replica lists)"


def _engine_words(spec: RunSpec, policies: Sequence[Any]) -> str:
    """", engine code sglang 0.5.16" naming the engine code the run's engine algorithms ran
    (`engines.engine_code`), and ", weights moved by vllm 0.33.0" the engine whose updater moved the
    weights (`--migration`); or ""."""
    code = engine_code([*policies, spec.dispatch.policy, spec.solver.solver],
               spec.dispatch.engine_source)
    migration = spec.schedule.migration
    moved = "" if migration == "eplbsim" else \
        f", weights moved by {engine_label(migration, as_sources(spec.dispatch.engine_source))}"
    return (f", engine code {code}" if code else "") + moved


def _model_words(trace: RunTrace, spec: RunSpec, asked: RunSpec | None) -> str:
    """"model NAME (M MoE layers; the trace holds L; where it came from)"."""
    return (f"model {spec.cost.name} ({spec.cost.shape.moe_layers} MoE layers; the trace "
            f"holds {trace.num_layers}; {model_origin(trace.meta, asked)})")


def model_origin(meta: dict, asked: RunSpec | None) -> str:
    """Where a run's model came from: "given" (`asked`, the spec before
    `replay.spec_for_trace`, names one; or `asked` is None), the trace's meta, or the default
    (`cost.catalog.model_origin`)."""
    return origin_of(meta, asked is None or asked.cost.model is not None)


def run_warnings(trace: RunTrace, spec: RunSpec, asked: RunSpec | None,
                 windows: Sequence[tuple[str, int, int]] = ()) -> list[str]:
    """What a run warns of, one message each (the header prints each after "warning: "; a
    Python caller gets each as a `RunWarning`): when a cost model prices the time, a model
    whose experts or top-k differ from the trace's, or the default priced for a model the
    trace names but eplbsim does not know (`cost.catalog.model_note`, one line); and the
    flagged warm-up and outlier steps (`traces.steps.flag_steps`) in each `(name, start,
    stop)` window of steps (default: the whole trace, "the trace"). A trace of more than
    `FLAG_SCAN_IDS` ids is not scanned for them: that would read it all once more (`trace
    info` scans any trace)."""
    out = []
    if spec.cost.cost is not None:
        note = model_note(spec.cost.name, spec.cost.shape, model_origin(trace.meta, asked),
                          trace.num_experts, getattr(trace, "top_k", None))
        if note:
            out.append(note)
    if isinstance(trace, CountsTrace) or math.prod(trace.ids_shape) > FLAG_SCAN_IDS:
        return out
    flags = flag_steps(trace)
    names = trace.log_steps()  # the log's own
    for name, lo, hi in windows or [("the trace", 0, trace.num_steps)]:
        words = flag_words(flags, lo, hi, names)
        if words:
            out.append(f"{name} holds {words}")
    return out


def _slot_words(spec: RunSpec, asked: RunSpec | None, trace: RunTrace) -> str:
    """" (redundant R, ...)" saying where the redundant slots came from, when not given."""
    if asked is None or asked.topology.redundant is not None:
        return ""
    if spec.solver.placement is not None or spec.schedule.initial is not None:
        return f" (redundant {spec.topology.redundant}: the placement file's)"
    least = max(MIN_REDUNDANT, spec.topology.gpus)
    got = spec.topology.redundant
    if got == least:
        return ""
    return (f" (redundant {got}: the default {least}, one a GPU and at least {MIN_REDUNDANT}, "
            f"rounded up so {spec.topology.gpus} GPUs divide the {trace.num_experts + got} "
            f"slots)")


def _shared_words(spec: RunSpec, asked: RunSpec | None = None,
                  policies: Sequence[Any] = ()) -> str:
    """", shared experts N (...)" when `spec` counts them, saying why; else ""."""
    work = spec.shared_work()
    if not work:
        return ""
    given = (asked or spec).dispatch.shared_experts
    count = given if given is not None else (spec.dispatch.shared_experts
                                             or spec.cost.shape.shared_experts)
    placers = [name_of(p, POLICIES) for p in policies if resolve_policy(p)[1].places_shared]
    why = ("given" if given is not None else
           f"{', '.join(placers)} place{'s' if len(placers) == 1 else ''} them, so every row "
           f"counts them" if placers else "the cost model prices the model's whole layer")
    return (f", shared experts {count} ({work:g} routed pair{'' if work == 1 else 's'} of work "
            f"a token and layer: {why})")


def with_speedup(rows: Sequence[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """The rows with `speedup`: the `baseline` policy's `moe_ms` in the same mode over the
    row's (above 1: faster than the baseline); None for a row whose output is wrong
    (`output_corrupt`): its time is no speedup. InputError when a mode has no baseline row."""
    base = {r["mode"]: r.get("moe_ms") for r in rows if r["policy"] == baseline}
    missing = sorted({r["mode"] for r in rows} - set(base))
    if missing:
        raise InputError(f"--baseline {baseline}: no such row in mode {', '.join(missing)}; "
                         f"the policies are {', '.join(dict.fromkeys(r['policy'] for r in rows))}")
    return [{**r, "speedup": None if r.get("moe_ms") in (None, 0) or base[r["mode"]] is None
             or r.get("output_corrupt") else base[r["mode"]] / r["moe_ms"]} for r in rows]


def time_report(spec: RunSpec, rows: Sequence[dict[str, Any]], num_layers: int) -> str:
    """The rows' time metrics (DESIGN.md §8) under `spec`'s cost model, with what it read and
    how the trace's `num_layers` layers stand for the model's (and `speedup`, when the rows
    have it: "corrupt" for a row whose output is wrong)."""
    c = spec.cost
    shape = c.profiles()[0]
    columns, labels = table_columns(rows, "time")
    shown = list(rows)
    if rows and "speedup" in rows[0]:
        columns += (("speedup", "speedup", None),)
        shown = [{**r, "speedup": "corrupt"} if r.get("output_corrupt") else r for r in rows]
    corrupt = [f"{r['policy']} ({', '.join(str(r[k]) for k in ('mode', 'engine') if r.get(k))})"
               for r in rows if r.get("output_corrupt")]
    lines = [f"time of the whole model ({c.name}: {shape.moe_layers} MoE layers, the trace's "
             f"{num_layers} standing for them; layer_us: one layer's mean), cost "
             f"{name_of(c.cost)}, device {c.device_profile}, "
             f"{'overlapped' if c.overlap else 'compute + communication'}:",
             format_table(shown, columns, labels),
             f"compute: {c.describe(spec.topology.gpus)}"]
    if corrupt:
        lines.append(f"corrupt: {', '.join(corrupt)}: ranks disagree or pairs reach the wrong "
                     f"expert, so the output is wrong and the time is no speedup")
    return "\n".join(lines)


def rebalance_report(result: Results, rows: Sequence[dict[str, Any]]) -> str:
    """The decomposition of every row and the migration table of `result`'s schedule (shared
    by the rows of one comparison)."""
    spec = result.spec
    s = spec.schedule
    migrations = result.migrations()
    columns, labels = table_columns(rows, "decomposition")
    given = "" if s.expert_bytes is None else " (given)"
    lines = ["executed imbalance = solver x prediction x dispatch (means over steps and "
             "layers):", format_table(rows, columns, labels)]
    if any((r.get("factor_prediction") or 1) < 1 for r in rows):
        lines.append("prediction below 1: the placement in service beats the solver's own "
                     "placement for the true loads (the solver is a heuristic)")
    L = result.true_load.shape[1]
    layers = spec.cost.profiles()[0].moe_layers
    lines += ["", f"rebalances (predictor {name_of(s.predictor)}, every {s.rebalance_every}, "
              f"window {s.window or s.rebalance_every}, expert {spec.expert_bytes():,} bytes"
              f"{given or f', one {spec.cost.name} expert'}; slots and copies in the trace's "
              f"{L} layers, bytes and stalls in the whole model's {layers}):"]
    lines.append(format_table(migrations, MIGRATION_COLUMNS, labels=0) if migrations else
                 "  none: the trace ends before the first window does")
    lines += _engine_moves_table(result, migrations)
    return "\n".join(lines)


ENGINE_MOVE_COLUMNS = ("step", "same_gpu", "same_node", "cross_node", "copies_same_gpu",
                       "copies_nvlink", "copies_rdma", "p2p_ops", "max_recv_copies",
                       "mismatched_slots", "lost", "map_mismatched_ranks", "model_stall_ms",
                       "engine_stall_ms")


def _engine_moves_table(result: Results, migrations: Sequence[dict[str, Any]]) -> list[str]:
    """With `--migration sglang|vllm`: each moving rebalance as the engine's updater did it
    beside eplbsim's model of it (`migration.replayed`), as lines; none otherwise."""
    moves = result.engine_moves()
    if moves is None or not moves["rows"]:
        return []
    model = {m["step"]: m for m in migrations if not m["skipped"]}
    rows = [{**model.get(r["step"], {}), **r} for r in moves["rows"]]
    columns = tuple((c, c, None) for c in ENGINE_MOVE_COLUMNS if any(c in r for r in rows))
    engine = result.spec.schedule.migration
    return ["", f"the same rebalances moved by {engine}'s own updater (copies: eplbsim's model "
                f"same_gpu / same_node / cross_node, the engine's copies_*; slots not holding "
                f"the new map's expert after the move: mismatched_slots; the same for every "
                f"policy: each row's wrong_from says from which step its output is wrong):",
            format_table(rows, columns, labels=0)]


# ----------------------------------------------------------------------------- files

def to_json(value: Any, indent: int | None = 2) -> str:
    """`value` (rows, or any JSON-like object) as strict JSON: NaN and infinities written as
    null, never as the non-JSON `NaN`."""
    return json.dumps(_jsonable(value), indent=indent, allow_nan=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy or torch values
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def flat_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row with every dict value spread into columns (for CSV): a metric's sub-keys as
    `KEY_SUB` (`multiplicity_0`, `multiplicity_1`, `multiplicity_2+`), options as
    `PREFIX.NAME` (`solver_option.time_limit`)."""
    prefixes = {name: knob.type.prefix for _, name, knob in knobs()
                if isinstance(knob.type, Options)}
    out: dict[str, Any] = {}
    for key, value in row.items():
        if not isinstance(value, dict):
            out[key] = value
        elif key in prefixes:
            out.update({f"{prefixes[key]}.{sub}": v for sub, v in value.items()})
        else:
            out.update({f"{key}_{sub}": v for sub, v in value.items()})
    return out


def write_results(rows: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write `results.json` and `results.csv` into `out_dir` (created); returns the paths."""
    json_path = Path(out_dir) / "results.json"
    with atomic_file(json_path) as tmp:
        tmp.write_text(to_json(rows) + "\n")
    return [json_path, write_csv([flat_row(r) for r in rows], Path(out_dir) / "results.csv")]


def csv_value(value: Any) -> Any:
    """A CSV field: None and NaN are written empty."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else value


class Rows(list):
    """A table's rows (dicts) that name its `columns`, so that a table of no rows still has its
    header (`write_csv`)."""

    def __init__(self, rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> None:
        super().__init__(rows)
        self.columns = tuple(columns)


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows of plain values as a CSV (columns in first-seen order, after a `Rows`' own columns:
    its header even without rows; `csv_value` fields), written through a temporary sibling."""
    path = Path(path)
    named = rows.columns if isinstance(rows, Rows) else ()
    fields = list(dict.fromkeys([*named, *(k for r in rows for k in r)]))
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: csv_value(v) for k, v in r.items()} for r in rows)
    return path


def series_rows(labels: dict[str, Any], columns: dict[str, Any]) -> list[dict[str, Any]]:
    """Time-series columns of equal length (numpy arrays) as rows, each prefixed by `labels`
    (e.g. policy and mode)."""
    names = list(columns)
    values = zip(*(columns[n].tolist() for n in names))
    return [{**labels, **dict(zip(names, v))} for v in values]
