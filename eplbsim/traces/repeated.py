"""A trace read repeatedly: its steps `times` times over as one run, read again each time.

Dimensions: `S` steps of the trace, `L` layers, `E` experts, `K` top-k.

An hour of routing from a shorter log, without the copies: step `s` of the run is step
`s % S` of the trace, read from it (a directory trace: from its files) when the replay asks;
nothing but the trace and the count is kept, so it pickles as small as the trace does (a
directory trace as its path) and each worker of `eplbsim.replay.workers` reads its own steps.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.errors import InputError
from .trace import TraceShape


class Repeated(TraceShape):
    """`trace` (a Trace or DirTrace) read `times` times over as one trace of `times x S`
    steps, with the read interface `replay` uses."""

    def __init__(self, trace: Any, times: int) -> None:
        if times < 1:
            raise InputError(f"a trace is read at least once, got {times} times")
        self.trace, self.times = trace, times
        offsets, n = trace.step_offsets, trace.num_tokens
        self.step_offsets = torch.cat([offsets[:-1] + i * n for i in range(times)]
                                      + [offsets[-1:] + (times - 1) * n])  # [times S + 1]
        self.meta, self.num_experts = trace.meta, trace.num_experts

    def __repr__(self) -> str:
        return f"Repeated({self.trace!r}, {self.times} times)"

    @property
    def ids_shape(self) -> tuple[int, int, int]:
        return (self.trace.num_tokens * self.times, *self.trace.ids_shape[1:])

    def step(self, s: int) -> torch.Tensor:
        """Ids of step `s`, int32 `[T, L, K]`: the trace's step `s % S`."""
        return self.trace.step(s % self.trace.num_steps)

    def stored_step(self, s: int) -> torch.Tensor:
        """Ids of step `s` as the trace stores them."""
        return self.trace.stored_step(s % self.trace.num_steps)

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        return self.trace.step_src_rank(s % self.trace.num_steps)

    def counts(self) -> torch.Tensor:
        """Routed pairs per (step, layer, expert), `[times S, L, E]`: the trace's, repeated."""
        return self.trace.counts().repeat(self.times, 1, 1)
