"""Import SGLang expert-distribution recorder dumps (`torch.save` files) as eplbsim traces.

Dimensions: `S` forward passes (steps), `L` model layers in the dump, `P` physical expert slots,
`E` logical experts, `B` rows of the stat ring buffer.

SGLang's recorder writes three kinds of dump; the mode is detected from the content:

- `per_token`: one file per rank, `{"records": [...], "last_physical_to_logical_map": [L, P]}`;
  each record has `forward_pass_id`, `rank` and `topk_ids_of_layer`, int `[L, tokens, 8]` of
  **physical** ids, -1 for padding (the tensor always has 8 columns whatever the model's top-k).
  Imported as a :class:`~eplbsim.traces.trace.Trace`: ids mapped to logical ids through the map, one
  step per `forward_pass_id` (ascending) holding every rank's tokens in rank order, each token's
  rank kept as `src_rank`. The records' `input_ids`, `positions` and `extend_seq_lens` are not
  required and not imported (a Trace has no per-row token-id array); their `forward_mode`
  (written by the detail gatherer, per_token and per_pass alike) gives each pass's stage,
  `meta["stages"]` (`traces.stages.forward_mode_mark`).
- `per_pass`: the same layout, each record with `global_physical_count` `[L, P]`; the ranks'
  counts of one pass are summed and folded onto logical experts (a logical expert's count is the
  sum of its physical slots' counts): a :class:`~eplbsim.traces.counts.CountsTrace` `[S, L, E]`.
- `stat`: one file from rank 0 with `logical_count` `[B, L, E]`, a ring buffer, and
  `average_utilization_rate_over_window`. All-zero rows were never filled and are dropped; the
  rest are kept in buffer order. The ring's write position is not in the dump, so the first
  kept row is not necessarily the oldest.

In every mode, layers that never route (all padding / zero counts throughout) are dropped, so
they are never priced, as idle or otherwise; `meta["model_layers"]` is the model layer index of
each kept layer, `meta["num_model_layers"]` is `L` and `meta["empty_layers"]` names the dropped
ones, of which a warning tells the caller: dense layers, or MoE layers the recorder attributed
nothing to (SGLang's DeepSeek-V4 recorder counted 40 of its 43 layers: sgl-project/sglang
#25948 and #25961; V4 has no dense layer, TensorRT-LLM #13595). Files are loaded with
`weights_only=True` only. Anything
corrupt, partial or inconsistent raises :class:`InputError` naming the file and the problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...base.errors import InputError, InputWarning, warn_caller
from ...base.files import regular_file
from ...base.limits import MAX_EXPERTS
from ...base.progress import Progress
from ..counts import CountsTrace
from ..layer_kinds import EMPTY_LAYERS
from ..stages import forward_mode_mark
from ..trace import Trace

MODES = ("per_token", "per_pass", "stat")
_MAP = "last_physical_to_logical_map"
_RECORD_KEYS = {"per_token": ("forward_pass_id", "rank", "topk_ids_of_layer"),
                "per_pass": ("forward_pass_id", "rank", "global_physical_count")}
_STAT_KEYS = ("logical_count", "average_utilization_rate_over_window")


def import_sglang(paths: Sequence[str | Path], num_experts: int | None = None,
                  top_k: int | None = None,
                  progress: Progress | None = None) -> Trace | CountsTrace:
    """Read SGLang recorder dumps: a Trace for `per_token`, a CountsTrace for `per_pass` and
    `stat`. `num_experts` defaults to the largest logical id in the map (or the dump's `E` in
    `stat`) + 1; `top_k` keeps the first `top_k` columns of `per_token` ids (default: all).
    `progress` is told of each file read."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise InputError("import-sglang needs at least one dump file")
    if num_experts is not None and (not isinstance(num_experts, int) or num_experts < 1):
        raise InputError(f"num_experts must be a positive integer, got {num_experts!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise InputError(f"top_k must be a positive integer, got {top_k!r}")
    dumps = []
    for p in paths:
        dumps.append((p, _load(p)))
        if progress is not None:
            progress(1)
    modes = [(p, _mode(p, d)) for p, d in dumps]
    first_path, mode = modes[0]
    for p, m in modes[1:]:
        if m != mode:
            raise InputError(f"{p}: a {m} dump, but {first_path} is a {mode} dump "
                             f"(mixed modes cannot be imported together)")
    meta: dict[str, Any] = {"source": "sglang", "mode": mode, "files": [p.name for p in paths]}
    if mode == "stat":
        if len(paths) > 1:
            raise InputError(f"{paths[1]}: stat dumps come from rank 0 alone; give one file, "
                             f"got {len(paths)}")
        return _stat(paths[0], dumps[0][1], num_experts, meta)
    mapping, E = _common_map(dumps, num_experts)
    if mode == "per_token":
        return _per_token(dumps, mapping, E, top_k, meta)
    return _per_pass(dumps, mapping, E, meta)


# -- loading and validation ---------------------------------------------------------------------

def _load(path: Path) -> Any:
    """A dump loaded with `weights_only=True` (tensors and plain containers only: nothing in it
    runs); InputError naming the file otherwise, never advising an unsafe load."""
    regular_file(path, "torch.save file")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    # torch raises many exception types for corrupt, non-torch and unsafe (non-weights) files
    except Exception as exc:  # noqa: BLE001
        text = str(exc)
        if "Unsupported global" in text:  # an object whose class would be imported and run
            raise InputError(f"{path}: refused: it holds Python objects beyond tensors and "
                             f"plain containers, and eplbsim never unpickles those") from None
        why = ("not a torch.save archive" if "Weights only" in text  # torch's text advises
               else (text.strip().splitlines() or [type(exc).__name__])[0])  # an unsafe load
        raise InputError(f"{path}: not a readable torch file (truncated, corrupt, or not "
                         f"saved with torch.save?): {why}") from None


def _mode(path: Path, dump: Any) -> str:
    if not isinstance(dump, dict):
        raise InputError(f"{path}: not an SGLang expert-distribution dump (a "
                         f"{type(dump).__name__}, not a dict)")
    if "logical_count" in dump:
        missing = [k for k in _STAT_KEYS if k not in dump]
        if missing:
            raise InputError(f"{path}: stat dump is missing {', '.join(missing)}")
        return "stat"
    if "records" not in dump:
        raise InputError(f"{path}: not an SGLang expert-distribution dump (missing records or "
                         f"logical_count; found {', '.join(map(str, dump)) or 'no keys'})")
    if _MAP not in dump:
        raise InputError(f"{path}: dump is missing {_MAP}")
    records = dump["records"]
    if not isinstance(records, (list, tuple)) or not records:
        raise InputError(f"{path}: records must be a non-empty list of dicts")
    modes = set()
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise InputError(f"{path}: record {i} is a {type(rec).__name__}, not a dict")
        kind = ("per_token" if "topk_ids_of_layer" in rec else
                "per_pass" if "global_physical_count" in rec else None)
        if kind is None:
            raise InputError(f"{path}: record {i} is missing topk_ids_of_layer "
                             f"(per_token) or global_physical_count (per_pass)")
        missing = [k for k in _RECORD_KEYS[kind] if k not in rec]
        if missing:
            raise InputError(f"{path}: record {i} is missing {', '.join(missing)}")
        modes.add(kind)
    if len(modes) > 1:
        raise InputError(f"{path}: records mix per_token and per_pass modes")
    return modes.pop()


def _int_tensor(path: Path, value: Any, what: str, dims: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError):
            raise InputError(f"{path}: {what} is not a numeric array") from None
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise InputError(f"{path}: {what} must hold integers, got dtype {value.dtype}")
    if value.dim() != dims:
        raise InputError(f"{path}: {what} must be {dims}-D, got shape {tuple(value.shape)}")
    if value.numel() and value.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64,
                                             torch.uint8):
        raise InputError(f"{path}: {what} has dtype {value.dtype}; expected signed integers")
    return value.to(torch.int64)


