"""Generic JSONL router logs, the layout per-layer router tracers write, read as a stream.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` MoE layers, `E` logical experts, `K` top-k.

One JSON object per line: `{"step": s, "layer": l, "topk_ids": [[...], ...]}`, the `[T_s, K]`
logical ids layer `l` chose for the tokens of step `s` (-1 for padding). Blank lines are skipped.
Rules (anything else is an InputError naming `file:line`):

- a step's lines are contiguous and steps come in strictly ascending order (gaps in the step
  numbers are allowed; steps are renumbered 0..S-1 and the first and last ids go to `meta`);
- within a step the layers may come in any order, but every layer `0..L-1` appears exactly once
  (`L` is fixed by the first step) and all with the same `T_s`;
- every row has the same `K`; ids are integers in `[-1, E)` (the draft's: its own `Kd`, ids
  below a header's `draft_experts`).

The first record naming a model (`model`, `model_id`, ...: `trace.MODEL_KEYS`) gives
`meta["model"]`.

A step's stage, where its records say it (`is_prefill`, `forward_mode`, `stage` or `phase`:
`stages.record_mark`), goes into `meta["stages"]`: prefill when any of its records says
prefill (a mixed batch), else decode when any says decode (`stages.StageLog`).

Draft (MTP) layers: a record marked as a draft's (`"block": "mtp"`, `"is_draft": true`, ...:
`records.draft_mark`), or of a layer at or above the model's `num_hidden_layers` where a header
says it (DeepSeek's MTP layer is `model.layers.{num_hidden_layers}`), is one layer of the
draft's in its step, not the target's: the trace's `draft` (`traces.draft.with_draft`), of its
own rows (one `T_s` for the step's draft layers), top-k and experts (a header's `draft_experts`,
else its largest id + 1), its layers the log's numbers (`meta["model_layers"]`). A step holds
every draft layer (those of the first step holding any) or none (no draft rows). Streamed into a
directory (which holds no draft), a draft record is an InputError.

Only one step is held in memory at a time, so a log larger than memory can be written straight
into the directory form (:func:`eplbsim.traces.directory.write_steps`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError
from ...base.files import atomic_file
from ...base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_TOP_K
from ...base.progress import Progress
from ..directory import DirTrace, write_steps
from ...base.options import option
from ..draft import with_draft
from ..stages import StageLog
from ..trace import Trace, model_in
from .records import LogSource, draft_mark, keep_header, records


class _Steps:
    """Iterate over a log's steps as (int32 `[T_s, L, K]`, None) pairs; `meta` (first and last
    step ids, the stages), `L`, `K` and `top` (the largest id) are filled in as it goes, and
    the draft's layers of each step (`drafts`, module doc) beside them."""

    def __init__(self, path: Path, num_experts: int | None, source: LogSource | None = None,
                 keys: tuple[str, str, str] = ("step", "layer", "topk_ids"),
                 streaming: bool = False) -> None:
        self.path, self.E, self.source, self.keys = path, num_experts, source, keys
        self.streaming = streaming
        self.L: int | None = None
        self.K: int | None = None
        self.top = -1
        self.meta: dict[str, Any] = {"source": str(path), "format": "jsonl"}
        self.header: dict[str, Any] = {}  # what the headers say of the model
        self.stages = StageLog()
        self.step_ids: list[int] = []  # each step's id, as the log numbers it
        self.draft_layers: list[int] | None = None  # the draft's layers, as the log numbers them
        self.drafts: list[np.ndarray | None] = []  # [Td_s, Ld, Kd] a step, None: no draft rows
        self.Kd: int | None = None
        self.draft_from: str | None = None  # how the first draft record was told (meta)

    def __iter__(self) -> Iterator[tuple[np.ndarray, None]]:
        current, parts, start = None, ({}, {}), 0  # the step's target and draft layers
        items = records(self.path, "JSONL router log") if self.source is None \
            else self.source.items()
        for n, rec in items:
            if self.source is not None and self.source.header(rec):
                keep_header(f"{self.path}:{n}", rec, self.header)
                if "model" not in self.meta and model_in(rec) is not None:
                    self.meta["model"] = model_in(rec)
                continue
            step, layer, ids, draft = self._parse(rec, n)
            if step != current:
                if current is not None and step < current:
                    raise self._error(n, f"step {step} after step {current}: steps "
                                         f"must be contiguous and ascending")
                if current is not None:
                    yield self._finish(current, *parts, start), None
                current, parts, start = step, ({}, {}), n
                self.meta.setdefault("first_step", step)
            layers = parts[draft]
            what = "draft layer" if draft else "layer"
            if layer in layers:
                raise self._error(n, f"{what} {layer} of step {step} appears twice")
            if layers and ids.shape[0] != next(iter(layers.values())).shape[0]:
                raise self._error(n, f"{what} {layer} of step {step} has {ids.shape[0]} "
                                     f"tokens, other {what}s of the step "
                                     f"{next(iter(layers.values())).shape[0]}")
            layers[layer] = ids
            self.stages.add(step, f"{self.path}:{n}", rec)
        if current is None:
            raise InputError(f"{self.path}: no records (a router log has one JSON object "
                             f"per line)")
        yield self._finish(current, *parts, start), None
        self.stages.into(self.meta, self.step_ids)

    def _error(self, n: int, text: str) -> InputError:
        return InputError(f"{self.path}:{n}: {text}")

    def _parse(self, rec: dict[str, Any], n: int) -> tuple[int, int, np.ndarray, bool]:
        """The record's step, layer, int64 `[T, K]` ids and whether it is the draft's."""
        step_key, layer_key, ids_key = self.keys
        missing = [k for k in self.keys if k not in rec]
        if missing:
            named = ", ".join(option(k) for k in ("token_key", "layer_key", "ids_key",
                                                  "step_key", "skip_type"))
            raise self._error(n, f"missing key(s) {', '.join(missing)} (a per-token log, or "
                              f"other key names? name them with {named}; a log of one record "
                              f"per layer call in execution order: "
                              f"{option('layers_per_pass', 'L')})")
        step, layer, rows = rec[step_key], rec[layer_key], rec[ids_key]
        if "model" not in self.meta and model_in(rec) is not None:  # a tracer naming its model
            self.meta["model"] = model_in(rec)
        for name, v, cap in ((step_key, step, 2**62), (layer_key, layer, MAX_LAYERS)):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < cap:
                raise self._error(n, f"{name} must be an integer in [0, {cap}), got {v!r}")
        mark = draft_mark(f"{self.path}:{n}", rec, layer, self.header.get("num_hidden_layers"))
        draft = mark is not None
        self.draft_from = self.draft_from or mark
        if draft and self.streaming:
            raise self._error(n, "a record of the draft's (MTP) layers: a trace directory holds "
                                 "the target's alone; write an .npz trace, which holds both")
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise self._error(n, f"{ids_key} must be a list of rows (lists of ids)")
        widths = {len(r) for r in rows}
        if len(widths) > 1:
            raise self._error(n, f"ragged {ids_key}: rows of lengths {sorted(widths)}")
        if rows and not all(isinstance(x, int) and not isinstance(x, bool)
                            for r in rows for x in r):
            raise self._error(n, f"{ids_key} must hold integers")
        K = self.Kd if draft else self.K
        if widths:
            width = widths.pop()
            if K is None:
                K = width
            elif width != K:
                raise self._error(n, f"rows of {width} ids, earlier rows "
                                     f"{'of the draft ' if draft else ''}have {K}")
        if (K or 0) > MAX_TOP_K:
            raise self._error(n, f"rows of {K} ids, above the cap of {MAX_TOP_K}")
        if draft:
            self.Kd = K
        else:
            self.K = K
        limit = self.header.get("draft_experts", MAX_EXPERTS) if draft else \
            MAX_EXPERTS if self.E is None else self.E
        for row in rows:  # Python ints, checked before anything could wrap
            for x in row:
                if not -1 <= x < limit:
                    raise self._error(n, f"expert id {x} outside [-1, {limit})")
        ids = np.asarray(rows, dtype=np.int64).reshape(len(rows), K or 0)
        if ids.size and not draft:
            self.top = max(self.top, int(ids.max()))
        return step, layer, ids, draft

    def _finish(self, step: int, layers: dict[int, np.ndarray], drafts: dict[int, np.ndarray],
                line: int) -> np.ndarray:
        if not layers:
            raise self._error(line, f"step {step} (starting here) holds draft (MTP) layers "
                                    f"{sorted(drafts)} but none of the target's")
        if self.L is None:
            self.L = max(layers) + 1
        missing = sorted(set(range(self.L)) - set(layers))
        extra = sorted(set(layers) - set(range(self.L)))
        if missing or extra:
            what = f"lacks layer(s) {missing}" if missing else f"has layer(s) {extra} beyond"
            raise self._error(line, f"step {step} (starting here) {what} of layers "
                                    f"0..{self.L - 1}")
        self.drafts.append(self._draft(step, drafts, line) if drafts else None)
        self.step_ids.append(step)
        T = next(iter(layers.values())).shape[0]
        K = self.K or 0
        out = np.empty((T, self.L, K), dtype=np.int32)
        for layer, ids in layers.items():
            out[:, layer] = ids.reshape(T, K)
        self.meta["last_step"] = step
        return out

    def _draft(self, step: int, drafts: dict[int, np.ndarray], line: int) -> np.ndarray:
        """A step's draft layers as int32 `[Td, Ld, Kd]`: the draft layers of the first step
        holding any, every one (a step holds all of them or none)."""
        if self.draft_layers is None:
            self.draft_layers = sorted(drafts)
        if sorted(drafts) != self.draft_layers:
            raise self._error(line, f"step {step} (starting here) holds draft (MTP) layers "
                                    f"{sorted(drafts)}, earlier steps {self.draft_layers}: a "
                                    f"step runs every draft layer or none")
        return np.stack([drafts[layer].reshape(-1, self.Kd or 0)
                         for layer in self.draft_layers], axis=1).astype(np.int32)

    def draft_steps(self) -> list[np.ndarray]:
        """Each step's draft rows, int32 `[Td_s, Ld, Kd]` (none where it ran no draft pass)."""
        empty = np.empty((0, len(self.draft_layers or ()), self.Kd or 0), dtype=np.int32)
        return [empty if d is None else d for d in self.drafts]


