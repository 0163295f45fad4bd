"""When each rank starts serving a rebalance's placement (DESIGN.md §8, rebalancing in time).

Dimensions: `S` steps, `L` layers, `P` physical slots, `G` GPUs = EP ranks.

- `sync`: serving stops until the copies land (the stall the cost model prices); every rank
  serves the new placement from the rebalance's step.
- `async`: the copies go on in the background for `copy_steps` steps into staging buffers
  while the old placement keeps serving, its weights intact; when they land, each rank swaps
  its slots' weights and its view of the placement together, `switch_delay` = 0 at once, else
  after its own delay of 0 to `switch_delay` steps (seeded per rebalance and rank), as ranks
  that learn of the new placement at different steps do. While some ranks serve the new
  placement and others the old (the hazard window), "none" ranks disagree and "a2a" pairs can
  reach a slot that holds another expert's weights (`ranks`: a wrong-expert pair).

A segment's `start` is the step its placement starts serving (for `async`, when the copies
land); `Segment.switch` holds each rank's own first step when they differ.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch

from ..placement import Placement

REBALANCE_MODES = ("sync", "async")


def switched(segments: Sequence[Any], schedule: Any, seed: int, num_gpus: int,
             num_steps: int) -> tuple[Any, ...]:
    """`segments` (`plan.Segment`) as `schedule` (`rebalance_mode`, `copy_steps`,
    `switch_delay`) serves them: unchanged for `sync`; for `async`, each rebalance that moved
    experts starts `copy_steps` steps later (at most at step `S`: a placement whose copies
    land after the trace serves no step), the segment before serving until then, with every
    rank's first step `start + delay` in `switch` when `switch_delay > 0` (delays drawn from
    `seed` and the rebalance's step)."""
    if schedule.rebalance_mode == "sync":
        return tuple(segments)
    starts = [seg.start if seg.rebalance is None or seg.rebalance.skipped
              else min(seg.start + schedule.copy_steps, num_steps) for seg in segments]
    out = []
    for seg, start, stop in zip(segments, starts, starts[1:] + [num_steps]):
        switch = None
        if start != seg.start and schedule.switch_delay:
            rng = np.random.default_rng([seed, seg.rebalance.step])
            switch = start + rng.integers(0, schedule.switch_delay + 1, num_gpus)
        out.append(replace(seg, start=start, stop=stop, switch=switch))
    return tuple(out)


def phases(segments: Sequence[Any]) -> list[tuple[int, int, Placement, tuple | None]]:
    """`(start, stop, placement, serving)` of each stretch of steps every rank serves alike:
    `serving` is None when every rank serves `placement` (the segment's), else the placement
    each rank serves, `[G]` in rank order (the new one from its `switch` step, the one before
    until then). Consecutive stretches on one placement (a skipped rebalance) are merged."""
    out: list[tuple[int, int, Placement, tuple | None]] = []
    previous = None
    for seg in segments:
        cuts = {seg.start, seg.stop}
        if seg.switch is not None:
            cuts |= set(np.clip(seg.switch, seg.start, seg.stop).tolist())
        cuts = sorted(cuts)
        for lo, hi in zip(cuts, cuts[1:]):
            serving = None
            if seg.switch is not None and (seg.switch > lo).any():
                serving = tuple(seg.placement if lo >= s else previous
                                for s in seg.switch.tolist())
            if out and serving is None and out[-1][3] is None and out[-1][2] is seg.placement:
                out[-1] = (out[-1][0], hi, seg.placement, None)
            else:
                out.append((lo, hi, seg.placement, serving))
        previous = seg.placement
    return out


def held_experts(serving: Sequence[Placement]) -> torch.Tensor:
    """The expert whose weights each slot holds while ranks serve different placements: slot
    `p` on GPU `g` holds `serving[g]`'s expert, int64 `[L, P]`."""
    stacked = torch.stack([p.phy2log for p in serving])  # [G, L, P]
    slot_gpu = serving[0].slot_gpu  # [P]
    return stacked[slot_gpu, :, torch.arange(slot_gpu.numel())].T.contiguous()
