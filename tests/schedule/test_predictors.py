"""Load predictors: the registry's contract, each predictor's formula, and agreement on a
stationary trace.

Dimensions: `S` steps, `L` layers, `E` experts.
"""


import pytest
import torch

from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.schedule.predictors import PREDICTORS
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


# `decay`: TensorRT-LLM's online load statistic (eplbsim.schedule.predictors.decay)

@pytest.mark.parametrize("factor", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("window", [1, 4, 9, 20])
def test_decay_is_the_engine_counter_since_its_last_clearing(factor, window):
    """`h <- h * factor + counts` each step, from 0 at the first of the last `window` steps
    (TensorRT-LLM clears it at each update; every step when there are fewer)."""
    loads = _loads()
    past = loads[:9]
    h = torch.zeros(3, 5, dtype=torch.float64)
    for step in past[max(0, 9 - window):]:
        h = h * factor + step.double()
    got = PREDICTORS["decay"](past, loads[9:], window, factor)
    assert torch.allclose(got, h, rtol=1e-12, atol=0)
    assert torch.equal(got, PREDICTORS["decay"](past, torch.zeros_like(loads[9:]), window, factor))
    if window >= 9:  # the whole history: ema's sum
        assert torch.equal(got, PREDICTORS["ema"](past, loads[9:], window, factor))


def _factors_seen(monkeypatch, loads, **schedule):
    """The factors `decay` and `ema` sum with in a plan of `schedule` (every 5 steps)."""
    import eplbsim.schedule.predictors as predictors
    from eplbsim.schedule.plan import plan
    from eplbsim.placement.topology import Topology
    seen = []
    real = predictors._decayed_sum

    def spy(steps, factor):
        seen.append(factor)
        return real(steps, factor)

    monkeypatch.setattr(predictors, "_decayed_sum", spy)
    spec = RunSpec.of(gpus=2, redundant=2, rebalance_every=5, **schedule)
    plan(loads, spec.schedule, spec.solver, Topology(2), loads.shape[2] + 2, 1)
    return set(seen)


def test_decay_defaults_to_trtllm_factor_and_takes_a_given_one(monkeypatch):
    from eplbsim.schedule.predictors import DEFAULT_DECAY, TRTLLM_DECAY
    assert TRTLLM_DECAY == 0.95 and DEFAULT_DECAY[PREDICTORS["decay"]] == 0.95
    loads = _loads(S=16, E=6)
    assert _factors_seen(monkeypatch, loads, predictor="decay") == {0.95}
    assert _factors_seen(monkeypatch, loads, predictor=PREDICTORS["decay"]) == {0.95}
    assert _factors_seen(monkeypatch, loads, predictor="decay", decay=0.5) == {0.5}
    assert _factors_seen(monkeypatch, loads, predictor="decay", decay=0.0) == {0.0}
    # ema keeps the plan's default, 1 - 1/W (W = 5 here)
    assert _factors_seen(monkeypatch, loads, predictor="ema") == {0.8}
    assert _factors_seen(monkeypatch, loads, predictor="ema", decay=0.95) == {0.95}


def test_hashed_is_exact_on_hash_layers_and_window_on_the_others():
    loads = _loads()
    past, future = loads[:8], loads[8:9]
    out = PREDICTORS["hashed"](past, future, 4, 0.5, hash_layers=(0, 2))
    assert torch.equal(out[[0, 2]], future[0, [0, 2]].to(torch.float64))  # the step's own
    assert torch.equal(out[1], PREDICTORS["window"](past, future, 4, 0.5)[1])
    assert torch.equal(PREDICTORS["hashed"](past, future, 4, 0.5),
                       PREDICTORS["window"](past, future, 4, 0.5))  # no hash layer: window


def test_on_a_v4_shaped_trace_the_hashed_forecast_is_each_steps_true_load():
    """Rebalanced every step from a window of 4: on the hash layers the forecast is the step's
    own load (its token ids through the table), so each hash layer's placement is the one the
    solver makes for the truth, and their imbalance is at or below the window predictor's;
    the learned layers are the window's either way."""
    trace = synthesize("skewed", steps=16, tokens=256, layers=5, experts=32, top_k=4, seed=3,
                       hash_layers=3, vocab=4096)
    load = trace.counts().to(torch.int64)
    seen = []

    def spy(past, future, window, decay, hash_layers=()):
        out = PREDICTORS["hashed"](past, future, window, decay, hash_layers)
        seen.append((past.shape[0], out[list(hash_layers)], hash_layers))
        return out
    spec = RunSpec.of(gpus=8, redundant=8, rebalance_every=1, window=4, predictor=spy)
    replay(trace, spec)
    assert [s for s, _, _ in seen] == list(range(4, 16))
    for step, forecast, layers in seen:
        assert layers == (0, 1, 2)
        assert torch.equal(forecast, load[step, :3].to(torch.float64))
    runs = {p: replay(trace, spec.replace(predictor=p)).metrics for p in ("window", "hashed")}
    assert runs["hashed"]["gpu_imbalance_hash"] <= runs["window"]["gpu_imbalance_hash"]
    assert runs["hashed"]["placement_imbalance_hash"] < runs["window"]["placement_imbalance_hash"]
    assert runs["hashed"]["gpu_imbalance_learned"] == runs["window"]["gpu_imbalance_learned"]
    plain = replay(synthesize("skewed", steps=4, tokens=32, layers=2, experts=8, top_k=2),
                   RunSpec.of(gpus=2)).metrics
    assert plain["gpu_imbalance_hash"] is None and plain["placement_imbalance_learned"] is None
