"""The reductions a metric's per-(step, layer) components go through, over any of the axes `dims`
of `[S, L]`: means, peaks, totals, ratios, step times, overheads, throughput, shares.
"""

from __future__ import annotations

import math

import torch



WHOLE, PER_STEP, PER_LAYER = (0, 1), (1,), ()  # the axes of `[S, L]` a reduction sums over


# Each takes components `[S, L]` and `dims`, the axes to reduce: WHOLE, PER_STEP or PER_LAYER.

def mean(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """Mean of the defined (non-NaN) entries; NaN where there are none."""
    if not dims:
        return x.to(torch.float64)
    if dims == WHOLE:
        values = x[~x.isnan()]
        return values.mean() if values.numel() else torch.tensor(math.nan, dtype=torch.float64)
    return x.nanmean(dims)


def peak(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """Max of the defined entries; NaN where there are none."""
    if not dims:
        return x
    defined = (~x.isnan()).sum(dims) > 0
    return torch.where(defined, x.nan_to_num(-math.inf).amax(dims), math.nan)


def total(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """Plain sum (integers stay integers)."""
    return x.sum(dims) if dims else x


def _divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den as float64, NaN where den is 0."""
    num, den = num.to(torch.float64), den.to(torch.float64)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), math.nan)


def ratio(num: torch.Tensor, den: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """sum(num) / sum(den): a pooled ratio of counts; NaN where the denominator is 0."""
    return _divide(total(num, dims=dims), total(den, dims=dims))


def root_ratio(num: torch.Tensor, den: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """sqrt(sum(num) / sum(den)): a relative norm from squared norms."""
    return ratio(num, den, dims=dims).sqrt()


def step_time(x: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """A step's time is the sum of its layers': summed over layers, then the mean over steps."""
    x = x.to(torch.float64)
    if 1 in dims:
        x = x.sum(1)
    return x.mean(0) if 0 in dims else x


def overhead(num: torch.Tensor, den: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    """sum(num) / sum(den) - 1: the pooled excess of a time over its reference."""
    return ratio(num, den, dims=dims) - 1


def throughput(tokens: torch.Tensor, seconds: torch.Tensor, *,
               dims: tuple[int, ...]) -> torch.Tensor:
    """Tokens over time: `tokens [S, L]` is each step's tokens on every layer (counted once per
    step), `seconds` each layer's time."""
    n = tokens.to(torch.float64)
    n = n.mean(1) if 1 in dims else n
    return _divide(n.sum(0) if 0 in dims else n, total(seconds, dims=dims))


def shares(*counts: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Each count's share of their sum, float64 `[..., n]`; NaN where the sum is 0."""
    sums = [total(c, dims=dims) for c in counts]
    whole = sum(sums)
    return torch.stack([_divide(part, whole) for part in sums], -1)
