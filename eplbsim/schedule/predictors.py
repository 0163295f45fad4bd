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
experts within a layer, so the scale does not matter). A predictor that also takes a keyword
`hash_layers` gets the indices of the hash-routed layers (`traces.layer_kinds`: a token-id table
routes them, so the batch's token ids give their loads before any routing). A new predictor is
one function and one line in `PREDICTORS`; the replay also takes any such callable.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import torch

Predictor = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def window(past: torch.Tensor, future: torch.Tensor, window: int, decay: float) -> torch.Tensor:
    """The sum of the last `window` steps (all of them when fewer): the serving engines'
    default. `[s, L, E] -> [L, E]`."""
    return window_sum(past, window)


def window_sum(past: torch.Tensor, steps: int) -> torch.Tensor:
    """The sum of the last `steps` of `past [s, L, E]` (all of them when fewer), float64
    `[L, E]`."""
    return past[-steps:].sum(0).to(torch.float64)


def _decayed_sum(steps: torch.Tensor, factor: float) -> torch.Tensor:
    """`sum_j factor^(n-1-j) steps[j]` over `steps [n, L, E]`: the counter `h <- factor * h +
    steps[j]` run from `h = 0` over the `n` steps, in float64. `[n, L, E] -> [L, E]`."""
    n = steps.shape[0]
    weights = torch.full((n,), float(factor), dtype=torch.float64).pow(
        torch.arange(n - 1, -1, -1, dtype=torch.float64))  # [n] oldest gets factor^(n-1)
    return torch.tensordot(weights, steps.to(torch.float64), dims=1)


def ema(past: torch.Tensor, future: torch.Tensor, window: int, decay: float) -> torch.Tensor:
    """Exponentially decayed sum of every past step, `sum_j decay^(s-1-j) past[j]`, the running
    counter some engines keep on the GPU (`h <- decay * h + load` each step). `[s, L, E] ->
    [L, E]`."""
    return _decayed_sum(past, decay)


def decay(past: torch.Tensor, future: torch.Tensor, window: int, decay: float) -> torch.Tensor:
    """TensorRT-LLM's online load statistic: `h <- decay * h + load` each step, cleared at each
    rebalance, i.e. the decayed sum of the last `window` steps (all of them when fewer; by
    default `W` is the rebalance interval, so exactly the steps since the last rebalance), with
    TensorRT-LLM's factor 0.95 unless `--decay` is given (`DEFAULT_DECAY`). `[s, L, E] ->
    [L, E]`.

    Read in NVIDIA/TensorRT-LLM (not copied):
    - `cpp/tensorrt_llm/kernels/moeLoadBalance/moeLoadBalanceKernels.cu` @
      ada8389ee4c35f398d95701e231e8b2405ebc606: `updateLoadFactorKernel`, once an iteration
      `expertLoadFactor = expertLoadFactor * decayFactor + the iteration's token count`;
    - `cpp/tensorrt_llm/kernels/moeLoadBalance/moeLoadBalanceCommon.h` @
      3e6a30e43304848062444d64928ab18b4b34867f: `MoeLoadBalanceStatisticInfo::decayFactor`,
      0.95 (none of these files sets another);
    - `cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp` @
      65b31db1b401d3752b8ebe7c29093cbfb6af04b7: `copyPlacementInfoToGpu` zeroes the statistic
      after each update of the layer;
    - `tensorrt_llm/_torch/modules/fused_moe/moe_load_balancer.py` @
      56851033051a6f9bd50e22219db64d68722a6f01: the Python side only feeds each iteration's
      routed expert ids (`update_statistic_with_global_ids` / `..._local_ids`), no factor.
    The engine keeps `h` in float32; here it is float64.
    """
    return _decayed_sum(past[-window:], decay)


def hashed(past: torch.Tensor, future: torch.Tensor, window: int, decay: float,
           hash_layers: Sequence[int] = ()) -> torch.Tensor:
    """Exact on hash-routed layers, `window` on the learned ones (DESIGN.md §16): a hash layer's
    experts are the token-id table's entries for the batch's token ids, known before routing,
    so its forecast is the true load of the steps about to run (their token ids through the
    table); a learned layer's is the sum of the last `window` steps. What a placement can gain
    on hash layers; with no hash layer it is `window`. `[s, L, E] -> [L, E]`."""
    out = window_sum(past, window)
    layers = list(hash_layers)
    out[layers] = future[:, layers].sum(0).to(torch.float64)
    return out


def oracle(past: torch.Tensor, future: torch.Tensor, window: int, decay: float) -> torch.Tensor:
    """The true loads of the steps about to run: the best any predictor could do.
    `[n, L, E] -> [L, E]`."""
    return future.sum(0).to(torch.float64)


PREDICTORS: dict[str, Predictor] = {
    "window": window,
    "ema": ema,
    "decay": decay,
    "oracle": oracle,
    "hashed": hashed,
}

TRTLLM_DECAY = 0.95  # TensorRT-LLM's `MoeLoadBalanceStatisticInfo::decayFactor` (`decay` doc)

# Predictors that bring their own default `decay` factor (an engine's), used when the schedule
# gives none (`--decay`); every other predictor gets the plan's `1 - 1/W` (`plan.plan`).
DEFAULT_DECAY: dict[Predictor, float] = {decay: TRTLLM_DECAY}


def takes_hash_layers(predictor: Predictor) -> bool:
    """Whether `predictor` takes the keyword `hash_layers` (module doc)."""
    try:
        return "hash_layers" in inspect.signature(predictor).parameters
    except (TypeError, ValueError):
        return False
