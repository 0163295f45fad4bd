"""Placement files in and out: every JSON form a placement comes in, read by one function
(`read_phy2log`, `load_placement`), and the forms a serving engine loads (SGLang's
`--init-expert-location`).

Dimensions: `L` MoE layers (the rows eplbsim solves), `L_model` layers of the model (MoE and
dense), `E` logical experts, `P` physical slots, `S` steps.

A placement file is JSON in one of three forms: a `solve --json` output (an object with
`phy2log [L][P]`, and `layers`, the model layer of each row, when solved from real counts), a
bare `phy2log [L][P]` list, or SGLang's `physical_to_logical_map` object (below). The first two
may hold empty slots (-1) and keep them through a save and load; SGLang's map cannot (it
requires every slot to hold an expert, equal slots in every layer), so writing one refuses them.

SGLang reads a JSON object with one of two keys:

- `physical_to_logical_map`: int `[L_model, P]`, the logical expert held by each physical slot of
  every model layer. Dense layers, which never route, get the trivial map `p % E`, so the row count
  matches the model.
- `logical_count`: `[L_model, E]` tokens per logical expert; the engine runs its own solver on it.

`moe_layers[i]` is the model layer of eplbsim's layer `i` (as kept by an importer that drops dense
layers); by default it is the identity.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from ..base.files import regular_file
from . import Placement, refuse_empty_slots
from .topology import Topology

PLACEMENT_KEY = "physical_to_logical_map"
COUNT_KEY = "logical_count"


def check_moe_layers(moe_layers: Sequence[int], num_layers: int,
                     num_model_layers: int) -> list[int]:
    """Validate the MoE-layer -> model-layer mapping: `num_layers` distinct ints in
    `[0, num_model_layers)`. Returns it as a list of ints; InputError otherwise."""
    if isinstance(num_model_layers, bool) or not isinstance(num_model_layers, (int, np.integer)) \
            or num_model_layers < 1:
        raise InputError(f"the number of model layers must be a positive integer, "
                         f"got {num_model_layers!r}")
    try:
        layers = [int(x) for x in moe_layers]
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise InputError(f"moe layers must be integers, got {moe_layers!r}") from None
    if any(isinstance(x, bool) or int(x) != x for x in moe_layers):
        raise InputError(f"moe layers must be integers, got {list(moe_layers)!r}")
    if len(layers) != num_layers:
        raise InputError(f"{len(layers)} moe layers given for {num_layers} layers of data")
    if len(set(layers)) != len(layers):
        dup = next(x for x in layers if layers.count(x) > 1)
        raise InputError(f"moe layer {dup} is named more than once")
    bad = [x for x in layers if not 0 <= x < num_model_layers]
    if bad:
        raise InputError(f"moe layer {bad[0]} is outside the model's layers "
                         f"[0, {num_model_layers})")
    return layers


def _phy2log_array(phy2log: Any, num_experts: int) -> np.ndarray:
    """`phy2log` as int64 `[L, P]`, each expert in `[0, E)` present in every layer, as SGLang
    loads it: InputError in one line for an empty slot (-1), which its map cannot hold."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) \
            or num_experts < 1:
        raise InputError(f"num_experts must be a positive integer, got {num_experts!r}")
    if hasattr(phy2log, "detach"):  # a torch tensor
        phy2log = phy2log.detach().cpu().numpy()
    try:
        arr = np.asarray(phy2log)
    except (TypeError, ValueError) as exc:
        raise InputError(f"phy2log is not a rectangular array ({exc})") from None
    if arr.ndim != 2 or 0 in arr.shape:
        raise InputError(f"phy2log must have shape [layers, slots] with none empty, "
                         f"got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"phy2log must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.min() < -1 or arr.max() >= num_experts:
        raise InputError(f"phy2log holds expert ids outside [0, {num_experts})")
    refuse_empty_slots(arr, f"SGLang's {PLACEMENT_KEY}")
    present = np.zeros((arr.shape[0], num_experts), dtype=bool)
    present[np.arange(arr.shape[0])[:, None], arr] = True
    if not present.all():
        layer, expert = map(int, np.argwhere(~present)[0])
        raise InputError(f"expert {expert} has no slot in layer {layer} of phy2log")
    return arr


def sglang_placement(phy2log: Any, num_experts: int, num_model_layers: int,
                     moe_layers: Sequence[int]) -> dict[str, list[list[int]]]:
    """A placement as SGLang's `--init-expert-location` JSON object.

    phy2log: `[L, P]` (array, tensor or nested lists); moe_layers: the model layer of each of the
    `L` rows. Returns `{"physical_to_logical_map": [L_model, P]}` as nested lists of ints: row
    `moe_layers[i]` is `phy2log[i]`; every other (dense) row is the trivial map `p % E`.
    InputError when `moe_layers` has the wrong length, repeats, or leaves `[0, num_model_layers)`,
    or when `phy2log` is not a valid placement over `num_experts` experts or has an empty slot
    (-1: SGLang requires every slot to hold an expert, equal slots in every layer).
    """
    arr = _phy2log_array(phy2log, num_experts)  # [L, P]
    layers = check_moe_layers(moe_layers, arr.shape[0], num_model_layers)
    full = np.tile(np.arange(arr.shape[1], dtype=np.int64) % num_experts,
                   (num_model_layers, 1))  # [L_model, P]
    full[layers] = arr
    return {PLACEMENT_KEY: full.tolist()}


def sglang_logical_count(counts: Any, num_model_layers: int,
                         moe_layers: Sequence[int]) -> dict[str, list[list[int]]]:
    """Expert loads as SGLang's `logical_count` JSON object (the engine then runs its own solver).

    counts: `[L, E]` summed counts, or `[S, L, E]` per-step counts (summed over steps here);
    whole, non-negative numbers. Always writes the 2-D layout `{"logical_count": [L_model, E]}`,
    nested lists of ints: row `moe_layers[i]` is the summed count of layer `i`; dense layers are
    all zero. (SGLang's 3-D `logical_count` form has a leading axis of *ranks*, not steps, so the
    steps are never written as a leading axis.)
    """
    if hasattr(counts, "detach"):
        counts = counts.detach().cpu().numpy()
    try:
        arr = np.asarray(counts)
    except (TypeError, ValueError) as exc:
        raise InputError(f"counts is not a rectangular array ({exc})") from None
    if arr.ndim == 3:
        arr = arr.sum(0) if arr.shape[0] else arr[0:0]
    if arr.ndim != 2 or 0 in arr.shape:
        raise InputError(f"counts must have shape [layers, experts] or [steps, layers, experts] "
                         f"with none empty, got {np.shape(counts)}")
    if not np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.complexfloating):
        raise InputError(f"counts must be numbers, got dtype {arr.dtype}")
    if not np.isfinite(arr).all() or (arr < 0).any() or (arr != np.round(arr)).any():
        raise InputError("counts must be finite, non-negative whole numbers")
    layers = check_moe_layers(moe_layers, arr.shape[0], num_model_layers)
    full = np.zeros((num_model_layers, arr.shape[1]), dtype=np.int64)  # [L_model, E]
    full[layers] = arr.astype(np.int64)
    return {COUNT_KEY: full.tolist()}


