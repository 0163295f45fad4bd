"""Counts-only input: expert loads `[L, E]` read from CSV (DESIGN.md §5's weaker kind of input).

Dimensions: `L` layers, `E` logical experts.

A counts CSV has a header with at least `layer`, `expert` and `count`; any other columns (e.g.
`model`, `domain`) describe where the counts came from and can be filtered on. Counts can drive
placement and the even-split promise, never row-sensitive dispatch.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InputError

REQUIRED = ("layer", "expert", "count")


@dataclass(frozen=True)
class LayerCounts:
    """load: float64 `[L, E]`; layers: the file's layer id of each row of `load`."""

    load: np.ndarray
    layers: tuple[int, ...]


def parse_where(text: str | None) -> dict[str, str]:
    """`"model=olmoe,domain=arxiv"` -> `{"model": "olmoe", "domain": "arxiv"}`."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--where takes COLUMN=VALUE pairs separated by commas, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def load_counts_csv(path: str | Path, where: dict[str, str] | None = None,
                    num_experts: int | None = None) -> LayerCounts:
    """Read `layer,expert,count` rows matching every `where` column=value; one `(layer, expert)`
    may appear once. Layers are sorted by id; `E` is `num_experts` or the largest id + 1.
    InputError naming the file and the problem otherwise."""
    path = Path(path)
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
        triples = np.array([(int(r["layer"]), int(r["expert"]), float(r["count"]))
                            for r in rows])
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: layer and expert must be integers and count a number "
                         f"({exc})") from None
    layer, expert, count = triples[:, 0].astype(int), triples[:, 1].astype(int), triples[:, 2]
    if not np.isfinite(count).all() or (count < 0).any():
        raise InputError(f"{path}: counts must be finite and non-negative")
    if (expert < 0).any() or (layer < 0).any():
        raise InputError(f"{path}: layer and expert ids must be >= 0")
    E = int(expert.max()) + 1 if num_experts is None else num_experts
    if expert.max() >= E:
        raise InputError(f"{path}: expert id {int(expert.max())} but {E} experts declared")
    layers, row = np.unique(layer, return_inverse=True)
    seen = np.zeros((len(layers), E), dtype=int)
    np.add.at(seen, (row, expert), 1)
    if (seen > 1).any():
        others = [c for c in columns if c not in REQUIRED and c not in where]
        hint = f"; filter with --where on {', '.join(others)}" if others else ""
        raise InputError(f"{path}: some (layer, expert) pairs appear in several rows{hint}")
    load = np.zeros((len(layers), E))
    load[row, expert] = count
    return LayerCounts(load, tuple(int(x) for x in layers))
