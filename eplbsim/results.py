"""Results as tables, JSON and CSV (no computation, no plotting).

A row is `Results.row()`: `policy`, `solver`, `mode`, `view`, `rng` and the DESIGN.md §4 metric
keys, with `multiplicity` as `{"0": f0, "1": f1, "2+": f2}` and None where a metric is undefined,
then the decomposition factors and migration totals. Time series are columns of equal length
(`Results.time_series()`); migration rows come from `Results.migrations()`.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Iterable

LABELS = ("policy", "solver", "mode", "view", "rng")

# (column header, row key, multiplicity sub-key or None)
TABLE_COLUMNS = (
    ("policy", "policy", None),
    ("mode", "mode", None),
    ("gpu_imb", "gpu_imbalance", None),
    ("balanced", "balancedness", None),
    ("skew_mean", "replica_skew_mean", None),
    ("skew_max", "replica_skew_max", None),
    ("skew_cum", "replica_skew_cumulative", None),
    ("idle", "idle_replica_frac", None),
    ("promise", "placement_imbalance", None),
    ("gap", "placement_gap", None),
    ("agree", "rank_agreement", None),
    ("c=0", "multiplicity", "0"),
    ("c=1", "multiplicity", "1"),
    ("c>=2", "multiplicity", "2+"),
    ("out_err", "output_rel_error", None),
)
# The executed imbalance and its three factors (timeseries module doc), and migration totals.
DECOMPOSITION_COLUMNS = (
    ("policy", "policy", None),
    ("mode", "mode", None),
    ("gpu_imb", "gpu_imbalance", None),
    ("solver", "factor_solver", None),
    ("prediction", "factor_prediction", None),
    ("dispatch", "factor_dispatch", None),
    ("rebalances", "rebalances", None),
    ("moved_slots", "moved_slots", None),
)
MIGRATION_COLUMNS = tuple((key, key, None) for key in (
    "step", "skipped", "balancedness", "moved_slots", "same_gpu", "same_node", "cross_node",
    "bytes"))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


def format_table(rows: Iterable[dict[str, Any]], columns: tuple = TABLE_COLUMNS,
                 labels: int = 2) -> str:
    """A fixed-width text table, one line per row; `-` where a value is undefined.

    columns: `(header, row key, sub-key or None)` triples; the first `labels` columns are
    left-aligned, the rest right-aligned."""
    rows = list(rows)
    header = [h for h, _, _ in columns]
    body = [[_cell(row[key] if sub is None else (row[key] or {}).get(sub))
             for _, key, sub in columns] for row in rows]
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    lines = ["  ".join(c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths))) for line in [header] + body]
    return "\n".join(lines)


def to_json(rows: Iterable[dict[str, Any]]) -> str:
    """The rows as a JSON array (NaN written as null)."""
    return json.dumps([_jsonable(r) for r in rows], indent=2)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def flat_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row with `multiplicity` spread into `multiplicity_0`, `multiplicity_1`,
    `multiplicity_2+` columns (for CSV)."""
    out = {k: v for k, v in row.items() if k != "multiplicity"}
    for key, frac in (row.get("multiplicity") or {}).items():
        out[f"multiplicity_{key}"] = frac
    return out


def write_results(rows: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write `results.json` and `results.csv` into `out_dir` (created); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    json_path.write_text(to_json(rows) + "\n")
    return [json_path, write_csv([flat_row(r) for r in rows], out / "results.csv")]


def csv_value(value: Any) -> Any:
    """A CSV field: None and NaN are written empty."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else value


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows of plain values as a CSV (columns in first-seen order, `csv_value` fields)."""
    path = Path(path)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
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