def check_sglang_placement(obj: Any, num_experts: int) -> None:
    """The engine's documented loading rules for `physical_to_logical_map`, re-implemented.

    Rules: (1) a JSON object with exactly one key, `physical_to_logical_map`; (2) its value is a
    rectangular `[L_model, P]` list of lists with `L_model, P >= 1`; (3) every value is an int in
    `[0, E)`; (4) every logical expert appears in every layer. InputError naming the rule broken.
    """
    if not isinstance(obj, dict) or list(obj) != [PLACEMENT_KEY]:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise InputError(f"rule 1 (one key): expected exactly the key {PLACEMENT_KEY!r}, "
                         f"got {keys}")
    rows = obj[PLACEMENT_KEY]
    if not isinstance(rows, list) or not rows or \
            not all(isinstance(r, list) and r for r in rows):
        raise InputError(f"rule 2 (shape): {PLACEMENT_KEY} must be a non-empty list of "
                         f"non-empty lists [L_model, P]")
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        raise InputError(f"rule 2 (shape): {PLACEMENT_KEY} is not rectangular: rows have "
                         f"{sorted(widths)} slots")
    for layer, row in enumerate(rows):
        for slot, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_experts:
                raise InputError(f"rule 3 (values): layer {layer} slot {slot} holds {v!r}, "
                                 f"not an int in [0, {num_experts})")
        missing = set(range(num_experts)).difference(row)
        if missing:
            raise InputError(f"rule 4 (coverage): logical expert {min(missing)} is missing from "
                             f"layer {layer}")


