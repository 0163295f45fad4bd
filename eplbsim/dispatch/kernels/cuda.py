"""CUDA step kernels for `row` and `ordinal`: the Triton kernels of `triton_dispatch` behind the
step-kernel signature `(topk_ids [T, L, K], view, ctx) -> phys int64 [T, L, K]`.

Importing this module imports triton, so it fails (and `dispatch_step` falls back to the next
kernel or the reference) where triton is not installed.
"""

from __future__ import annotations

import torch

from ...placement import View
from ..policies import DispatchContext, layer_offsets
from . import triton_dispatch


def row_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`row` for every layer in one launch."""
    return triton_dispatch.row_step_triton(topk_ids, view.log2phy, view.logcnt)


def row_rows(topk_ids: torch.Tensor, view: View, rows: torch.Tensor) -> torch.Tensor:
    """`row` for several steps' tokens in one launch, each at its row within its step
    (`torch_step.row_rows`)."""
    return triton_dispatch.row_step_triton(topk_ids, view.log2phy, view.logcnt, rows=rows)


def ordinal_step(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`ordinal` for every layer: a histogram launch, a scan, and the dispatch launch."""
    return triton_dispatch.ordinal_step_triton(topk_ids, view.log2phy, view.logcnt,
                                               layer_offsets(ctx, topk_ids.shape[1],
                                                             topk_ids.device))
