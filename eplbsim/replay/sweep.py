"""`eplbsim sweep`: a grid of replays described by a TOML spec, run in parallel into one table.

A spec (paths in it are relative to the spec file):

    out = "sweep_out"                  # optional: the output directory when --out is not given
    [grid]                             # each value a non-empty list of distinct scalars
    scenario = ["skewed", "template"]  # or: trace = ["traces/x.npz", ...]
    policy = ["row", "ordinal"]
    seed = [0, 1]
    [fixed]                            # scalars shared by every cell
    steps = 16
    gpus = 4

The cells are the cartesian product of the grid's lists in key order (the first key varies
slowest), each completed by `fixed` and the defaults. The keys are the run schema's
(`runspec.sweep_keys`: every field settable from a sweep, under its name, with the same checks and
messages as the command line), each in `grid` or `fixed`, not both:
- the source, exactly one of `scenario` (a `SCENARIOS` name) or `trace` (any form
  `open_trace` reads; `where` filters a counts CSV);
- with `scenario`: the sizes `steps`, `tokens`, `layers`, `experts`, `top_k` and scenario
  options as `option.NAME` (`option.sigma = [1.0, 2.0]`), which every scenario of the spec must
  take;
- every RunSpec field (policy, mode, view, rng, ..., solver, `solver_option.NAME`, placement,
  rebalance_every, ..., gpus, redundant, ..., and the steps' `select_steps`, `drop_warmup`,
  `drop_dummy`, `drop_outliers`, `max_batched_tokens`: the cell's trace is shaped by them, and
  its row says them). `seed` seeds both the synthetic trace and the replay.
Names are checked against the registries, and every cell's topology, before anything runs.

The output directory holds `spec.toml` (a copy of the spec; a directory holding a different
spec is refused), `results.csv` and, when pyarrow imports, `results.parquet`: one row per cell,
`cell` (a stable id of the cell's configuration), every configuration column (`Cell.config`:
the source's, then every setting as `Results.row()` labels it, paths as the spec writes them),
then the metrics of `Results.row()` spread by `flat_row`. Rows are appended as cells finish, so
an interrupted sweep keeps the cells it finished and a rerun skips them; once every cell is in,
the table is rewritten in grid order. It holds no timings: for one spec it is the same, byte
for byte, whichever executor ran it and however often it was interrupted.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import os
from concurrent.futures import as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..base.errors import InputError
from ..base.files import atomic_file, check_output, regular_file
from ..base.limits import MAX_CELLS
from ..base.progress import bar
from ..runspec import (BATCHING, READER_OPTIONS, RUN_PARTS, Device, File, Filter, Name, Options,
                       build, knobs, sweep_keys, sweep_value)
from ..traces.request_synth import REQUEST_SCENARIOS
from ..traces.requests import RequestSet
from . import replay_quiet
from .executors import check_executor, local_pool, ray_session
from .results import csv_value, flat_row, write_csv

SOURCES = ("scenario", "trace", "requests")
SIZES = ("steps", "tokens", "layers", "experts", "top_k")
SPEC, CSV, PARQUET = "spec.toml", "results.csv", "results.parquet"
_TRACES_KEPT = 4  # traces a worker keeps for its next cells


@dataclass(frozen=True)
class Cell:
    """One configuration of a sweep.

    index:  the cell's position in grid order
    id:     `cell_id(config)`
    config: column -> value, in column order: the source (`scenario` with the sizes and
            `option.NAME` values, or `trace` and `where`, as the spec writes them), then every
            setting as `RunSpec.labels` gives it (options spread as `solver_option.NAME`),
            defaults resolved
    values: field name -> value to run with (paths resolved against the spec's folder)
    """

    index: int
    id: str
    config: dict[str, Any]
    values: dict[str, Any]


@dataclass(frozen=True)
class Sweep:
    """A parsed spec: the file, its text (copied into the output), the parsed TOML, the cells in
    grid order and the spec's `out` resolved against its folder (None when it has none)."""

    path: Path
    text: str
    doc: dict[str, Any]
    cells: tuple[Cell, ...]
    out: Path | None


@dataclass(frozen=True)
class SweepRun:
    """What `run_sweep` did: the table files written, how many cells ran now, and every cell's
    row in grid order (CSV text values)."""

    paths: tuple[Path, ...]
    ran: int
    rows: tuple[dict[str, str], ...] = ()

    def __repr__(self) -> str:
        return (f"SweepRun({len(self.rows)} cells, {self.ran} run now, wrote "
                f"{', '.join(map(str, self.paths))})")


# ----------------------------------------------------------------------------- the spec

def cell_id(config: dict[str, Any]) -> str:
    """12 hex digits of the SHA-1 of the configuration's canonical JSON (sorted keys)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _label(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def _table(doc: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """The `[name]` table of the spec with nested option tables spread into `PREFIX.NAME`
    keys; InputError for an unknown key."""
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise InputError(f"{where}: {name} must be a table ([{name}])")
    keys = sweep_keys()
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict) and key in keys and isinstance(keys[key][2].type, Options):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def _columns(keys: dict[str, Any]) -> list[str]:
    """The source columns of the cells: the trace's or the scenario's with its sizes and
    options, in order, then how the file is read, where given (its steps' settings are the
    run's, among `RunSpec.labels`)."""
    reading = [k for k in READER_OPTIONS if k in keys and k not in ("where", "experts")]
    if "trace" in keys:
        return ["trace", "where", *reading]
    options = [k for k in keys if k.startswith("option.")]
    if "requests" in keys:
        return ["requests", "layers", "experts", "top_k", *options, *BATCHING, *reading]
    return ["scenario", *SIZES, *options, *reading]


def _cell(index: int, given: dict[str, Any], where: str, base: Path) -> Cell:
    """The cell of one combination of `given` spec values (the rest default)."""
    values: dict[str, Any] = {}
    for key, value in given.items():
        name, checked = sweep_value(key, value, where, base)
        if "." in key:  # an option, PREFIX.NAME: (NAME, value)
            values.setdefault(name, {})[checked[0]] = checked[1]
        else:
            values[name] = checked
    try:
        source, spec = build(values)
        if source.file is None and not isinstance(source.requests, RequestSet):
            experts = source.scenario_experts
            spec.fit(experts)
    except InputError as exc:
        raise InputError(f"{where}: cell {_label(given)}: {exc}") from None
    shown = {**{k: getattr(source, k) for k in ("scenario", *SIZES, "trace", "requests",
                                                *BATCHING, *READER_OPTIONS)},
             "experts": source.experts if source.file else source.scenario_experts,
             **{f"option.{k}": v for k, v in source.scenario_options.items()}}
    shown["steps"] = source.steps or spec.schedule.steps()
    config = {c: given.get(c, shown[c]) for c in _columns(given)}
    config.update(flat_row(spec.labels()))
    for _, name, knob in knobs(RUN_PARTS, "sweep"):  # files as the spec writes them
        if isinstance(knob.type, File) and name in given:
            config[name] = given[name]
    if source.trace is None and source.requests is None:
        values["steps"] = shown["steps"]
    return Cell(index, cell_id(config), config, values)


def parse_spec(doc: dict[str, Any], base: Path, where: str = "spec",
               max_cells: int = MAX_CELLS) -> tuple[Cell, ...]:
    """The cells of a parsed spec, in grid order (module doc). `base`: the folder that paths
    are relative to; `where` names the spec in messages; a grid of more than `max_cells` cells
    is refused before any is made. InputError for anything the module doc does not allow."""
    unknown = sorted(set(doc) - {"out", "grid", "fixed"})
    if unknown:
        raise InputError(f"{where}: unknown key {', '.join(unknown)}; a spec holds out, "
                         f"[grid] and [fixed]")
    grid, fixed = _table(doc, "grid", where), _table(doc, "fixed", where)
    both = sorted(set(grid) & set(fixed))
    if both:
        raise InputError(f"{where}: {', '.join(both)} in both [grid] and [fixed]")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise InputError(f"{where}: [grid] {key} must be a non-empty list, got {values!r}")
        for value in values:
            sweep_value(key, value, f"{where}: [grid]", base)
        if len({json.dumps(v) for v in values}) < len(values):
            raise InputError(f"{where}: [grid] {key} lists a value twice: {values!r}")
    for key, value in fixed.items():
        if isinstance(value, list):
            raise InputError(f"{where}: [fixed] {key} must be one value; lists go in [grid]")
        sweep_value(key, value, f"{where}: [fixed]", base)
    cells = math.prod(len(v) for v in grid.values())
    if cells > max_cells:
        raise InputError(f"{where}: the grid has {cells} cells, above the cap of {max_cells}; "
                         f"raise it with --max-cells")
    keys = {**grid, **fixed}
    source = [k for k in SOURCES if k in keys]
    if len(source) != 1:
        raise InputError(f"{where}: give exactly one of scenario, trace or requests (in [grid] "
                         f"or [fixed]), got {len(source)}")
    if source == ["trace"]:
        extra = [k for k in keys if k in SIZES or k.startswith("option.")]
        if extra:
            raise InputError(f"{where}: {', '.join(extra)} apply to scenarios only, not to "
                             f"a trace")
    return tuple(_cell(index, {**fixed, **dict(zip(grid, combo))}, where, base)
                 for index, combo in enumerate(itertools.product(*grid.values())))


def read_spec(path: str | Path, max_cells: int = MAX_CELLS) -> Sweep:
    """Read and check a spec file (module doc; at most `max_cells` cells); InputError naming
    the file when it is missing, not TOML, or not a valid spec."""
    path = regular_file(path, "TOML sweep spec")
    try:
        text = path.read_text()
        doc = tomllib.loads(text)
    except RecursionError:
        raise InputError(f"{path}: not a TOML sweep spec (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"{path}: not a TOML sweep spec ({exc})") from None
    out = doc.get("out")
    if out is not None and not isinstance(out, str):
        raise InputError(f"{path}: out must be a path, got {out!r}")
    cells = parse_spec(doc, path.parent, str(path), max_cells)
    return Sweep(path, text, doc, cells, None if out is None else path.parent / out)


# ----------------------------------------------------------------------------- one cell

_TRACES: dict[str, Any] = {}  # a worker's recent traces, by their source and seed


def cell_trace(cell: Cell) -> Any:
    """The trace a cell replays: its file opened, or its scenario synthesized with the cell's
    sizes, options and seed (kept for the worker's next cells that use the same one)."""
    source, spec = build(cell.values)
    key = json.dumps([repr(source), spec.dispatch.seed])
    if key not in _TRACES:
        if len(_TRACES) >= _TRACES_KEPT:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = source.open(spec.dispatch.seed, spec.schedule)
    return _TRACES[key]


def cell_row(cell: Cell) -> dict[str, Any]:
    """Replay one cell -> its table row: `cell` (the id), the configuration, then the metrics
    of `flat_row(Results.row())`."""
    _, spec = build(cell.values)
    row = flat_row(replay_quiet(cell_trace(cell), spec).row())
    return {"cell": cell.id, **cell.config,  # a default the run decided (`redundant`) shown
            **{k: v for k, v in row.items() if k not in cell.config or cell.config[k] is None}}


def _run_cell(cell: Cell) -> dict[str, Any]:
    """A worker's task: one torch thread (results independent of threading; cores not
    oversubscribed), then `cell_row`."""
    torch.set_num_threads(1)
    return cell_row(cell)


def _cell_failure(cell: Cell, exc: BaseException) -> InputError:
    """One line naming the cell that failed and why."""
    what = str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
    return InputError(f"cell {cell.id} ({_label(cell.config)}) failed: "
                      f"{what.splitlines()[0] if what else ''}")


# ----------------------------------------------------------------------------- executors

Emit = Callable[[Cell, dict[str, Any]], None]


def _on_cuda(cell: Cell) -> bool:
    """Whether a cell runs on a CUDA device (a Ray task then asks for a GPU)."""
    return str(cell.values.get("device", "cpu")).startswith("cuda")


def _run_local(cells: list[Cell], workers: int, emit: Emit) -> None:
    """Run `cells` on `workers` spawned processes, emitting each row as its cell finishes."""
    pool = local_pool(workers)
    try:
        futures = {pool.submit(_run_cell, cell): cell for cell in cells}
        for future in as_completed(futures):
            try:
                row = future.result()
            except Exception as exc:
                raise _cell_failure(futures[future], exc) from None
            emit(futures[future], row)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_ray(cells: list[Cell], workers: int, address: str | None, emit: Emit) -> None:
    """Run each cell as a Ray task (one CPU; one GPU for device cuda) on the cluster at
    `address`, or on a local instance of `workers` CPUs (`ray_session`); emit rows as cells
    finish."""
    pending: list[Any] = []
    with ray_session(workers, address) as ray:
        try:
            task = ray.remote(num_cpus=1)(_run_cell)
            refs = {task.options(num_gpus=int(_on_cuda(cell))).remote(cell): cell
                    for cell in cells}
            pending = list(refs)
            while pending:
                (ref,), pending = ray.wait(pending, num_returns=1)
                try:
                    row = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise _cell_failure(refs[ref], getattr(exc, "cause", None) or exc) from None
                emit(refs[ref], row)
        finally:
            for ref in pending:
                ray.cancel(ref)


# ----------------------------------------------------------------------------- the table

def _read_table(path: Path) -> tuple[list[str] | None, list[dict[str, str]]]:
    """The header and rows of a results CSV (None, [] when there is none). A torn last line,
    left by a killed sweep, is cut from the file."""
    try:
        with open(path, newline="") as f:
            text = f.read()
    except FileNotFoundError:
        return None, []
    complete = text[:text.rfind("\n") + 1]
    if complete != text:
        with open(path, "w", newline="") as f:
            f.write(complete)
    reader = csv.reader(io.StringIO(complete))
    header = next(reader, None)
    return header, [dict(zip(header, r)) for r in reader if len(r) == len(header)]


def _claim(sweep: Sweep, out: Path) -> None:
    """Make `out` this sweep's directory: write spec.toml, or refuse a directory that holds
    another sweep's (specs compared as parsed, without `out`)."""
    copy = out / SPEC
    if not copy.exists():
        if (out / CSV).exists():
            raise InputError(f"{out} has a {CSV} but no {SPEC}, so it is not a sweep's "
                             f"directory; use another --out")
        with atomic_file(copy) as tmp:
            tmp.write_text(sweep.text)
        return
    try:
        theirs = tomllib.loads(copy.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"{copy}: not a TOML sweep spec ({exc})") from None
    if ({k: v for k, v in theirs.items() if k != "out"} !=
            {k: v for k, v in sweep.doc.items() if k != "out"}):
        raise InputError(f"{out} holds another sweep: its {SPEC} differs from {sweep.path}; "
                         f"use another --out")


def _write_parquet(csv_path: Path, path: Path, text_columns: list[str]) -> Path | None:
    """`path` as the CSV's table with inferred column types (`text_columns` kept as text), or
    None without pyarrow."""
    try:
        import pyarrow as pa
        from pyarrow import csv as pa_csv, parquet as pq
    except ImportError:
        return None
    types = dict.fromkeys(text_columns, pa.string())
    table = pa_csv.read_csv(csv_path, convert_options=pa_csv.ConvertOptions(column_types=types))
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    return path


def _is_text(column: str) -> bool:
    """Whether a table column holds names or paths (kept as text in the parquet copy)."""
    field = {name: knob for _, name, knob in knobs()}.get(column)
    return field is not None and isinstance(field.type, (Name, File, Device, Filter))


def run_sweep(sweep: Sweep, out: str | Path, executor: str = "local",
              workers: int | None = None, address: str | None = None,
              progress: bool | None = None) -> SweepRun:
    """Run the cells of `sweep` that `out/results.csv` lacks, appending each row as its cell
    finishes; then rewrite the table in grid order and write the parquet copy.

    executor: "local" (spawned processes) or "ray" (tasks on the cluster at `address`, else on
    a local instance); workers: processes, or the local Ray instance's CPUs (default: every
    core); progress: a tqdm bar on stderr (default: when stderr is a terminal). InputError for
    bad arguments, an `out` that would touch an input (the spec, a trace, a placement file), a
    directory holding another sweep, or a failed cell (the rows written so far stay).
    """
    check_executor(executor, address, workers)
    if address is None and any(map(_on_cuda, sweep.cells)) and not torch.cuda.is_available():
        raise InputError(f"{sweep.path}: device cuda, but torch sees no CUDA device here")
    workers = workers or os.cpu_count() or 1
    out = Path(out)
    inputs = [sweep.path] + [cell.values.get(name) for cell in sweep.cells
                             for name in ("trace", "requests", "placement", "initial")]
    inputs = [p for p in inputs if isinstance(p, (str, os.PathLike)) and p not in
              REQUEST_SCENARIOS]
    check_output(out, inputs, is_dir=True)
    for name in (CSV, PARQUET):  # an existing spec.toml is never written (`_claim`)
        check_output(out / name, inputs)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create {out}: {exc.strerror or exc}") from None
    _claim(sweep, out)
    csv_path = out / CSV
    header, rows = _read_table(csv_path)
    done = {row["cell"] for row in rows}
    pending = [cell for cell in sweep.cells if cell.id not in done]
    with open(csv_path, "a", newline="") as f, bar(
            len(sweep.cells), "sweep", "cell", len(sweep.cells) - len(pending), progress) as cells:
        writer = csv.writer(f)

        def emit(cell: Cell, row: dict[str, Any]) -> None:
            nonlocal header
            if header is None:
                header = list(row)
                writer.writerow(header)
            elif list(row) != header:
                raise InputError(f"{csv_path} has other columns than this version writes; "
                                 f"use another --out")
            writer.writerow(csv_value(row[k]) for k in header)
            f.flush()
            cells.update()

        if pending and executor == "local":
            _run_local(pending, min(workers, len(pending)), emit)
        elif pending:
            _run_ray(pending, workers, address, emit)
    rows = {row["cell"]: row for row in reversed(_read_table(csv_path)[1])}
    ordered = [rows[cell.id] for cell in sweep.cells]
    write_csv(ordered, csv_path)
    text = ["cell"] + [k for k in sweep.cells[0].config if _is_text(k)]
    parquet = _write_parquet(csv_path, out / PARQUET, text)
    return SweepRun((csv_path,) + ((parquet,) if parquet else ()), len(pending), tuple(ordered))


SUMMARY_METRICS = ("gpu_imbalance", "moe_ms")  # what `summary_lines` ranks the cells by


def summary_lines(sweep: Sweep, rows: Sequence[dict[str, str]]) -> list[str]:
    """What a sweep's table says in a few lines: for each of `SUMMARY_METRICS` the rows have,
    its range over the cells with the settings (those that vary) of the best and worst cell;
    and how many cells' output is wrong (`output_corrupt`), by the settings they share."""
    varying = [k for k in sweep.cells[0].config
               if len({r.get(k, "") for r in rows}) > 1]

    def where(row: dict[str, str]) -> str:
        return " ".join(f"{k}={row.get(k, '')}" for k in varying) or "every cell"

    lines = []
    for key in SUMMARY_METRICS:
        valued = [(float(r[key]), r) for r in rows if r.get(key) not in (None, "")]
        if not valued:
            continue
        valued.sort(key=lambda item: item[0])
        values = [v for v, _ in valued]
        lines.append(f"  {key}: {values[0]:.4g} ({where(valued[0][1])}) to {values[-1]:.4g} "
                     f"({where(valued[-1][1])}), median {float(np.median(values)):.4g}")
    corrupt = [r for r in rows if r.get("output_corrupt") == "True"]
    if corrupt:
        shared = {k: corrupt[0].get(k) for k in varying
                  if len({r.get(k) for r in corrupt}) == 1}
        lines.append(f"  corrupt output in {len(corrupt)} of {len(rows)} cells"
                     + (f" (all {', '.join(f'{k}={v}' for k, v in shared.items())})"
                        if shared else ""))
    return lines
