"""One reader for routing logs of any shape (DESIGN.md §5): a file, a folder of them, or several
files named together, read by what they hold.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `K` top-k, `E` logical experts.

A file's records (`.jsonl`: a record a line; `.json`: `documents.json_records`; a `.csv` of
gate rows: `documents.gate_records`) have their fields found (`infer.fields_of`) and are read
in the form they make (`infer.form_of`) by that form's reader, every check of which applies.
Counts (a JSON or array counts matrix) read as a counts-only trace; an array of gate rows as a
trace of one step. A file's name may give its layer (`moe_layer8.jsonl`: `infer.layer_of_name`)
where its records name none; a name and records that disagree are refused.

Several files (a folder's `LOG_SUFFIXES` files in natural order, numbers compared as numbers,
or files named together) are joined (`join`):
- files of disjoint layers (one a layer, as a per-layer hook writes them) by (step, token): step
  `s` of each file is the same forward pass, so every file has the same steps and step `s` the
  same tokens in each (a mismatch names the file, the step and both counts); the layers are
  the model's layer numbers, in order (`meta["model_layers"]`);
- files of the same layers (a log cut into parts) by steps, in file order;
- anything else is refused. Counts join the same two ways; several request logs do not join.

Stages and draft (MTP) layers, where the records say them, are read by each form's reader
(`traces.stages.StageLog`, `records.draft_mark`); joined files keep them: files of other layers
make a step's marks one (prefill when any file says it, `stages.step_mark`) and keep the one
draft among them, parts of one log each their own steps' marks and drafts, in file order (all
holding a draft, or none).

`meta["read_as"]` says in one line how the log was read (the fields that said the stages, the
draft's layers and how they were told); `trace info` shows it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...base.errors import InputError
from ..counts import CountsTrace
from ..directory import META, is_trace_dir
from ...base.options import option
from ..requests import RequestSet
from ..stages import step_mark
from ..trace import Trace
from .documents import (array_counts, csv_header, gate_csv_columns, gate_records, gate_rows,
                        json_counts, json_records, load_array, load_json)
from .infer import (EVERY_LAYER, STEP, TOKEN, Fields, describe, fields_of, form_of,
                    layer_of_name)
from .jsonl import read_jsonl
from .positional import read_positional
from .records import Items, LogSource, records
from .token_log import read_token_requests, read_token_trace

LOG_SUFFIXES = (".jsonl", ".json", ".csv", ".npy", ".npz")  # a folder's files read as a log


def _natural(path: Path) -> list[Any]:
    """A sort key comparing the numbers in a name as numbers (`layer2` before `layer10`)."""
    return [int(p) if p.isdigit() else p.lower() for p in re.split(r"(\d+)", path.name)]


def log_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The log files of a folder that is no trace directory, in natural order, and the names
    of the other entries (left out); InputError when it holds none."""
    entries = sorted(folder.iterdir(), key=_natural)
    files = [p for p in entries if p.is_file() and p.suffix.lower() in LOG_SUFFIXES]
    others = [p.name for p in entries if p not in files]
    if not files:
        raise InputError(f"{folder}: a folder holding no log ({', '.join(LOG_SUFFIXES)} files) "
                         f"and no trace directory ({META})")
    return files, others


