"""A token trace whose long steps are cut into chunks, as a chunked-prefill engine runs a long
forward pass: a step of more than `N` tokens becomes consecutive steps of `N` tokens and one of
the rest (1960 tokens at `N = 256`: 7 x 256 + 168); shorter steps stay whole.

Dimensions: `S` steps of the base trace, `S'` steps of the view, `T_s` tokens of step `s`, `L`
layers, `K` top-k, `E` logical experts.

A trace read from a log holds the passes its engine ran; `max_batched_tokens` replays them as
an engine with that token budget a step would have. The view is taken after the steps are
selected (`traces.steps.select`), so a selection and the flagged steps keep the log's own
numbering and a dummy or warm-up pass is dropped whole. Nothing is copied until a step is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..base.errors import InputError
from ..base.loops import expert_counts
from .counts import CountsTrace
from .trace import View, shape_words


@dataclass(frozen=True, eq=False)
class ChunkView(View):
    """`base` (a Trace, DirTrace or StepView) with each step of more than `size` tokens cut
    into consecutive chunks of at most `size` rows: the same read interface.

    parent: int64 `[S']` the base step each step of the view is part of
    start:  int64 `[S']` its first row within that base step
    """

    base: Any
    size: int
    meta: dict

    def __post_init__(self) -> None:
        tokens = self.base.tokens_per_step.numpy()  # [S]
        pieces = np.maximum(-(-tokens // self.size), 1)  # a step of no tokens stays one
        parent = np.repeat(np.arange(len(tokens)), pieces)  # [S']
        first = np.cumsum(pieces) - pieces
        start = (np.arange(len(parent)) - first[parent]) * self.size
        sizes = np.minimum(tokens[parent] - start, self.size)
        object.__setattr__(self, "parent", torch.from_numpy(parent))
        object.__setattr__(self, "start", torch.from_numpy(start))
        object.__setattr__(self, "step_offsets", torch.from_numpy(
            np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)))

    def _rows(self, s: int) -> tuple[int, slice]:
        lo = int(self.start[s])
        return int(self.parent[s]), slice(lo, lo + int(self.tokens_per_step[s]))

    def step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s`, int32 `[T_s', L, K]`."""
        return self.stored_step(s).to(torch.int32)

    def stored_step(self, s: int) -> torch.Tensor:
        """Logical ids of step `s` as the base stores them, `[T_s', L, K]`; the base step last
        read is kept, so a replay reading the chunks in order reads each base step once."""
        parent, rows = self._rows(s)
        last = self.__dict__.get("_last")
        if last is None or last[0] != parent:
            last = self.__dict__["_last"] = (parent, self.base.stored_step(parent))
        return last[1][rows]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_last", None)
        return state

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        parent, rows = self._rows(s)
        src = self.base.step_src_rank(parent)
        return None if src is None else src[rows]

    def step_weights(self, s: int) -> torch.Tensor | None:
        parent, rows = self._rows(s)
        weights = self.base.step_weights(parent)
        return None if weights is None else weights[rows]

    def counts(self) -> torch.Tensor:
        """Routed pairs per logical expert of each step of the view, `[S', L, E]`: a whole
        step's from the base's counts, a cut step's counted from its ids."""
        base = self.base.counts()  # [S, L, E]
        out = torch.empty(self.num_steps, self.num_layers, self.num_experts,
                          dtype=self.load_dtype)
        parent = self.parent.numpy()
        pieces = np.bincount(parent, minlength=base.shape[0])
        whole = np.flatnonzero(pieces[parent] == 1)
        out[whole] = base[parent[whole]].to(out.dtype)
        offsets = self.step_offsets.numpy()
        for p in np.flatnonzero(pieces > 1):
            mine = np.flatnonzero(parent == p)  # consecutive steps of the view
            ids = self.base.stored_step(int(p)).numpy()
            local = offsets[mine[0]:mine[-1] + 2] - offsets[mine[0]]
            out[mine[0]:mine[-1] + 1] = torch.from_numpy(
                expert_counts(ids, local, self.num_experts, self.load_dtype))
        return out

    def log_steps(self) -> list[str]:
        names = self.base.log_steps()
        parent = self.parent.numpy()
        cut = np.bincount(parent, minlength=len(names)) > 1
        return [f"{names[p]}.{c}" if cut[p] else names[p] for p, c in
                zip(parent.tolist(), (self.start.numpy() // self.size).tolist())]

    def __repr__(self) -> str:
        return f"ChunkView({shape_words(self)}: of {self.base!r} in chunks of {self.size})"


def chunk_steps(trace: Any, size: int) -> Any:
    """`trace` with each step of more than `size` tokens cut into chunks of at most `size`
    (module doc), `meta["chunked"]` recording how; `trace` itself when no step is longer.
    InputError for a counts-only trace (it has no token rows to cut)."""
    if isinstance(trace, CountsTrace):
        raise InputError("max_batched_tokens cuts the steps of a trace with token rows; a "
                         "counts-only trace has none")
    tokens = trace.tokens_per_step
    cut = int((tokens > size).sum())
    if not cut:
        return trace
    view = ChunkView(trace, size, {})
    view.meta.update(trace.meta, chunked={"max_batched_tokens": size, "cut": cut,
                                          "of": trace.num_steps, "into": view.num_steps})
    return view


def describe_chunks(meta: dict) -> str:
    """"chunks of at most 256 tokens: 1 step became 8"-style words for a trace's
    `meta["chunked"]`, or ""."""
    info = meta.get("chunked")
    if not info:
        return ""
    return (f"chunks of at most {info['max_batched_tokens']} tokens: {info['cut']} "
            f"step{'' if info['cut'] == 1 else 's'} became "
            f"{info['into'] - info['of'] + info['cut']}")
