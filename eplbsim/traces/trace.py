"""Routing traces: ragged steps of top-k logical expert ids, validated, saved as `.npz`.

Dimensions: `S` steps, `T` tokens in a step (`T_s` for step `s`), `L` MoE layers, `E` logical
experts, `K` top-k. A routing id of -1 is padding ("no expert") and is never counted as load.

On disk (DESIGN.md §5): `topk_ids` int16/int32 `[sum T_s, L, K]`, `step_offsets` int64 `[S + 1]`,
optional `src_rank` int16 `[sum T_s]`, optional `topk_weights` float32 `[sum T_s, L, K]` (the
router's gating weight of each pair, where the log had them), and `meta`, a JSON string with
`num_experts`, `top_k`, `num_layers`, optional `num_groups`, and free-form provenance. Files are read without pickle.

A draft's (MTP) layers of the same steps (`Trace.draft`, `traces.draft`) are a second part of
the file: `draft_topk_ids [sum Td_s, Ld, Kd]` and `draft_step_offsets [S + 1]` (the draft runs
its own rows a step), and `meta["draft"]`, the draft's own meta with its `num_experts`, `top_k`
and `num_layers`; read with the target's checks, an error naming the draft part.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from ..base.files import (NPY_HEADER, NPY_HEADER_ERRORS, atomic_file, check_memory, npy_refusal,
                          regular_file)
from ..base.limits import MAX_EXPERTS, MAX_GPUS, MAX_LAYERS, MAX_TOP_K, check_at_most
from ..base.loops import counts_and_first_duplicate, expert_counts, first_duplicate


class TraceShape:
    """Sizes shared by every trace form, from `step_offsets [S + 1]`, `meta` and `ids_shape`
    (`(sum T_s, L, K)`)."""

    step_offsets: torch.Tensor
    meta: dict[str, Any]

    @property
    def ids_shape(self) -> tuple[int, int, int]:
        raise NotImplementedError

    @property
    def num_steps(self) -> int:
        return self.step_offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.ids_shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids_shape[1]

    @property
    def top_k(self) -> int:
        return self.ids_shape[2]

    @property
    def num_groups(self) -> int | None:
        return self.meta.get("num_groups")

    @property
    def tokens_per_step(self) -> torch.Tensor:
        """int64 `[S]`."""
        return self.step_offsets.diff()

    def step_weights(self, s: int) -> torch.Tensor | None:
        """The gating weights of step `s`'s pairs, float32 `[T_s, L, K]`, or None when the
        trace has none (the toy MoE then draws its gates)."""
        return None

    def step_rows(self, s: int) -> slice:
        """The rows of step `s` in the trace's token arrays, a slice of Python ints
        (`step_offsets` read into a list once: slicing by tensor elements would read them
        back one by one, every step)."""
        bounds = self.__dict__.get("_step_bounds")
        if bounds is None:
            bounds = self.__dict__["_step_bounds"] = self.step_offsets.tolist()
        return slice(bounds[s], bounds[s + 1])

    def log_steps(self) -> list[str]:
        """Each step's name as the log counts it, `[S]`: its index here; a view's steps keep
        their base's names (`StepView`: the selected steps' own, `ChunkView`: `"2.3"` for the
        fourth chunk of step 2), so every page names a step as `trace info` and
        `--select-steps` do (`traces.steps.span_words`)."""
        return [str(s) for s in range(self.num_steps)]

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype of per-(step, layer, expert or slot) pair counts: int32, which holds them
        (a count is at most its step's tokens: a token routes an expert once), unless a step
        has 2**31 tokens or more."""
        return count_dtype(int(self.tokens_per_step.max()) if self.num_steps else 0)

    def _validated_counts(self) -> torch.Tensor | None:
        """The pair counts validation made in its pass over the ids, handed over once (the
        caller owns them); None after that, or when validation made none."""
        return self.__dict__.pop("_counts", None)

    def __getstate__(self) -> dict[str, Any]:
        """The trace to pickle, without the counts its validation made (they wait for this
        process's first `counts()`; another process counts, or reads only what it needs)."""
        state = dict(self.__dict__)
        state.pop("_counts", None)
        return state