def read_log(paths: Any, *, ids_key: str | None = None, layer_key: str | None = None,
             token_key: str | None = None, step_key: str | None = None,
             request_key: str | None = None, prompt_len_key: str | None = None,
             skip_type: Any = None, experts: int | None = None, incomplete: str = "error",
             layers_per_pass: int | None = None) -> Trace | CountsTrace | RequestSet:
    """The log at `paths` (a file, a folder of logs or a list of files) read by what it holds
    (module doc). Each option names what the log cannot say, or overrules a guess:

    ids_key, layer_key, token_key, step_key: the fields of the ids, layer, token and step
    request_key:     read the log as requests, one a value of this field (`RequestSet`)
    prompt_len_key:  with `request_key`: the field of a request's prompt length
    skip_type:       records whose "type" is it are headers
    experts:         `E` (default: a header's `num_experts`, else the largest id + 1)
    incomplete:      a token missing from some layers: "error", or "drop" it
    layers_per_pass: records of one layer call each, in execution order: the MoE layers of a
                     forward pass
    """
    options = dict(ids_key=ids_key, layer_key=layer_key, token_key=token_key,
                   step_key=step_key, request_key=request_key, prompt_len_key=prompt_len_key,
                   skip_type=skip_type, experts=experts, incomplete=incomplete,
                   layers_per_pass=layers_per_pass)
    files, others = _files(paths)
    read = [read_file(f, file_layer=layer_of_name(f), **options) for f in files]
    out = read[0] if len(read) == 1 else join(files, read)
    if len(read) > 1 or others:  # read from a folder or several files: name what was given
        given = [paths] if isinstance(paths, (str, Path)) else list(paths)
        out.meta["source"] = ", ".join(map(str, given[:3])) + (", ..." if len(given) > 3 else "")
    if others:
        out.meta["read_as"] = out.meta.get("read_as", "") + \
            f"; left out: {', '.join(others[:6])}{', ...' if len(others) > 6 else ''}"
    return out


def read_request_log(path: Any, *, request_key: str, ids_key: str | None = None,
                     layer_key: str | None = None, token_key: str | None = None,
                     prompt_len_key: str | None = None, skip_type: Any = None,
                     experts: int | None = None, incomplete: str = "error") -> RequestSet:
    """A log read as requests, one a value of `request_key` (`read_log`'s options)."""
    return read_log(path, request_key=request_key, ids_key=ids_key, layer_key=layer_key,
                    token_key=token_key, prompt_len_key=prompt_len_key, skip_type=skip_type,
                    experts=experts, incomplete=incomplete)


def _files(paths: Any) -> tuple[list[Path], list[str]]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    others: list[str] = []
    for p in map(Path, paths):
        if p.is_dir() and not is_trace_dir(p):
            found, left = log_files(p)
            files += found
            others += left
        else:
            files.append(p)
    if len(set(files)) != len(files):
        raise InputError(f"{files[0]}: a file named twice")
    return files, others


def read_file(path: Path, file_layer: int | None = None,
              **options: Any) -> Trace | CountsTrace | RequestSet:
    """One file read by what it holds (module doc); `file_layer` the layer its name gives."""
    suffix = path.suffix.lower()
    if suffix in (".npy", ".npz"):
        return _array(path, *load_array(path), file_layer)
    if suffix == ".json":
        doc = load_json(path)
        counts = json_counts(doc, path)
        if counts is not None:
            return counts
        found = json_records(doc)
        return read_records(path, lambda: iter(found), file_layer, **options, in_memory=True)
    if suffix == ".csv":
        if gate_csv_columns(csv_header(path)) is None:
            raise InputError(f"{path}: a CSV of neither counts (layer,expert,count) nor gate "
                             f"rows (a column per expert: expert_0, expert_1, ...)")
        return read_records(path, lambda: gate_records(path), file_layer, **options)
    return read_records(path, lambda: records(path, "router log", torn_tail=True), file_layer,
                        **options)


