"""Traces larger than memory: the uncompressed directory form of a trace, read step by step.

Dimensions: `S` steps, `T_s` tokens of step `s`, `N = sum T_s` token rows, `L` MoE layers,
`E` logical experts, `K` top-k. A routing id of -1 is padding.

A trace directory holds (DESIGN.md §5, the `.npz` arrays as separate `.npy` files, uncompressed
so they can be memory-mapped):

    topk_ids.npy      int16 or int32 `[N, L, K]`, ids in `[-1, E)`
    step_offsets.npy  int64 `[S + 1]`, rows of step `s` are `offsets[s]:offsets[s + 1]`
    src_rank.npy      optional int16 `[N]`, the source EP rank of each token row
    meta.json         `num_experts`, `top_k`, `num_layers`, optional `num_groups`, provenance

:class:`DirTrace` has the read interface `replay` uses; it keeps only `step_offsets` and `meta`
in memory. Every read maps just the rows it needs for as long as it copies them, so resident
pages never pile up: replaying a trace far larger than RAM needs memory for one step (plus the
`[S, L, E]` counts and replay's per-step counters), not for the file. Nothing is unpickled.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from .trace import Trace, TraceShape

IDS, OFFSETS, SRC, META = "topk_ids.npy", "step_offsets.npy", "src_rank.npy", "meta.json"
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
        """A private copy of rows `lo:hi` (mapped only while copying)."""
        row_shape = self.shape[1:]
        if hi <= lo:
            return np.zeros((0, *row_shape), self.dtype)
        row_bytes = self.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        view = np.memmap(self.path, self.dtype, "r", self.offset + lo * row_bytes,
                         (hi - lo, *row_shape))
        out = np.array(view)
        del view
        return out


def _open_npy(path: Path, ndim: int) -> _Npy:
    """Header of an integer `.npy` with `ndim` dims; InputError naming the file otherwise."""
    if not path.is_file():
        raise InputError(f"{path}: missing (a trace directory needs {IDS}, {OFFSETS} and "
                         f"{META})")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        info = _Npy(path, arr.dtype, tuple(arr.shape), int(arr.offset))
        fortran = arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous
        del arr
    except (OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: not a readable uncompressed .npy array (truncated or "
                         f"corrupt?): {exc}") from None
    if info.dtype.kind not in "iu":
        raise InputError(f"{path}: must hold integers, got dtype {info.dtype}")
    if len(info.shape) != ndim or fortran:
        raise InputError(f"{path}: must be a C-ordered {ndim}-D array, got shape {info.shape}")
    return info


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
        offsets = offsets_npy.rows(0, offsets_npy.shape[0]).astype(np.int64)
        N = ids.shape[0]
        if offsets.size < 1 or offsets[0] != 0 or offsets[-1] != N:
            raise InputError(f"{offsets_npy.path}: must start at 0 and end at the number of "
                             f"token rows in {IDS} ({N}), got "
                             f"{offsets[:1].tolist()} ... {offsets[-1:].tolist()}")
        if (np.diff(offsets) < 0).any():
            raise InputError(f"{offsets_npy.path}: must be non-decreasing")
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
        """Stream over ids (and src ranks) in chunks; InputError naming file and step."""
        E = self.num_experts
        for lo, hi in _row_chunks(self._ids, self.num_tokens):
            chunk = self._ids.rows(lo, hi)
            if chunk.size and (chunk.min() < -1 or chunk.max() >= E):
                row = lo + int(np.flatnonzero(((chunk < -1) | (chunk >= E)).reshape(
                    hi - lo, -1).any(1))[0])
                bad = chunk[row - lo][(chunk[row - lo] < -1) | (chunk[row - lo] >= E)]
                step = int(np.searchsorted(self.step_offsets.numpy(), row, "right")) - 1
                raise InputError(f"{self._ids.path}: expert id {int(bad[0])} at token row "
                                 f"{row} (step {step}); ids must lie in [-1, {E})")
        if self._src is not None:
            for lo, hi in _row_chunks(self._src, self.num_tokens):
                chunk = self._src.rows(lo, hi)
                if chunk.size and chunk.min() < 0:
                    raise InputError(f"{self._src.path}: negative rank {int(chunk.min())}")

    @property
    def ids_shape(self) -> tuple[int, int, int]:
        return tuple(self._ids.shape)

    def _bounds(self, s: int) -> tuple[int, int]:
        if not 0 <= s < self.num_steps:
            raise IndexError(f"step {s} of a {self.num_steps}-step trace")
        return int(self.step_offsets[s]), int(self.step_offsets[s + 1])

    def step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s`, int32 `[T_s, L, K]` (a fresh copy)."""
        lo, hi = self._bounds(s)
        return torch.from_numpy(self._ids.rows(lo, hi).astype(np.int32, copy=False))

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        """Source ranks of step `s`'s tokens, int64 `[T_s]`, or None."""
        if self._src is None:
            return None
        lo, hi = self._bounds(s)
        return torch.from_numpy(self._src.rows(lo, hi).astype(np.int64))

    def counts(self) -> torch.Tensor:
        """(token, slot) pairs per logical expert, int64 `[S, L, E]`, read in chunks of steps."""
        S, L, E = self.num_steps, self.num_layers, self.num_experts
        out = torch.zeros(S, L, E, dtype=torch.int64)
        per_row = max(L * self.top_k, 1)
        offsets = self.step_offsets
        a = 0
        while a < S:
            b = a + 1  # at least one step; more while the chunk stays small
            while b < S and int(offsets[b + 1] - offsets[a]) * per_row <= CHUNK_ELEMENTS:
                b += 1
            lo, hi = int(offsets[a]), int(offsets[b])
            ids = torch.from_numpy(self._ids.rows(lo, hi).astype(np.int64))  # [rows, L, K]
            step_of_row = torch.repeat_interleave(torch.arange(b - a), offsets[a:b + 1].diff())
            flat = (step_of_row.view(-1, 1, 1) * L + torch.arange(L).view(1, L, 1)) * E + ids
            out[a:b] = torch.bincount(flat[ids >= 0], minlength=(b - a) * L * E).view(b - a, L, E)
            a = b
        return out


