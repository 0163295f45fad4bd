"""Load predictors: the registry's contract, each predictor's formula, and agreement on a
stationary trace.

Dimensions: `S` steps, `L` layers, `E` experts.
"""


import pytest
import torch

from eplbsim.schedule.predictors import PREDICTORS
from eplbsim.replay import replay
from eplbsim.spec import RunSpec
from eplbsim.traces.synth import synthesize


def _loads(S=12, L=3, E=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (S, L, E), generator=g)  # [S, L, E]


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_contract(name):
    loads = _loads()
    past, future = loads[:8], loads[8:]
    kept = loads.clone()
    out = PREDICTORS[name](past, future, 4, 0.5)
    assert out.shape == (3, 5) and out.dtype == torch.float64
    assert (out >= 0).all() and torch.isfinite(out).all()
    assert torch.equal(loads, kept)  # inputs untouched


@pytest.mark.parametrize("name", ["window", "ema"])
def test_history_predictors_never_read_the_future(name):
    loads = _loads()
    past = loads[:8]
    a = PREDICTORS[name](past, loads[8:], 4, 0.5)
    b = PREDICTORS[name](past, torch.zeros_like(loads[8:]), 4, 0.5)
    assert torch.equal(a, b)


def test_window_sums_the_last_w_steps_or_all_there_are():
    loads = _loads()
    assert torch.equal(PREDICTORS["window"](loads[:8], loads[8:], 3, 1.0),
                       loads[5:8].sum(0).double())
    assert torch.equal(PREDICTORS["window"](loads[:2], loads[2:], 5, 1.0),
                       loads[:2].sum(0).double())


@pytest.mark.parametrize("decay", [0.0, 0.3, 0.9, 1.0])
def test_ema_is_the_running_decayed_counter(decay):
    loads = _loads()
    h = torch.zeros(3, 5, dtype=torch.float64)
    for step in loads[:9]:
        h = decay * h + step.double()
    got = PREDICTORS["ema"](loads[:9], loads[9:], 4, decay)
    assert torch.allclose(got, h, rtol=1e-12, atol=0)


def test_oracle_sums_the_steps_about_to_run():
    loads = _loads()
    assert torch.equal(PREDICTORS["oracle"](loads[:6], loads[6:10], 4, 0.5),
                       loads[6:10].sum(0).double())


def test_predictors_agree_on_a_stationary_trace():
    """No drift: every predictor's forecast is the same distribution up to sampling noise, so
    the imbalance the GPUs suffer after the first rebalance agrees within a few percent."""
    trace = synthesize("skewed", steps=60, tokens=512, layers=2, experts=32, top_k=4, seed=3,
                       drift=0.0)
    cfg = RunSpec.of(policy="ordinal", mode="a2a", gpus=4, redundant=8,
                       rebalance_every=10)
    imbalance = {}
    for name in sorted(PREDICTORS):
        series = replay(trace, cfg.replace(predictor=name)).time_series()
        imbalance[name] = float(series["gpu_imbalance"][10:].mean())
    trivial = float(series["gpu_imbalance"][:10].mean())
    assert max(imbalance.values()) / min(imbalance.values()) < 1.03, imbalance
    assert trivial > 1.2 * max(imbalance.values())  # rebalancing does something here
