"""Device-generic step kernels in plain torch (used on CUDA for the table and draw policies,
and wherever no compiled kernel exists).

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts, `R` max candidates.
Each writes int64 `[T, L, K]` with -1 where the id is -1, bit-identical to the reference.
"""

from __future__ import annotations

import torch

from ...placement import View
from ..policies import DispatchContext, layer_draws, static_table


def _flat(topk_ids: torch.Tensor, view: View) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat `(layer, expert)` index `[T, L, K]`, padding mask `[T, L, K]`)."""
    L, E = view.logcnt.shape
    ids = topk_ids.long()
    layer = torch.arange(L, device=ids.device).view(1, L, 1)
    return layer * E + ids.clamp(min=0), ids < 0


def _pick(topk_ids: torch.Tensor, view: View, replica: torch.Tensor) -> torch.Tensor:
    """Candidate number `replica [T, L, K]` of each pair's expert, -1 at padding."""
    le, pad = _flat(topk_ids, view)
    R = view.log2phy.shape[-1]
    phys = view.log2phy.reshape(-1)[le * R + torch.where(pad, 0, replica)]
    return phys.masked_fill(pad, -1)


def _counts(topk_ids: torch.Tensor, view: View) -> torch.Tensor:
    le, _ = _flat(topk_ids, view)
    return view.logcnt.reshape(-1)[le]  # [T, L, K]


def row_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`row % n_e` for every layer at once."""
    return row_rows(topk_ids, view, torch.arange(topk_ids.shape[0], device=topk_ids.device))


def row_rows(topk_ids: torch.Tensor, view: View, rows: torch.Tensor) -> torch.Tensor:
    """`row` for tokens `topk_ids [N, L, K]` whose rows within their own steps are `rows [N]`
    (several steps' tokens concatenated): `log2phy[l, e, rows[t] % n_e]`."""
    return _pick(topk_ids, view, rows.view(-1, 1, 1) % _counts(topk_ids, view))


def static_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """The rank's fixed table `[L, E]`, one gather."""
    le, pad = _flat(topk_ids, view)
    table = static_table(view, ctx.rank, ctx.seed).reshape(-1)
    return table[le].masked_fill(pad, -1)


def random_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """One `randint(0, 65536)` batch of `T * K` draws per layer, in layer order."""
    T, L, K = topk_ids.shape
    draws = layer_draws(ctx, T * K, L, topk_ids.device).view(L, T, K).permute(1, 0, 2)
    return _pick(topk_ids, view, draws % _counts(topk_ids, view))