class View(TraceShape):
    """Sizes of a trace read through another (`base`: its layers, top-k and experts) with rows
    of its own (`step_offsets`): `traces.steps.StepView`, `traces.prefill_chunks.ChunkView`."""

    base: Any

    @property
    def ids_shape(self) -> tuple[int, int, int]:
        return (int(self.step_offsets[-1]), self.base.num_layers, self.base.top_k)

    @property
    def num_experts(self) -> int:
        return self.base.num_experts


# the keys under which logs name the model they ran, in order of precedence: a trace's meta,
# a reader's header records, a vLLM response; the readers keep the first under `meta["model"]`
MODEL_KEYS = ("model", "model_id", "model_name", "served_model_name")


def model_in(record: Any) -> str | None:
    """The model a meta or header `record` names: the text under the first of `MODEL_KEYS`
    it holds (stripped, not empty), else None."""
    if not isinstance(record, dict):
        return None
    return next((record[k].strip() for k in MODEL_KEYS
                 if isinstance(record.get(k), str) and record[k].strip()), None)


def count_dtype(most_tokens: int) -> torch.dtype:
    """int32 for the pair counts of steps of at most `most_tokens` tokens, unless that is
    2**31 or more (`TraceShape.load_dtype`)."""
    return torch.int64 if most_tokens >= 2 ** 31 else torch.int32