def _row_chunks(npy: _Npy, rows: int) -> Iterator[tuple[int, int]]:
    per_row = max(int(np.prod(npy.shape[1:], dtype=np.int64)), 1)
    step = max(CHUNK_ELEMENTS // per_row, 1)
    for lo in range(0, rows, step):
        yield lo, min(lo + step, rows)


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: missing (a trace directory needs {IDS}, {OFFSETS} and "
                         f"{META})") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: must hold a JSON object")
    for key in ("num_experts", "top_k", "num_layers"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{path}: lacks the positive integer field {key!r}")
    groups = meta.get("num_groups")
    if groups is not None and (not isinstance(groups, int) or groups < 1
                               or meta["num_experts"] % groups):
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


def save_trace_dir(trace: Any, path: str | Path, chunk_steps: int = 64) -> DirTrace:
    """Write any trace-like object (`num_steps`, `num_layers`, `top_k`, `num_experts`, `meta`,
    `step(s)` `[T_s, L, K]`, `step_src_rank(s)` `[T_s]` or None) as a trace directory, step
    by step, so the source never has to fit in memory; `chunk_steps` steps are buffered per
    write. Returns the written trace, validated."""
    steps = ((trace.step(s), trace.step_src_rank(s)) for s in range(trace.num_steps))
    return write_steps(path, steps, int(trace.num_experts), trace.meta, chunk_steps,
                       trace.num_layers, trace.top_k)


def write_steps(path: str | Path, steps: Iterable[tuple[Any, Any]], num_experts: int | None,
                meta: dict[str, Any], chunk_steps: int = 64, num_layers: int | None = None,
                top_k: int | None = None) -> DirTrace:
    """Write `(ids [T_s, L, K], src_rank [T_s] or None)` per step as a trace directory.
    `L` and `K` come from the first step unless given; `num_experts=None` takes the largest
    id + 1 (ids then stored as int32, since the width is not known in advance). A source that
    fails part way leaves a partial directory behind, which `DirTrace` rejects (the ids header
    still declares shape `(0, 0, 0)`)."""
    root = Path(path)
    E, L, K = num_experts, num_layers, top_k
    dtype = np.dtype(np.int16 if E is not None and E <= np.iinfo(np.int16).max else np.int32)
    has_src = None
    top = -1
    try:
        root.mkdir(parents=True, exist_ok=True)
        offsets = [0]
        with open(root / IDS, "wb") as fi, open(root / SRC, "wb") as fs:
            fi.write(_npy_header(dtype, (0, 0, 0)))
            fs.write(_npy_header(np.dtype(np.int16), (0,)))
            ids_buf: list[np.ndarray] = []
            src_buf: list[np.ndarray] = []
            for s, (ids, src) in enumerate(steps):
                ids = np.asarray(ids)
                if L is None:
                    L, K = ids.shape[1:] if ids.ndim == 3 else (None, None)
                if ids.ndim != 3 or ids.shape[1:] != (L, K):
                    raise InputError(f"step {s} has shape {ids.shape}, expected [T_s, {L}, {K}]")
                if ids.size:
                    top = max(top, int(ids.max()))
                ids_buf.append(ids.astype(dtype))
                offsets.append(offsets[-1] + ids.shape[0])
                if has_src is None:
                    has_src = src is not None
                if has_src:
                    if src is None or len(src) != ids.shape[0]:
                        raise InputError(f"step {s}: src_rank missing or not one per token")
                    src_buf.append(np.asarray(src).astype(np.int16))
                if len(ids_buf) >= chunk_steps:
                    _flush(fi, fs, ids_buf, src_buf)
            _flush(fi, fs, ids_buf, src_buf)
            if L is None:
                raise InputError("a trace needs at least one step to fix its layers and top-k")
            fi.seek(0)
            fi.write(_npy_header(dtype, (offsets[-1], L, K)))
            fs.seek(0)
            fs.write(_npy_header(np.dtype(np.int16), (offsets[-1],)))
        if not has_src:
            (root / SRC).unlink()
        np.save(root / OFFSETS, np.asarray(offsets, dtype=np.int64), allow_pickle=False)
        E = max(top + 1, 1) if E is None else E
        meta = dict(meta, num_experts=E, top_k=K, num_layers=L)
        (root / META).write_text(json.dumps(meta, sort_keys=True, indent=1))
    except OSError as exc:
        raise InputError(f"cannot write {root}: {exc.strerror or exc}") from None
    return DirTrace(root)


def _flush(fi: Any, fs: Any, ids_buf: list[np.ndarray], src_buf: list[np.ndarray]) -> None:
    if ids_buf:
        fi.write(np.concatenate(ids_buf).tobytes())
    if src_buf:
        fs.write(np.concatenate(src_buf).tobytes())
    ids_buf.clear()
    src_buf.clear()


def load_trace_dir(path: str | Path) -> DirTrace:
    """Open (and validate) a trace directory."""
    return DirTrace(Path(path))


def to_memory(trace: Trace | DirTrace) -> Trace:
    """An in-memory :class:`Trace` with the same rows (for writing `.npz`)."""
    if isinstance(trace, Trace):
        return trace
    if trace.num_steps == 0:
        raise InputError(f"{trace.path}: has no steps")
    steps = [trace.step(s) for s in range(trace.num_steps)]
    src = None if trace.step_src_rank(0) is None else \
        [trace.step_src_rank(s) for s in range(trace.num_steps)]
    return Trace.from_steps(steps, trace.num_experts, src, trace.meta)
