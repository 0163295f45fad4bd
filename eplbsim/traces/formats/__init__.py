"""Every form a trace comes in, behind one `open_trace(path, **options)`.

Dimensions: `S` steps, `L` layers, `E` logical experts.

`FORMATS` lists the forms in the order they are tried; the first whose `detect` accepts the
path reads it. Each reader takes the path and the keyword options of its form (e.g. `where`
for a counts CSV, `experts` for a JSONL log); `open_trace` refuses an option the form does not
take, naming the forms that do. Readers never unpickle, and a malformed file is an InputError
naming it. Foreign formats have a module each here (`jsonl`, `sglang`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...errors import InputError
from ..counts import (CountsTrace, LayerCounts, is_counts_file, load_counts_csv,
                      load_counts_trace, parse_where)
from ..directory import DirTrace, load_trace_dir
from ..trace import Trace, load_trace
from .jsonl import read_jsonl


@dataclass(frozen=True)
class Format:
    """One form: `detect(path)` says whether a path is in it; `read(path, **options)` opens
    it as a Trace, DirTrace or CountsTrace."""

    detect: Callable[[Path], bool]
    read: Callable[..., Any]


def read_counts_csv(path: Path, *, where: str | None = None,
                    experts: int | None = None) -> CountsTrace:
    """A counts CSV (`layer,expert,count`, rows filtered by `where`) as a one-step counts-only
    trace whose `meta["model_layers"]` are the file's layer ids."""
    counts = load_counts_csv(path, parse_where(where), experts)
    return CountsTrace(counts.load[None], {"source": str(path),
                                          "model_layers": list(counts.layers)})


def read_npz(path: Path) -> Trace | CountsTrace:
    """An `.npz`: a counts-only trace when it holds `counts`, else a routing trace."""
    return load_counts_trace(path) if is_counts_file(path) else load_trace(path)


def read_router_log(path: Path, *, experts: int | None = None) -> Trace:
    """A JSONL router log (`formats.jsonl`), read into memory; `experts` defaults to the
    largest id + 1."""
    return read_jsonl(path, experts)


FORMATS: dict[str, Format] = {
    "trace directory": Format(Path.is_dir, load_trace_dir),
    "counts CSV": Format(lambda p: p.suffix.lower() == ".csv", read_counts_csv),
    "JSONL router log": Format(lambda p: p.suffix.lower() == ".jsonl", read_router_log),
    ".npz trace": Format(lambda p: True, read_npz),
}


def _options_of(read: Callable[..., Any]) -> list[str]:
    return [p.name for p in inspect.signature(read).parameters.values()
            if p.kind is p.KEYWORD_ONLY]


def open_trace(path: str | Path, **options: Any) -> Trace | DirTrace | CountsTrace:
    """The trace at `path`, in whichever of `FORMATS` it is; options left None are ignored,
    and one the form does not take is an InputError naming the forms that do."""
    path = Path(path)
    name, form = next((n, f) for n, f in FORMATS.items() if f.detect(path))
    accepted = _options_of(form.read)
    given = {k: v for k, v in options.items() if v is not None}
    for key in given:
        if key not in accepted:
            takers = [n for n, f in FORMATS.items() if key in _options_of(f.read)]
            raise InputError(f"{path}: {key} applies to a {' or '.join(takers) or 'no'} "
                             f"source only, not to a {name}")
    return form.read(path, **given)


def open_loads(path: str | Path, where: str | None = None,
               experts: int | None = None) -> LayerCounts:
    """Expert loads `[L, E]` from any trace form (a counts CSV filtered by `where`, counts
    only, or routing rows summed over steps); `layers` are the model layer ids the file
    records, else `0 .. L-1`. InputError when `experts` is given and differs from the file."""
    trace = open_trace(path, where=where,
                       experts=experts if Path(path).suffix.lower() in (".csv", ".jsonl")
                       else None)
    load = trace.load() if isinstance(trace, CountsTrace) else \
        trace.counts().sum(0).double().numpy()
    if experts is not None and experts != load.shape[1]:
        raise InputError(f"{path}: holds {load.shape[1]} experts, not {experts}")
    layers = trace.meta.get("model_layers") or list(range(load.shape[0]))
    return LayerCounts(load, tuple(int(x) for x in layers))
