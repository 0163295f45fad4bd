"""The toy MoE layer that measures what wrong multiplicities do to a layer's output.

Dimensions: `T` tokens, `K` top-k, `L` layers, `E` logical experts, `D` hidden size.

Expert `e` of layer `l` is a fixed random matrix `W[l, e]` (all replicas share it); token `t` of
a step has a random hidden vector `x_t` and positive gate weights `w_tk` summing to 1. The exact
output is `y_t = sum_k w_tk W_{e_tk} x_t`; when pair `(t, k)` is executed `c_tk` times (summed
over ranks by the all-reduce) the simulated output is `sum_k c_tk w_tk W_{e_tk} x_t`.

Pair outputs are float64 values on the grid of multiples of `2**-GRID_BITS` (rounded once from
the float32 product), far from float64's limits, so every sum of them is exact in any order:
the in-process simulation and an all-reduce over real processes get bit-identical outputs, and
an exactly executed pair adds exactly 0 error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

GRID_BITS = 24  # pair outputs are multiples of 2**-GRID_BITS


@dataclass(frozen=True)
class ToyMoE:
    """weights: float32 `[L, E, D, D]`; seed also drives the per-step token inputs."""

    weights: torch.Tensor
    seed: int


def make_toy_moe(num_layers: int, num_experts: int, hidden: int = 8, seed: int = 0,
                 device: torch.device | str = "cpu") -> ToyMoE:
    """Expert matrices with entries N(0, 1/D), seeded (float32 is ample: outputs are rounded to
    the module's grid anyway)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(num_layers, num_experts, hidden, hidden, generator=gen, dtype=torch.float32)
    return ToyMoE((w / hidden ** 0.5).to(device), seed)


def token_inputs(moe: ToyMoE, step: int, num_tokens: int,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden vectors `x [T, D]` and gates `w [T, K]` of step `step`, seeded by (seed, step)."""
    gen = torch.Generator().manual_seed(moe.seed * 1_000_003 + step + 1)
    hidden = moe.weights.shape[-1]
    x = torch.randn(num_tokens, hidden, generator=gen)
    gates = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    gates = gates / gates.sum(-1, keepdim=True)
    device = moe.weights.device
    return x.to(device), gates.to(device)


def pair_outputs(moe: ToyMoE, layer: int, topk_ids: torch.Tensor, x: torch.Tensor,
                 gates: torch.Tensor) -> torch.Tensor:
    """`w_tk W_{e_tk} x_t` of every pair on the grid, float64 `[T, K, D]`; zero for padding."""
    ids = topk_ids.long()
    w = moe.weights[layer][ids.clamp(min=0)]  # [T, K, D, D]
    weight = (gates * (ids >= 0)).unsqueeze(-1)  # [T, K, 1]
    out = (torch.einsum("tkij,tj->tki", w, x) * weight).double()
    return torch.round(out * 2.0 ** GRID_BITS) / 2.0 ** GRID_BITS


def all_reduced_error_terms(moe: ToyMoE, step: int, topk_ids: torch.Tensor,
                            executed: torch.Tensor,
                            all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The toy layer's output error for one step, every layer: float64 `[L, 2]` of
    `(||Y - Y_exact||^2, ||Y_exact||^2)`.

    topk_ids: `[T, L, K]` the step's ids (every token; -1 padding)
    executed: int `[T, L, K]` times the ranks of this process executed each pair
    all_reduce: sums a tensor over the processes of the group (identity in one process)
    Each process sums the pair outputs of the pairs it executed, `[L, T, D]`; the all-reduce
    of those partial outputs is `Y`, as a serving engine's all-reduce forms it.
    """
    T, L, K = topk_ids.shape
    x, gates = token_inputs(moe, step, T, K)
    pairs = [pair_outputs(moe, layer, topk_ids[:, layer], x, gates) for layer in range(L)]
    partial = torch.stack([(p * executed[:, layer].unsqueeze(-1)).sum(1)
                           for layer, p in enumerate(pairs)])  # [L, T, D]
    summed = all_reduce(partial)
    terms = [error_terms(summed[layer] - p.sum(1), p.sum(1)) for layer, p in enumerate(pairs)]
    return torch.tensor(terms, dtype=torch.float64).view(L, 2)


def error_terms(diff: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """`(||diff||^2, ||exact||^2)` for `diff [R, D]` (any rows of `Y - Y_exact`; zero rows may
    be left out) and `exact [T, D]`. The first is summed exactly rounded (`math.fsum`), so it
    does not depend on which zero rows are included or in what order."""
    squares = (diff * diff).flatten()
    return math.fsum(squares[squares != 0].tolist()), float((exact * exact).sum())