def read_sglang_placement(obj_or_path: Any, num_experts: int,
                          moe_layers: Sequence[int] | None = None) -> np.ndarray:
    """The inverse of :func:`sglang_placement`: the MoE rows, int64 `[L, P]`.

    obj_or_path: the JSON object or a path to its file. The object must pass
    :func:`check_sglang_placement`; `moe_layers` (default: every model layer) selects the rows.
    """
    obj = (read_json(obj_or_path, "a JSON placement") if isinstance(obj_or_path, (str, Path))
           else obj_or_path)
    check_sglang_placement(obj, num_experts)
    full = np.asarray(obj[PLACEMENT_KEY], dtype=np.int64)  # [L_model, P]
    if moe_layers is None:
        moe_layers = range(full.shape[0])
    layers = check_moe_layers(moe_layers, len(moe_layers), full.shape[0])
    return full[layers]


def read_json(path: str | Path, what: str) -> Any:
    """The JSON document at `path`; InputError naming the file when missing or not JSON."""
    path = regular_file(path, "JSON file")
    try:
        return json.loads(path.read_text())
    except RecursionError:
        raise InputError(f"{path}: not {what} (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: not {what} ({exc})") from None


def read_phy2log(data: Any, path: str | Path, num_experts: int,
                 model_layers: Sequence[int] | None = None,
                 num_layers: int | None = None) -> np.ndarray:
    """The `phy2log` int64 `[L, P]` of a placement file's JSON `data` in any of the three forms
    (module doc). An SGLang map (checked by the engine's rules) with more rows than
    `num_layers` keeps the rows of `model_layers` (the model layer of each MoE layer); the
    other forms are checked to be integer rows here and as a placement where they are used
    (`Placement`, `sglang_placement`). InputError naming `path` otherwise."""
    if isinstance(data, dict) and PLACEMENT_KEY in data:
        rows = data[PLACEMENT_KEY]
        picked = (model_layers if isinstance(rows, list) and num_layers is not None
                  and len(rows) != num_layers else None)
        return read_sglang_placement(data, num_experts, picked)
    if isinstance(data, dict):
        if data.get("phy2log") is None:
            raise InputError(f"{path}: a JSON object placement needs a phy2log key")
        data = data["phy2log"]
    try:
        arr = np.asarray(data)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{path}: phy2log is not a [layers][slots] list of integers")
    return arr.astype(np.int64)


def placement_experts(data: Any, path: str | Path) -> int:
    """The logical experts of a placement file's JSON `data`: its `logcnt`'s width when it has
    one (a `solve --json` output), else the largest id in its map + 1."""
    rows = data
    if isinstance(data, dict):
        if data.get("logcnt"):
            rows = data["logcnt"]
            return len(rows[0]) if isinstance(rows, list) and rows else 0
        rows = data.get("phy2log", data.get(PLACEMENT_KEY))
    try:
        return max(max(r) for r in rows) + 1
    except (TypeError, ValueError):
        raise InputError(f"{path}: phy2log is not a [layers][slots] list of integers") from None


def load_placement(value: Any, num_experts: int, topology: Topology, num_layers: int,
                   model_layers: Sequence[int] | None = None,
                   what: str = "given placement") -> Placement | None:
    """The Placement a run setting names (`what` it is, for messages): None as it is, a
    Placement object checked to be for `num_layers` layers of `num_experts` experts, a path
    read as a placement file (`read_phy2log`) for them on `topology`."""
    if value is None:
        return None
    if isinstance(value, Placement):  # its topology is checked against the run's by the plan
        if (value.num_experts, value.num_layers) != (num_experts, num_layers):
            raise InputError(f"the {what} is for {value.num_layers} layers and "
                             f"{value.num_experts} experts; the trace has {num_layers} layers "
                             f"and {num_experts} experts")
        return value
    phy2log = read_phy2log(read_json(value, "a JSON placement"), value, num_experts,
                           model_layers, num_layers)
    try:
        placement = Placement(torch.from_numpy(phy2log), num_experts, topology)
    except InputError as exc:
        raise InputError(f"{value}: {exc}") from None
    if placement.num_layers != num_layers:
        raise InputError(f"{value}: the placement has {placement.num_layers} layers; the trace "
                         f"has {num_layers}")
    return placement
