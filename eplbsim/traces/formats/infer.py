"""Record logs read by what they hold (DESIGN.md §5): which field of the records is the top-k
ids, which the gating weights, which say layer, token, step or request, and which record is a
header; then the form they make, read by its reader (`token_log`, `jsonl`, `positional`).

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts.

`fields_of(records, given)` looks at up to `SAMPLE` records:
- **ids**: the field that holds, in every record but headers, a list of `K` distinct integers
  in `[-1, MAX_EXPERTS)` (one token of one layer, "flat"), or a list of such lists of one
  width (`[T][K]` or `[L][K]`, "nested"). A flat list of integers that is the shape of another
  field's nested list in every record holding both (a hook logging a tensor's `.shape`) is not
  a candidate. Where several fields would be the ids with their headers, the one the fewest
  records lack is (the others are lists the headers carry); several lacked by equally few are
  refused. Where no field is, the error names the first record (`file:line`) that lacks the
  field most records hold ids in: a record with a role field, or ids malformed, is data, so a
  record of data without its ids, anywhere, is an error, never a header.
- **weights**: a field of numbers of the ids' shape (or a probability per expert), by name
  (`WEIGHT_NAMES`, in order) where several fit; without one, the trace draws its gates.
- **layer, token, step, request**: the first of their usual names (`ROLE_NAMES`) that holds an
  integer (a request id: text too) in every record; two names of one role that disagree are
  refused.
- **a header**: a record without the ids' field, no role field, and some text or a key of
  `HEADER_KEYS` (`type: "meta"`, `model_id`, `vllm_version`, ...), anywhere in the log; its model
  is read (`records.keep_header`). A header is a header by what it lacks, whatever lists it
  carries (a hook's `{"type": "meta", "layers_logged": [0]}` opens its log of `topk_ids`):
  those lists are named in `meta["read_as"]` (`Fields.header_lists`). Records whose `type` is
  `skip_type` are headers too; any other record without ids is an error, never skipped.
A field the options name (`ids_key`, `layer_key`, ...) is taken as named, never guessed; two
fields that could each be the ids are refused with both names and the flag that chooses.

The form the fields make (`form_of`): flat ids with a layer (or a file whose name gives its
layer) are per-token records, in steps where the token index restarts unless a step field
says; nested ids with a token field hold every layer of a token; nested ids with step and layer
fields are one layer of one step a record; nested ids with none are one layer call a record in
execution order (`--layers-per-pass`, which the log cannot say, or one step a record in a
per-layer file). `describe` words how a log was read (`meta["read_as"]`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable

from ...base.errors import InputError, InputWarning, warn_caller
from ...base.limits import MAX_EXPERTS, MAX_TOP_K
from ...base.options import option
from ..trace import model_in
from .records import Items

SAMPLE = 512  # records looked at to find the fields

ID_NAMES = ("topk_ids", "topk_idx", "topk_indices", "expert_ids", "experts", "selected_experts",
            "expert_indices", "expert_idx", "routed_experts", "ids")
WEIGHT_NAMES = ("topk_weights", "topk_weight", "routing_weights", "weights", "topk_probs",
                "selected_probs", "probs", "gating_probs", "topk_scores", "scores",
                "gate_weights", "expert_weights")
ROLE_NAMES = {
    "layer": ("layer", "layer_id", "layer_idx", "layer_index", "layer_num", "layer_number",
              "moe_layer", "moe_layer_id"),
    "token": ("token_idx", "token_index", "token_pos", "token_position", "token", "tok_idx",
              "position", "pos"),
    "step": ("step", "step_id", "step_idx", "iteration", "iter", "forward_pass", "forward_id",
             "forward_step", "pass_id", "batch_idx"),
    "request": ("request_id", "req_id", "request", "request_idx", "rid", "seq_id",
                "sequence_id"),
}
HEADER_KEYS = ("type", "model", "model_id", "model_name", "served_model_name", "num_experts",
               "vllm_version", "sglang_version", "version", "config", "meta", "engine",
               "num_hidden_layers")
OPTION_OF = {"ids": "ids_key", "layer": "layer_key", "token": "token_key", "step": "step_key",
             "request": "request_key"}  # the option (and flag) that names each field
LAYER_IN_NAME = re.compile(r"layer[_-]?(\d+)", re.IGNORECASE)
IDS = f"list of distinct expert ids (integers in [-1, {MAX_EXPERTS}))"  # as refusals word it


def id_shape(value: Any) -> tuple[str, int, int] | None:
    """`("flat", K, 1)` for a list of `K` distinct ids, `("nested", K, rows)` for a list of
    such lists of one width `K` (rows may be none), else None."""
    if not isinstance(value, list) or not value:
        return None
    if isinstance(value[0], list):
        widths = {len(r) if isinstance(r, list) else -1 for r in value}
        if len(widths) != 1 or not all(_ids(r) for r in value):
            return None
        return "nested", widths.pop(), len(value)
    return ("flat", len(value), 1) if _ids(value) else None


def _ids(row: Any) -> bool:
    """Whether `row` is a list of 1 to `MAX_TOP_K` distinct integer ids in `[-1, MAX_EXPERTS)`
    (-1, padding, may repeat)."""
    if not isinstance(row, list) or not 0 < len(row) <= MAX_TOP_K:
        return False
    if not all(type(x) is int and -1 <= x < MAX_EXPERTS for x in row):
        return False
    real = [x for x in row if x >= 0]
    return len(set(real)) == len(real)


def _integer(value: Any) -> bool:
    return type(value) is int


@dataclass
class Fields:
    """What a log's records hold (module doc).

    ids:     the ids' field; nested: whether it holds lists of rows
    weights: the gating weights' field, or None
    roles:   "layer", "token", "step", "request" -> the field that says it (those found)
    headers: the header records among those looked at; model: the model one names
    given:   the options that named a field (the rest were found)
    header_lists: the fields of those headers (not of `skip_type`) holding lists that could
             be ids, passed over because the headers lack the ids' field
    """

    ids: str
    nested: bool
    weights: str | None = None
    roles: dict[str, str] = field(default_factory=dict)
    headers: int = 0
    model: str | None = None
    given: set[str] = field(default_factory=set)
    header_lists: tuple[str, ...] = ()

    def is_header(self, skip_type: Any) -> Callable[[dict[str, Any]], bool]:
        """The rule that tells a header in this log (module doc)."""
        roles = set(self.roles.values())
        return lambda rec: is_header(rec, skip_type, self.ids, roles)


def is_header(rec: dict[str, Any], skip_type: Any, ids: str | None = None,
              roles: set[str] | None = None) -> bool:
    """Whether `rec` is a header (module doc): of `skip_type`, or without ids (the field
    `ids`, else any that could hold them) and role fields (`roles`, else any usual name),
    holding some text or a key of `HEADER_KEYS`."""
    if of_type(rec, skip_type):
        return True
    names = roles if roles is not None else {n for ns in ROLE_NAMES.values() for n in ns}
    has_ids = ids in rec if ids is not None else any(id_shape(v) for v in rec.values())
    said = any(isinstance(v, str) for v in rec.values()) or bool(set(HEADER_KEYS) & rec.keys())
    return not has_ids and not names & rec.keys() and said


def of_type(rec: dict[str, Any], skip_type: Any) -> bool:
    """Whether `rec` is of `skip_type` (its `type` field; None: no record is)."""
    return skip_type is not None and rec.get("type") == skip_type


def fields_of(items: Items, path: Path, given: dict[str, Any],
              skip_type: Any = None) -> Fields:
    """The fields of the log `items` reads (module doc); `given` maps "ids", "layer", "token",
    "step", "request" to the keys the options name. InputError naming `path`, the choices
    and the option that decides, where the records cannot tell, or `path:line` of a record of
    data without ids."""
    with warnings.catch_warnings():  # a torn last line: the reader warns of it, once
        warnings.simplefilter("ignore")
        sample = list(islice(items(), SAMPLE))
    header = [is_header(rec, skip_type, given.get("ids")) for _, rec in sample]
    plain = [item for item, h in zip(sample, header) if not h]  # headers holding lists too
    if not plain:
        what = f"only headers in its first {SAMPLE} records" if sample else \
            "neither records of expert ids nor a counts matrix"
        raise InputError(f"{path}: holds no list of expert ids ({what})")
    ids = given.get("ids") or _find_ids(plain, path)
    header = [h or is_header(rec, None, ids) for h, (_, rec) in zip(header, sample)]
    heads = [rec for (_, rec), h in zip(sample, header) if h]
    data = [rec for (_, rec), h in zip(sample, header) if not h]
    model = next(filter(None, map(model_in, heads)), None)
    lists = dict.fromkeys(k for rec in heads if not of_type(rec, skip_type)
                          for k, v in rec.items() if id_shape(v))
    nested = any(isinstance(rec.get(ids), list) and rec[ids] and isinstance(rec[ids][0], list)
                 for rec in data)
    roles = {role: given[role] for role in ROLE_NAMES if given.get(role)}
    for role, names in ROLE_NAMES.items():
        if role not in roles:
            found = _role(data, names, role, path)
            if found is not None:
                roles[role] = found
    taken = {ids, *roles.values()}
    return Fields(ids, nested, _weights(data, ids, taken, path), roles, len(heads), model,
                  {k for k, v in given.items() if v}, tuple(lists))


def _find_ids(plain: list[tuple[int, dict[str, Any]]], path: Path) -> str:
    """The field every record of `plain` (`(line, record)`) but headers holds ids in, the
    fewest records lacking it (module doc)."""
    data = [rec for _, rec in plain]
    shapes = [{k: id_shape(v) for k, v in rec.items()} for rec in data]
    keys = list(dict.fromkeys(k for s in shapes for k, v in s.items() if v))
    lacking = {k: [i for i, (s, rec) in enumerate(zip(shapes, data))
                   if s.get(k) is None and rec.get(k) != []] for k in keys}  # [] no tokens
    candidates = [k for k in keys if all(is_header(data[i], None, k) for i in lacking[k])]
    form = {k: next(s[k][0] for s in shapes if s.get(k)) for k in candidates}
    flat = {k for k in candidates if form[k] == "flat"}
    nested = [k for k in candidates if k not in flat]
    both = {(k, n): [rec for rec in data if k in rec and n in rec] for k in flat for n in nested}
    shape_like = {k for (k, n), recs in both.items() if recs and all(
        rec[k] == [len(rec[n]), len(rec[n][0]) if rec[n] else 0] for rec in recs)}
    candidates = [k for k in candidates if k not in shape_like]
    least = min((len(lacking[k]) for k in candidates), default=0)
    fewest = [k for k in candidates if len(lacking[k]) == least]
    if len(fewest) == 1:
        return fewest[0]
    if fewest:
        raise InputError(f"{path}: the fields {', '.join(repr(c) for c in fewest)} could each "
                         f"hold the top-k ids: choose with {option('ids_key')}")
    if not keys:
        raise InputError(f"{path}: no field holds a {IDS} in any record; a record has "
                         f"{', '.join(list(data[0])[:12])}: name the ids' field with "
                         f"{option('ids_key')}")
    best = min(keys, key=lambda k: len(lacking[k]))
    faults = [i for i in lacking[best] if not is_header(data[i], None, best)]
    i, held = faults[0], len(data) - len(lacking[best])
    raise InputError(f"{path}:{plain[i][0]}: no {IDS} under {best!r}, which {held} of the "
                     f"{held + len(faults)} records of data looked at hold; this record has "
                     f"{', '.join(list(data[i])[:12])}: mend it, or name the ids' field with "
                     f"{option('ids_key')}")


def _role(data: list[dict[str, Any]], names: tuple[str, ...], role: str,
          path: Path) -> str | None:
    """The first of `names` every record holds an integer under (a request: text too); two
    such fields that disagree in some record are refused."""
    ok = (lambda v: _integer(v) or isinstance(v, str)) if role == "request" else _integer
    found = [n for n in names if all(n in rec and ok(rec[n]) for rec in data)]
    for other in found[1:]:
        if any(rec[other] != rec[found[0]] for rec in data):
            raise InputError(f"{path}: the fields {found[0]!r} and {other!r} could each be the "
                             f"{role} and disagree: choose with --{OPTION_OF[role]}"
                             f"".replace("_", "-"))
    return found[0] if found else None


def _weights(data: list[dict[str, Any]], ids: str, taken: set[str],
             path: Path) -> str | None:
    """The field of gating weights (module doc), or None: the first of `WEIGHT_NAMES` that
    holds numbers in every record (one per id, or a probability per expert:
    `records.weight_rows` checks which), else the one other field of numbers in the ids'
    shape, some of them fractions; several such unnamed fields keep none, with a warning
    naming them."""
    def numbers(value: Any) -> bool:
        flat = [x for r in value for x in (r if isinstance(r, list) else [r])] \
            if isinstance(value, list) else None
        return flat is not None and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                        for x in flat)

    def shape(rec: dict[str, Any]) -> list[int]:
        rows = rec.get(ids)
        if not isinstance(rows, list) or not rows:
            return [0]
        return [len(rows), len(rows[0])] if isinstance(rows[0], list) else [len(rows)]

    def shaped(rec: dict[str, Any], key: str) -> bool:
        value, rows = rec.get(key), rec.get(ids)
        if not isinstance(value, list) or not isinstance(rows, list) or not rows:
            return value == [] == rows
        inner = [len(r) for r in value if isinstance(r, list)]
        same = len(value) == len(rows) and (inner == [len(rows[0])] * len(rows)
                                            if isinstance(rows[0], list) else not inner)
        return same and value != shape(rec) and numbers(value)

    def valued(rec: dict[str, Any], key: str) -> bool:  # not a tensor's shape, logged
        return key in rec and numbers(rec[key]) and rec[key] != shape(rec)
    named = [k for k in WEIGHT_NAMES if k not in taken and all(valued(rec, k) for rec in data)]
    if named:
        return named[0]
    fitting = [k for k in data[0] if k not in taken and all(shaped(rec, k) for rec in data)
               and any(isinstance(x, float) for rec in data for r in rec[k]
                       for x in (r if isinstance(r, list) else [r]))]  # ints: more ids
    if len(fitting) > 1:
        warn_caller(f"{path}: the fields {', '.join(map(repr, fitting))} could each be the "
                    f"gating weights; none is kept and the toy MoE draws its gates",
                    InputWarning)
    return fitting[0] if len(fitting) == 1 else None


def layer_of_name(path: Path) -> int | None:
    """The layer a file's name gives (`moe_layer8.jsonl`, `layer_08.npy`), or None."""
    found = LAYER_IN_NAME.findall(path.stem)
    return int(found[-1]) if len(found) == 1 else None