def _int_scalar(path: Path, value: Any, what: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InputError(f"{path}: {what} must be a non-negative integer, got {value!r}")
    return int(value)


def _common_map(dumps: list[tuple[Path, Any]], num_experts: int | None
                ) -> tuple[torch.Tensor, int]:
    """The ranks' shared physical->logical map, int64 `[L, P]`, and `E`."""
    first_path = dumps[0][0]
    mapping = _int_tensor(first_path, dumps[0][1][_MAP], _MAP, 2)
    if 0 in mapping.shape:
        raise InputError(f"{first_path}: {_MAP} is empty, shape {tuple(mapping.shape)}")
    for path, dump in dumps[1:]:
        other = _int_tensor(path, dump[_MAP], _MAP, 2)
        if other.shape != mapping.shape or not torch.equal(other, mapping):
            raise InputError(f"{path}: {_MAP} disagrees with {first_path}'s "
                             f"({tuple(other.shape)} vs {tuple(mapping.shape)}); all ranks "
                             f"must share one map")
    if int(mapping.min()) < 0 or int(mapping.max()) >= MAX_EXPERTS:
        bad = int(mapping.min()) if int(mapping.min()) < 0 else int(mapping.max())
        raise InputError(f"{first_path}: {_MAP} has logical id {bad}; ids must lie in "
                         f"[0, {MAX_EXPERTS})")
    E = int(mapping.max()) + 1 if num_experts is None else num_experts
    if int(mapping.max()) >= E:
        raise InputError(f"{first_path}: {_MAP} names logical expert {int(mapping.max())}, but "
                         f"{E} experts were given")
    return mapping, E


def _records(dumps: list[tuple[Path, Any]], key: str) -> dict[int, dict[int, tuple[Path, Any]]]:
    """`{forward_pass_id: {rank: (file, record[key])}}`; duplicates are an error."""
    passes: dict[int, dict[int, tuple[Path, Any]]] = {}
    for path, dump in dumps:
        for i, rec in enumerate(dump["records"]):
            fpid = _int_scalar(path, rec["forward_pass_id"], f"record {i} forward_pass_id")
            rank = _int_scalar(path, rec["rank"], f"record {i} rank")
            ranks = passes.setdefault(fpid, {})
            if rank in ranks:
                where = "" if ranks[rank][0] == path else f" (also in {ranks[rank][0]})"
                raise InputError(f"{path}: duplicate forward_pass_id {fpid} for rank {rank}"
                                 f"{where}")
            ranks[rank] = (path, rec[key])
    return passes


def _pass_stages(dumps: list[tuple[Path, Any]], meta: dict[str, Any]) -> None:
    """Each forward pass's stage mark, in ascending pass id, into `meta["stages"]`, when some
    record says its `forward_mode` (`traces.stages.forward_mode_mark` of its ranks' records)."""
    modes: dict[int, list[Any]] = {}
    for _, dump in dumps:
        for rec in dump["records"]:
            mode = rec.get("forward_mode")
            modes.setdefault(int(rec["forward_pass_id"]), []).append(
                int(mode) if isinstance(mode, torch.Tensor) and mode.numel() == 1 else mode)
    if any(m is not None for ranks in modes.values() for m in ranks):
        meta["stages"] = "".join(forward_mode_mark(modes[fpid]) for fpid in sorted(modes))


def _kept_layers(routes: torch.Tensor, L: int, where: Path) -> list[int]:
    kept = [int(layer) for layer in torch.nonzero(routes).flatten()]
    if not kept:
        raise InputError(f"{where}: no layer routes any token in the dump (all {L} layers are "
                         f"empty)")
    return kept


def _layer_meta(meta: dict[str, Any], kept: list[int], L: int, where: Path) -> dict[str, Any]:
    """`meta` with the kept layers (module doc), and the empty ones warned of."""
    empty = [layer for layer in range(L) if layer not in set(kept)]
    if empty:
        warn_caller(f"{where}: {len(empty)} of the dump's {L} layers route nothing (model "
                    f"layers {', '.join(map(str, empty))}): dense layers, or MoE layers the "
                    f"recorder attributed no count to (SGLang's DeepSeek-V4 recorder, #25961); "
                    f"dropped, so never priced", InputWarning)
    return dict(meta, num_model_layers=L, model_layers=kept, **{EMPTY_LAYERS: empty})


# -- the three modes ----------------------------------------------------------------------------

def _per_token(dumps: list[tuple[Path, Any]], mapping: torch.Tensor, E: int,
               top_k: int | None, meta: dict[str, Any]) -> Trace:
    L, P = mapping.shape
    passes = _records(dumps, "topk_ids_of_layer")
    width = None
    steps, ranks = [], []
    routes = torch.zeros(L, dtype=torch.bool)
    for fpid in sorted(passes):
        parts, owners = [], []
        for rank in sorted(passes[fpid]):
            path, raw = passes[fpid][rank]
            what = f"topk_ids_of_layer of forward pass {fpid}"
            ids = _int_tensor(path, raw, what, 3)  # [L, T, K8]
            if ids.shape[0] != L:
                raise InputError(f"{path}: {what} has {ids.shape[0]} layers but {_MAP} has {L}")
            if width is None:
                width = ids.shape[2]
                if width < 1 or (top_k is not None and top_k > width):
                    raise InputError(f"{path}: {what} has {width} id columns; top_k={top_k} "
                                     f"needs at least that many")
            elif ids.shape[2] != width:
                raise InputError(f"{path}: {what} has {ids.shape[2]} id columns, other records "
                                 f"{width}")
            if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= P):
                bad = int(ids.min()) if int(ids.min()) < -1 else int(ids.max())
                raise InputError(f"{path}: {what} has physical id {bad} outside [-1, {P})")
            if top_k is not None:
                if (ids[:, :, top_k:] >= 0).any():
                    raise InputError(f"{path}: {what} routes in columns beyond top_k={top_k}; "
                                     f"the model's top-k is larger")
                ids = ids[:, :, :top_k]
            logical = torch.where(
                ids >= 0, mapping.gather(1, ids.clamp(min=0).reshape(L, -1)).view(ids.shape), -1)
            routes |= (ids >= 0).flatten(1).any(1)
            parts.append(logical.permute(1, 0, 2))  # [T, L, K]
            owners.append(torch.full((ids.shape[1],), rank, dtype=torch.int64))
        steps.append(torch.cat(parts))
        ranks.append(torch.cat(owners))
    kept = _kept_layers(routes, L, dumps[0][0])
    steps = [s[:, kept] for s in steps]
    meta = _layer_meta(meta, kept, L, dumps[0][0])
    meta["forward_pass_ids"] = sorted(passes)
    _pass_stages(dumps, meta)
    return Trace.from_steps(steps, E, ranks, meta)


