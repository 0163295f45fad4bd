"""Files that are not one record a line, read into the records (or the counts) they hold
(DESIGN.md §5): a JSON document, a CSV of gate rows, an array.

Dimensions: `S` steps, `N` rows, `L` layers, `E` logical experts, `K` top-k.

- **A JSON document** holds either counts or records.
  - Counts: a rectangular `[L][E]` or `[S][L][E]` array of non-negative whole numbers (integer
    or float), the document itself or under one of `COUNT_NAMES`, beside which `num_layers`,
    `num_experts` and a model name may stand (checked against the array, kept).
  - Records: every object holding a list of ids (`infer`), found anywhere in the document; an
    object whose keys are all one word and a number (`token_178`, `layer_0`) is a level, and
    each record below it gets that word as a field with the number as its value, as a forward
    hook's nested per-token JSON is read; the document's top-level text and `HEADER_KEYS`
    fields make a header (its model).
- **A CSV of gate rows**: a column per expert (`expert_0` .. `expert_{E-1}`, or `e0`.. or
  `exp_0`..) and exactly `K` non-zero gates a row, beside optional layer, token and step
  columns (`infer.ROLE_NAMES`): a row is one token of one layer, its ids the non-zero columns
  in descending gate order (ties by expert), its weights their gates. Without a token column
  the rows of each layer are one step's tokens in order.
- **An array** (`.npy`, or the one array of an `.npz` that is no trace): float gates in `[0, 1]`
  with the same `K < E` non-zeros in every row, `[N, E]` (one layer) or `[N, L, E]`, read as
  gate rows of one step; any other non-negative array of 2 or 3 dimensions as counts.
"""

from __future__ import annotations

import csv
import json
import re
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError
from ...base.files import NPY_HEADER, NPY_HEADER_ERRORS, check_memory, npy_refusal, regular_file
from ...base.limits import MAX_EXPERTS, MAX_TOP_K
from ..counts import CountsTrace
from ..trace import model_in
from .infer import HEADER_KEYS, ROLE_NAMES, id_shape

COUNT_NAMES = ("counts", "logical_count", "logical_counts", "expert_counts", "expert_count",
               "expert_load", "expert_loads", "loads", "load", "counts_per_layer",
               "tokens_per_expert", "num_tokens_per_expert")
LEVEL = re.compile(r"^([A-Za-z]+)[_-]?(\d+)$")
EXPERT_COLUMN = re.compile(r"^(?:expert|exp|e)[_-]?(\d+)$", re.IGNORECASE)
GATES, IDS = "gates", "topk_ids"  # the fields a gate row's record is given