@dataclass(frozen=True, eq=False)
class Trace(TraceShape):
    """A validated routing trace. Tensors are private copies of what the caller passed.

    topk_ids:     int16 (`E <= 32768`) or int32 `[sum T_s, L, K]` logical expert ids in
                  `[-1, E)` (`id_dtype`); `step` widens one step to int32
    step_offsets: int64 `[S + 1]`, rows of step `s` are `step_offsets[s]:step_offsets[s+1]`
    num_experts:  `E`
    src_rank:     int64 `[sum T_s]` source EP rank of each token, or None
    meta:         provenance (JSON-serialisable dict); `num_groups` is read from it when present
    topk_weights: float32 `[sum T_s, L, K]` finite, non-negative gating weight of each pair
                  (a padding slot's is ignored), or None
    draft:        the draft's (MTP) layers of the same `S` steps, a Trace `[sum Td_s, Ld, Kd]`
                  of its own experts and rows, with no draft of its own (`traces.draft`), or
                  None
    """

    topk_ids: torch.Tensor
    step_offsets: torch.Tensor
    num_experts: int
    src_rank: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    topk_weights: torch.Tensor | None = None
    draft: "Trace | None" = None

    def __post_init__(self) -> None:
        ids = _int_array(self.topk_ids, "topk_ids")
        offsets = _int_array(self.step_offsets, "step_offsets")
        if ids.ndim != 3:
            raise InputError(f"topk_ids must have shape [tokens, layers, top_k], got {ids.shape}")
        num_experts = check_sizes_of(ids.shape, self.num_experts)
        lo, hi = _bounds(ids)
        if hi >= num_experts:
            raise InputError(f"topk_ids has expert id {hi} but the trace declares "
                             f"{num_experts} experts (ids must lie in [-1, {num_experts}))")
        if lo < -1:
            raise InputError(f"topk_ids has expert id {lo}; ids must lie in "
                             f"[-1, {num_experts}) with -1 for padding")
        if offsets.ndim != 1 or offsets.size < 2:
            raise InputError(f"step_offsets must be 1-D with S + 1 >= 2 entries (a trace needs "
                             f"at least one step), got shape {offsets.shape}")
        first, last = _bounds(offsets[:1])[0], _bounds(offsets[-1:])[0]
        if first != 0 or last != ids.shape[0]:
            raise InputError(f"step_offsets must start at 0 and end at the number of token rows "
                             f"({ids.shape[0]}), got {first} ... {last}")
        offsets = torch.from_numpy(offsets.astype(np.int64))
        if (offsets[1:] < offsets[:-1]).any():
            raise InputError("step_offsets must be non-decreasing")
        if ids.shape[0] == 0:
            raise InputError("the trace holds no token rows")
        counts, duplicate, _ = counts_and_first_duplicate(  # one pass: ids read once
            ids, offsets.numpy(), num_experts, count_dtype(int((offsets[1:] - offsets[:-1]).max())))
        raise_duplicate(duplicate, "topk_ids")
        ids = torch.from_numpy(ids.astype(id_dtype(num_experts)))  # a private copy
        src = None
        if self.src_rank is not None:
            src = _int_array(self.src_rank, "src_rank")
            if src.shape != (ids.shape[0],):
                raise InputError(f"src_rank must have one entry per token row ({ids.shape[0]}), "
                                 f"got shape {src.shape}")
            lo, hi = _bounds(src)
            if lo < 0 or hi >= MAX_GPUS:
                raise InputError(f"src_rank has rank {lo if lo < 0 else hi}; ranks must lie in "
                                 f"[0, {MAX_GPUS})")
            src = torch.from_numpy(src.astype(np.int64))
        weights = None if self.topk_weights is None else \
            torch.from_numpy(gating_weights(self.topk_weights, ids.shape))
        meta = dict(self.meta or {})
        groups = meta.get("num_groups")
        if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool)
                                   or groups < 1 or num_experts % groups):
            raise InputError(f"meta num_groups={groups!r} must be a positive divisor of "
                             f"num_experts={num_experts}")
        object.__setattr__(self, "topk_ids", ids)
        object.__setattr__(self, "step_offsets", offsets)
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "src_rank", src)
        object.__setattr__(self, "meta", meta)
        object.__setattr__(self, "topk_weights", weights)
        self.__dict__["_counts"] = torch.from_numpy(counts)  # handed to the first `counts()`
        if self.draft is not None and (not isinstance(self.draft, Trace)
                                       or self.draft.draft is not None
                                       or self.draft.num_steps != self.num_steps):
            raise InputError(f"draft must be a Trace of the same {self.num_steps} steps with no "
                             f"draft of its own, got {self.draft!r}")

    @classmethod
    def from_steps(cls, steps: Sequence[Any], num_experts: int,
                   src_rank: Sequence[Any] | None = None,
                   meta: dict[str, Any] | None = None,
                   weights: Sequence[Any] | None = None) -> "Trace":
        """Build a trace from a list of per-step `[T_s, L, K]` arrays (and `[T_s]` src ranks,
        `[T_s, L, K]` gating weights)."""
        if len(steps) == 0:
            raise InputError("a trace needs at least one step")
        parts = [_int_array(s, f"step {i}") for i, s in enumerate(steps)]
        shapes = {p.shape[1:] for p in parts}
        if any(p.ndim != 3 for p in parts) or len(shapes) != 1:
            raise InputError(f"every step must be [T_s, L, K] with the same L and K, got shapes "
                             f"{[p.shape for p in parts]}")
        sizes = np.cumsum([0] + [p.shape[0] for p in parts])
        src = None if src_rank is None else np.concatenate(
            [_int_array(r, "src_rank") for r in src_rank])
        gates = None if weights is None else np.concatenate([np.asarray(w) for w in weights])
        return cls(np.concatenate(parts), sizes, num_experts, src, meta or {}, gates)

    @classmethod
    def from_arrays(cls, topk_ids: Any, *, step_offsets: Any = None,
                    tokens_per_step: Any = None, num_experts: int | None = None,
                    weights: Any = None, model: str | None = None,
                    layers: Sequence[int] | None = None,
                    meta: dict[str, Any] | None = None) -> "Trace":
        """A trace from the arrays a notebook holds (numpy, torch or nested lists), checked as
        a file of the same content is: for a log of a shape no reader takes.

        topk_ids:        int `[N, L, K]` logical expert ids, -1 for padding (`[N, K]`: one layer)
        step_offsets:    int `[S + 1]`, rows of step `s` are `step_offsets[s]:step_offsets[s+1]`
        tokens_per_step: int `[S]`, the rows of each step in order (instead of `step_offsets`;
                         neither: one step of all `N` rows)
        num_experts:     `E` (default the largest id + 1)
        weights:         float `[N, L, K]` (`[N, K]`) gating weights (default none: the toy MoE
                         draws its gates)
        model:           the model's name (`meta["model"]`: priced as it)
        layers:          the model's layer number of each of the `L` layers
        meta:            more provenance, kept
        Returns the Trace; InputError where a file holding the same would be refused.
        """
        ids = _int_array(topk_ids, "topk_ids")
        if ids.ndim == 2:
            ids = ids[:, None]
            weights = None if weights is None else np.asarray(weights)[:, None]
        if step_offsets is not None and tokens_per_step is not None:
            raise InputError("give step_offsets or tokens_per_step, not both")
        if step_offsets is None:
            sizes = [ids.shape[0]] if tokens_per_step is None else \
                _int_array(tokens_per_step, "tokens_per_step")
            if np.ndim(sizes) != 1 or (np.asarray(sizes) < 0).any():
                raise InputError("tokens_per_step must be a 1-D list of counts >= 0")
            step_offsets = np.concatenate([[0], np.cumsum(sizes)])
        if num_experts is None:
            num_experts = max(_bounds(ids)[1] + 1, 1)
        info = dict(meta or {}, source=(meta or {}).get("source", "arrays"))
        if model is not None:
            info["model"] = model
        if layers is not None:
            info["model_layers"] = [int(x) for x in layers]
            if len(info["model_layers"]) != ids.shape[1]:
                raise InputError(f"layers names {len(info['model_layers'])} layers; topk_ids "
                                 f"holds {ids.shape[1]}")
        return cls(ids, step_offsets, num_experts, None, info, weights)


    @property
    def ids_shape(self) -> tuple[int, int, int]:
        return tuple(self.topk_ids.shape)

    def __repr__(self) -> str:
        draft = "" if self.draft is None else (f"; draft L={self.draft.num_layers}, "
                                                f"E={self.draft.num_experts}, K={self.draft.top_k}")
        return (f"Trace({shape_words(self)}{', src_rank' if self.src_rank is not None else ''}"
                f"{draft})")

    def step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s`, int32 `[T_s, L, K]` (a fresh copy, widened from storage)."""
        return self.stored_step(s).to(torch.int32)

    def stored_step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s` as stored (`id_dtype`), `[T_s, L, K]`: a view of the
        trace, for readers that take any integer dtype and never write."""
        return self.topk_ids[self.step_rows(s)]

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        """Source ranks of step `s`'s tokens, int64 `[T_s]`, or None."""
        if self.src_rank is None:
            return None
        return self.src_rank[self.step_rows(s)]

    def step_weights(self, s: int) -> torch.Tensor | None:
        if self.topk_weights is None:
            return None
        return self.topk_weights[self.step_rows(s)]

    def counts(self) -> torch.Tensor:
        """(token, slot) pairs per logical expert, `load_dtype` `[S, L, E]`; padding is not
        counted. The first call gets the counts validation made in the same pass over the ids
        (the caller owns them, as every call's); later calls count again."""
        made = self._validated_counts()
        if made is not None:
            return made
        return torch.from_numpy(expert_counts(self.topk_ids.numpy(), self.step_offsets.numpy(),
                                              self.num_experts, self.load_dtype))

    def window(self, start: int, stop: int) -> "Trace":
        """Steps `start:stop` as a new trace (Python slice semantics)."""
        idx = range(self.num_steps)[start:stop]
        if len(idx) == 0 or idx.step != 1:
            raise InputError(f"window {start}:{stop} selects no steps of a {self.num_steps}-step trace")
        lo, hi = int(self.step_offsets[idx.start]), int(self.step_offsets[idx.stop])
        src = None if self.src_rank is None else self.src_rank[lo:hi]
        weights = None if self.topk_weights is None else self.topk_weights[lo:hi]
        meta = dict(self.meta)
        if isinstance(meta.get("stages"), str):  # one mark a step (`traces.stages`): its own
            meta["stages"] = meta["stages"][idx.start:idx.stop]
        draft = None if self.draft is None else self.draft.window(start, stop)
        return Trace(self.topk_ids[lo:hi], self.step_offsets[idx.start:idx.stop + 1] - lo,
                     self.num_experts, src, meta, weights, draft)


