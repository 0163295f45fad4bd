"""Megatron-core MoE router traces (`router_trace_rank{r}.jsonl`, one file a rank) as a Trace.

Dimensions: `S` steps, `T_{s,r}` tokens of rank `r` in step `s`, `L` MoE layers, `K` top-k, `E`
logical experts.

The layout is the one Megatron-core's `RouterTracer` writes (NVIDIA/Megatron-LM,
`megatron/core/transformer/moe/router_trace.py`, read at commit d98e8a64ddf3, added in c1560d94
"MoE routing analysis and metrics capture (#5220)"; turned on by `--moe-routing-trace-path DIR`,
see `examples/inference/README.md`): each rank appends to `DIR/router_trace_rank{r}.jsonl` one
line per (step, block, layer),

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, ...], ...]}

`top_indices` being the `[num_tokens, topk]` logical expert ids the layer's router chose for the
rank's tokens of that step. Inference counts steps (forward passes) from 0, a layer firing again
starting the next; training stamps the iteration. A step's records are written together. Layer ids
are Megatron's (the index in `decoder.layers`, or the 1-based `layer_number` under the
routing-replay sink), so they need not start at 0 and skip dense layers. Records of MTP heads have
`"block": "mtp"`, `mtp_idx` and `layer` (the layer within that MTP module: the router's module
`mtp.layers.{mtp_idx}.mtp_model_layer.layers.{layer}`, read at commit 059f0f5c78cd); optional
sidecar fields (`hs_offset`, `logit_offset`, ...) are ignored here, as is `stage` (the tracer's
point of capture, `pre_dispatch`, not a serving stage).

Read from a directory's `router_trace_rank*.jsonl` files or from given files. Rules (anything else
is an InputError naming `file:line`):

- decoder records (`block` absent or `"decoder"`) are the target's layers; MTP records
  (`"block": "mtp"`, `records.draft_mark`) are the draft's (`Trace.draft`, `traces.draft`: they
  were skipped before), one draft layer a `(mtp_idx, layer)` (`meta["mtp_layers"]` of the
  draft, in order), of their own top-k and experts (the largest id + 1), a (step, rank)'s MTP
  layers all of one token count, ranks concatenated in rank order (`src_rank`); a step holds
  every MTP layer (of the first step holding any) or none, and `meta["read_as"]` says how they
  were read. Records of any other block are skipped and counted in `meta["skipped_records"]`;
- a file holds one rank (its `rank` field, the number in its name when it is named
  `router_trace_rank{r}.jsonl`), no two files the same;
- a file's steps are contiguous and ascending; in a step every layer appears once, all with the
  step's `num_tokens` rows (`len(top_indices)`) of `topk` ids, one `topk` throughout; ids are
  integers in `[-1, E)`, no id twice in a row. A training trace of several microbatches (or of
  recomputed forwards) repeats layers within a step and is refused;
- every file holds the same steps, and every step the layers of the lowest rank's first step
  (`meta["model_layers"]`, ascending: the trace's layer `i` is the `i`-th).

Step `s` of the Trace holds each rank's tokens of the `s`-th step, ranks concatenated in rank
order, `src_rank` each token's rank. Steps are renumbered 0..S-1 (the first and last ids go to
`meta`). `experts` (`E`) defaults to the largest id + 1. The files are read into memory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...base.errors import InputError
from ...base.limits import MAX_EXPERTS, MAX_GPUS, MAX_LAYERS, MAX_TOP_K
from ..draft import with_draft
from ..trace import Trace
from .records import MAX_INDEX, draft_mark, id_rows, integer, records, require

NAME = re.compile(r"router_trace_rank(\d+)\.jsonl")
KEYS = ["step", "layer", "rank", "num_tokens", "topk", "top_indices"]


@dataclass
class _Step:
    """One step of one rank file: its id, first line and layer -> int32 `[T, K]` ids."""

    step: int
    line: int
    layers: dict[int, np.ndarray] = field(default_factory=dict)
    drafts: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (mtp_idx, layer)


class _Reader:
    """Reads rank files, keeping what they must share: `K`, the largest id, skipped records."""

    def __init__(self, experts: int | None) -> None:
        self.limit = MAX_EXPERTS if experts is None else experts
        self.K: int | None = None
        self.Kd: int | None = None  # the MTP records' top-k
        self.top = -1
        self.skipped = 0

    def file(self, path: Path) -> tuple[int, list[_Step]]:
        """A rank file's rank and steps (module doc)."""
        named = NAME.fullmatch(path.name)
        rank, steps = None, []
        for n, rec in records(path, "Megatron router trace"):
            where = f"{path}:{n}"
            draft = draft_mark(where, rec) is not None
            if not draft and rec.get("block", "decoder") != "decoder":
                self.skipped += 1
                continue
            require(where, rec, KEYS)
            step = integer(where, rec, "step", 0, MAX_INDEX)
            layer = integer(where, rec, "layer", 0, MAX_LAYERS)
            r = integer(where, rec, "rank", 0, MAX_GPUS)
            T = integer(where, rec, "num_tokens", 0, MAX_INDEX)
            topk = integer(where, rec, "topk", 1, MAX_TOP_K + 1)
            if rank is None and named and int(named[1]) != r:
                raise InputError(f"{where}: rank {r} in the file of rank {int(named[1])}")
            if rank is not None and r != rank:
                raise InputError(f"{where}: rank {r}, earlier records of the file rank {rank}")
            rank = r
            known = self.Kd if draft else self.K
            if known is not None and topk != known:
                raise InputError(f"{where}: topk {topk}, earlier "
                                 f"{'MTP ' if draft else ''}records {known}")
            if draft:
                self.Kd = topk
            else:
                self.K = topk
            ids = id_rows(where, rec["top_indices"], "top_indices",
                          MAX_EXPERTS if draft else self.limit)
            if ids.shape[0] != T:
                raise InputError(f"{where}: num_tokens is {T} but top_indices has "
                                 f"{ids.shape[0]} rows")
            if T and ids.shape[1] != topk:
                raise InputError(f"{where}: rows of {ids.shape[1]} ids, topk is {topk}")
            if not steps or step != steps[-1].step:
                if steps and step < steps[-1].step:
                    raise InputError(f"{where}: step {step} after step {steps[-1].step}: a "
                                     f"file's steps must be contiguous and ascending")
                steps.append(_Step(step, n))
            current = steps[-1]
            key = (integer(where, rec, "mtp_idx", 0, MAX_LAYERS) if "mtp_idx" in rec else 0,
                   layer) if draft else layer
            layers = current.drafts if draft else current.layers
            what = f"MTP layer {key}" if draft else f"layer {layer}"
            if key in layers:
                raise InputError(f"{where}: {what} of step {step} appears twice (a training "
                                 f"trace of several microbatches is not supported)")
            other = next(iter(layers.values()), None)
            if other is not None and other.shape[0] != T:
                raise InputError(f"{where}: {what} of step {step} has {T} tokens, other "
                                 f"{'MTP ' if draft else ''}layers of the step "
                                 f"{other.shape[0]}")
            layers[key] = ids.reshape(T, topk).astype(np.int32)
            if T and not draft:
                self.top = max(self.top, int(ids.max()))
        if rank is None or not any(s.layers for s in steps):
            raise InputError(f"{path}: no decoder records (a Megatron router trace has one "
                             f"JSON object per line)")
        return rank, steps


