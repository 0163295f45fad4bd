"""The steps of a trace after some experts lost every replica (dead ranks, DESIGN.md §16): their
pairs masked to padding (-1), so no dispatch ever asks for them and no load counts them.

Dimensions: `S` steps, `T` tokens in a step, `L` layers, `E` logical experts, `K` top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .counts import CountsTrace
from .steps import StepView


@dataclass(frozen=True, eq=False)
class LostView(StepView):
    """The steps `steps` of a Trace or DirTrace (`base`) with each pair of an expert in `lost`
    (bool `[L, E]`, per layer) read as padding (-1); the same read interface, nothing copied
    until a step is read. The tokens' source ranks are dropped: the ranks that owned them may
    be dead, so the survivors share each step's tokens (`ranks`: contiguous shares)."""

    lost: torch.Tensor

    def stored_step(self, s: int) -> torch.Tensor:
        ids = self.base.stored_step(int(self.steps[s]))  # [T, L, K]
        return masked(ids, self.lost)

    def step(self, s: int) -> torch.Tensor:
        return self.stored_step(s).to(torch.int32)

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        return None

    def counts(self) -> torch.Tensor:
        """Routed pairs per logical expert of the kept steps, lost experts' none, `[S', L, E]`."""
        counts = self.base.counts()[self.steps]
        return counts.masked_fill(self.lost, 0)

    def __repr__(self) -> str:
        return (f"LostView({int(self.lost.sum())} (layer, expert) lost, steps "
                f"{int(self.steps[0])}.. of {self.base!r})")


def masked(ids: torch.Tensor, lost: torch.Tensor) -> torch.Tensor:
    """`ids [T, L, K]` (-1: padding) with the pairs of the experts `lost [L, E]` set to -1, a
    new tensor of the same dtype."""
    L = ids.shape[1]
    hit = lost[torch.arange(L).view(1, L, 1), ids.long().clamp(min=0)] & (ids >= 0)
    return ids.masked_fill(hit, -1)


def lost_view(trace: Any, first: int, lost: torch.Tensor) -> Any:
    """The steps of `trace` from `first` on with the pairs of the experts `lost [L, E]` masked
    (`LostView`; for counts only, a `CountsTrace` whose lost counts are 0)."""
    if isinstance(trace, CountsTrace):
        counts = torch.from_numpy(trace.counts[first:]).masked_fill(lost, 0)
        return CountsTrace(counts.numpy(), dict(trace.meta))
    steps = torch.arange(first, trace.num_steps)
    return LostView(trace, steps, dict(trace.meta), lost)
