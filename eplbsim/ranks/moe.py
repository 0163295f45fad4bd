"""The toy MoE layer that measures what wrong multiplicities do to a layer's output.

Dimensions: `T` tokens, `K` top-k, `L` layers, `E` logical experts, `D` hidden size.

Expert `e` of layer `l` is a fixed random matrix `W[l, e]` (all replicas share it); token `t` of
a step has a random hidden vector `x_t` and gate weights `w_tlk`: the router's own where the
trace holds them (`step_weights`: a real log's gating weights, so each pair weighs what it
weighed in the model), else positive random ones summing to 1, the same in every layer. The
exact output of layer `l` is `y_t = sum_k w_tlk W_{e_tlk} x_t`; when pair `(t, l, k)` is
executed `c_tlk` times (summed over ranks by the all-reduce) the simulated output is
`sum_k c_tlk w_tlk W_{e_tlk} x_t`.

Pair outputs are float64 values on the grid of multiples of `2**-GRID_BITS` (rounded once from
the float32 product, summed over the hidden index in order), far from float64's limits, so every
sum of them is exact in any order: the in-process simulation and an all-reduce over real
processes get bit-identical outputs, and an exactly executed pair adds exactly 0 error. On the
CPU the compiled loops of `counting.layer_sums` define them, every layer of a step at once; on
CUDA `pair_outputs` (torch) does, layer by layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import numpy as np
import torch

from . import counting

GRID_BITS = counting.GRID_BITS  # pair outputs are multiples of 2**-GRID_BITS


@dataclass(frozen=True)
class ToyMoE:
    """The toy layer of `L` layers of `E` experts of hidden size `D`; `seed` draws the expert
    matrices (made on first use: a run that never measures the error never makes them) and
    the per-step token inputs."""

    num_layers: int
    num_experts: int
    hidden: int
    seed: int
    device: torch.device
    gates: Callable[[int], torch.Tensor | None] | None = None  # step -> `[T, L, K]` or None

    @cached_property
    def weights(self) -> torch.Tensor:
        """float32 `[L, E, D, D]`, entries N(0, 1/D), seeded (float32 is ample: outputs are
        rounded to the module's grid anyway)."""
        gen = torch.Generator().manual_seed(self.seed)
        w = torch.randn(self.num_layers, self.num_experts, self.hidden, self.hidden,
                        generator=gen, dtype=torch.float32)
        return (w / self.hidden ** 0.5).to(self.device)

    @cached_property
    def transposed(self) -> np.ndarray:
        """The weights as the CPU loops read them, float32 `[L, E, D, D]`, `[l, e, j, i] =
        weights[l, e, i, j]`."""
        return np.ascontiguousarray(self.weights.cpu().numpy().transpose(0, 1, 3, 2))


def make_toy_moe(num_layers: int, num_experts: int, hidden: int = 8, seed: int = 0,
                 device: torch.device | str = "cpu", trace: Any = None) -> ToyMoE:
    """The toy layer of these sizes on `device` (its matrices are drawn when first used),
    weighing pairs by `trace`'s gating weights where it has them (`step_weights`)."""
    weights = getattr(trace, "step_weights", None)  # a Trace's, a view's; None for the rest
    has = weights is not None and trace.num_steps and weights(0) is not None
    return ToyMoE(num_layers, num_experts, hidden, seed, torch.device(device),
                  weights if has else None)


def token_inputs(moe: ToyMoE, step: int, ids_shape: tuple[int, int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden vectors `x [T, D]` and gates `w [T, L, K]` of step `step` of ids `ids_shape`
    `(T, L, K)`: `x` seeded by (seed, step); the gates the trace's (`ToyMoE.gates`) or, when
    it has none, drawn after `x` and the same in every layer."""
    T, L, K = ids_shape
    gen = torch.Generator().manual_seed(moe.seed * 1_000_003 + step + 1)
    x = torch.randn(T, moe.hidden, generator=gen)
    gates = None if moe.gates is None else moe.gates(step)
    if gates is None:
        drawn = torch.rand(T, K, generator=gen) + 0.1
        gates = (drawn / drawn.sum(-1, keepdim=True)).unsqueeze(1).expand(T, L, K)
    return x.to(moe.device), gates.to(moe.device)


def pair_outputs(moe: ToyMoE, layer: int, topk_ids: torch.Tensor, x: torch.Tensor,
                 gates: torch.Tensor) -> torch.Tensor:
    """`w_tk W_{e_tk} x_t` of every pair of layer `layer` on the grid, float64 `[T, K, D]`;
    zero for padding (`topk_ids [T, K]` and `gates [T, K]` are the layer's)."""
    ids = topk_ids.long()
    w = moe.weights[layer][ids.clamp(min=0)]  # [T, K, D, D]
    weight = (gates * (ids >= 0)).unsqueeze(-1)  # [T, K, 1]
    out = (torch.einsum("tkij,tj->tki", w, x) * weight).double()
    return torch.round(out * 2.0 ** GRID_BITS) / 2.0 ** GRID_BITS


def step_sums(moe: ToyMoE, step: int, topk_ids: torch.Tensor,
              executed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy layer on step `step`, every layer: `(exact, weighted)`, float64 `[L, T, D]` on
    the ids' device: each token's exact output, and its output with pair `(t, k)` counted
    `executed [T, L, K]` times (None: `exact` itself).

    topk_ids: `[T, L, K]` the step's ids (every token; -1 padding, which adds nothing)"""
    x, gates = token_inputs(moe, step, topk_ids.shape)
    if topk_ids.device.type == "cpu":
        sums = counting.layer_sums(moe.transposed, x.numpy(), gates.numpy(), topk_ids.numpy(),
                                   None if executed is None else executed.numpy())
        return torch.from_numpy(sums[0]), torch.from_numpy(sums[1])
    return pair_sums(moe, topk_ids, x, gates, executed)


def pair_sums(moe: ToyMoE, topk_ids: torch.Tensor, x: torch.Tensor, gates: torch.Tensor,
              executed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`step_sums` in torch on the ids' device (what a GPU runs), from the step's inputs
    (`token_inputs`)."""
    L = topk_ids.shape[1]
    pairs = [pair_outputs(moe, layer, topk_ids[:, layer], x, gates[:, layer])
             for layer in range(L)]
    exact = torch.stack([p.sum(1) for p in pairs])
    if executed is None:
        return exact, exact
    return exact, torch.stack([(p * executed[:, layer].unsqueeze(-1)).sum(1)
                               for layer, p in enumerate(pairs)])


def all_reduced_error_terms(moe: ToyMoE, step: int, topk_ids: torch.Tensor,
                            executed: torch.Tensor,
                            all_reduce: Callable[[torch.Tensor], torch.Tensor],
                            squares: Callable[[torch.Tensor], torch.Tensor] | None = None
                            ) -> torch.Tensor:
    """The toy layer's output error for one step, every layer: float64 `[L, 2]` of
    `(||Y - Y_exact||^2, ||Y_exact||^2)`.

    topk_ids: `[T, L, K]` the step's ids (every token; -1 padding)
    executed: int `[T, L, K]` times the ranks of this process executed each pair
    all_reduce: sums a tensor over the processes of the group (identity in one process)
    squares:  how the squares are summed (`error_terms`)
    Each process sums the pair outputs of the pairs it executed, `[L, T, D]`; the all-reduce
    of those partial outputs is `Y`, as a serving engine's all-reduce forms it.
    """
    exact, partial = step_sums(moe, step, topk_ids, executed)
    return error_terms(all_reduce(partial) - exact, exact, squares)


def local_error_terms(moe: ToyMoE, step: int, topk_ids: torch.Tensor,
                      executed: torch.Tensor) -> torch.Tensor:
    """`all_reduced_error_terms` where one process holds every rank (`executed` counts all of
    them), the same bits: on the CPU one compiled pass that sums each token's output and error
    and squares them there (`counting.error_squares`, no `[L, T, D]` arrays), unless some
    output is off the grid."""
    if topk_ids.device.type == "cpu":
        x, gates = token_inputs(moe, step, topk_ids.shape)
        terms = counting.error_squares(moe.transposed, x.numpy(), gates.numpy(),
                                       topk_ids.numpy(), executed.numpy())
        if terms is not None:
            return torch.from_numpy(terms)
    return all_reduced_error_terms(moe, step, topk_ids, executed, lambda t: t)


def error_terms(diff: torch.Tensor, exact: torch.Tensor,
                squares: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """`(||diff[l]||^2, ||exact[l]||^2)` of every layer, float64 `[L, 2]`, for `diff [L, R, D]`
    (any rows of `Y - Y_exact`; zero rows may be left out) and `exact [L, T, D]`, on their
    device: each `squares` (default `square_sums`: exactly rounded, on the CPU), so neither
    depends on which zero rows are included, in what order, or on the device;
    `device_square_sums` keeps them on the device (NaN where it cannot be exact there)."""
    squares = squares or square_sums
    return torch.stack([squares(diff), squares(exact)], 1)


def square_sums(rows: torch.Tensor) -> torch.Tensor:
    """The exactly rounded sum of the squares (each rounded to float64) of each `rows[l]`
    (float64 `[L, ...]` on any device), float64 `[L]` on the CPU, as `math.fsum`: on the CPU
    by `counting.square_sums`; elsewhere by `grid_square_sums` on the device (only `[L]`
    integer pairs cross to the CPU), or on the CPU where that does not apply."""
    rows = rows.reshape(rows.shape[0], -1)
    squares = None if rows.device.type == "cpu" else grid_square_sums(rows)
    if squares is None:
        squares = torch.from_numpy(counting.square_sums(rows.cpu().numpy()))
    return squares


UNMEASURED = float("inf")  # an exact norm the fast path left to compute (its error is 0)


def zero_error_terms(valid: torch.Tensor) -> torch.Tensor:
    """The toy layer's error terms of steps whose every pair is executed once, float64
    `[..., L, 2]` on the device of `valid [..., L]` (their valid pairs): error exactly 0, the
    exact norm `UNMEASURED` where some pair is valid (the caller fills it in only if it is ever
    read, `replay.fill_norms`), else 0."""
    error = torch.zeros(*valid.shape, 2, dtype=torch.float64, device=valid.device)
    error[..., 1] = torch.where(valid > 0, UNMEASURED, 0.0)
    return error


DEVICE_SUM_VALUES = 1 << 22  # a row of at most this many values keeps its parts under 2**53


def _grid_parts(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(on_grid [L], high [L], low [L])` of float64 `rows [L, n]`, on their device: whether
    every value of a row is a multiple of `2**-GRID_BITS` below `2**7` in magnitude (toy-MoE
    output differences are), and the sums of the high and the low 31 bits of each value's
    square as an integer multiple `m < 2**62` of `2**(-2 * GRID_BITS)` (rounding a multiple of
    that power of two to float64 keeps it one), exact in int64; 0 in a row off the grid."""
    scaled = rows * 2.0 ** GRID_BITS
    ok = ((rows.abs() < 2.0 ** 7) & (scaled == scaled.round())).all(1)  # [L]
    m = torch.where(ok.unsqueeze(1), rows * rows * 2.0 ** (2 * GRID_BITS), 0.0).to(torch.int64)
    return ok, (m >> 31).sum(1), (m & (2 ** 31 - 1)).sum(1)


def device_square_sums(rows: torch.Tensor) -> torch.Tensor:
    """`square_sums` of float64 `rows [L, ...]` computed on their device and read back nowhere:
    float64 `[L]` there, equal to `square_sums` bit for bit in every row on the grid
    (`_grid_parts`) of under `DEVICE_SUM_VALUES` values; NaN in the other rows, which the
    caller recomputes on the host (`replay.dispatch_steps`).

    The grid sum's high and low parts are each under `2**53` there, so both convert to float64
    exactly, `high * 2**31` stays exact, and their one float64 sum is the correctly rounded
    total, as Python's int -> float conversion rounds it (`counting.grid_value`)."""
    rows = rows.reshape(rows.shape[0], -1)
    if rows.shape[1] >= DEVICE_SUM_VALUES:
        return torch.full(rows.shape[:1], math.nan, dtype=torch.float64, device=rows.device)
    ok, high, low = _grid_parts(rows)
    total = (high.double() * 2.0 ** 31 + low.double()) * 2.0 ** (-2 * GRID_BITS)
    return torch.where(ok, total, math.nan)


def grid_square_sums(rows: torch.Tensor) -> torch.Tensor | None:
    """The exactly rounded sum of the squares (each rounded to float64) of each row of float64
    `rows [L, n]` on any device, float64 `[L]` on the CPU, equal to `math.fsum`; None unless
    every row is on the grid (`_grid_parts`), with `n < 2**32`: the parts are summed exactly on
    the device, and the total is rounded once, by Python's correctly rounded int -> float
    conversion."""
    if rows.shape[1] >= 2 ** 32:
        return None
    ok, high, low = _grid_parts(rows)
    if not bool(ok.all()):
        return None
    high, low = torch.stack([high, low]).cpu().tolist()
    return torch.tensor([counting.grid_value(h, lo) for h, lo in zip(high, low)],
                        dtype=torch.float64)
