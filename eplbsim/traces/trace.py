"""Routing traces: ragged steps of top-k logical expert ids, validated, saved as `.npz`.

Dimensions: `S` steps, `T` tokens in a step (`T_s` for step `s`), `L` MoE layers, `E` logical
experts, `K` top-k. A routing id of -1 is padding ("no expert") and is never counted as load.

On disk (DESIGN.md §5): `topk_ids` int16/int32 `[sum T_s, L, K]`, `step_offsets` int64 `[S + 1]`,
optional `src_rank` int16 `[sum T_s]`, and `meta`, a JSON string with `num_experts`, `top_k`,
`num_layers`, optional `num_groups`, and free-form provenance. Files are read without pickle.
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

from ..errors import InputError


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


@dataclass(frozen=True, eq=False)
class Trace(TraceShape):
    """A validated routing trace. Tensors are private copies of what the caller passed.

    topk_ids:     int32 `[sum T_s, L, K]` logical expert ids in `[-1, E)`
    step_offsets: int64 `[S + 1]`, rows of step `s` are `step_offsets[s]:step_offsets[s+1]`
    num_experts:  `E`
    src_rank:     int64 `[sum T_s]` source EP rank of each token, or None
    meta:         provenance (JSON-serialisable dict); `num_groups` is read from it when present
    """

    topk_ids: torch.Tensor
    step_offsets: torch.Tensor
    num_experts: int
    src_rank: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = _as_int_tensor(self.topk_ids, "topk_ids")
        offsets = _as_int_tensor(self.step_offsets, "step_offsets")
        if ids.dim() != 3:
            raise InputError(
                f"topk_ids must have shape [tokens, layers, top_k], got {tuple(ids.shape)}")
        if ids.shape[1] < 1 or ids.shape[2] < 1:
            raise InputError(f"topk_ids needs at least one layer and top_k >= 1, "
                             f"got shape {tuple(ids.shape)}")
        if not isinstance(self.num_experts, (int, np.integer)) or self.num_experts < 1:
            raise InputError(f"num_experts must be a positive integer, got {self.num_experts!r}")
        num_experts = int(self.num_experts)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if hi >= num_experts:
                raise InputError(f"topk_ids has expert id {hi} but the trace declares "
                                 f"{num_experts} experts (ids must lie in [-1, {num_experts}))")
            if lo < -1:
                raise InputError(f"topk_ids has expert id {lo}; ids must lie in "
                                 f"[-1, {num_experts}) with -1 for padding")
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise InputError(f"step_offsets must be 1-D with S + 1 entries, "
                             f"got shape {tuple(offsets.shape)}")
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.shape[0]:
            raise InputError(f"step_offsets must start at 0 and end at the number of token rows "
                             f"({ids.shape[0]}), got {int(offsets[0])} ... {int(offsets[-1])}")
        if (offsets[1:] < offsets[:-1]).any():
            raise InputError("step_offsets must be non-decreasing")
        src = None
        if self.src_rank is not None:
            src = _as_int_tensor(self.src_rank, "src_rank").to(torch.int64)
            if src.shape != (ids.shape[0],):
                raise InputError(f"src_rank must have one entry per token row ({ids.shape[0]}), "
                                 f"got shape {tuple(src.shape)}")
            if src.numel() and int(src.min()) < 0:
                raise InputError(f"src_rank has negative rank {int(src.min())}")
        meta = dict(self.meta or {})
        groups = meta.get("num_groups")
        if groups is not None and (not isinstance(groups, int) or groups < 1
                                   or num_experts % groups):
            raise InputError(f"meta num_groups={groups!r} must be a positive divisor of "
                             f"num_experts={num_experts}")
        object.__setattr__(self, "topk_ids", ids.to(torch.int32))
        object.__setattr__(self, "step_offsets", offsets.to(torch.int64))
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "src_rank", src)
        object.__setattr__(self, "meta", meta)

    @classmethod
    def from_steps(cls, steps: Sequence[Any], num_experts: int,
                   src_rank: Sequence[Any] | None = None,
                   meta: dict[str, Any] | None = None) -> "Trace":
        """Build a trace from a list of per-step `[T_s, L, K]` arrays (and `[T_s]` src ranks)."""
        if len(steps) == 0:
            raise InputError("a trace needs at least one step")
        parts = [_as_int_tensor(s, f"step {i}") for i, s in enumerate(steps)]
        shapes = {tuple(p.shape[1:]) for p in parts}
        if any(p.dim() != 3 for p in parts) or len(shapes) != 1:
            raise InputError(f"every step must be [T_s, L, K] with the same L and K, got shapes "
                             f"{[tuple(p.shape) for p in parts]}")
        sizes = torch.tensor([0] + [p.shape[0] for p in parts], dtype=torch.int64)
        src = None if src_rank is None else torch.cat(
            [_as_int_tensor(r, "src_rank") for r in src_rank])
        return cls(torch.cat(parts), sizes.cumsum(0), num_experts, src, meta or {})


    @property
    def ids_shape(self) -> tuple[int, int, int]:
        return tuple(self.topk_ids.shape)

    def step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s`, int32 `[T_s, L, K]` (a view: do not modify)."""
        return self.topk_ids[self.step_offsets[s]:self.step_offsets[s + 1]]

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        """Source ranks of step `s`'s tokens, int64 `[T_s]`, or None."""
        if self.src_rank is None:
            return None
        return self.src_rank[self.step_offsets[s]:self.step_offsets[s + 1]]

    def counts(self) -> torch.Tensor:
        """(token, slot) pairs per logical expert, int64 `[S, L, E]`; padding is not counted."""
        S, L, E = self.num_steps, self.num_layers, self.num_experts
        step_of_row = torch.repeat_interleave(torch.arange(S), self.tokens_per_step)  # [sum T_s]
        layer = torch.arange(L).view(1, L, 1)
        flat = (step_of_row.view(-1, 1, 1) * L + layer) * E + self.topk_ids.to(torch.int64)
        valid = self.topk_ids >= 0
        return torch.bincount(flat[valid], minlength=S * L * E).view(S, L, E)

    def window(self, start: int, stop: int) -> "Trace":
        """Steps `start:stop` as a new trace (Python slice semantics)."""
        idx = range(self.num_steps)[start:stop]
        if len(idx) == 0 or idx.step != 1:
            raise InputError(f"window {start}:{stop} selects no steps of a {self.num_steps}-step trace")
        lo, hi = int(self.step_offsets[idx.start]), int(self.step_offsets[idx.stop])
        src = None if self.src_rank is None else self.src_rank[lo:hi]
        return Trace(self.topk_ids[lo:hi], self.step_offsets[idx.start:idx.stop + 1] - lo,
                     self.num_experts, src, self.meta)