def load_json(path: Path) -> Any:
    """The JSON document at `path`; InputError naming the file when it is not one."""
    path = regular_file(path, "JSON document")
    check_memory(8 * path.stat().st_size, f"reading {path}", "write it as JSON lines")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc})") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not a JSON document ({exc})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _rectangular(value: Any) -> np.ndarray | None:
    """`value` as a float64 array when it is a rectangular nested list of numbers of 2 or 3
    dimensions, else None."""
    if not isinstance(value, list) or not value or not isinstance(value[0], list):
        return None
    try:
        arr = np.array(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        return None
    return arr if arr.ndim in (2, 3) and arr.size else None


def json_counts(doc: Any, path: Path) -> CountsTrace | None:
    """The counts a JSON document holds (module doc), or None when it holds none."""
    where, found = None, None
    if isinstance(doc, list) and not any(isinstance(v, dict) for v in doc):
        found = _rectangular(doc)
    elif isinstance(doc, dict):
        named = [k for k in COUNT_NAMES if k in doc]
        for key in named:
            found = _rectangular(doc[key])
            if found is not None:
                where = key
                break
        if found is None and named:
            raise InputError(f"{path}: {named[0]} is not a rectangular [layers][experts] or "
                             f"[steps][layers][experts] array of numbers")
    if found is None:
        return None
    meta: dict[str, Any] = {"source": str(path), "format": "counts (JSON)",
                            "read_as": f"counts, {'the document' if where is None else where!r}"
                                       f" [{']['.join(map(str, found.shape))}]"}
    counts = found[None] if found.ndim == 2 else found  # [S, L, E]
    if isinstance(doc, dict):
        for key, dim in (("num_layers", 1), ("num_experts", 2)):
            if key in doc and doc[key] != counts.shape[dim]:
                raise InputError(f"{path}: {key} is {doc[key]!r}, but {where} holds "
                                 f"{counts.shape[dim]}")
        if model_in(doc) is not None:
            meta["model"] = model_in(doc)
    _whole(counts, path)
    try:
        return CountsTrace(counts, meta)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


def _whole(counts: np.ndarray, path: Path) -> None:
    """InputError for counts that are not non-negative whole numbers (fractions are shares,
    not counts of pairs)."""
    if np.isfinite(counts).all() and (counts >= 0).all() and (counts != np.round(counts)).any():
        raise InputError(f"{path}: holds fractions ({counts[counts != np.round(counts)][0]}), "
                         f"not counts of (token, expert) pairs: scale the shares by the pairs "
                         f"they came from")


def json_records(doc: Any) -> list[tuple[int, dict[str, Any]]]:
    """The records of a JSON document (module doc), numbered in document order, a header
    first where the top level names the model."""
    out: list[dict[str, Any]] = []
    if isinstance(doc, dict):
        said = {k: v for k, v in doc.items() if not isinstance(v, (list, dict))}
        if any(isinstance(v, str) for v in said.values()) or set(HEADER_KEYS) & said.keys():
            out.append(said)
    _walk(doc, {}, out)
    return list(enumerate(out, 1))


def _walk(value: Any, levels: dict[str, int], out: list[dict[str, Any]]) -> None:
    if isinstance(value, list):
        for item in value:
            _walk(item, levels, out)
        return
    if not isinstance(value, dict) or not value:
        return
    matched = [LEVEL.match(str(k)) for k in value]
    words = {m.group(1).lower() for m in matched if m}
    if all(matched) and len(words) == 1 and len(value) > 1 or (
            all(matched) and len(words) == 1 and not any(id_shape(v) for v in value.values())):
        word = words.pop()
        for m, item in zip(matched, value.values()):
            where = {**levels, word: int(m.group(2))}
            if id_shape(item):  # the level's values are the ids themselves
                out.append({**where, IDS: item})
            else:
                _walk(item, where, out)
        return
    if any(id_shape(v) for v in value.values()):
        out.append({**levels, **value})
        return
    for item in value.values():
        if isinstance(item, (list, dict)):
            _walk(item, levels, out)


def gate_csv_columns(header: list[str]) -> dict[int, int] | None:
    """Expert -> column of a CSV header with a column per expert `0 .. E-1`, else None."""
    experts = {}
    for i, name in enumerate(header):
        m = EXPERT_COLUMN.match(name.strip())
        if m:
            experts[int(m.group(1))] = i
    if len(experts) < 2 or sorted(experts) != list(range(len(experts))):
        return None
    return experts


def csv_header(path: Path) -> list[str]:
    """The first row of the CSV at `path` (empty when it cannot be read as text)."""
    try:
        with open(regular_file(path, "CSV"), encoding="utf-8", newline="") as f:
            return next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error, InputError):
        return []


