"""`eplbsim.review.evidence`: the block bootstrap against a straightforward resampling, its intervals on
runs that are alike, differ by a constant or differ only by seed, and its determinism."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eplbsim.review.evidence import block_steps, draws, figure, interval, resampled


@given(st.integers(1, 4), st.integers(1, 40), st.integers(1, 9), st.integers(0, 2**31))
def test_each_resample_is_the_figure_on_its_drawn_seeds_and_blocks(R, S, block, seed):
    rng = np.random.default_rng(seed)
    num, den = rng.random((R, S)), rng.integers(0, 3, (R, S)).astype(float)
    d = draws(R, S, resamples=20, seed=seed, block=block)
    got = resampled(num, den, d)
    for b in range(d.resamples):
        steps = (d.starts[b][:, None] + np.arange(block)).ravel() % S  # circular blocks
        rows = d.seeds[b]
        n, m = num[rows][:, steps].sum(), den[rows][:, steps].sum()
        assert got[b] == pytest.approx(n / m) if m else np.isnan(got[b])


def test_runs_alike_give_a_zero_interval_and_a_constant_gain_its_own():
    rng = np.random.default_rng(0)
    ms = rng.gamma(4.0, 2.0, (1, 50))  # steps that differ from one another
    ones = np.ones_like(ms)
    d = draws(1, 50, seed=3)
    same = resampled(ms, ones, d) - resampled(ms, ones, d)
    assert interval(same) == (0.0, 0.0)
    faster = resampled(ms * 0.97, ones, d) / resampled(ms, ones, d) - 1
    lo, hi = interval(faster)
    assert lo == pytest.approx(-0.03) and hi == pytest.approx(-0.03)
    assert figure(ms * 0.97, ones) / figure(ms, ones) - 1 == pytest.approx(-0.03)


def test_a_deterministic_difference_that_varies_by_step_gets_a_real_interval():
    rng = np.random.default_rng(1)
    diff = rng.normal(-1.0, 2.0, (1, 200))  # no seed spread, only steps
    lo, hi = interval(resampled(diff, np.ones_like(diff), draws(1, 200, seed=0)))
    assert lo < -1.0 < hi and hi - lo > 0.2  # about +-1.96 x 2 / sqrt(200) wide
    assert hi < 0


def test_the_spread_across_seeds_widens_the_interval():
    rng = np.random.default_rng(2)
    steps = rng.normal(0.0, 0.1, 40)
    one = np.tile(steps, (3, 1))  # three seeds that agree
    spread = one + np.array([[-1.0], [0.0], [1.0]])  # three that differ by a constant each
    d = draws(3, 40, seed=5)
    agree, differ = (interval(resampled(x, np.ones_like(x), d)) for x in (one, spread))
    assert differ[1] - differ[0] > 5 * (agree[1] - agree[0])


def test_the_same_seed_gives_the_same_draws_and_blocks_grow_slowly():
    a, b, c = draws(3, 30, seed=7), draws(3, 30, seed=7), draws(3, 30, seed=8)
    assert np.array_equal(a.starts, b.starts) and np.array_equal(a.seeds, b.seeds)
    assert not np.array_equal(a.starts, c.starts)
    assert [block_steps(s) for s in (1, 8, 27, 1000)] == [1, 2, 3, 10]
    assert np.isnan(interval(np.array([np.nan]))).all()