def read_records(path: Path, items: Items, file_layer: int | None = None, *,
                 ids_key: str | None = None, layer_key: str | None = None,
                 token_key: str | None = None, step_key: str | None = None,
                 request_key: str | None = None, prompt_len_key: str | None = None,
                 skip_type: Any = None, experts: int | None = None, incomplete: str = "error",
                 layers_per_pass: int | None = None,
                 in_memory: bool = False) -> Trace | RequestSet:
    """The records `items` gives (one file's, `path`) read in the form their fields make
    (module doc), by that form's reader; `in_memory`: a document's records, which records of
    one step in one layer may come in any order of (a document keyed by layer, then step)."""
    given = {"ids": ids_key, "layer": layer_key, "token": token_key, "step": step_key,
             "request": request_key}
    fields = fields_of(items, path, given, skip_type)
    form = form_of(fields, file_layer, layers_per_pass)
    roles = fields.roles
    if form == TOKEN and "layer" not in roles and file_layer is None:
        file_layer = 0  # a log of one layer
    source = LogSource(path, items, fields.is_header(skip_type), file_layer,
                       (fields.weights,) if fields.weights else ())
    token = roles.get("token")
    if request_key is not None or form in (TOKEN, EVERY_LAYER):
        if token is None:
            raise InputError(f"{path}: records of one token each, but no field gives the "
                             f"token's index: name it with {option('token_key')}")
        keys = dict(token_key=token, layer_key=roles.get("layer", "layer"), ids_key=fields.ids,
                    experts=experts, incomplete=incomplete, source=source)
        if request_key is not None:
            requests = read_token_requests(path, request_key=request_key,
                                           prompt_len_key=prompt_len_key, **keys)
            requests.meta["read_as"] = _words(form, fields, 1, requests,
                                              "a request a value of it")
            return requests
        trace = read_token_trace(path, step_key=roles.get("step"), **keys)
        steps = f'steps from "{roles["step"]}"' if "step" in roles else \
            f'steps where "{token}" restarts'
    elif form == STEP:
        if in_memory:  # one step's records together, in step order, headers first
            step, header = roles["step"], source.header
            ordered = sorted(items(), key=lambda item: (not header(item[1]),
                                                        _order(item[1].get(step))))
            source = LogSource(path, lambda: iter(ordered), header, file_layer, source.weights)
        trace = read_jsonl(path, experts, source=source,
                           keys=(roles["step"], roles["layer"], fields.ids))
        steps = f'steps from "{roles["step"]}"'
    elif layers_per_pass is None and file_layer is None:
        raise InputError(f"{path}: each record holds [tokens][top-k] ids with no step, layer or "
                         f"token field: one MoE layer call a record, in execution order. Give "
                         f"{option('layers_per_pass', 'L')} (the model's MoE layers a forward pass), which "
                         f"the log cannot say")
    else:
        trace = read_positional(path, layers_per_pass=layers_per_pass or 1, ids_key=fields.ids,
                                experts=experts, source=source)
        if layers_per_pass is None:
            trace.meta["model_layers"] = [file_layer]
            steps = "a step a record"
        else:
            steps = f"passes of {layers_per_pass} records in execution order"
    _check_name(path, trace, file_layer, roles)
    trace.meta["read_as"] = _words(form, fields, 1, trace, steps)
    return trace


def _order(value: Any) -> tuple[int, Any]:
    """A sort key of a step value of any type: integers in order, anything else after them
    (the reader then names it)."""
    return (0, value) if type(value) is int else (1, 0)


def _check_name(path: Path, trace: Trace, file_layer: int | None, roles: dict) -> None:
    """InputError when a file's name gives a layer its records do not hold."""
    layers = trace.meta.get("model_layers")
    if file_layer is not None and "layer" in roles and layers != [file_layer]:
        raise InputError(f"{path}: its name says layer {file_layer}, its records "
                         f"(\"{roles['layer']}\") layer(s) {layers}: rename the file, or name "
                         f"the layer's field with {option('layer_key')}")


def _words(form: str, fields: Fields, files: int, trace: Any, steps: str) -> str:
    """`meta["read_as"]`: the form and its fields, the layers, the steps and the header: its
    model, and the lists it carries that are not the ids (`infer.Fields.header_lists`)."""
    layers = trace.meta.get("model_layers") or list(range(trace.num_layers))
    shown = ", ".join(map(str, layers[:12])) + (", ..." if len(layers) > 12 else "")
    parts = [describe(form, fields, files), f"layers [{shown}]", steps]
    if trace.meta.get("stages_from"):
        said = ", ".join(f'"{k}"' for k in trace.meta["stages_from"])
        parts.append(f"stages from {said} (a step prefill when any record is)")
    draft = getattr(trace, "draft", None)
    if draft is not None:
        numbers = draft.meta.get("model_layers") or list(range(draft.num_layers))
        parts.append(f"draft (MTP) layers [{', '.join(map(str, numbers))}] "
                     f"({draft.meta['draft_from']})")
    model = trace.meta.get("model") or fields.model
    said = [f": {model}"] if model else []
    if fields.header_lists:
        lists = ", ".join(f'"{k}"' for k in fields.header_lists)
        said.append(f' (without "{fields.ids}": {lists} not ids)')
    if said:
        parts.append("header" + "".join(said))
    return ", ".join(parts)