def gate_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The records of a CSV of gate rows (module doc), numbered by line."""
    with open(regular_file(path, "CSV"), encoding="utf-8", newline="") as f:
        rows = csv.reader(f)
        header = next(rows, [])
        experts = gate_csv_columns(header)
        if experts is None:
            raise InputError(f"{path}: no column per expert (expert_0, expert_1, ...)")
        roles = {name.strip(): i for i, name in enumerate(header)
                 if name.strip() in {n for ns in ROLE_NAMES.values() for n in ns}}
        columns = [experts[e] for e in range(len(experts))]
        counter: dict[Any, int] = {}
        K = None
        for n, row in enumerate(rows, 2):
            if not row or not any(c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise InputError(f"{path}:{n}: {len(row)} fields, the header has {len(header)}")
            try:
                gates = np.array([float(row[c]) for c in columns])
                rec = {name: int(row[i]) for name, i in roles.items()}
            except ValueError as exc:
                raise InputError(f"{path}:{n}: not a number ({exc})") from None
            if not np.isfinite(gates).all() or (gates < 0).any():
                raise InputError(f"{path}:{n}: gates must be finite and >= 0")
            chosen = np.flatnonzero(gates)
            if K is None:
                K = len(chosen)
            if not 0 < len(chosen) == K <= MAX_TOP_K:
                raise InputError(f"{path}:{n}: {len(chosen)} non-zero gates, the rows before "
                                 f"have {K}: a row of gates holds the top-k experts' alone")
            order = chosen[np.lexsort((chosen, -gates[chosen]))]
            rec[IDS], rec[GATES] = order.tolist(), gates[order].tolist()
            if not any(n in rec for n in ROLE_NAMES["token"]):
                layer = next((rec[n] for n in ROLE_NAMES["layer"] if n in rec), None)
                rec["token_idx"] = counter[layer] = counter.get(layer, -1) + 1
            yield n, rec


def load_array(path: Path) -> tuple[np.ndarray, str | None]:
    """The array of a `.npy` file, or the one array of an `.npz` that is no trace (or its one
    array named as counts, `COUNT_NAMES`), with its name in the `.npz`; read without
    unpickling; InputError naming the file otherwise."""
    path = regular_file(path, "array file")
    check_memory(path.stat().st_size, f"reading {path}", "save a smaller window")
    if not _magic(path):
        raise InputError(f"{path}: not an array file (.npy or .npz)")
    try:
        with open(path, "rb") as f:
            loaded = np.load(f, allow_pickle=False, max_header_size=NPY_HEADER)
            if isinstance(loaded, np.lib.npyio.NpzFile):
                with loaded:
                    arrays = [n for n in loaded.files if n != "meta"]
                    named = [n for n in arrays if n in COUNT_NAMES]
                    if len(arrays) != 1 and len(named) != 1:
                        raise InputError(f"{path}: {len(arrays)} arrays ({', '.join(arrays)}); "
                                         f"counts or gates are one array, or one named "
                                         f"{' or '.join(COUNT_NAMES[:3])}")
                    name = (named or arrays)[0]
                    return loaded[name], name
            return loaded, None
    except InputError:
        raise
    except (*NPY_HEADER_ERRORS, zipfile.BadZipFile, zlib.error) as exc:
        raise InputError(f"{path}: not a readable array (truncated or corrupt?): "
                         f"{npy_refusal(exc)}") from None


def _magic(path: Path) -> bool:
    """Whether `path` starts as a numpy array file or a zip archive does."""
    with open(path, "rb") as f:
        head = f.read(6)
    return head == b"\x93NUMPY" or head[:4] == b"PK\x03\x04"


def gate_rows(arr: np.ndarray) -> int | None:
    """`K` when `arr` holds float gate rows (module doc), else None."""
    if arr.ndim not in (2, 3) or not np.issubdtype(arr.dtype, np.floating) or not arr.size:
        return None
    if not np.isfinite(arr).all() or (arr < 0).any() or (arr > 1).any():
        return None
    nonzero = (arr != 0).sum(-1)
    K = int(nonzero.flat[0])
    return K if 0 < K < arr.shape[-1] and K <= MAX_TOP_K and (nonzero == K).all() else None


def looks_like_ids(arr: np.ndarray) -> bool:
    """Whether an integer array could be top-k ids rather than counts: at most 16 columns,
    values in `[-1, MAX_EXPERTS)` and no expert twice in a row."""
    if not np.issubdtype(arr.dtype, np.integer) or not arr.size or arr.shape[-1] > 16:
        return False
    if arr.min() < -1 or arr.max() >= MAX_EXPERTS:
        return False
    rows = np.sort(arr.reshape(-1, arr.shape[-1]), -1)
    return not ((rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)).any()


def array_counts(arr: np.ndarray, path: Path, name: str | None = None) -> CountsTrace:
    """An array of 2 or 3 dimensions read as counts (module doc); an integer one that could as
    well be top-k ids (`looks_like_ids`) is refused with the two ways to say which, unless its
    name in an `.npz` (`name`) is one of `COUNT_NAMES`."""
    if arr.ndim in (2, 3) and name not in COUNT_NAMES and looks_like_ids(arr):
        raise InputError(f"{path}: an integer array [{']['.join(map(str, arr.shape))}] that could "
                         f"be top-k ids or counts: save counts under a key saying so "
                         f"(np.savez(path, counts=...)), or build a trace from ids with "
                         f"Trace.from_arrays (docs/guide/03-real-log.md)")
    if arr.ndim not in (2, 3) or not np.issubdtype(arr.dtype, np.number):
        raise InputError(f"{path}: an array of shape {list(arr.shape)} ({arr.dtype}) is neither "
                         f"counts ([layers, experts] or [steps, layers, experts]) nor gate rows "
                         f"([tokens, experts] or [tokens, layers, experts] of floats)")
    counts = arr.astype(np.float64)
    _whole(counts, path)
    meta = {"source": str(path), "format": "counts (array)",
            "read_as": f"counts [{']['.join(map(str, arr.shape))}] ({arr.dtype})"}
    try:
        return CountsTrace(counts[None] if arr.ndim == 2 else counts, meta)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