def _rank_files(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """The files `source` names: a directory's `router_trace_rank*.jsonl`, one file, or a
    sequence of files."""
    if not isinstance(source, (str, Path)):
        paths = [Path(p) for p in source]
        if not paths:
            raise InputError("a Megatron router trace needs at least one rank file")
        return paths
    source = Path(source)
    if not source.is_dir():
        return [source]
    try:
        found = [p for p in source.iterdir() if NAME.fullmatch(p.name)]
    except OSError as exc:
        raise InputError(f"{source}: cannot list ({exc.strerror or exc})") from None
    if not found:
        raise InputError(f"{source}: holds no router_trace_rank{{r}}.jsonl files")
    return sorted(found, key=lambda p: int(NAME.fullmatch(p.name)[1]))


def _check_steps(ref: tuple[Path, list[_Step]], other: tuple[Path, list[_Step]],
                 layer_ids: list[int]) -> None:
    """InputError unless `other` holds the steps of `ref`, each with the layers `layer_ids`."""
    (ref_path, ref_steps), (path, steps) = ref, other
    for s in steps:
        missing = sorted(set(layer_ids) - set(s.layers))
        extra = sorted(set(s.layers) - set(layer_ids))
        if missing or extra:
            what = f"lacks layer(s) {missing}" if missing else f"has layer(s) {extra} beyond"
            raise InputError(f"{path}:{s.line}: step {s.step} (starting here) {what} the "
                             f"layers {layer_ids} of step {ref_steps[0].step} of {ref_path}")
    for (a, a_steps), (b, b_steps) in ((other, ref), (ref, other)):
        b_ids = {s.step for s in b_steps}
        lone = next((s for s in a_steps if s.step not in b_ids), None)
        if lone is not None:
            raise InputError(f"{a}:{lone.line}: step {lone.step} is not in {b} (every rank "
                             f"file must hold the same steps)")


def read_megatron(source: str | Path | Sequence[str | Path], *,
                  experts: int | None = None) -> Trace:
    """Read a Megatron-core router trace (module doc) from a directory, one rank file or a
    sequence of them, into memory; `experts` defaults to the largest id + 1."""
    if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int)
                                or not 1 <= experts <= MAX_EXPERTS):
        raise InputError(f"experts must be an integer in [1, {MAX_EXPERTS}], got {experts!r}")
    paths = _rank_files(source)
    reader = _Reader(experts)
    ranks: dict[int, tuple[Path, list[_Step]]] = {}
    for path in paths:
        rank, steps = reader.file(path)
        if rank in ranks:
            raise InputError(f"{path}:{steps[0].line}: rank {rank} again ({ranks[rank][0]} holds "
                             f"it too)")
        ranks[rank] = (path, steps)
    order = sorted(ranks)
    ref = ranks[order[0]]
    layer_ids = sorted(ref[1][0].layers)
    for r in order:
        _check_steps(ref, ranks[r], layer_ids)
    arrays, src = [], []
    for i in range(len(ref[1])):
        parts = [np.stack([ranks[r][1][i].layers[layer] for layer in layer_ids], axis=1)
                 for r in order]  # [T_{s,r}, L, K] each
        arrays.append(np.concatenate(parts))
        src.append(np.concatenate([np.full(p.shape[0], r, dtype=np.int64)
                                   for p, r in zip(parts, order)]))
    if not sum(a.shape[0] for a in arrays):
        raise InputError(f"{source}: no token rows (every record has num_tokens 0)")
    meta = {"source": str(source) if isinstance(source, (str, Path)) else
            [str(p) for p in paths], "format": "megatron",
            "files": [ranks[r][0].name for r in order], "ranks": order,
            "first_step": ref[1][0].step, "last_step": ref[1][-1].step,
            "model_layers": layer_ids, "skipped_records": reader.skipped}
    E = experts if experts is not None else max(reader.top + 1, 1)
    trace = Trace.from_steps(arrays, E, src, meta)
    keys = next((sorted(s.drafts) for r in order for s in ranks[r][1] if s.drafts), None)
    if keys is None:
        return trace
    draft_from = 'records "block": "mtp"'
    trace.meta["read_as"] = (f"Megatron router trace of {len(order)} rank file(s), layers "
                             f"{layer_ids}; its {draft_from.replace('records', 'MTP records')} "
                             f"as the draft's layers (mtp_idx, layer) {[list(k) for k in keys]}")
    drafts, draft_src = _drafts(ranks, order, keys, reader.Kd or 0)
    return with_draft(trace, drafts, None, {"source": meta["source"], "format": "megatron",
                                            "draft_from": draft_from,
                                            "mtp_layers": [list(k) for k in keys]}, draft_src)


