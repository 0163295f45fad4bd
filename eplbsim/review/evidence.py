"""How sure a paired comparison over steps is: a seeded block bootstrap (`review`'s intervals).

Dimensions: `R` seeds (replays of the same steps with different random streams), `S` scored
steps, `B` resamples, `n` blocks a resample.

Two runs scored on the same steps give, per seed and step, a numerator and a denominator of each
figure: a step's time (`ms`, over 1), or the sum of its layers' GPU imbalances over the layers
where it is defined. A figure over any set of (seed, step) pairs is the sum of their numerators
over the sum of their denominators, so the whole run's figure is the plain one (`moe_ms`,
`gpu_imbalance`) and every resample's is the same formula on other pairs.

A resample (`draws`) keeps the steps' order within blocks, because neighbouring steps are alike
(one batch of requests runs for many steps):
- the seeds are drawn `R` times with replacement, so a policy that draws at random carries the
  spread across its seeds into the interval (for a deterministic one every seed is the same run
  and this changes nothing);
- the steps as `n = ceil(S / b)` circular blocks of `b = block_steps(S)` consecutive steps, their
  starts uniform (Politis and Romano's circular block bootstrap).
Candidate and baseline are resampled with the same draws (paired), so what the steps share (a
heavy batch slows both) cancels in their difference. The interval is the central `level` share of
the resampled differences (percentile interval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95  # the interval's coverage
RESAMPLES = 1000  # resamples by default


def block_steps(num_steps: int) -> int:
    """The block length for `num_steps` steps: `round(S ** (1/3))`, at least 1 (the order of
    the mean-squared-error-optimal length for a smooth statistic)."""
    return max(1, round(num_steps ** (1 / 3)))


@dataclass(frozen=True)
class Draws:
    """One set of resamples: `seeds` int64 `[B, R]` (which seed's run each of the `R` draws
    reads) and `starts` int64 `[B, n]` (each block's first step); `block` steps a block."""

    seeds: np.ndarray
    starts: np.ndarray
    block: int

    @property
    def resamples(self) -> int:
        return self.seeds.shape[0]


def draws(num_seeds: int, num_steps: int, resamples: int = RESAMPLES, seed: int = 0,
          block: int | None = None) -> Draws:
    """`resamples` resamples of `num_seeds` seeds x `num_steps` steps (module doc), from a
    generator seeded by `seed`; `block` steps a block (None: `block_steps`)."""
    block = block_steps(num_steps) if block is None else block
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, num_seeds, size=(resamples, num_seeds))
    starts = rng.integers(0, num_steps, size=(resamples, math.ceil(num_steps / block)))
    return Draws(seeds, starts, block)


def resampled(num: np.ndarray, den: np.ndarray, d: Draws) -> np.ndarray:
    """The figure `sum(num) / sum(den)` on each resample of `d`: float64 `[B]` for `num`, `den`
    `[R, S]` (NaN where a resample's denominator is 0)."""
    sums = []
    for x in (num, den):
        x = np.asarray(x, dtype=np.float64)
        S = x.shape[1]
        wrapped = np.take(x, np.arange(S + d.block - 1) % S, axis=1)  # circular
        cum = np.concatenate([np.zeros((x.shape[0], 1)), np.cumsum(wrapped, axis=1)], axis=1)
        blocks = cum[:, d.block:d.block + S] - cum[:, :S]  # [R, S] the block starting at each step
        sums.append(blocks[d.seeds[:, :, None], d.starts[:, None, :]].sum((1, 2)))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sums[1] != 0, sums[0] / np.where(sums[1] != 0, sums[1], 1.0), np.nan)


def interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The central `level` share of `values` (NaN left out): `(lo, hi)`; NaN when none are
    defined."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if not values.size:
        return math.nan, math.nan
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def bounds(values: np.ndarray, steps: int, level: float = LEVEL) -> list[float] | None:
    """`[lo, hi]`, the `interval` of the resampled `values` of a figure over `steps` scored
    steps; None for a single step: every resample of it is that step, so the resamples agree
    and their interval has no width, which bounds nothing (`UNBOUNDED` says so)."""
    return list(interval(values, level)) if steps > 1 else None


UNBOUNDED = "no interval: a block bootstrap over steps cannot bound one scored step"


def figure(num: np.ndarray, den: np.ndarray) -> float:
    """The figure over every (seed, step): `sum(num) / sum(den)`; NaN when `sum(den)` is 0."""
    total = float(np.sum(den))
    return float(np.sum(num)) / total if total else math.nan


__all__ = ["Draws", "LEVEL", "RESAMPLES", "UNBOUNDED", "block_steps", "bounds", "draws",
           "figure", "interval", "resampled"]