def read_jsonl(path: str | Path, num_experts: int | None = None,
               out: str | Path | None = None,
               progress: Progress | None = None, *, source: LogSource | None = None,
               keys: tuple[str, str, str] = ("step", "layer", "topk_ids")) -> Trace | DirTrace:
    """Read a JSONL router log. With `out`, stream it into that trace directory and return
    the :class:`DirTrace` (`progress` is told of each step written); without, build an
    in-memory :class:`Trace`. `num_experts=None` takes the largest id + 1. `source`: the
    records, when not `path`'s lines (`records.LogSource`), in `keys` (the step's, the
    layer's and the ids')."""
    path = Path(path)
    steps = _Steps(path, num_experts, source, keys, streaming=out is not None)
    if out is not None:  # meta is complete by the time it is written
        return write_steps(out, steps, num_experts, steps.meta, progress=progress)
    arrays = [ids for ids, _ in steps]
    if steps.K is None:
        raise InputError(f"{path}: no token rows, so top-k is unknown")
    E = num_experts if num_experts is not None else max(steps.top + 1, 1)
    trace = Trace.from_steps(arrays, E, None, steps.meta)
    if steps.draft_layers is None:
        return trace
    if steps.Kd is None:
        raise InputError(f"{path}: the draft's (MTP) records hold no token rows, so its top-k "
                         f"is unknown")
    meta = {"source": str(path), "format": "jsonl", "model_layers": steps.draft_layers,
            "draft_from": steps.draft_from}
    return with_draft(trace, steps.draft_steps(), steps.header.get("draft_experts"), meta)


def write_jsonl(trace: Any, path: str | Path, progress: Progress | None = None) -> None:
    """Write a trace-like object as a JSONL router log, one line per (step, layer), through a
    temporary sibling (an existing file stays as it was if writing fails); `progress` is told
    of each step written."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for s in range(trace.num_steps):
            ids = trace.step(s).numpy()  # [T_s, L, K]
            for layer in range(trace.num_layers):
                f.write(json.dumps({"step": s, "layer": layer,
                                    "topk_ids": ids[:, layer].tolist()}) + "\n")
            if progress is not None:
                progress(1)