TOKEN, EVERY_LAYER, STEP, CALL, FILE_STEP = (
    "records of one token in one layer", "records of one token in every layer",
    "records of one step in one layer", "records of one layer call each, in execution order",
    "records of one step each")  # the forms, as `meta["read_as"]` names them


def form_of(fields: Fields, file_layer: int | None, layers_per_pass: int | None) -> str:
    """Which reader the fields call for (module doc): one of `TOKEN`, `EVERY_LAYER`, `STEP`,
    `CALL` or `FILE_STEP` (a per-layer file's)."""
    roles = fields.roles
    if not fields.nested:
        return TOKEN
    if "token" in roles:
        return EVERY_LAYER
    if "step" in roles and "layer" in roles:
        return STEP
    if layers_per_pass is None and file_layer is not None:
        return FILE_STEP
    return CALL


def describe(form: str, fields: Fields, files: int = 1) -> str:
    """The words of `meta["read_as"]` for one form and its fields (the caller adds layers,
    steps and the header)."""
    parts = [form + (f", {files} files" if files > 1 else "")]
    parts.append(f'ids from "{fields.ids}"')
    if fields.weights:
        parts.append(f'weights from "{fields.weights}"')
    for role in ("layer", "token", "step", "request"):
        if role in fields.roles:
            parts.append(f'{role} from "{fields.roles[role]}"')
    return ", ".join(parts)