def _drafts(ranks: dict[int, tuple[Path, list[_Step]]], order: list[int],
            keys: list[tuple[int, int]], Kd: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each step's MTP rows, int32 `[Td_s, Ld, Kd]` (ranks in rank order, a rank's step holding
    every MTP layer of `keys` or none), and each row's rank `[Td_s]`."""
    arrays, src = [], []
    for i in range(len(ranks[order[0]][1])):
        parts = []
        for r in order:
            path, steps = ranks[r]
            held = steps[i].drafts
            if held and sorted(held) != keys:
                raise InputError(f"{path}:{steps[i].line}: step {steps[i].step} (starting here) "
                                 f"holds MTP layers {sorted(held)}, other steps {keys}: a step "
                                 f"runs every MTP layer or none")
            parts.append(np.stack([held[k] for k in keys], axis=1) if held else
                         np.empty((0, len(keys), Kd), dtype=np.int32))  # [T, Ld, Kd]
        arrays.append(np.concatenate(parts))
        src.append(np.concatenate([np.full(p.shape[0], r, dtype=np.int64)
                                   for p, r in zip(parts, order)]))
    return arrays, src


def is_megatron_trace(path: Path) -> bool:
    """Whether `path` is a `router_trace_rank{r}.jsonl` file or a directory holding one."""
    if NAME.fullmatch(path.name):
        return True
    try:
        return path.is_dir() and any(NAME.fullmatch(p.name) for p in path.iterdir())
    except OSError:
        return False
