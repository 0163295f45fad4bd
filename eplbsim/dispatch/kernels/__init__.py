"""Fast step kernels: every layer of a step in one call, bit-identical to the reference
policies of `eplbsim.dispatch` (which stay as the oracle the tests compare against).

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts, `R` max candidates.

A step kernel is `kernel(topk_ids [T, L, K], view, ctx) -> phys [T, L, K]` (int64, -1 at
padding) and must equal `stack([policy(topk_ids[:, l], view, ctx with layer=l) for l])`.
CPU kernels are compiled with numba (`cpu.py`); on CUDA `row` and `ordinal` are Triton kernels
(`triton_dispatch.py`, when triton is installed) and `static`, `random` plain torch
(`torch_step.py`). `dispatch_step` uses the kernel for the policy on the device of `topk_ids`
when there is one, and otherwise runs the reference policy layer by layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..policies import (
    DispatchContext,
    Policy,
    layer_offsets,
    ordinal_policy,
    random_policy,
    row_policy,
    static_policy,
)
from ...placement import View

StepKernel = Callable[[torch.Tensor, View, DispatchContext], torch.Tensor]


def _cpu_kernels() -> dict[Policy, StepKernel]:
    from . import cpu
    return {row_policy: cpu.row_step, ordinal_policy: cpu.ordinal_step,
            static_policy: cpu.static_step, random_policy: cpu.random_step}


def _cuda_kernels() -> dict[Policy, StepKernel]:
    from . import torch_step
    kernels = {row_policy: torch_step.row_step, static_policy: torch_step.static_step,
               random_policy: torch_step.random_step}
    try:
        from . import triton_dispatch
    except ImportError:  # no triton: torch kernels and the reference ordinal run instead
        return kernels

    def row(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
        return triton_dispatch.row_step_triton(topk_ids, view.log2phy, view.logcnt)

    def ordinal(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
        return triton_dispatch.ordinal_step_triton(topk_ids, view.log2phy, view.logcnt,
                                                   layer_offsets(ctx, topk_ids.shape[1]))

    return {**kernels, row_policy: row, ordinal_policy: ordinal}


_LOADERS = {"cpu": _cpu_kernels, "cuda": _cuda_kernels}
_LOADED: dict[str, dict[Policy, StepKernel]] = {}


def step_kernel(policy: Policy, device: torch.device | str) -> StepKernel | None:
    """The fast step kernel of `policy` on `device`, or None (kernels load on first use)."""
    kind = torch.device(device).type
    if kind not in _LOADED:
        _LOADED[kind] = _LOADERS.get(kind, dict)()
    return _LOADED[kind].get(policy)


def reference_step(policy: Policy, topk_ids: torch.Tensor, view: View,
                   ctx: DispatchContext) -> torch.Tensor:
    """The reference: `policy` layer by layer, stacked to `[T, L, K]`."""
    layers = [policy(topk_ids[:, layer], view, replace(ctx, layer=layer))
              for layer in range(topk_ids.shape[1])]
    return torch.stack(layers, 1) if layers else topk_ids.long().clone()


def dispatch_step(policy: Policy, topk_ids: torch.Tensor, view: View,
                  ctx: DispatchContext) -> torch.Tensor:
    """Every layer of a step, `topk_ids [T, L, K]` -> phys int64 `[T, L, K]`: the fast kernel
    where one exists for `policy` on this device, else the reference (ctx.layer is ignored)."""
    kernel = step_kernel(policy, topk_ids.device)
    if kernel is None:
        return reference_step(policy, topk_ids, view, ctx)
    return kernel(topk_ids, view, ctx)
