"""The tokens each EP rank dispatches a step in "a2a": what its dispatch buffer must hold
(`cost.buffers`, DESIGN.md §16).

Dimensions: `S` steps, `G` GPUs = EP ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from .traffic import share_bounds, token_owners


def rank_tokens(trace: object, num_ranks: int) -> torch.Tensor:
    """Tokens each rank dispatches in each step of a token trace, int64 `[S, G]`: the tokens it
    owns as "a2a" owns them (`token_owners`: the trace's `src_rank`, else contiguous shares of
    each step), padding rows included (a buffer holds a row whatever its ids)."""
    sizes = trace.tokens_per_step.tolist()
    out = torch.zeros(len(sizes), num_ranks, dtype=torch.int64)
    for s, size in enumerate(sizes):
        src = trace.step_src_rank(s)
        out[s] = (torch.from_numpy(np.diff(share_bounds(size, num_ranks))) if src is None else
                  torch.bincount(token_owners(size, num_ranks, src), minlength=num_ranks))
    return out
