"""Counts-only input (DESIGN.md §5's weaker kind): expert loads `[L, E]` read from CSV, and
counts-only traces `[S, L, E]` saved as `.npz`.

Dimensions: `S` steps, `L` layers, `E` logical experts.

A counts CSV has a header with at least `layer`, `expert` and `count`; any other columns (e.g.
`model`, `domain`) describe where the counts came from and can be filtered on. Counts can drive
placement and the even-split promise, never row-sensitive dispatch.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base.errors import InputError
from ..base.files import atomic_file, regular_file
from ..base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_LOAD, check_at_most
from ..base.options import option
from .trace import npz_names, read_npz

REQUIRED = ("layer", "expert", "count")
MAX_LAYER_ID = 2**31  # model layer ids a counts CSV may name


@dataclass(frozen=True)
class LayerCounts:
    """load: float64 `[L, E]`; layers: the file's layer id of each row of `load`."""

    load: np.ndarray
    layers: tuple[int, ...]

    def __repr__(self) -> str:
        return f"LayerCounts(L={self.load.shape[0]}, E={self.load.shape[1]}, layers {self.layers})"


def parse_where(text: str | None) -> dict[str, str]:
    """`"model=olmoe,domain=arxiv"` -> `{"model": "olmoe", "domain": "arxiv"}`."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{option('where')} takes COLUMN=VALUE pairs separated by commas, "
                             f"got {item!r}")
        out[key.strip()] = value.strip()
    return out


INTEGER = re.compile(r"\s*[+-]?\d+\s*")
DECIMAL = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _number(text: Any, form: re.Pattern) -> Any:
    """`text` as an int (`INTEGER`) or a float (`DECIMAL`) when it is written as one; ValueError
    otherwise (Python's int and float also take `1_0` for 10, and float takes `inf`)."""
    if not isinstance(text, str) or not form.fullmatch(text):
        raise ValueError(f"not a number: {text!r}")
    return int(text) if form is INTEGER else float(text)


def load_counts_csv(path: str | Path, where: dict[str, str] | None = None,
                    num_experts: int | None = None) -> LayerCounts:
    """Read `layer,expert,count` rows matching every `where` column=value; one `(layer, expert)`
    may appear once. Layers are sorted by id; `E` is `num_experts` or the largest id + 1.
    InputError naming the file and the problem otherwise."""
    path = regular_file(path, "counts CSV")
    where = where or {}
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            missing = [c for c in REQUIRED if c not in columns]
            if missing:
                raise InputError(f"{path}: a counts CSV needs the columns "
                                 f"{', '.join(REQUIRED)}; missing {', '.join(missing)}")
            unknown = [c for c in where if c not in columns]
            if unknown:
                raise InputError(f"{path}: cannot filter on {', '.join(unknown)}; the columns "
                                 f"are {', '.join(columns)}")
            rows = [r for r in reader if all(r[c] == v for c, v in where.items())]
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"{path}: not a readable CSV ({exc})") from None
    if not rows:
        raise InputError(f"{path}: no rows match {where or 'the file'}")
    try:
        ids = [(_number(r["layer"], INTEGER), _number(r["expert"], INTEGER)) for r in rows]
        count = np.array([_number(r["count"], DECIMAL) for r in rows])
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: layer and expert must be integers and count a finite number "
                         f"({exc})") from None
    if not np.isfinite(count).all() or (count < 0).any() or count.max() > MAX_LOAD:
        raise InputError(f"{path}: counts must be finite, non-negative and at most 2**53")
    for lay, exp in ids:  # checked as Python ints, before anything could wrap
        if not (0 <= lay < MAX_LAYER_ID and 0 <= exp < MAX_EXPERTS):
            raise InputError(f"{path}: layer {lay}, expert {exp}: layer ids must lie in "
                             f"[0, {MAX_LAYER_ID}) and expert ids in [0, {MAX_EXPERTS})")
    layer, expert = np.array(ids, dtype=np.int64).T
    E = int(expert.max()) + 1 if num_experts is None else num_experts
    if expert.max() >= E:
        raise InputError(f"{path}: expert id {int(expert.max())} but {E} experts declared")
    layers, row = np.unique(layer, return_inverse=True)
    seen = np.zeros((len(layers), E), dtype=int)
    np.add.at(seen, (row, expert), 1)
    if (seen > 1).any():
        others = [c for c in columns if c not in REQUIRED and c not in where]
        hint = f"; filter with {option('where')} on {', '.join(others)}" if others else ""
        raise InputError(f"{path}: some (layer, expert) pairs appear in several rows{hint}")
    load = np.zeros((len(layers), E))
    load[row, expert] = count
    return LayerCounts(load, tuple(int(x) for x in layers))


