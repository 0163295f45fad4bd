"""Per-token JSON-lines router logs with configurable keys, read as a Trace or a RequestSet.

Dimensions: `S` steps, `R` requests, `T` tokens of a step or request, `L` MoE layers, `K` top-k,
`E` logical experts.

One JSON object per line (blank lines are skipped), in one of two forms, fixed by the first token
record (the key names are options; the defaults are shown):

- one record per (token, layer): `{"token_idx": t, "layer": l, "topk_ids": [K ids]}`;
- one record per token holding every layer: `{"token_idx": t, "topk_ids": [[K ids], ...]}`, the
  `[L][K]` ids of layers `0..L-1` (such a record names no layer).

Records whose `"type"` field equals `skip_type` (a header, say) are skipped, but the first one
naming a model (text under `model`, `model_id`, `model_name` or `served_model_name`) gives
`meta["model"]`, and the first naming `num_experts` gives `E` (unless `experts` is given);
every other record must hold the keys its form needs (a record lacking the ids is an error,
not skipped). Tokens are grouped, and the groups read as follows:

- `read_token_requests`: a :class:`~eplbsim.traces.requests.RequestSet`, one request per
  distinct `request_key` value (a string or an integer, compared as text), in order of first
  appearance, with no arrival times (the set's order); a request's tokens are ordered by token
  index (gaps allowed). With `prompt_len_key`, that field gives the request's prompt length: at
  least one of its records carries it, all that do agree, and its first `prompt_len` tokens are
  the prompt. Without it every token counts as prompt (`prompt_len` is the request's token
  count, no output tokens).
- `read_token_trace` with `step_key`: a :class:`~eplbsim.traces.trace.Trace` with one step per
  distinct step value, ascending (gaps allowed: steps are renumbered 0..S-1, the first and last
  ids go to `meta`); records may come in any order; a step's rows are its tokens in token-index
  order.
- `read_token_trace` without a step key: a Trace whose steps are delimited by token-index
  restarts: a record starts a new step when, at a layer the current step already has, its
  token index is below the previous record's, or is 0 while token 0 of the step has that layer
  (so one-token steps follow each other; for a record of every layer, any layer). So a step's
  records may come token by token (all layers of token 0, then of token 1, ...) or layer by
  layer (all tokens of layer 0 in ascending order, then all of layer 1, ...: the drop back to
  token 0 at a layer the step has not had yet continues the step), and the next step begins
  when token 0 (or any lower token) comes again at a layer the step has had. Any other repeat
  of a (token, layer) is an error.

Rules (anything else is an InputError naming `file:line`): token indices, steps and prompt
lengths are integers >= 0, layers integers in `[0, MAX_LAYERS)`; every id row has the same `K >=
1`; ids are integers in `[-1, E)` (-1: padding), no id twice in a row; a (token, layer) appears
once. Per-layer form: the layers are the layer ids the file names (`meta["model_layers"]`, the
trace's layer `i` the `i`-th smallest) and every token has every one of them: a token missing
from some layers is an InputError naming the first (by line) and how many tokens are, unless
`incomplete="drop"` (`--incomplete drop`, traces and request logs alike), which leaves those
tokens out with one InputWarning saying how many of how many, in how many steps (requests).
Every-layer form: all records hold the same `L`. `experts` (`E`) defaults to the largest id + 1.
Gating weights beside the ids (`topk_weights` of one weight per id, or `gating_probs` of one per
expert: `records.weight_rows`) go into the trace (`Trace.topk_weights`) when every record holds
them (some only: one InputWarning, none kept); a RequestSet holds ids alone, so a request log's
are not kept. A last line cut short (not valid JSON, no line break at its end: an engine stopped
mid-write) loses its record with an InputWarning naming `file:line`; a line that is not JSON
anywhere else is an InputError.
A step's stage, where its records say it (`is_prefill`, SGLang's `forward_mode`, `stage` or
`phase`: `stages.record_mark`), goes into a trace's `meta["stages"]`: prefill when any of its
records says prefill (a mixed batch), `stages.StageLog`. A record marked as a draft's (MTP)
layer (`records.draft_mark`: `"is_draft": true`, `"block": "mtp"`, ...), or of a layer at or
above a header's `num_hidden_layers`, is the draft's: its tokens and layers are read apart, by
the same rules, into the trace's `draft` (`traces.draft.with_draft`), a step of them with the
step (request or step value, else the target's restart run the record follows: a draft record
starts no step), of their own top-k and experts (a header's `draft_experts`, else the largest
id + 1); a request log leaves them out with one InputWarning (requests hold the target's).
The whole log is read into memory: it cannot be streamed, since a step (or request) is complete
only when the log ends (its records may come in any order, and another may follow).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError, InputWarning, warn_caller
from ...base.limits import MAX_EXPERTS, MAX_LAYERS
from ...base.options import option
from ..draft import with_draft
from ..requests import RequestSet, requests_of
from ..stages import StageLog
from ..trace import Trace
from .records import (MAX_INDEX, WEIGHT_KEYS, LogSource, draft_mark, id_rows, integer,
                      keep_header, records, require, weight_rows, weights_kept)


INCOMPLETE = ("error", "drop")  # what to do with a token missing from some layers


@dataclass
class _Token:
    """One token's ids so far: layer -> int64 `[K]`, its gating weights (layer -> float32
    `[K]`, where its records hold them), and the line of its first record."""

    line: int
    layers: dict[int, np.ndarray] = field(default_factory=dict)
    weights: dict[int, np.ndarray] = field(default_factory=dict)


def _key_hint(rec: dict[str, Any], skip_type: Any) -> str:
    """What to do about a record that lacks a key: the keys it has, and the options that name
    the log's keys or skip records of another kind (`options.option`)."""
    keys = ", ".join(list(rec)[:10]) + (", ..." if len(rec) > 10 else "")
    kind = rec.get("type")
    skip = ("" if skip_type is not None else
            f", or skip records of another kind with "
            f"{option('skip_type', kind if isinstance(kind, str) else 'TYPE')}")
    named = ", ".join(option(k) for k in ("token_key", "layer_key", "ids_key", "step_key"))
    return (f"; this record has {keys or 'no keys'}: name the log's keys with {named} or "
            f"{option('request_key')}{skip}")


