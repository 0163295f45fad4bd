"""Several steps of "none" in one pass, where the rank step's outcome is provably simple.

Dimensions: `W` steps of a window, `N` tokens of all of them, `L` layers, `K` top-k, `P` slots,
`G` GPUs.

When one group of identical ranks holding every rank, in this one process, executes every
valid pair exactly once (`Epoch.executes_once`), nothing but the slot loads is counted (no
links, shared experts, spill, kept choices or wrong-weight slots), and the policy's choice reads
nothing of the step but each token's row within it (`DispatchPolicy.window_kernels`: `row`), a
window of consecutive steps is one call: their tokens concatenated `[N, L, K]`, dispatched at
each token's row within its own step, counted in one tally per counter. Every count is
what `none_step` gives step by step, bit for bit (`tests/ranks/test_window.py`); a replay kept on a
device (`replay.dispatch_steps`) takes this way to launch its kernels once a window rather than
a few dozen times a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..dispatch.kernels import tally, window_kernel
from .epoch import Epoch
from .moe import zero_error_terms

WINDOW_PAIRS = 1 << 22  # a window holds at most this many (token, layer, top-k) pairs, or one step


@dataclass(frozen=True, kw_only=True)
class WindowOutcome:
    """What `none_step` would give for each step of a window, stacked over its `W` steps (the
    counters a window's steps have; `Counters.record` takes it at a slice of steps).

    slot_load:           int64 `[W, L, P]` pairs executed on each slot
    valid, agreed:       int64 `[W, L]` non-padding pairs; pairs every rank chose alike (all)
    multiplicity_counts: int64 `[W, L, 3]` valid pairs executed 0, 1, >= 2 times
    error:               float64 `[W, L, 2]` the toy layer's error terms (0, its norm left
                         `UNMEASURED` where a pair is valid), or None without a toy layer
    drifted:             bool `[W, G]` ranks that consumed an extra batch of draws (CPU)
    """

    slot_load: torch.Tensor
    valid: torch.Tensor
    agreed: torch.Tensor
    multiplicity_counts: torch.Tensor
    error: torch.Tensor | None
    drifted: torch.Tensor


def window_dispatch(epoch: Epoch) -> Callable[..., torch.Tensor] | None:
    """The window kernel the steps of `epoch` may be dispatched with (module doc), or None
    when they must go step by step."""
    if (epoch.mode != "none" or not epoch.executes_once or epoch.count_links or epoch.shared
            or epoch.keep_choices or epoch.policy.spill is not None):
        return None
    return window_kernel(epoch.policy, epoch.device)


def windows(sizes: list[int], pairs_per_token: int) -> list[tuple[int, int]]:
    """Consecutive runs `[a, b)` of steps of `sizes` tokens, each holding at most
    `WINDOW_PAIRS` pairs (`pairs_per_token = L * K` each), or one step."""
    out, start, held = [], 0, 0
    for s, size in enumerate(sizes):
        pairs = size * pairs_per_token
        if s > start and held + pairs > WINDOW_PAIRS:
            out.append((start, s))
            start, held = s, 0
        held += pairs
    if sizes:
        out.append((start, len(sizes)))
    return out


def none_window(epoch: Epoch, kernel: Callable[..., torch.Tensor], steps: range,
                ids: torch.Tensor, sizes: list[int]) -> WindowOutcome:
    """`steps` of `sizes` tokens, `ids [N, L, K]` (their tokens concatenated, any integer
    dtype, on the epoch's device), dispatched with `kernel` (`window_dispatch`) and counted as
    `none_step` counts them, on that device; nothing is read back to the host."""
    W, (N, L, K) = len(sizes), ids.shape
    P = epoch.placement.num_slots
    device = ids.device
    size = torch.tensor(sizes, dtype=torch.int64).to(device, non_blocking=True)  # [W]
    step_of = torch.repeat_interleave(torch.arange(W, device=device), size, output_size=N)
    first = torch.cumsum(size, 0) - size  # [W] each step's first token
    rows = torch.arange(N, device=device) - first[step_of]  # [N] row within its own step
    phys = kernel(ids, epoch.views[0], rows)  # [N, L, K], -1 at padding
    cell = (step_of.view(N, 1, 1) * L + torch.arange(L, device=device).view(1, L, 1)) * P
    slot_load = tally(torch.where(phys >= 0, phys + cell, W * L * P), W * L * P).view(W, L, P)
    pairs = slot_load.sum(-1)  # [W, L] every valid pair is executed once, on some slot
    error = None if epoch.moe is None else zero_error_terms(pairs)  # as `none_step` leaves it
    zero = torch.zeros_like(pairs)
    drifted = torch.stack([epoch.drifted(s) for s in steps])  # [W, G]: every rank is held
    return WindowOutcome(slot_load=slot_load, valid=pairs, agreed=pairs,
                         multiplicity_counts=torch.stack([zero, pairs, zero], -1), error=error,
                         drifted=drifted)