def shape_words(trace: TraceShape) -> str:
    """"S steps, N tokens, L=.., E=.., K=..": a token trace's sizes, for a short repr."""
    return (f"{trace.num_steps} steps, {trace.num_tokens} tokens, L={trace.num_layers}, "
            f"E={trace.num_experts}, K={trace.top_k}")


def id_dtype(num_experts: int) -> type:
    """The narrowest dtype ids in `[-1, E)` are stored in: int16 up to 32768 experts, else
    int32."""
    return np.int16 if num_experts <= 2 ** 15 else np.int32


def _int_array(x: Any, name: str) -> np.ndarray:
    """An integer numpy array of an array-like (a torch tensor's values as they are), in this
    machine's byte order; InputError if it is not one. Values are compared in this dtype
    before any conversion, so none wraps."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise InputError(f"{name} must hold integers, got dtype {x.dtype}")
        x = x.detach().cpu().numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputError(f"{name} is not a numeric array ({exc})") from None
    if arr.dtype.kind not in "iu":
        raise InputError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def gating_weights(x: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Gating weights of `shape` (a trace's ids' `[N, L, K]`) as a private float32 copy;
    InputError unless they are real numbers of that shape, finite and non-negative."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    try:
        arr = np.array(x, dtype=np.float32)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputError(f"topk_weights is not a numeric array ({exc})") from None
    if arr.shape != tuple(shape):
        raise InputError(f"topk_weights must have the shape of topk_ids {tuple(shape)}, got "
                         f"{arr.shape}")
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        row, layer, slot = np.argwhere(bad)[0]
        raise InputError(f"topk_weights: token row {row}, layer {layer}, slot {slot} has weight "
                         f"{arr[row, layer, slot]}; gating weights are finite and >= 0")
    return arr


def _bounds(arr: np.ndarray) -> tuple[int, int]:
    """(min, max) of an integer array as Python ints ((0, -1) when empty)."""
    return (int(arr.min()), int(arr.max())) if arr.size else (0, -1)


def check_sizes_of(ids_shape: tuple[int, ...], num_experts: Any) -> int:
    """`num_experts` as an int, after checking a trace's `(rows, L, K)` and `E` against the
    caps of `eplbsim.base.limits`; InputError otherwise."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) \
            or num_experts < 1:
        raise InputError(f"num_experts must be a positive integer, got {num_experts!r}")
    _, L, K = ids_shape
    if L < 1 or K < 1:
        raise InputError(f"topk_ids needs at least one layer and top_k >= 1, "
                         f"got shape {tuple(ids_shape)}")
    check_at_most(int(num_experts), MAX_EXPERTS, "num_experts")
    check_at_most(L, MAX_LAYERS, "the number of layers")
    check_at_most(K, MAX_TOP_K, "top_k")
    return int(num_experts)