def _as_int_tensor(x: Any, name: str) -> torch.Tensor:
    """A fresh integer CPU tensor from an array-like; InputError if not integral."""
    try:
        t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"{name} is not a numeric array ({exc})") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputError(f"{name} must hold integers, got dtype {t.dtype}")
    return t.detach().to("cpu", torch.int64, copy=True)


_REQUIRED = ("topk_ids", "step_offsets", "meta")


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` as an `.npz` file in the DESIGN.md §5 format."""
    dtype = np.int16 if trace.num_experts <= np.iinfo(np.int16).max else np.int32
    meta = dict(trace.meta, num_experts=trace.num_experts, top_k=trace.top_k,
                num_layers=trace.num_layers)
    arrays = {"topk_ids": trace.topk_ids.numpy().astype(dtype),
              "step_offsets": trace.step_offsets.numpy(),
              "meta": np.array(json.dumps(meta, sort_keys=True))}
    if trace.src_rank is not None:
        arrays["src_rank"] = trace.src_rank.numpy().astype(np.int16)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_trace(path: str | Path) -> Trace:
    """Read an `.npz` trace without unpickling; InputError naming the file on any problem."""
    path = Path(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a bare .npy array, not an archive
            raise InputError(f"{path}: not an eplbsim trace (a single .npy array, "
                             f"not an .npz archive)")
        with loaded as npz:
            missing = [k for k in _REQUIRED if k not in npz.files]
            if missing:
                raise InputError(f"{path}: not an eplbsim trace (missing {', '.join(missing)}; "
                                 f"found {', '.join(npz.files) or 'no arrays'})")
            arrays = {k: npz[k] for k in npz.files}
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise InputError(f"{path}: not a readable .npz trace (truncated or corrupt?): {exc}") from None
    try:
        meta = json.loads(str(arrays["meta"][()]))
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path}: meta is not a JSON string ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: meta must be a JSON object")
    for key in ("num_experts", "top_k", "num_layers"):
        if not isinstance(meta.get(key), int):
            raise InputError(f"{path}: meta lacks the integer field {key!r}")
    ids = arrays["topk_ids"]
    if ids.ndim == 3 and (ids.shape[1], ids.shape[2]) != (meta["num_layers"], meta["top_k"]):
        raise InputError(f"{path}: topk_ids has shape {ids.shape} but meta declares "
                         f"num_layers={meta['num_layers']}, top_k={meta['top_k']}")
    try:
        return Trace(ids, arrays["step_offsets"], meta["num_experts"], arrays.get("src_rank"), meta)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
