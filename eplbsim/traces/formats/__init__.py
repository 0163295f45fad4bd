"""Every form a trace comes in, behind one `open_trace(path, **options)`.

Dimensions: `S` steps, `L` layers, `E` logical experts.

`FORMATS` lists the forms in the order they are tried; the first whose `detect` accepts the
path reads it. Each reader takes the path and the keyword options of its form (e.g. `where`
for a counts CSV, `experts` for a JSONL log); `open_trace` refuses an option the form does not
take, naming the forms that do. Readers never unpickle, and a malformed file is an InputError
naming it. A form may need an option to be chosen (`Format.requires`), and among the forms
that detect a path the first that takes every option given reads it. Logs of records (`.jsonl`,
a `.json` document, a CSV of gate rows), arrays, and a folder or several files of them are read
by one reader that looks at what they hold (`logs.read_log`: the fields by `infer`, the files
that are no record a line by `documents`), in the forms `token_log`, `jsonl` and `positional`
read; the tools' own dumps have a module each (`sglang`, `megatron`, `trtllm`, `flame`,
`vllm`). Request-level inputs (per request, before batching) are in `REQUEST_FORMATS`, opened
by `open_requests`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...base.errors import InputError
from ..counts import (CountsTrace, LayerCounts, is_counts_file, load_counts_csv,
                      load_counts_trace, parse_where)
from ..directory import DirTrace, is_trace_dir, load_trace_dir
from ...base.options import option
from ..requests import RequestSet, is_request_file, load_requests
from ..steps import shape_steps
from ..trace import Trace, is_zip, load_trace, npz_names
from .documents import csv_header, gate_csv_columns
from .flame import is_flame, read_flame
from .logs import read_log, read_request_log
from .megatron import is_megatron_trace, read_megatron
from .trtllm import is_trtllm_stats, read_trtllm_stats
from .vllm import is_vllm_arrays, is_vllm_json, read_vllm_arrays, read_vllm_json


@dataclass(frozen=True)
class Format:
    """One form: `detect(path)` says whether a path is in it; `read(path, **options)` opens
    it (as a Trace, DirTrace or CountsTrace; a RequestSet for `REQUEST_FORMATS`). A form is
    chosen only when the options given include all of `requires`."""

    detect: Callable[[Path], bool]
    read: Callable[..., Any]
    requires: tuple[str, ...] = ()


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


def _suffix(*suffixes: str) -> Callable[[Path], bool]:
    return lambda path: path.suffix.lower() in suffixes


def _gate_csv(path: Path) -> bool:
    return path.suffix.lower() == ".csv" and gate_csv_columns(csv_header(path)) is not None


def _foreign_npz(path: Path) -> bool:
    """A readable `.npz` of neither a trace (`topk_ids`) nor counts (`counts`) eplbsim wrote:
    an array someone saved (`documents.load_array`)."""
    names = npz_names(path)
    return bool(names) and not {"topk_ids.npy", "counts.npy"} & names


FORMATS: dict[str, Format] = {
    "Megatron router trace": Format(is_megatron_trace, read_megatron),
    "TensorRT-LLM expert statistics": Format(is_trtllm_stats, read_trtllm_stats),
    "FLAME-MoE parquet": Format(is_flame, read_flame),
    "trace directory": Format(is_trace_dir, load_trace_dir),
    "folder of logs": Format(Path.is_dir, read_log),
    "CSV of gate rows": Format(_gate_csv, read_log),
    "counts CSV": Format(_suffix(".csv"), read_counts_csv),
    "router log": Format(_suffix(".jsonl", ".json"), read_log),
    "array": Format(lambda p: _suffix(".npy")(p) or _foreign_npz(p), read_log),
    ".npz trace": Format(lambda p: p.suffix.lower() == ".npz" or is_zip(p), read_npz),
}


# Request-level inputs (`traces.requests.RequestSet`), batched into steps by `traces.workload`.
REQUEST_FORMATS: dict[str, Format] = {
    "request file": Format(lambda p: p.suffix.lower() == ".npz" and is_request_file(p),
                           load_requests),
    "vLLM routed experts (JSON)": Format(is_vllm_json, read_vllm_json),
    "vLLM routed experts (arrays)": Format(is_vllm_arrays, read_vllm_arrays),
    "per-token request log": Format(_suffix(".jsonl", ".json", ".csv"), read_request_log,
                                    requires=("request_key",)),
}


def _options_of(read: Callable[..., Any]) -> list[str]:
    return [p.name for p in inspect.signature(read).parameters.values()
            if p.kind is p.KEYWORD_ONLY]


def reading_options(forms: dict[str, Format]) -> set[str]:
    """Every option the readers of `forms` take (`FORMATS`: `open_trace`'s reading options;
    `REQUEST_FORMATS`: `open_requests`')."""
    return {name for form in forms.values() for name in _options_of(form.read)}


def _choose(path: Path, forms: dict[str, Format], given: dict[str, Any]
            ) -> tuple[str, Format] | None:
    """The first of `forms` that detects `path`, needs no option missing from `given` and
    takes every one given; else the first that detects it (None when none does), so its
    refusal of an option can be reported."""
    found = [(n, f) for n, f in forms.items()
             if set(f.requires) <= set(given) and f.detect(path)]
    fitting = [(n, f) for n, f in found if set(given) <= set(_options_of(f.read))]
    return (fitting or found or [None])[0]


def _read(path: Path, forms: dict[str, Format], what: str, options: dict[str, Any]) -> Any:
    """`path` read by the form `_choose` picks among `forms`; options left None are ignored,
    and one the form does not take is an InputError naming the forms that do."""
    given = {k: v for k, v in options.items() if v is not None}
    chosen = _choose(path, forms, given)
    if chosen is None:
        raise InputError(f"{path}: not a {what} (one of: {', '.join(forms)})")
    name, form = chosen
    for key in given:
        if key not in _options_of(form.read):
            takers = list(dict.fromkeys(n.split(" (")[0] for n, f in forms.items()
                                        if key in _options_of(f.read)))  # one name a form
            which = f"applies to a {' or '.join(takers)} only" if takers else \
                f"applies to no {what}"
            raise InputError(f"{path}: {option(key)} {which}, not to a {name}")
    return form.read(path, **given)


Paths = Any  # a path, or several (a list or tuple): files read as one log (`logs.read_log`)


def _one(path: Paths) -> Path | None:
    """The one path `path` names, or None for several."""
    if isinstance(path, (list, tuple)):
        return Path(path[0]) if len(path) == 1 else None
    return Path(path)


def _several(paths: Paths, options: dict[str, Any]) -> Any:
    """Several files read as one log (`logs.read_log`): the options of a log alone."""
    given = {k: v for k, v in options.items() if v is not None}
    taken = set(_options_of(read_log))
    for key in given:
        if key not in taken:
            raise InputError(f"{option(key)} applies to a single file, not to several read as "
                             f"one log")
    return read_log(list(paths), **given)


def open_requests(path: Paths, **options: Any) -> RequestSet:
    """The requests at `path`, in whichever of `REQUEST_FORMATS` it is (module doc)."""
    one = _one(path)
    if one is None:
        raise InputError(f"{path[0]}: several files read as requests do not join; give one "
                         f"request log")
    return _read(one, REQUEST_FORMATS, "request input", options)


def is_request_input(path: Paths, **options: Any) -> bool:
    """Whether `open_requests` reads `path` with these options (rather than `open_trace`)."""
    given = {k: v for k, v in options.items() if v is not None}
    one = _one(path)
    if one is None:
        return "request_key" in given
    return _choose(one, REQUEST_FORMATS, given) is not None


def open_trace(path: Paths, *, experts: int | None = None, where: str | None = None,
               ids_key: str | None = None, layer_key: str | None = None,
               token_key: str | None = None, step_key: str | None = None,
               request_key: str | None = None, prompt_len_key: str | None = None,
               skip_type: Any = None, incomplete: str | None = None,
               layers_per_pass: int | None = None, rank: int | None = None,
               step_tokens: int | None = None, iteration: int | None = None,
               max_tokens: int | None = None, select_steps: str | None = None,
               drop_warmup: bool = False, drop_dummy: bool = False,
               drop_outliers: bool = False,
               max_batched_tokens: int | None = None) -> Trace | DirTrace | CountsTrace:
    """The trace at `path`, in whichever of `FORMATS` it is, with its steps shaped as a run
    replays them: what `eplbsim run --trace PATH` reads, each option its flag with dashes
    (`ids_key` is `--ids-key`).

    path: a file or folder; several (a list) are one log (`logs.read_log`: files of other
          layers, or parts of one log)
    Reading options (None: the reader decides; an option the file's form does not take is an
    InputError naming the forms that do):
    experts:         `E` (default: a header's `num_experts`, else the largest id + 1)
    where:           a counts CSV's rows, filtered: "model=olmoe,domain=arxiv"
    ids_key, layer_key, token_key, step_key: a log's fields of the top-k ids, the layer, the
                     token's index and the step (default: found by what they hold)
    request_key:     read a per-token log as requests, one a value of this field
    prompt_len_key:  with `request_key`: the field of a request's prompt length
    skip_type:       a log's records whose "type" is it are headers, skipped
    incomplete:      a token missing from some of a log's layers: "error" (default), or
                     "drop" such tokens, with one warning saying how many
    layers_per_pass: a log of one record per MoE layer call in execution order: its MoE
                     layers a forward pass (record n is layer n mod L of step n // L)
    rank:            TensorRT-LLM expert statistics: this rank's counts alone (default all
                     ranks' summed)
    step_tokens, iteration, max_tokens: FLAME-MoE parquet: tokens a step (default its
                     sequence length), the training iteration read (default the only one),
                     the tokens read (default all)
    Steps (`steps.shape_steps`, after reading):
    select_steps:    these steps only, of the trace's own numbering: "2:", "0:100,150", ":-1"
    drop_warmup, drop_dummy, drop_outliers: leave out the steps flagged as an engine's
                     warm-up pass, a data-parallel rank's dummy padding batches, or more than
                     `steps.OUTLIER_FACTOR` times the median tokens (`steps.flag_steps`)
    max_batched_tokens: cut each step of more tokens into consecutive chunks of at most this
                     many, as a chunked-prefill engine runs a long pass
    An error or warning names an option as the caller writes it (`options.option`).
    """
    options = dict(experts=experts, where=where, ids_key=ids_key, layer_key=layer_key,
                   token_key=token_key, step_key=step_key, request_key=request_key,
                   prompt_len_key=prompt_len_key, skip_type=skip_type, incomplete=incomplete,
                   layers_per_pass=layers_per_pass, rank=rank, step_tokens=step_tokens,
                   iteration=iteration, max_tokens=max_tokens)
    one = _one(path)
    trace = _several(path, options) if one is None else _read(one, FORMATS, "trace", options)
    return shape_steps(trace, select_steps=select_steps, drop_warmup=drop_warmup,
                       drop_dummy=drop_dummy, drop_outliers=drop_outliers,
                       max_batched_tokens=max_batched_tokens)


def layer_loads(trace: Trace | DirTrace | CountsTrace) -> LayerCounts:
    """Expert loads `[L, E]` of any trace form (counts only, or routing rows), summed over its
    steps; `layers` are the model layer ids the trace records, else `0 .. L-1`."""
    load = trace.load() if isinstance(trace, CountsTrace) else \
        trace.counts().sum(0).double().numpy()
    layers = trace.meta.get("model_layers") or list(range(load.shape[0]))
    return LayerCounts(load, tuple(int(x) for x in layers))