def _array(path: Path, arr: np.ndarray, name: str | None,
           file_layer: int | None) -> Trace | CountsTrace:
    """An array file: gate rows (`documents.gate_rows`) as a trace of one step, else counts
    (`name`: the array's in an `.npz`)."""
    K = gate_rows(arr)
    if K is None:
        return array_counts(arr, path, name)
    gates = arr if arr.ndim == 3 else arr[:, None]  # [N, L, E]
    order = np.argsort(-gates, axis=-1, kind="stable")[..., :K]  # [N, L, K] largest first
    weights = np.take_along_axis(gates, order, -1).astype(np.float32)
    layers = [file_layer] if arr.ndim == 2 and file_layer is not None else \
        list(range(gates.shape[1]))
    meta = {"source": str(path), "format": "gate rows (array)", "model_layers": layers}
    trace = Trace.from_steps([order.astype(np.int32)], arr.shape[-1], None, meta, [weights])
    trace.meta["read_as"] = (f"gate rows [{']['.join(map(str, arr.shape))}], ids the top-{K} "
                             f"non-zero gates of a row, weights the gates, layers {layers}, one "
                             f"step")
    return trace


def join(files: list[Path], read: list[Any]) -> Trace | CountsTrace:
    """Several files' traces (or counts) as one (module doc)."""
    kinds = {type(r) for r in read}
    if RequestSet in kinds:
        raise InputError(f"{files[0]}: several files read as requests do not join; give one "
                         f"request log")
    if len(kinds) > 1:
        raise InputError(f"{files[0]} and {files[1]}: one holds counts, another token rows; "
                         f"give files of one kind")
    layers = [r.meta.get("model_layers") or list(range(r.num_layers)) for r in read]
    flat = [x for ls in layers for x in ls]
    if len(set(flat)) == len(flat):
        out = _by_layer(files, read, layers)
        how = "joined by (step, token) across layers"
    elif all(ls == layers[0] for ls in layers):
        out = _by_step(read)
        how = "joined by steps in file order"
    else:
        raise InputError(f"{files[0]} (layers {layers[0]}) and the others share some layers but "
                         f"not all: files join when each holds other layers, or all the same")
    _join_stages(out, read, by_layer=how.startswith("joined by (step"))
    out = _join_drafts(files, out, read, by_layer=how.startswith("joined by (step"))
    words = read[0].meta.get("read_as", "")
    first, _, rest = words.partition(", ")
    shown = ", ".join(map(str, out.meta["model_layers"][:12]))
    rest = re.sub(r"layers \[[^]]*\]", f"layers [{shown}"
                  f"{', ...' if len(out.meta['model_layers']) > 12 else ''}]", rest)
    out.meta["read_as"] = f"{first}, {len(files)} files {how}, {rest}".rstrip(", ")
    out.meta["files"] = [str(f) for f in files]
    return out


def _join_stages(out: Any, read: list[Any], by_layer: bool) -> None:
    """The joined trace's stages (`meta["stages"]`, `traces.stages`) from its files': a step's
    files' marks made one (`stages.step_mark`: files of other layers hold the same steps), or
    each file's marks in file order (parts of one log); a file without marks marks none."""
    marks = [r.meta.get("stages") or "?" * r.num_steps for r in read]
    fields = list(dict.fromkeys(f for r in read for f in r.meta.get("stages_from", ())))
    out.meta.pop("stages", None)
    out.meta.pop("stages_from", None)
    if not fields:
        return
    joined = "".join(map(step_mark, zip(*marks))) if by_layer else "".join(marks)
    out.meta.update(stages=joined, stages_from=fields)