def _fold(counts: torch.Tensor, mapping: torch.Tensor, E: int) -> torch.Tensor:
    """Physical counts `[L, P]` -> logical counts `[L, E]`."""
    out = torch.zeros(mapping.shape[0], E, dtype=torch.int64)
    return out.scatter_add_(1, mapping, counts)


def _per_pass(dumps: list[tuple[Path, Any]], mapping: torch.Tensor, E: int,
              meta: dict[str, Any]) -> CountsTrace:
    L, P = mapping.shape
    passes = _records(dumps, "global_physical_count")
    rows = []
    for fpid in sorted(passes):
        total = torch.zeros(L, P, dtype=torch.int64)
        for rank in sorted(passes[fpid]):
            path, raw = passes[fpid][rank]
            what = f"global_physical_count of forward pass {fpid}"
            counts = _int_tensor(path, raw, what, 2)
            if counts.shape != (L, P):
                raise InputError(f"{path}: {what} has shape {tuple(counts.shape)}, but {_MAP} "
                                 f"is {(L, P)}")
            if counts.numel() and int(counts.min()) < 0:
                raise InputError(f"{path}: {what} has a negative count {int(counts.min())}")
            total += counts
        rows.append(_fold(total, mapping, E))
    counts = torch.stack(rows)  # [S, L, E]
    kept = _kept_layers(counts.sum((0, 2)) > 0, L, dumps[0][0])
    meta = _layer_meta(meta, kept, L, dumps[0][0])
    meta["forward_pass_ids"] = sorted(passes)
    _pass_stages(dumps, meta)
    return CountsTrace(counts[:, kept].numpy(), meta)