class _Log:
    """A token log read into groups (requests, step values or restart runs) of tokens."""

    def __init__(self, path: Path, keys: dict[str, str | None], skip_type: Any,
                 experts: int | None, source: LogSource | None = None,
                 of_draft: bool = False) -> None:
        self.path, self.keys, self.skip_type = path, keys, skip_type
        self.source = source
        self.of_draft = of_draft  # the draft's (MTP) records of a log (`draft`)
        self.draft: _Log | None = None  # the draft's records, where the log holds any
        self.draft_from: str | None = None  # how its first draft record was told
        self.stages = StageLog()
        self.limit = MAX_EXPERTS if experts is None else experts
        self.groups: dict[Any, dict[int, _Token]] = {}  # in order of first appearance
        self.first_line: dict[Any, int] = {}
        self.prompt: dict[Any, tuple[int, int]] = {}  # group -> (prompt length, its line)
        self.per_layer: bool | None = None
        self.layer_ids: set[int] = set()
        self.L: int | None = None
        self.K: int | None = None
        self.top = -1
        self.skipped = 0
        self.weighed = [0, 0]  # records of ids with gating weights, and all records of ids
        self.header: dict[str, Any] = {}  # what the skipped records say of the model
        self.previous: int | None = None  # the token index of the previous record (restarts)
        self.seen: set[int] = set()  # the layers of the current restart run (restarts)
        self.kept: dict[Any, list[int]] = {}  # each group's token indices kept (`arrays`)

    def _is_header(self, rec: dict[str, Any]) -> bool:
        if self.source is not None:
            return self.source.header(rec)
        return self.skip_type is not None and rec.get("type") == self.skip_type

    def read(self) -> None:
        items = records(self.path, "token router log", torn_tail=True) if self.source is None \
            else self.source.items()
        for n, rec in items:
            if self._is_header(rec):
                self.skipped += 1
                self._header(f"{self.path}:{n}", rec)
            else:
                self._add(f"{self.path}:{n}", n, rec)
        if not self.groups:
            skipped = f" ({self.skipped} of type {self.skip_type!r} skipped)" if self.skipped \
                else ""
            raise InputError(f"{self.path}: no token records{skipped}")

    def _header(self, where: str, rec: dict[str, Any]) -> None:
        """Keep the model a skipped record names (`model`, `model_id`, ...:
        `trace.model_in`) and its experts (`num_experts`), the first of each."""
        had = "num_experts" in self.header
        keep_header(where, rec, self.header)
        if "num_experts" in self.header and not had:
            E = self.header["num_experts"]
            if self.limit == MAX_EXPERTS:  # not given: the header's bounds the ids
                self.limit = E
                if self.top >= E:
                    raise InputError(f"{where}: num_experts {E}, but an earlier record routes "
                                     f"to expert {self.top}")

    def _add(self, where: str, n: int, rec: dict[str, Any], group: Any = None) -> None:
        """Keep the record's ids: in its `group` (default: its request, step or restart run,
        `_group`), or in the draft's records (`draft`) when it is of a draft layer."""
        k = self.keys
        hint = ("" if all(v is None or v in rec for v in k.values())
                else _key_hint(rec, self.skip_type))
        require(where, rec, [v for v in (k["request"], k["step"], k["token"], k["ids"])
                             if v is not None],
                hint)
        token = integer(where, rec, k["token"], 0, MAX_INDEX)
        if not self.of_draft:
            layer = rec.get(k["layer"], None if self.source is None else self.source.layer)
            mark = draft_mark(where, rec, layer if type(layer) is int else None,
                              self.header.get("num_hidden_layers"))
            if mark is not None:
                self.draft_from = self.draft_from or mark
                if self.draft is None:
                    self.draft = _Log(self.path, k, self.skip_type,
                                      self.header.get("draft_experts"), self.source, True)
                group = self._draft_group(where, rec)
                self.draft._add(where, n, rec, group)
                self.stages.add(group, where, rec)
                return
        layers, weights = self._layers(where, rec)
        if group is None:
            group = self._group(where, rec, token, layers)
        self.stages.add(group, where, rec)
        tokens = self.groups.setdefault(group, {})
        self.first_line.setdefault(group, n)
        entry = tokens.setdefault(token, _Token(n))
        again = sorted(set(layers) & set(entry.layers))
        if again:
            what = f"layer {again[0]} of token {token}" if self.per_layer else f"token {token}"
            raise InputError(f"{where}: {what} of {self._name(group)} appears twice")
        entry.layers.update(layers)
        entry.weights.update(weights)
        if k["prompt_len"] is not None and k["prompt_len"] in rec:
            length = integer(where, rec, k["prompt_len"], 0, MAX_INDEX)
            stated = self.prompt.setdefault(group, (length, n))
            if stated[0] != length:
                raise InputError(f"{where}: {k['prompt_len']} {length}, but line {stated[1]} "
                                 f"gives {stated[0]} for {self._name(group)}")

    def _layers(self, where: str, rec: dict[str, Any]
                ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """The record's ids by layer, checked against the form and sizes of earlier records,
        and its gating weights by layer (`records.weight_rows`; empty when it holds none)."""
        key, layer_key = self.keys["ids"], self.keys["layer"]
        ids = rec[key]
        if not isinstance(ids, list) or not ids:
            raise InputError(f"{where}: {key} must be a non-empty list: [K] ids of one layer or "
                             f"[L][K] of every layer")
        per_layer = not isinstance(ids[0], list)
        if self.per_layer is None:
            self.per_layer = per_layer
        elif per_layer != self.per_layer:
            raise InputError(f"{where}: {key} is {'[K]' if per_layer else '[L][K]'}, but earlier "
                             f"records hold {'one layer' if self.per_layer else 'every layer'} "
                             f"each")
        if per_layer:
            fixed = None if self.source is None else self.source.layer
            if fixed is None or layer_key in rec:
                require(where, rec, [layer_key])
                layer = integer(where, rec, layer_key, 0, MAX_LAYERS)
            else:
                layer = fixed
            rows = id_rows(where, [ids], key, self.limit)
            self.layer_ids.add(layer)
        else:
            if layer_key in rec:
                raise InputError(f"{where}: {key} holds every layer ([L][K] ids) but the record "
                                 f"also names {layer_key} {rec[layer_key]!r}; a record naming "
                                 f"its layer holds [K] ids")
            if len(ids) > MAX_LAYERS:
                raise InputError(f"{where}: {len(ids)} layers, above the cap of {MAX_LAYERS}")
            rows = id_rows(where, ids, key, self.limit)
            if self.L is None:
                self.L = len(ids)
            elif len(ids) != self.L:
                raise InputError(f"{where}: {len(ids)} layers, earlier records hold {self.L}")
        K = rows.shape[1]
        if K == 0:
            raise InputError(f"{where}: {key} holds no ids")
        if self.K is None:
            self.K = K
        elif K != self.K:
            raise InputError(f"{where}: rows of {K} ids, earlier rows have {self.K}")
        self.top = max(self.top, int(rows.max()))
        keys = WEIGHT_KEYS if self.source is None else self.source.weights
        weights = weight_rows(where, rec, rows[0] if per_layer else rows, keys)
        self.weighed[0] += weights is not None
        self.weighed[1] += 1
        if weights is None:
            return ({layer: rows[0]} if per_layer else dict(enumerate(rows))), {}
        if per_layer:
            return {layer: rows[0]}, {layer: weights}
        return dict(enumerate(rows)), dict(enumerate(weights))

    def _draft_group(self, where: str, rec: dict[str, Any]) -> Any:
        """The group of a draft record: its request or step, else the restart run of the
        target's records before it (a draft layer starts no step)."""
        if self.keys["request"] is not None or self.keys["step"] is not None:
            return self._group(where, rec, 0, {})
        return max(len(self.groups) - 1, 0)

    def _group(self, where: str, rec: dict[str, Any], token: int,
               layers: dict[int, np.ndarray]) -> Any:
        """The request id, the step value, or the restart run the record belongs to."""
        request, step = self.keys["request"], self.keys["step"]
        if request is not None:
            value = rec[request]
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise InputError(f"{where}: {request} must be a string or an integer, got "
                                 f"{value!r}")
            return str(value)
        if step is not None:
            return integer(where, rec, step, 0, MAX_INDEX)
        run = max(len(self.groups) - 1, 0)
        first = self.groups.get(run, {}).get(0)
        again = token == 0 and first is not None and set(layers) & set(first.layers)
        back = self.previous is not None and token < self.previous \
            and set(layers) & self.seen  # a lower token again, at a layer the step has had
        if again or back:
            run += 1
            self.seen = set()
        self.previous = token
        self.seen |= set(layers)
        return run

    def _name(self, group: Any) -> str:
        if self.keys["request"] is not None:
            return f"request {group!r}"
        return f"step {group}"

    def arrays(self, order: list[Any], incomplete: str | None = None
               ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Each group's int32 `[T, L, K]` ids, tokens in index order, and their float32 gating
        weights where every record held them (`records.weights_kept`), else None. A token
        lacking a layer is an InputError naming its line and how many tokens lack one
        (suggesting `incomplete="drop"`, as the caller writes it, `options.option`, when
        `incomplete` is "error", saying nothing of it when None); with "drop" such tokens are left out, with one InputWarning."""
        layer_ids = sorted(self.layer_ids) if self.per_layer else list(range(self.L or 0))
        groups = {group: self.groups.get(group, {}) for group in order}  # the draft's: some
        lacking = {(group, t): entry for group in order
                   for t, entry in groups[group].items()
                   if len(entry.layers) < len(layer_ids)}  # a token's layers are among them
        total = sum(len(groups[group]) for group in order)
        steps = len({group for group, _ in lacking})
        share = (f"{len(lacking)} of the log's {total} tokens lack some layer (in {steps} "
                 f"{'step' if self.keys['request'] is None else 'request'}"
                 f"{'' if steps == 1 else 's'})")
        if lacking and incomplete != "drop":
            (group, t), entry = min(lacking.items(), key=lambda kv: kv[1].line)
            missing = [layer for layer in layer_ids if layer not in entry.layers]
            fix = f": {option('incomplete', 'drop')} leaves them out" \
                if incomplete == "error" else ""
            raise InputError(f"{self.path}:{entry.line}: token {t} of {self._name(group)} "
                             f"(first record here) lacks layer(s) {missing}; {share}{fix}")
        if lacking:
            warn_caller(f"{self.path}: {share}; {option('incomplete', 'drop')} left them out",
                        InputWarning)
        weighed = weights_kept(self.path, *self.weighed)
        out, gates = [], []
        for group in order:
            tokens = [t for t in sorted(groups[group]) if (group, t) not in lacking]
            self.kept[group] = tokens
            ids = np.empty((len(tokens), len(layer_ids), self.K or 0), dtype=np.int32)
            weights = np.empty(ids.shape if weighed else 0, dtype=np.float32)
            for i, t in enumerate(tokens):
                entry = groups[group][t]
                ids[i] = np.stack([entry.layers[layer] for layer in layer_ids])
                if weighed:
                    weights[i] = np.stack([entry.weights[layer] for layer in layer_ids])
            out.append(ids)
            gates.append(weights)
        return out, gates if weighed else None

    def prompt_lens(self, order: list[Any], ids: list[np.ndarray]) -> list[int]:
        """Each request's prompt length (module doc): of the tokens kept (`arrays`), those
        below the stated length."""
        if self.keys["prompt_len"] is None:
            return [a.shape[0] for a in ids]
        out = []
        for group, a in zip(order, ids):
            if group not in self.prompt:
                raise InputError(f"{self.path}:{self.first_line[group]}: {self._name(group)} "
                                 f"(first record here) has no {self.keys['prompt_len']} in any "
                                 f"of its records")
            length, line = self.prompt[group]
            if length > len(self.groups[group]):
                raise InputError(f"{self.path}:{line}: prompt length {length} exceeds the "
                                 f"{len(self.groups[group])} tokens of {self._name(group)}")
            out.append(sum(t < length for t in self.kept[group]))
        return out


def _read(path: Path, keys: dict[str, str | None], skip_type: Any,
          experts: int | None, incomplete: str | None = None, source: LogSource | None = None
          ) -> tuple[_Log, list[Any], tuple[list[np.ndarray], list[np.ndarray] | None], int,
                     dict[str, Any]]:
    """The log read (module doc): itself, its groups in order, their `[T, L, K]` ids and
    gating weights or None (tokens lacking a layer as `_Log.arrays` has them), `E` and the
    meta they share."""
    if incomplete not in INCOMPLETE + (None,):
        raise InputError(f"incomplete must be one of {', '.join(INCOMPLETE)}, got "
                         f"{incomplete!r}")
    if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int)
                                or not 1 <= experts <= MAX_EXPERTS):
        raise InputError(f"experts must be an integer in [1, {MAX_EXPERTS}], got {experts!r}")
    log = _Log(path, keys, skip_type, experts, source)
    log.read()
    meta: dict[str, Any] = {"source": str(path), "format": "token_log",
                            "skipped_records": log.skipped}
    if "model" in log.header:
        meta["model"] = log.header["model"]
    if log.per_layer:
        meta["model_layers"] = sorted(log.layer_ids)
    order = sorted(log.groups) if keys["step"] is not None else list(log.groups)
    E = experts if experts is not None else log.header.get("num_experts", max(log.top + 1, 1))
    return log, order, log.arrays(order, incomplete), E, meta


def read_token_trace(path: str | Path, *, token_key: str = "token_idx",
                     layer_key: str = "layer", ids_key: str = "topk_ids",
                     step_key: str | None = None, skip_type: Any = None,
                     experts: int | None = None, incomplete: str = "error",
                     source: LogSource | None = None) -> Trace:
    """A per-token router log (module doc) as a Trace, its steps from `step_key` or, without
    one, from token-index restarts.

    token_key: the token index's key
    layer_key: the layer's key, in records of one layer
    ids_key:   the key of the `[K]` (one layer) or `[L][K]` (every layer) ids
    step_key:  the step's key (None: steps from token-index restarts)
    skip_type: records whose "type" field equals it are skipped (None: none)
    experts:   `E` (None: a skipped header's `num_experts`, else the largest id + 1)
    incomplete: a token missing from some layers: "error", or "drop" it (module doc)
    source:    the records, when not `path`'s lines in these keys (`records.LogSource`)
    """
    keys = {"request": None, "token": token_key, "layer": layer_key, "ids": ids_key,
            "step": step_key, "prompt_len": None}
    log, order, (ids, weights), E, meta = _read(Path(path), keys, skip_type, experts,
                                                incomplete, source)
    if step_key is not None:
        meta.update(first_step=order[0], last_step=order[-1])
    else:
        meta["steps_from"] = "token-index restarts"
    log.stages.into(meta, order)
    trace = Trace.from_steps(ids, E, None, meta, weights)
    return trace if log.draft is None else _with_draft(log, order, trace, incomplete)


def _with_draft(log: _Log, order: list[Any], trace: Trace, incomplete: str) -> Trace:
    """`trace` carrying the draft's (MTP) records of `log` (module doc), a step of them in
    each of `order`'s steps (none where a step has none); InputError for draft records of a
    step the target's records do not have."""
    draft = log.draft
    lone = [group for group in draft.groups if group not in set(order)]
    if lone:
        raise InputError(f"{log.path}:{draft.first_line[lone[0]]}: draft (MTP) records of "
                         f"{log._name(lone[0])}, which holds none of the target's records")
    ids, _ = draft.arrays(order, incomplete)
    layers = sorted(draft.layer_ids) if draft.per_layer else list(range(draft.L or 0))
    meta = {"source": str(log.path), "format": "token_log", "model_layers": layers,
            "draft_from": log.draft_from}
    return with_draft(trace, ids, log.header.get("draft_experts"), meta)


def read_token_requests(path: str | Path, *, request_key: str = "request_id",
                        token_key: str = "token_idx", layer_key: str = "layer",
                        ids_key: str = "topk_ids", prompt_len_key: str | None = None,
                        skip_type: Any = None, experts: int | None = None,
                        incomplete: str = "error", source: LogSource | None = None
                        ) -> RequestSet:
    """A per-token router log (module doc) as a RequestSet, one request per `request_key`
    value; the keys, `skip_type`, `experts`, `incomplete` and `source` as in
    :func:`read_token_trace` (a request's dropped tokens leave it, and its prompt length
    counts the prompt tokens kept).

    prompt_len_key: the key of a request's prompt length (None: every token is prompt)
    """
    keys = {"request": request_key, "token": token_key, "layer": layer_key, "ids": ids_key,
            "step": None, "prompt_len": prompt_len_key}
    log, order, (ids, _), E, meta = _read(Path(path), keys, skip_type, experts, incomplete,
                                          source)
    if log.draft is not None:
        warn_caller(f"{path}: its draft (MTP) records ({log.draft_from}) are left out: requests "
                    f"hold the target's layers alone", InputWarning)
    kept = [i for i, a in enumerate(ids) if a.shape[0]]  # a request all of whose tokens left
    order, ids = [order[i] for i in kept], [ids[i] for i in kept]
    return requests_of(ids, log.prompt_lens(order, ids), E, None, order, meta)


def is_token_log(path: Path) -> bool:
    """Whether `path` looks like a per-token log in the default keys rather than a per-step
    JSONL router log (`formats.jsonl`): a `.jsonl` file one of whose first 8 records has a
    `token_idx` key or `topk_ids` that are one flat `[K]` row. A log in other keys cannot be
    told apart by its content: the read options given must choose the form."""
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return False
    try:
        for _, rec in islice(records(path, "token router log"), 8):
            ids = rec.get("topk_ids")
            if "token_idx" in rec or (isinstance(ids, list) and ids
                                      and not isinstance(ids[0], list)):
                return True
    except InputError:
        return False
    return False