_REQUIRED = ("topk_ids", "step_offsets", "meta")
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip archive (an .npz), or an empty one


def check_distinct(ids: np.ndarray, what: str) -> None:
    """InputError naming `what` unless every token row of `ids [N, L, K]` routes distinct
    experts in each layer (`loops.first_duplicate`; padding -1 repeats freely)."""
    raise_duplicate(first_duplicate(ids), what)


def raise_duplicate(duplicate: tuple[int, int, int] | None, what: str) -> None:
    """InputError naming `what` and the `(row, layer, expert)` found routed twice, if any."""
    if duplicate is not None:
        row, layer, expert = duplicate
        raise InputError(f"{what}: token row {row} routes expert {expert} twice in layer "
                         f"{layer} (a router picks top_k distinct experts)")


def npz_names(path: str | Path) -> frozenset[str]:
    """The member names of the `.npz` archive at `path`, from its zip directory alone (nothing
    is loaded); empty for anything that is not a readable regular zip file."""
    if not Path(path).is_file():
        return frozenset()
    try:
        with zipfile.ZipFile(path) as archive:
            return frozenset(archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError, NotImplementedError, RuntimeError):
        return frozenset()


def is_zip(path: str | Path) -> bool:
    """Whether `path` is a regular file (never a FIFO: opening one waits) that starts as a zip
    archive (an `.npz`) does."""
    if not Path(path).is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) in _ZIP_MAGIC
    except OSError:
        return False