def _stat(path: Path, dump: Any, num_experts: int | None, meta: dict[str, Any]) -> CountsTrace:
    counts = _int_tensor(path, dump["logical_count"], "logical_count", 3)  # [B, L, E]
    B, L, E_dump = counts.shape
    if 0 in counts.shape:
        raise InputError(f"{path}: logical_count is empty, shape {tuple(counts.shape)}")
    if int(counts.min()) < 0:
        raise InputError(f"{path}: logical_count has a negative count {int(counts.min())}")
    E = E_dump if num_experts is None else num_experts
    if E < E_dump:
        raise InputError(f"{path}: logical_count has {E_dump} experts, but {E} were given")
    filled = [int(b) for b in torch.nonzero(counts.flatten(1).any(1)).flatten()]
    if not filled:
        raise InputError(f"{path}: logical_count has no filled rows (all {B} are zero)")
    counts = counts[filled]
    if E > E_dump:
        counts = torch.cat([counts, torch.zeros(len(filled), L, E - E_dump,
                                                dtype=torch.int64)], 2)
    kept = _kept_layers(counts.sum((0, 2)) > 0, L, path)
    meta = _layer_meta(meta, kept, L, path)
    rate = dump["average_utilization_rate_over_window"]
    if isinstance(rate, torch.Tensor) and rate.numel() == 1:
        rate = float(rate)
    meta.update(ring_buffer_rows=B, filled_rows=filled, ring_start_known=False,
                average_utilization_rate_over_window=(
                    float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool)
                    else None))
    return CountsTrace(counts[:, kept].numpy(), meta)
