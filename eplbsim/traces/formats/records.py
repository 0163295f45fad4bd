"""Pieces the readers of record logs share (`token_log`, `positional`, `jsonl`, `megatron`):
numbered records, where they come from (`LogSource`), checked integer fields and checked rows
of expert ids, each fault an InputError naming `file:line`.

Dimensions: `T` rows (tokens or layers), `K` ids a row.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError, InputWarning, warn_caller
from ...base.files import regular_file
from ...base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_TOP_K
from ..trace import model_in

MAX_INDEX = 2**62  # step and token indices: any a log can hold, far from wrapping an int64


def records(path: Path, what: str,
            torn_tail: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """`(line number, record)` for each non-blank line of the UTF-8 JSON-lines file `path` (a
    `what`); InputError naming `file:line` for a line that is not a JSON object, naming the file
    when it cannot be read or is not UTF-8.

    torn_tail: a last line that is not valid JSON and has no line break at its end (its writer
               was stopped mid-write) is left out with an InputWarning naming `file:line`,
               instead of an InputError; a torn line anywhere else is still an error
    """
    try:
        f = open(regular_file(path, what), encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    if torn_tail and not line.endswith("\n"):  # only the last line lacks one
                        warn_caller(f"{path}:{n}: the last line is cut short (not valid JSON, "
                                    f"no line break at its end), as when the {what}'s writer "
                                    f"is stopped mid-write; its record is left out",
                                    InputWarning)
                        return
                    raise InputError(f"{path}:{n}: not valid JSON ({exc})") from None
                if not isinstance(rec, dict):
                    raise InputError(f"{path}:{n}: a record must be a JSON object")
                yield n, rec
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not UTF-8 text ({exc})") from None


Items = Callable[[], Iterator[tuple[int, dict[str, Any]]]]  # a fresh `(number, record)` run


@dataclass(frozen=True)
class LogSource:
    """The records a reader reads, when they are not one JSON-lines file's in its own keys
    (`infer`: records of any file, its fields found by what they hold).

    path:    the file, as messages name it (`file:n`)
    items:   a fresh iterator of `(n, record)` at each call: `n` the line of a JSON-lines file
             or a CSV, the record's place in a JSON document
    header:  whether a record is a header (its model kept, the record skipped)
    layer:   the layer of every record of a file whose records name none (its name says it)
    weights: the keys a record may hold gating weights under (`weight_rows`)
    """

    path: Path
    items: Items
    header: Callable[[dict[str, Any]], bool]
    layer: int | None = None
    weights: Sequence[str] = ()


# What a header says of the model beside its name and experts, as a config.json names it (in
# the header, or in a `config` object it carries): its decoder layers, the draft (MTP) layers
# numbered from there (DeepSeek-V3's checkpoints hold the MTP layer as
# `model.layers.{num_hidden_layers}`, deepseek-ai/DeepSeek-V3 issue #19), and the draft's
# own routed experts where they differ from the target's (DeepSeek-V4.1's DSpark draft).
HEADER_COUNTS = {"num_hidden_layers": ("num_hidden_layers",),
                 "draft_experts": ("draft_experts", "draft_num_experts",
                                   "dspark_n_routed_experts")}


def keep_header(where: str, rec: dict[str, Any], header: dict[str, Any]) -> None:
    """Keep in `header` what a skipped record (`skip_type`) says of the model: its name
    (under `model`, `model_id`, ...: `trace.model_in`), `num_experts` (an integer in
    `[1, MAX_EXPERTS)`) and `HEADER_COUNTS` (in the record or its `config` object), the first
    of each."""
    if model_in(rec) is not None:
        header.setdefault("model", model_in(rec))
    if "num_experts" in rec and "num_experts" not in header:
        header["num_experts"] = integer(where, rec, "num_experts", 1, MAX_EXPERTS)
    config = rec.get("config")
    for said in (rec, config if isinstance(config, dict) else {}):
        for name, keys in HEADER_COUNTS.items():
            key = next((k for k in keys if said.get(k) is not None), None)
            if key is not None and name not in header:
                cap = MAX_LAYERS if name == "num_hidden_layers" else MAX_EXPERTS
                header[name] = integer(where, said, key, 1, cap)


# Draft (MTP) layers' records, as logs mark them: a flag (true or false), or a part named
# "mtp", "draft" or "nextn" (Megatron's router trace: `"block": "mtp"`; any other name, such as
# its "decoder", is the target's).
DRAFT_FLAGS = ("is_draft", "is_mtp", "is_nextn", "draft", "mtp", "nextn")
DRAFT_PARTS = ("block", "module", "layer_type", "model_part")
DRAFT_WORDS = ("mtp", "draft", "nextn")


def draft_mark(where: str, rec: dict[str, Any], layer: int | None = None,
               first_draft: int | None = None) -> str | None:
    """How the record `rec` is marked as of the draft's (MTP) layers, in words
    (`'"block": "mtp"'`, `"layers from num_hidden_layers 61"`), or None when it is the
    target's: marked so (`DRAFT_FLAGS`, `DRAFT_PARTS`: the first present decides), else its
    `layer` at or above `first_draft`, the model's decoder layers (`num_hidden_layers`) where
    the log says them. InputError naming `where` for a flag that is not true or false."""
    for key in DRAFT_FLAGS:
        value = rec.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise InputError(f"{where}: {key} must be true or false (whether the record is "
                                 f"of a draft's MTP layers), got {str(value)[:40]!r}")
            return f'records "{key}": true' if value else None
    for key in DRAFT_PARTS:
        if isinstance(rec.get(key), str):
            word = rec[key].strip().lower()
            return f'records "{key}": "{rec[key]}"' if word in DRAFT_WORDS else None
    if first_draft is not None and layer is not None and layer >= first_draft:
        return f"layers from num_hidden_layers {first_draft}"
    return None


def require(where: str, rec: dict[str, Any], keys: list[str], hint: str = "") -> None:
    """InputError naming `where` and the keys of `keys` that `rec` lacks (then `hint`)."""
    missing = [k for k in keys if k not in rec]
    if missing:
        raise InputError(f"{where}: missing key(s) {', '.join(missing)}{hint}")


def integer(where: str, rec: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """`rec[key]` if it is an integer in `[lo, hi)`; InputError naming `where` otherwise."""
    v = rec[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise InputError(f"{where}: {key} must be an integer in [{lo}, {hi}), got {v!r}")
    return v


def id_rows(where: str, rows: Any, key: str, limit: int) -> np.ndarray:
    """`rows`, a list of equally long lists of integer ids in `[-1, limit)` (-1: padding) with no
    id twice in a row, as int64 `[T, K]`; InputError naming `where` and `key` otherwise."""
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise InputError(f"{where}: {key} must be a list of rows (lists of ids)")
    widths = {len(r) for r in rows}
    if len(widths) > 1:
        raise InputError(f"{where}: ragged {key}: rows of lengths {sorted(widths)}")
    width = widths.pop() if widths else 0
    if width > MAX_TOP_K:
        raise InputError(f"{where}: rows of {width} ids, above the cap of {MAX_TOP_K}")
    if not all(type(x) is int for r in rows for x in r):  # bool is not int here
        raise InputError(f"{where}: {key} must hold integer ids")
    try:
        ids = np.array(rows, dtype=np.int64).reshape(len(rows), width)
    except OverflowError:
        raise InputError(f"{where}: {key} holds an expert id outside [-1, {limit})") from None
    bad = (ids < -1) | (ids >= limit)
    if bad.any():
        raise InputError(f"{where}: expert id {ids[bad][0]} outside [-1, {limit})")
    ordered = np.sort(ids, axis=1)
    twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if twice.any():
        row, col = np.argwhere(twice)[0]
        raise InputError(f"{where}: row {row} of {key} chooses expert {ordered[row, col]} twice; "
                         f"a router picks distinct experts")
    return ids


WEIGHT_KEYS = ("topk_weights", "gating_probs")  # where real logs keep the router's weights


def weight_rows(where: str, rec: dict[str, Any], ids: np.ndarray,
                keys: Sequence[str] = WEIGHT_KEYS) -> np.ndarray | None:
    """The gating weights a record holds for its id rows `ids` (int64 `[..., K]`), float32 of
    `ids`' shape, or None when it holds none: the first of `keys` present that holds values,
    either one weight per id (the shape of `ids`) or a probability per expert (`[..., E']`,
    gathered at the ids; a padding id's weight is 0). A key holding only the
    shape of a tensor (`[T, K]` integers, as some hooks log) holds no values and is passed
    over. InputError naming `where` for any other content, or a weight that is not finite
    and >= 0."""
    for key in keys:
        value = rec.get(key)
        if value is None or (isinstance(value, list) and value == list(ids.shape)
                             and all(type(x) is int for x in value)):  # a shape, not values
            continue
        try:
            arr = np.array(value, dtype=np.float64)
        except (TypeError, ValueError, OverflowError):
            arr = None
        fits = arr is not None and arr.ndim == ids.ndim and arr.shape[:-1] == ids.shape[:-1]
        if fits and arr.shape[-1] != ids.shape[-1]:  # a probability for each expert
            fits = arr.shape[-1] > int(ids.max(initial=-1))
            arr = np.where(ids >= 0, np.take_along_axis(arr, ids.clip(0), -1), 0.0) if fits \
                else arr
        if not fits:
            raise InputError(f"{where}: {key} must hold one weight per id (the shape of the "
                             f"ids, {list(ids.shape)}) or a probability per expert, got "
                             f"{str(value)[:60]}")
        if not np.isfinite(arr).all() or (arr < 0).any():
            raise InputError(f"{where}: {key} holds {arr[~(np.isfinite(arr) & (arr >= 0))][0]}"
                             f"; gating weights are finite and >= 0")
        return arr.astype(np.float32)
    return None


def weights_kept(path: Path, found: int, total: int) -> bool:
    """Whether a log whose `total` records of ids include `found` with gating weights
    (`weight_rows`) keeps them: all do (True) or none does (False); when only some do, they
    are left out with one InputWarning saying how many, and False."""
    if 0 < found < total:
        warn_caller(f"{path}: only {found} of its {total} records hold gating weights "
                    f"({', '.join(WEIGHT_KEYS)}); the weights are left out and the toy MoE "
                    f"draws its gates", InputWarning)
    return found == total > 0