def read_npz(path: str | Path, required: Sequence[str], what: str) -> dict[str, np.ndarray]:
    """The arrays of the `.npz` archive at `path`, read without unpickling. InputError naming
    the file when it is not a regular file or not a zip archive, lacks a `required` member,
    would not fit in memory, uses an unsupported compression or encryption, or is truncated
    or corrupt."""
    path = regular_file(path, what)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if head not in _ZIP_MAGIC:
        raise InputError(f"{path}: not {what} (not an .npz archive)")
    try:
        with np.load(path, allow_pickle=False, max_header_size=NPY_HEADER) as npz:
            missing = [k for k in required if k not in npz.files]
            if missing:
                raise InputError(f"{path}: not {what} (missing {', '.join(missing)}; found "
                                 f"{', '.join(npz.files) or 'no arrays'})")
            check_memory(sum(info.file_size for info in npz.zip.infolist()), f"reading {path}",
                         "convert it to the directory form, read step by step")
            return {k: npz[k] for k in npz.files}
    except InputError:
        raise
    except (*NPY_HEADER_ERRORS, KeyError, zipfile.BadZipFile, zlib.error,
            NotImplementedError, RuntimeError) as exc:
        raise InputError(f"{path}: not a readable {what} (truncated or corrupt?): "
                         f"{npy_refusal(exc)}") from None


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` as an `.npz` file in the DESIGN.md §5 format, its draft part too (module
    doc), through a temporary sibling (an existing file stays as it was if writing fails). Ids
    are int16 when `E` fits (`id_dtype`), else int32; source ranks int16 when they fit, else
    int32."""
    meta = dict(trace.meta, **_sizes(trace))
    arrays = {"topk_ids": trace.topk_ids.numpy().astype(id_dtype(trace.num_experts), copy=False),
              "step_offsets": trace.step_offsets.numpy()}
    if trace.src_rank is not None:
        src = trace.src_rank.numpy()
        arrays["src_rank"] = src.astype(np.int16 if src.max(initial=0) <= np.iinfo(np.int16).max
                                        else np.int32)
    if trace.topk_weights is not None:
        arrays["topk_weights"] = trace.topk_weights.numpy()
    if trace.draft is not None:
        draft = trace.draft
        meta["draft"] = dict(draft.meta, **_sizes(draft))
        arrays["draft_topk_ids"] = draft.topk_ids.numpy().astype(id_dtype(draft.num_experts),
                                                                 copy=False)
        arrays["draft_step_offsets"] = draft.step_offsets.numpy()
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)


def _sizes(trace: Trace) -> dict[str, int]:
    """The sizes a file's meta declares of a trace (or of its draft part)."""
    return {"num_experts": trace.num_experts, "top_k": trace.top_k,
            "num_layers": trace.num_layers}


def load_trace(path: str | Path) -> Trace:
    """Read an `.npz` trace, its draft part too (module doc), without unpickling; InputError
    naming the file (and the draft part, for its own) on any problem."""
    path = Path(path)
    arrays = read_npz(path, _REQUIRED, "an eplbsim trace")
    try:
        meta = json.loads(str(arrays["meta"][()]))
    except (ValueError, TypeError, RecursionError) as exc:
        raise InputError(f"{path}: meta is not a JSON string ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: meta must be a JSON object")
    draft_meta = meta.pop("draft", None)
    has_draft = [k for k in _DRAFT if k in arrays]
    if (draft_meta is None) != (not has_draft) or 0 < len(has_draft) < len(_DRAFT):
        raise InputError(f"{path}: a draft part is meta's draft, draft_topk_ids and "
                         f"draft_step_offsets together; found only "
                         f"{', '.join(has_draft + (['meta draft'] if draft_meta else []))}")
    draft = None
    if draft_meta is not None:
        if not isinstance(draft_meta, dict):
            raise InputError(f"{path}: draft part: meta's draft must be a JSON object")
        draft = _checked(f"{path}: draft part", arrays["draft_topk_ids"],
                         arrays["draft_step_offsets"], draft_meta)
    return _checked(str(path), arrays["topk_ids"], arrays["step_offsets"], meta,
                    arrays.get("src_rank"), arrays.get("topk_weights"), draft)


_DRAFT = ("draft_topk_ids", "draft_step_offsets")  # the arrays of a file's draft part


def _checked(where: str, ids: np.ndarray, offsets: np.ndarray, meta: dict[str, Any],
             src: np.ndarray | None = None, weights: np.ndarray | None = None,
             draft: Trace | None = None) -> Trace:
    """The Trace of a file's arrays and `meta` (its sizes declared), InputError prefixed by
    `where` on any problem."""
    for key in ("num_experts", "top_k", "num_layers"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool):
            raise InputError(f"{where}: meta lacks the integer field {key!r}")
    if ids.ndim == 3 and (ids.shape[1], ids.shape[2]) != (meta["num_layers"], meta["top_k"]):
        raise InputError(f"{where}: topk_ids has shape {ids.shape} but meta declares "
                         f"num_layers={meta['num_layers']}, top_k={meta['top_k']}")
    try:
        return Trace(ids, offsets, meta["num_experts"], src, meta, weights, draft)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
