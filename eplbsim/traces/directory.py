"""Traces larger than memory: the uncompressed directory form of a trace, read step by step.

Dimensions: `S` steps, `T_s` tokens of step `s`, `N = sum T_s` token rows, `L` MoE layers,
`E` logical experts, `K` top-k. A routing id of -1 is padding.

A trace directory holds (DESIGN.md §5, the `.npz` arrays as separate `.npy` files, uncompressed
so any rows can be read without the rest):

    topk_ids.npy      int16 or int32 `[N, L, K]`, ids in `[-1, E)`
    step_offsets.npy  int64 `[S + 1]`, rows of step `s` are `offsets[s]:offsets[s + 1]`
    src_rank.npy      optional int16 `[N]`, the source EP rank of each token row
    meta.json         `num_experts`, `top_k`, `num_layers`, optional `num_groups`, provenance

:class:`DirTrace` has the read interface `replay` uses; it keeps only `step_offsets` and `meta`
in memory. Every read copies just the rows it needs from the file into a fresh array, so
resident pages never pile up: replaying a trace far larger than RAM needs memory for one step
(plus the `[S, L, E]` counts and replay's per-step counters), not for the file. Nothing is
unpickled.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..base.errors import InputError, InputWarning, warn_caller
from ..base.files import NPY_HEADER_ERRORS, atomic_dir, npy_header, npy_refusal, regular_file
from ..base.limits import MAX_EXPERTS, MAX_GPUS
from ..base.loops import counts_and_first_duplicate, expert_counts
from ..base.progress import Progress
from .trace import Trace, TraceShape, check_sizes_of, id_dtype, shape_words

IDS, OFFSETS, SRC, META = "topk_ids.npy", "step_offsets.npy", "src_rank.npy", "meta.json"
TRACE_FILES = (IDS, OFFSETS, SRC, META)  # everything a trace directory holds
CHUNK_ELEMENTS = 1 << 22  # ids per chunk when validating or counting (<= 32 MiB as int64)
_HEADER = 128  # bytes reserved for the .npy header written by save_trace_dir


@dataclass(frozen=True)
class _Npy:
    """Where an `.npy` array's data lies: file, dtype, shape, byte offset of element 0."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """A private copy of rows `lo:hi`, read from the file straight into a fresh array, in
        this machine's byte order whatever the file's; InputError if the file has been cut
        short since its header was checked."""
        row_shape = self.shape[1:]
        out = np.empty((max(hi - lo, 0), *row_shape), self.dtype)
        if out.size:
            row_bytes = self.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
            with open(self.path, "rb") as f:
                f.seek(self.offset + lo * row_bytes)
                got = f.readinto(out)
            if got != out.nbytes:
                raise InputError(f"{self.path}: ended {out.nbytes - got} bytes short of rows "
                                 f"{lo}:{hi} (truncated while in use?)")
        return out if self.dtype.isnative else out.astype(self.dtype.newbyteorder("="))


def _open_npy(path: Path, ndim: int) -> _Npy:
    """Header of an integer `.npy` with `ndim` dims, checked against the file's size (the data
    the header declares must be there); InputError naming the file otherwise."""
    if not path.exists():
        raise InputError(f"{path}: missing (a trace directory needs {IDS}, {OFFSETS} and "
                         f"{META})")
    regular_file(path, "an .npy array")
    try:
        with open(path, "rb") as f:
            shape, fortran, dtype, nbytes = npy_header(f)
            offset = f.tell()
    except NPY_HEADER_ERRORS as exc:
        raise InputError(f"{path}: not a readable uncompressed .npy array (truncated or "
                         f"corrupt?): {npy_refusal(exc)}") from None
    if dtype.kind not in "iu":
        raise InputError(f"{path}: must hold integers, got dtype {dtype}")
    if len(shape) != ndim or (fortran and ndim > 1):
        raise InputError(f"{path}: must be a C-ordered {ndim}-D array, got shape {shape}")
    needed = offset + nbytes
    size = path.stat().st_size
    if size < needed:
        raise InputError(f"{path}: holds {size} bytes, shorter than the {needed} its header "
                         f"declares for shape {shape} (truncated?)")
    return _Npy(path, dtype, tuple(int(n) for n in shape), offset)


@dataclass(frozen=True, eq=False)
class DirTrace(TraceShape):
    """A validated trace directory, read lazily. Same read interface as :class:`Trace`.

    path: the directory; everything else is read from it on construction (streamed checks:
    ids in `[-1, E)`, offsets from 0 to `N` non-decreasing, shapes agreeing with `meta`).
    """

    path: Path

    def __post_init__(self) -> None:
        root = Path(self.path)
        if not root.is_dir():
            raise InputError(f"{root}: not a trace directory")
        meta = _read_meta(root / META)
        E, L, K = meta["num_experts"], meta["num_layers"], meta["top_k"]
        ids = _open_npy(root / IDS, 3)
        if ids.shape[1:] != (L, K):
            raise InputError(f"{ids.path}: shape {ids.shape} but {META} declares "
                             f"num_layers={L}, top_k={K}")
        offsets_npy = _open_npy(root / OFFSETS, 1)
        raw = offsets_npy.rows(0, offsets_npy.shape[0])  # in its own dtype: nothing wraps
        N = ids.shape[0]
        check_sizes_of(ids.shape, E)
        if raw.size < 2 or int(raw[0]) != 0 or int(raw[-1]) != N or int(raw.max()) > N:
            raise InputError(f"{offsets_npy.path}: must start at 0 and end at the number of "
                             f"token rows in {IDS} ({N}), with at least one step, got "
                             f"{raw[:1].tolist()} ... {raw[-1:].tolist()}")
        offsets = raw.astype(np.int64)
        if (np.diff(offsets) < 0).any():
            raise InputError(f"{offsets_npy.path}: must be non-decreasing")
        if N == 0:
            raise InputError(f"{ids.path}: holds no token rows")
        src = None
        if (root / SRC).exists():
            src = _open_npy(root / SRC, 1)
            if src.shape != (N,):
                raise InputError(f"{src.path}: shape {src.shape} but {IDS} has {N} token rows")
        object.__setattr__(self, "path", root)
        object.__setattr__(self, "meta", meta)
        object.__setattr__(self, "num_experts", E)
        object.__setattr__(self, "_ids", ids)
        object.__setattr__(self, "_src", src)
        object.__setattr__(self, "step_offsets", torch.from_numpy(offsets))
        self._check_values()

    def _check_values(self) -> None:
        """Stream over ids (and src ranks) in chunks of whole steps: ids in `[-1, E)`, no
        expert twice in a token's top-k (both found in the pass that counts the pairs per
        (step, layer, expert), handed to the first `counts()`), ranks in `[0, MAX_GPUS)`;
        InputError naming file, row and step."""
        E = self.num_experts
        offsets = self.step_offsets.numpy()
        counts = torch.zeros(self.num_steps, self.num_layers, E, dtype=self.load_dtype)
        for a, b in self._step_chunks():
            lo, hi = int(offsets[a]), int(offsets[b])
            chunk = self._ids.rows(lo, hi)
            made, duplicate, bad = counts_and_first_duplicate(chunk, offsets[a:b + 1] - lo, E,
                                                              self.load_dtype)
            if bad is not None:
                row = lo + bad[0]
                step = int(np.searchsorted(offsets, row, "right")) - 1
                raise InputError(f"{self._ids.path}: expert id {int(chunk[bad])} at token row "
                                 f"{row} (step {step}); ids must lie in [-1, {E})")
            if duplicate is not None:
                row, layer, expert = lo + duplicate[0], duplicate[1], duplicate[2]
                step = int(np.searchsorted(offsets, row, "right")) - 1
                raise InputError(f"{self._ids.path}: token row {row} (step {step}) routes "
                                 f"expert {expert} twice in layer {layer}; a router picks "
                                 f"top_k distinct experts")
            counts[a:b] = torch.from_numpy(made)
        self.__dict__["_counts"] = counts  # handed to the first `counts()`
        if self._src is not None:
            for lo, hi in _row_chunks(self._src, self.num_tokens):
                chunk = self._src.rows(lo, hi)
                if chunk.size and (chunk.min() < 0 or chunk.max() >= MAX_GPUS):
                    bad = int(chunk.min()) if chunk.min() < 0 else int(chunk.max())
                    raise InputError(f"{self._src.path}: rank {bad}; ranks must lie in "
                                     f"[0, {MAX_GPUS})")

    def moved_to(self, root: Path) -> "DirTrace":
        """This trace read from `root`, where its files were moved unchanged (no second pass of
        checks over the rows)."""
        moved = object.__new__(DirTrace)
        for name, value in vars(self).items():
            object.__setattr__(moved, name, value)
        object.__setattr__(moved, "path", root)
        object.__setattr__(moved, "_ids", replace(self._ids, path=root / IDS))
        if self._src is not None:
            object.__setattr__(moved, "_src", replace(self._src, path=root / SRC))
        return moved

    @property
    def ids_shape(self) -> tuple[int, int, int]:
        return tuple(self._ids.shape)

    def __repr__(self) -> str:
        return f"DirTrace({str(self.path)!r}: {shape_words(self)})"

    def _bounds(self, s: int) -> tuple[int, int]:
        if not 0 <= s < self.num_steps:
            raise IndexError(f"step {s} of a {self.num_steps}-step trace")
        rows = self.step_rows(s)
        return rows.start, rows.stop

    def step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s`, int32 `[T_s, L, K]` (a fresh copy)."""
        return self.stored_step(s).to(torch.int32)

    def stored_step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s` in the file's dtype, `[T_s, L, K]` (a fresh copy)."""
        lo, hi = self._bounds(s)
        return torch.from_numpy(self._ids.rows(lo, hi))

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        """Source ranks of step `s`'s tokens, int64 `[T_s]`, or None."""
        if self._src is None:
            return None
        lo, hi = self._bounds(s)
        return torch.from_numpy(self._src.rows(lo, hi).astype(np.int64))

    def counts(self) -> torch.Tensor:
        """(token, slot) pairs per logical expert, `load_dtype` `[S, L, E]`. The first call
        gets the counts validation made in its pass over the ids (the caller owns them, as
        every call's); later calls read the ids again in chunks of steps."""
        made = self._validated_counts()
        if made is not None:
            return made
        S, L, E = self.num_steps, self.num_layers, self.num_experts
        out = torch.zeros(S, L, E, dtype=self.load_dtype)
        offsets = self.step_offsets.numpy()
        for a, b in self._step_chunks():
            lo, hi = int(offsets[a]), int(offsets[b])
            out[a:b] = torch.from_numpy(expert_counts(self._ids.rows(lo, hi),
                                                      offsets[a:b + 1] - lo, E,
                                                      self.load_dtype))
        return out

    def _step_chunks(self) -> Iterator[tuple[int, int]]:
        """Steps `[a, b)` read together: at least one, more while their ids stay within
        `CHUNK_ELEMENTS`."""
        S, offsets = self.num_steps, self.step_offsets.numpy()
        per_row = max(self.num_layers * self.top_k, 1)
        a = 0
        while a < S:
            b = a + 1
            while b < S and int(offsets[b + 1] - offsets[a]) * per_row <= CHUNK_ELEMENTS:
                b += 1
            yield a, b
            a = b


def _row_chunks(npy: _Npy, rows: int) -> Iterator[tuple[int, int]]:
    per_row = max(int(np.prod(npy.shape[1:], dtype=np.int64)), 1)
    step = max(CHUNK_ELEMENTS // per_row, 1)
    for lo in range(0, rows, step):
        yield lo, min(lo + step, rows)


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise InputError(f"{path}: missing (a trace directory needs {IDS}, {OFFSETS} and "
                         f"{META})")
    try:
        meta = json.loads(regular_file(path, "JSON file").read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: must hold a JSON object")
    for key in ("num_experts", "top_k", "num_layers"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{path}: lacks the positive integer field {key!r}")
    groups = meta.get("num_groups")
    if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool)
                               or groups < 1 or meta["num_experts"] % groups):
        raise InputError(f"{path}: num_groups={groups!r} must be a positive divisor of "
                         f"num_experts={meta['num_experts']}")
    return meta


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 `.npy` header padded to exactly `_HEADER` bytes (rewritten once the row
    count is known)."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                 "shape": tuple(shape)})
    body_len = _HEADER - 10
    text = text.ljust(body_len - 1) + "\n"
    if len(text) != body_len:
        raise InputError(f"array shape {shape} too large for the .npy header")
    assert ast.literal_eval(text)  # the same literal numpy parses
    return b"\x93NUMPY\x01\x00" + body_len.to_bytes(2, "little") + text.encode("latin1")


def save_trace_dir(trace: Any, path: str | Path, chunk_steps: int = 64,
                   progress: Progress | None = None) -> DirTrace:
    """Write any trace-like object (`num_steps`, `num_layers`, `top_k`, `num_experts`, `meta`,
    `step(s)` `[T_s, L, K]`, `step_src_rank(s)` `[T_s]` or None) as a trace directory, step
    by step, so the source never has to fit in memory; `chunk_steps` steps are buffered per
    write. Returns the written trace, validated. The form holds no gating weights: a trace
    with them (`step_weights`) loses them, with an InputWarning saying so."""
    if trace.num_steps and getattr(trace, "step_weights", lambda s: None)(0) is not None:
        warn_caller("the trace directory form holds no gating weights: the toy MoE's output "
                    "error of the written trace draws its gates (keep an .npz to keep them)",
                    InputWarning)
    steps = ((trace.step(s), trace.step_src_rank(s)) for s in range(trace.num_steps))
    return write_steps(path, steps, int(trace.num_experts), trace.meta, chunk_steps,
                       trace.num_layers, trace.top_k, progress)


def write_steps(path: str | Path, steps: Iterable[tuple[Any, Any]], num_experts: int | None,
                meta: dict[str, Any], chunk_steps: int = 64, num_layers: int | None = None,
                top_k: int | None = None, progress: Progress | None = None) -> DirTrace:
    """Write `(ids [T_s, L, K], src_rank [T_s] or None)` per step as a trace directory
    (`progress` is told of each step written).
    `L` and `K` come from the first step unless given; `num_experts=None` takes the largest
    id + 1 (ids then stored as int32, since the width is not known in advance); source ranks
    are stored as int32. Every step's values are checked in their own dtype before they are
    narrowed, so nothing wraps. The directory is written next to `path` and moved there only
    once complete and valid: a source that fails part way leaves `path` as it was."""
    root = Path(path)
    E, L, K = num_experts, num_layers, top_k
    dtype = np.dtype(np.int32 if E is None else id_dtype(E))
    limit = MAX_EXPERTS if E is None else E
    src_dtype = np.dtype(np.int32)
    has_src = None
    top = -1
    with atomic_dir(root) as tmp:
        offsets = [0]
        with open(tmp / IDS, "wb") as fi, open(tmp / SRC, "wb") as fs:
            fi.write(_npy_header(dtype, (0, 0, 0)))
            fs.write(_npy_header(src_dtype, (0,)))
            ids_buf: list[np.ndarray] = []
            src_buf: list[np.ndarray] = []
            for s, (ids, src) in enumerate(steps):
                ids = np.asarray(ids)
                if L is None:
                    L, K = ids.shape[1:] if ids.ndim == 3 else (None, None)
                if ids.ndim != 3 or ids.shape[1:] != (L, K) or ids.dtype.kind not in "iu":
                    raise InputError(f"step {s} has {ids.dtype} shape {ids.shape}, expected "
                                     f"integers [T_s, {L}, {K}]")
                if ids.size:
                    lo, hi = int(ids.min()), int(ids.max())
                    if lo < -1 or hi >= limit:
                        raise InputError(f"step {s} has expert id {lo if lo < -1 else hi}; ids "
                                         f"must lie in [-1, {limit})")
                    top = max(top, hi)
                ids_buf.append(ids.astype(dtype))
                offsets.append(offsets[-1] + ids.shape[0])
                if has_src is None:
                    has_src = src is not None
                if has_src:
                    src = None if src is None else np.asarray(src)
                    if src is None or src.shape != (ids.shape[0],) or src.dtype.kind not in "iu":
                        raise InputError(f"step {s}: src_rank missing or not one per token")
                    if src.size and (int(src.min()) < 0 or int(src.max()) >= MAX_GPUS):
                        raise InputError(f"step {s}: src_rank outside [0, {MAX_GPUS})")
                    src_buf.append(src.astype(src_dtype))
                if len(ids_buf) >= chunk_steps:
                    _flush(fi, fs, ids_buf, src_buf)
                if progress is not None:
                    progress(1)
            _flush(fi, fs, ids_buf, src_buf)
            if L is None:
                raise InputError("a trace needs at least one step to fix its layers and top-k")
            fi.seek(0)
            fi.write(_npy_header(dtype, (offsets[-1], L, K)))
            fs.seek(0)
            fs.write(_npy_header(src_dtype, (offsets[-1],)))
        if not has_src:
            (tmp / SRC).unlink()
        np.save(tmp / OFFSETS, np.asarray(offsets, dtype=np.int64), allow_pickle=False)
        E = max(top + 1, 1) if E is None else E
        meta = dict(meta, num_experts=E, top_k=K, num_layers=L)
        (tmp / META).write_text(json.dumps(meta, sort_keys=True, indent=1))
        written = DirTrace(tmp)
    return written.moved_to(root)


def _flush(fi: Any, fs: Any, ids_buf: list[np.ndarray], src_buf: list[np.ndarray]) -> None:
    if ids_buf:
        fi.write(np.concatenate(ids_buf).tobytes())
    if src_buf:
        fs.write(np.concatenate(src_buf).tobytes())
    ids_buf.clear()
    src_buf.clear()


def is_trace_dir(path: str | Path) -> bool:
    """Whether `path` is a folder holding a trace directory's `META` (else a folder of logs)."""
    return Path(path).is_dir() and (Path(path) / META).is_file()


def load_trace_dir(path: str | Path) -> DirTrace:
    """Open (and validate) a trace directory."""
    return DirTrace(Path(path))


def to_memory(trace: Trace | DirTrace, progress: Progress | None = None) -> Trace:
    """An in-memory :class:`Trace` with the same rows (for writing `.npz`; `progress` is told
    of each step read from a directory)."""
    if isinstance(trace, Trace):
        return trace
    if trace.num_steps == 0:
        raise InputError(f"{trace.path}: has no steps")
    steps = []
    for s in range(trace.num_steps):
        steps.append(trace.step(s))
        if progress is not None:
            progress(1)
    src = None if trace.step_src_rank(0) is None else \
        [trace.step_src_rank(s) for s in range(trace.num_steps)]
    weights = None if trace.step_weights(0) is None else \
        [trace.step_weights(s) for s in range(trace.num_steps)]
    return Trace.from_steps(steps, trace.num_experts, src, trace.meta, weights)