def _join_drafts(files: list[Path], out: Any, read: list[Any], by_layer: bool) -> Any:
    """The joined trace with its files' draft (MTP) layers: the one file of other layers
    holding any (files of other layers: two drafts do not join), or every file's in file
    order (parts of one log, all holding a draft or none)."""
    held = [i for i, r in enumerate(read) if getattr(r, "draft", None) is not None]
    if not held or isinstance(out, CountsTrace):
        return out
    if by_layer and len(held) > 1:
        raise InputError(f"{files[held[0]]} and {files[held[1]]} each hold draft (MTP) layers: "
                         f"files of other layers join with one draft at most")
    if by_layer:
        return dataclasses.replace(out, draft=read[held[0]].draft)
    if len(held) < len(read):
        lacking = next(i for i in range(len(read)) if i not in held)
        raise InputError(f"{files[lacking]} holds no draft (MTP) layers, {files[held[0]]} "
                         f"does: parts of one log hold a draft alike")
    drafts = [r.draft for r in read]
    steps = [d.step(s) for d in drafts for s in range(d.num_steps)]
    draft = Trace.from_steps(steps, max(d.num_experts for d in drafts), None,
                             dict(drafts[0].meta))
    return dataclasses.replace(out, draft=draft)


def _by_layer(files: list[Path], read: list[Any], layers: list[list[int]]
              ) -> Trace | CountsTrace:
    order = sorted(range(len(read)), key=lambda i: layers[i][0])
    head = read[order[0]]
    for i in order[1:]:
        if read[i].num_steps != head.num_steps:
            raise InputError(f"{files[i]}: {read[i].num_steps} steps, {files[order[0]]} "
                             f"{head.num_steps}: a step of each layer's file is one forward "
                             f"pass, so they hold the same steps")
    meta = _meta(read[order[0]], [x for i in order for x in layers[i]], read)
    if isinstance(head, CountsTrace):
        return CountsTrace(np.concatenate([read[i].counts for i in order], 1), meta)
    for i in order[1:]:
        tokens, want = read[i].tokens_per_step, head.tokens_per_step
        if not torch.equal(tokens, want):
            s = int((tokens != want).nonzero()[0])
            raise InputError(f"{files[i]}: step {s} has {int(tokens[s])} tokens, "
                             f"{files[order[0]]}'s step {s} {int(want[s])}: each layer's "
                             f"file routes the same tokens in a step")
    ids = torch.cat([read[i].topk_ids for i in order], 1)  # [N, L, K]
    weighed = [read[i].topk_weights for i in order]
    weights = torch.cat(weighed, 1) if all(w is not None for w in weighed) else None
    return Trace(ids, head.step_offsets.clone(), max(r.num_experts for r in read), None, meta,
                 weights)


def _by_step(read: list[Any]) -> Trace | CountsTrace:
    head = read[0]
    meta = _meta(head, head.meta.get("model_layers") or list(range(head.num_layers)), read)
    if isinstance(head, CountsTrace):
        return CountsTrace(np.concatenate([r.counts for r in read], 0), meta)
    steps = [r.step(s) for r in read for s in range(r.num_steps)]
    weighed = [r.topk_weights for r in read]
    weights = [r.step_weights(s) for r in read for s in range(r.num_steps)] \
        if all(w is not None for w in weighed) else None
    return Trace.from_steps(steps, max(r.num_experts for r in read), None, meta, weights)


def _meta(head: Any, layers: list[int], read: list[Any]) -> dict[str, Any]:
    """The joined meta: the first file's, its model the one the files name (two models are
    refused), and the layers."""
    models = {r.meta["model"] for r in read if r.meta.get("model")}
    if len(models) > 1:
        raise InputError(f"the files name different models: {', '.join(sorted(models))}")
    meta = {k: v for k, v in head.meta.items() if k not in ("first_step", "last_step")}
    meta.update(model_layers=layers, format=f"{head.meta.get('format', 'log')}, joined")
    if models:
        meta["model"] = models.pop()
    return meta
