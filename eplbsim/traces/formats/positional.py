"""Positional router logs: one record per MoE layer call, in execution order, with no step, layer
or token key (what a hook right after expert selection writes), read as a Trace.

Dimensions: `S` forward passes (the trace's steps), `T_s` tokens of pass `s`, `L` MoE layers
(`layers_per_pass`), `K` top-k, `E` logical experts.

One JSON object per line (blank lines are skipped): `{"topk_ids": [[K ids] x T_s], ...}`, the
`[T_s, K]` ids one layer chose for the tokens of one pass (the key is `ids_key`), with their
gating weights where the record holds values under `topk_weights` or `gating_probs`
(`records.weight_rows`: a `topk_weights` holding only the tensor's shape holds none; weights
are kept when every record has them, else left out with one warning). Counting the records that
are not skipped from 0, record `n` is layer `n % L` of pass `n // L`: the log is read by
position alone, so `L` must be the model's MoE layers as the hook saw them. Records whose
`"type"` equals `skip_type` (a header) are skipped, but the first one naming a `model` (text)
gives `meta["model"]`, and the first naming `num_experts` gives `E` (unless `experts` is given).

Rules (anything else is an InputError naming `file:line`): every layer of a pass has the same
`T_s` (a pass may have none); every row has the same `K >= 1`; ids are integers in `[-1, E)`
(-1: padding), no id twice in a row. A record count that is not a multiple of `L` leaves the
last pass incomplete (its writer was stopped mid-pass): that pass is left out with one
InputWarning naming its first line, and the rest is read. A last line cut short (not valid
JSON, no line break at its end) loses its record with an InputWarning, as in every JSON-lines
reader here. `experts` (`E`) defaults to the largest id + 1. The whole log is read into memory.

A pass's stage, where its records say it (`stages.record_mark`), goes into `meta["stages"]`
(prefill when any record is: `stages.StageLog`). A record marked as a draft's (MTP) layer call
(`records.draft_mark`: `"block": "mtp"`, `"is_draft": true`, ...) is not counted among the
pass's `L`: it is one of the draft's layers of the pass it follows (the `j`-th such record of a
pass draft layer `j`), read into the trace's `draft` (`traces.draft.with_draft`) with its own
rows, top-k and experts (a header's `draft_experts`, else its largest id + 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError, InputWarning, warn_caller
from ...base.limits import MAX_EXPERTS, MAX_LAYERS
from ...base.options import option
from ..draft import with_draft
from ..stages import StageLog
from ..trace import Trace
from .records import (WEIGHT_KEYS, LogSource, draft_mark, id_rows, keep_header, records,
                      require, weight_rows, weights_kept)


def _layers(layers_per_pass: Any) -> int:
    """`layers_per_pass` checked: an integer in `[1, MAX_LAYERS]`."""
    if isinstance(layers_per_pass, bool) or not isinstance(layers_per_pass, int) \
            or not 1 <= layers_per_pass <= MAX_LAYERS:
        raise InputError(f"layers_per_pass must be an integer in [1, {MAX_LAYERS}], got "
                         f"{layers_per_pass!r}")
    return layers_per_pass


def read_positional(path: str | Path, *, layers_per_pass: int, ids_key: str = "topk_ids",
                    skip_type: Any = None, experts: int | None = None,
                    source: LogSource | None = None) -> Trace:
    """A positional router log (module doc) as a Trace of one step per forward pass.

    layers_per_pass: `L`, the MoE layers of one forward pass (records per pass)
    ids_key:         the key of a record's `[T, K]` ids
    skip_type:       records whose "type" field equals it are skipped (None: none)
    experts:         `E` (None: a skipped header's `num_experts`, else the largest id + 1)
    source:          the records, when not `path`'s lines (`records.LogSource`)
    """
    path, L = Path(path), _layers(layers_per_pass)
    if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int)
                                or not 1 <= experts <= MAX_EXPERTS):
        raise InputError(f"experts must be an integer in [1, {MAX_EXPERTS}], got {experts!r}")
    header: dict[str, Any] = {}
    passes: list[list[np.ndarray]] = []  # [S][L] of [T_s, K]
    gates: list[list[np.ndarray | None]] = []  # [S][L] of [T_s, K] gating weights, or None
    first_line: list[int] = []  # the line of each pass's first record
    K, top, skipped = None, -1, 0
    stages = StageLog()
    drafts: list[list[np.ndarray]] = []  # [S][Ld] of [Td_s, Kd]: each pass's draft records
    draft_from = None
    items = records(path, "positional router log", torn_tail=True) if source is None \
        else source.items()
    header_of = (lambda rec: skip_type is not None and rec.get("type") == skip_type) \
        if source is None else source.header
    for n, rec in items:
        where = f"{path}:{n}"
        if header_of(rec):
            skipped += 1
            keep_header(where, rec, header)
            if experts is None and top >= header.get("num_experts", MAX_EXPERTS):
                raise InputError(f"{where}: num_experts {header['num_experts']}, but an "
                                 f"earlier record routes to expert {top}")
            continue
        require(where, rec, [ids_key], f" (the ids of one layer call; name their key with "
                                       f"{option('ids_key')}, or skip records of another kind "
                                       f"with {option('skip_type')})")
        mark = draft_mark(where, rec)
        if mark is not None:
            if not passes:
                raise InputError(f"{where}: a draft (MTP) layer call ({mark}) before any of the "
                                 f"target's: a pass's draft layers run after its own")
            draft_from = draft_from or mark
            drafts[-1].append(id_rows(where, rec[ids_key], ids_key,
                                      header.get("draft_experts", MAX_EXPERTS)))
            stages.add(len(passes) - 1, where, rec)
            continue
        limit = experts or header.get("num_experts", MAX_EXPERTS)
        rows = id_rows(where, rec[ids_key], ids_key, limit)  # [T, K]
        if rows.shape[0]:
            if K is None:
                K = rows.shape[1]
            elif rows.shape[1] != K:
                raise InputError(f"{where}: rows of {rows.shape[1]} ids, earlier rows have {K}")
            if K == 0:
                raise InputError(f"{where}: {ids_key} holds rows of no ids")
            top = max(top, int(rows.max()))
        if not passes or len(passes[-1]) == L:
            passes.append([])
            gates.append([])
            drafts.append([])
            first_line.append(n)
        stages.add(len(passes) - 1, where, rec)
        layer = passes[-1]
        if layer and rows.shape[0] != layer[0].shape[0]:
            raise InputError(f"{where}: layer {len(layer)} of pass {len(passes) - 1} has "
                             f"{rows.shape[0]} tokens, but its layer 0 (line "
                             f"{first_line[-1]}) has {layer[0].shape[0]}: every layer of a "
                             f"pass routes the same tokens (is {option('layers_per_pass', L)} the "
                             f"model's MoE layers?)")
        layer.append(rows)
        gates[-1].append(weight_rows(where, rec, rows,
                                     WEIGHT_KEYS if source is None else source.weights))
    if passes and len(passes[-1]) < L:
        count = L * (len(passes) - 1) + len(passes[-1])
        warn_caller(f"{path}:{first_line[-1]}: the last pass (pass {len(passes) - 1}, from "
                      f"here) has {len(passes[-1])} of its {L} layer records ({count} records "
                      f"are not a multiple of {option('layers_per_pass', L)}), as when the log's "
                    f"writer is stopped mid-pass; the pass is left out", InputWarning)
        passes.pop()
        gates.pop()
        drafts.pop()
    if not passes:
        what = f" ({skipped} of type {skip_type!r} skipped)" if skipped else ""
        raise InputError(f"{path}: no complete pass of {L} layer records{what}")
    if K is None:
        raise InputError(f"{path}: no token rows, so top-k is unknown")
    steps = [np.stack([rows.reshape(-1, K) for rows in layers], axis=1)  # [T_s, L, K]
             for layers in passes]
    found = sum(w is not None for layers in gates for w in layers)
    weights = [np.stack([w.reshape(-1, K) for w in layers], axis=1)  # [T_s, L, K]
               for layers in gates] if weights_kept(path, found, L * len(passes)) else None
    meta: dict[str, Any] = {"source": str(path), "format": "positional",
                            "layers_per_pass": L, "skipped_records": skipped,
                            "steps_from": f"passes of {L} layer records in execution order"}
    if "model" in header:
        meta["model"] = header["model"]
    stages.into(meta, range(len(passes)))
    E = experts if experts is not None else header.get("num_experts", max(top + 1, 1))
    trace = Trace.from_steps(steps, E, None, meta, weights)
    if not any(drafts):  # none, or only in a pass left out
        return trace
    return with_draft(trace, _draft_steps(path, drafts, first_line), header.get("draft_experts"),
                      {"source": str(path), "format": "positional", "draft_from": draft_from})


def _draft_steps(path: Path, drafts: list[list[np.ndarray]], first_line: list[int]
                 ) -> list[np.ndarray]:
    """Each pass's draft layer calls as int32 `[Td_s, Ld, Kd]` (module doc): the `j`-th draft
    call of a pass is draft layer `j`; a pass holds as many as the first one holding any, or
    none, all of one `Td_s` and every row of one `Kd`."""
    Ld = next(len(calls) for calls in drafts if calls)
    widths = {rows.shape[1] for calls in drafts for rows in calls if rows.shape[0]}
    if len(widths) > 1:
        raise InputError(f"{path}: the draft's (MTP) rows have {sorted(widths)} ids: one top-k")
    Kd = widths.pop() if widths else 0
    out = []
    for s, calls in enumerate(drafts):
        if calls and (len(calls) != Ld or len({rows.shape[0] for rows in calls}) > 1):
            raise InputError(f"{path}:{first_line[s]}: pass {s} (from here) has "
                             f"{len(calls)} draft (MTP) layer calls of "
                             f"{sorted({rows.shape[0] for rows in calls})} tokens; every pass "
                             f"holding any has {Ld}, all of one token count")
        out.append(np.stack([rows.reshape(-1, Kd) for rows in calls], axis=1).astype(np.int32)
                   if calls else np.empty((0, Ld, Kd), dtype=np.int32))
    return out
