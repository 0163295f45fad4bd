"""Load predictors: what a placement is solved for at a rebalance, in the `PREDICTORS` registry.

Dimensions: `S` steps, `L` layers, `E` logical experts.

A predictor is a pure function

    predictor(past, future, window, decay) -> float64 [L, E]

  past:   int64 `[s, L, E]` routed pairs of every step before the rebalance at step `s`
  future: int64 `[n, L, E]` routed pairs of the `n` steps the new placement will serve; only an
          oracle may read it (it is there so that one can exist)
  window: `W`, the steps of history a windowed predictor sums (>= 1)
  decay:  the per-step factor of an exponentially decayed sum, in [0, 1] (0: the last step)
returning non-negative expected loads of the same scale as a sum of steps (solvers only compare
experts within a layer, so the scale does not matter). A new predictor is one function and one
line in `PREDICTORS`; the replay also takes any such callable.
"""

from __future__ import annotations

from typing import Callable

import torch

Predictor = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def window(past: torch.Tensor, future: torch.Tensor, window: int, decay: float) -> torch.Tensor:
    """The sum of the last `window` steps (all of them when fewer): the serving engines'
    default. `[s, L, E] -> [L, E]`."""
    return past[-window:].sum(0).to(torch.float64)


def ema(past: torch.Tensor, future: torch.Tensor, window: int, decay: float) -> torch.Tensor:
    """Exponentially decayed sum of every past step, `sum_j decay^(s-1-j) past[j]`, the running
    counter some engines keep on the GPU (`h <- decay * h + load` each step). `[s, L, E] ->
    [L, E]`."""
    s = past.shape[0]
    weights = torch.full((s,), float(decay), dtype=torch.float64).pow(
        torch.arange(s - 1, -1, -1, dtype=torch.float64))  # [s] oldest gets decay^(s-1)
    return torch.tensordot(weights, past.to(torch.float64), dims=1)


def oracle(past: torch.Tensor, future: torch.Tensor, window: int, decay: float) -> torch.Tensor:
    """The true loads of the steps about to run: the best any predictor could do.
    `[n, L, E] -> [L, E]`."""
    return future.sum(0).to(torch.float64)


PREDICTORS: dict[str, Predictor] = {
    "window": window,
    "ema": ema,
    "oracle": oracle,
}