@dataclass(frozen=True, eq=False)
class CountsTrace:
    """A counts-only trace: pairs per logical expert per step, no token rows.

    counts: int64 `[S, L, E]` (a private copy; non-negative)
    meta:   provenance (JSON-serialisable); `model_layers`, when present, is the model layer
            index of each of the `L` layers (MoE layers only, as kept from a dump)
    """

    counts: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            counts = np.array(self.counts)
        except (TypeError, ValueError) as exc:
            raise InputError(f"counts is not a numeric array ({exc})") from None
        if counts.ndim != 3 or 0 in counts.shape:
            raise InputError(f"counts must have shape [steps, layers, experts] with none empty, "
                             f"got {counts.shape}")
        if not np.issubdtype(counts.dtype, np.number) or np.issubdtype(counts.dtype,
                                                                        np.complexfloating):
            raise InputError(f"counts must be numbers, got dtype {counts.dtype}")
        whole = np.isfinite(counts).all() and (counts == np.round(counts)).all()
        if not whole or (counts < 0).any() or counts.max() > MAX_LOAD:
            raise InputError("counts must be finite, non-negative whole numbers of pairs, at "
                             "most 2**53")
        summed = counts.sum((0, 2), dtype=np.float64)  # [L] pairs of each layer, every step
        if summed.max() > MAX_LOAD:  # int64 sums would wrap, float64 ones round
            layer = int(summed.argmax())
            raise InputError(f"layer {layer}'s counts sum to about {summed[layer]:.3g} pairs "
                             f"over the steps, more than 2**53: sums that large cannot be "
                             f"exact")
        check_at_most(counts.shape[1], MAX_LAYERS, "the number of layers")
        check_at_most(counts.shape[2], MAX_EXPERTS, "the number of experts")
        meta = dict(self.meta or {})
        layers = meta.get("model_layers")
        if layers is not None and (not isinstance(layers, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in layers)):
            raise InputError(f"meta model_layers must be a list of integers, got {layers!r}")
        if layers is not None and len(layers) != counts.shape[1]:
            raise InputError(f"meta model_layers names {len(layers)} layers; counts has "
                             f"{counts.shape[1]}")
        groups = meta.get("num_groups")
        if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool)
                                   or groups < 1 or counts.shape[2] % groups):
            raise InputError(f"meta num_groups={groups!r} must be a positive divisor of the "
                             f"{counts.shape[2]} experts")
        object.__setattr__(self, "counts", counts.astype(np.int64))
        object.__setattr__(self, "meta", meta)

    @property
    def num_steps(self) -> int:
        return self.counts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts.shape[1]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[2]

    @property
    def num_groups(self) -> int | None:
        return self.meta.get("num_groups")

    def __repr__(self) -> str:
        return (f"CountsTrace({self.num_steps} steps, L={self.num_layers}, "
                f"E={self.num_experts}, {int(self.counts.sum())} pairs)")

    def load(self) -> np.ndarray:
        """Pairs per expert summed over steps, float64 `[L, E]` (what a solver takes)."""
        return self.counts.sum(0).astype(np.float64)


def save_counts_trace(trace: CountsTrace, path: str | Path) -> None:
    """Write a counts-only trace as `.npz`: `counts [S, L, E]` and `meta` (JSON, `kind:
    "counts"`), through a temporary sibling (an existing file stays if writing fails)."""
    meta = dict(trace.meta, kind="counts", num_experts=trace.num_experts,
                num_layers=trace.num_layers)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, counts=trace.counts, meta=np.array(json.dumps(meta, sort_keys=True)))


def is_counts_file(path: str | Path) -> bool:
    """Whether `path` is a regular file holding an `.npz` counts-only trace, judged from its zip
    directory alone (`npz_names`: nothing is loaded; False for anything else)."""
    names = npz_names(path)
    return "counts.npy" in names and "topk_ids.npy" not in names


def load_counts_trace(path: str | Path) -> CountsTrace:
    """Read a counts-only `.npz` without unpickling (`counts [S, L, E]`, or `[L, E]` as one
    step, as a user may save one); InputError naming the file otherwise."""
    path = Path(path)
    arrays = read_npz(path, ("counts",), "a counts-only trace")
    try:
        meta = json.loads(str(arrays["meta"][()])) if "meta" in arrays else {}
    except (ValueError, TypeError, RecursionError) as exc:
        raise InputError(f"{path}: meta is not a JSON string ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: meta must be a JSON object")
    counts = arrays["counts"]
    try:
        return CountsTrace(counts[None] if counts.ndim == 2 else counts, meta)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
