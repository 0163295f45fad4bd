"""Metrics over time (`metrics.components`, `metrics.time_series`): the decomposition multiplies back to the executed imbalance and each factor
is exactly 1 where it must be; time-series columns agree with the summary; the burst scenario's
staleness spike shows for `window` and not for `oracle`.

Dimensions: `S` steps, `L` layers, `E` experts, `P` slots, `G` GPUs.
"""


import numpy as np
import pytest
import torch

from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace

CFG = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8, rebalance_every=6)


def factors(res):
    """The three factors of the executed imbalance per (step, layer), `[S, L]` each."""
    return {k: res.components[f"factor_{k}"][0] for k in ("solver", "prediction", "dispatch")}


@pytest.fixture(scope="module")
def burst():
    return synthesize("burst", steps=24, tokens=96, layers=2, experts=16, top_k=4, seed=2,
                      start=9, length=8)


@pytest.mark.parametrize("predictor", ["window", "oracle"])
@pytest.mark.parametrize("mode", ["none", "a2a"])
@pytest.mark.parametrize("policy", ["static", "random", "row", "ordinal"])
def test_factors_multiply_back_to_the_executed_imbalance(burst, policy, mode, predictor):
    res = replay(burst, CFG.replace(policy=policy, mode=mode, predictor=predictor))
    f = factors(res)
    product = f["solver"] * f["prediction"] * f["dispatch"]  # [S, L]
    executed = res.components["gpu_imbalance"][0]
    assert not executed.isnan().any()
    assert torch.allclose(product, executed, rtol=1e-6, atol=0)
    assert res.metrics["factor_solver"] >= 1.0


def test_oracle_prediction_factor_is_exactly_one_after_the_first_solve(burst):
    res = replay(burst, CFG.replace(predictor="oracle"))
    prediction = factors(res)["prediction"]
    assert (prediction[6:] == 1.0).all()
    assert (prediction[:6] > 1.0).any()  # the trivial start is no prediction at all
    window = factors(replay(burst, CFG.replace(predictor="window")))["prediction"]
    assert (window[6:] != 1.0).any()


def _even_trace(counts_of_zero):
    """E = 3, K = 1: step s routes expert 0 `counts_of_zero[s]` times, then 1 and 2 twice."""
    steps = [torch.tensor([0] * c + [1, 2, 1, 2]).view(-1, 1, 1) for c in counts_of_zero]
    return Trace.from_steps(steps, num_experts=3)


def test_dispatch_factor_is_exactly_one_for_an_even_split():
    # expert 0 has replicas on slots 0 (GPU 0) and 2 (GPU 1); in "none" mode ordinal splits an
    # even count of its pairs exactly in half, so executed GPU loads equal the promise
    placement = Placement([[0, 1, 0, 2]], 3, Topology(2))
    cfg = RunSpec.of(policy="ordinal", mode="none", gpus=2, redundant=1,
                       placement=placement)
    even = replay(_even_trace([2, 4, 6, 8]), cfg)
    assert (even.components["factor_dispatch"][0] == 1.0).all()
    odd = replay(_even_trace([3, 5, 7, 9]), cfg)  # one pair left over every step
    assert (odd.components["factor_dispatch"][0] != 1.0).all()
    # a given placement was not solved: no solver or prediction to factor out
    assert even.components["factor_solver"] is None
    assert even.metrics["factor_prediction"] is None


def test_time_series_columns_match_the_summary(burst):
    res = replay(burst, CFG.replace(policy="row", mode="none"))
    S, L = 24, 2
    per_step = res.time_series()
    per_layer = res.time_series(per_layer=True)
    assert {len(v) for v in per_step.values()} == {S}
    assert {len(v) for v in per_layer.values()} == {S * L}
    assert per_layer["step"].tolist() == [s for s in range(S) for _ in range(L)]
    assert per_layer["layer"].tolist() == [layer for _ in range(S) for layer in range(L)]
    m = res.metrics
    assert np.nanmean(per_layer["gpu_imbalance"]) == pytest.approx(m["gpu_imbalance"])
    assert np.nanmean(per_step["gpu_imbalance"]) == pytest.approx(m["gpu_imbalance"])
    assert np.nanmax(per_step["replica_skew_max"]) == pytest.approx(m["replica_skew_max"])
    assert per_step["pairs"].sum() == int(res.true_load.sum())
    assert per_step["moved_slots"].sum() == m["moved_slots"] > 0
    assert np.flatnonzero(per_step["moved_slots"]).tolist() == [
        r["step"] for r in res.migrations() if r["moved_slots"]]
    assert (per_step["rank_agreement"] == 1.0).all()
    mult = per_step["multiplicity_0"] + per_step["multiplicity_1"] + per_step["multiplicity_2+"]
    assert np.allclose(mult, 1.0)
    a2a = replay(burst, CFG.replace(policy="row", mode="a2a")).time_series()
    assert np.isnan(a2a["rank_agreement"]).all() and np.isnan(a2a["output_rel_error"]).all()


def test_migration_rows_price_every_copy(burst):
    res = replay(burst, CFG.replace(expert_bytes=1000))
    rows = res.migrations()
    assert [r["step"] for r in rows] == [6, 12, 18]
    scale = res.spec.cost.profiles()[0].moe_layers / burst.num_layers  # the whole model's bytes
    for r in rows:
        assert r["same_gpu"] + r["same_node"] + r["cross_node"] == r["moved_slots"]
        assert r["bytes"] == round(1000 * r["moved_slots"] * scale)
        assert r["cross_node_bytes"] == round(1000 * r["cross_node"] * scale)
    assert res.metrics["moved_bytes"] == round(1000 * res.metrics["moved_slots"] * scale)


def test_burst_spikes_the_window_predictor_until_the_next_rebalance():
    """The burst starts right after a rebalance: `window` solved for the cold expert's old load
    and suffers until the next rebalance sees the burst; `oracle` saw it coming."""
    trace = synthesize("burst", steps=60, tokens=256, layers=1, experts=32, top_k=4, seed=0,
                       start=20, length=40)
    cfg = RunSpec.of(policy="ordinal", mode="a2a", gpus=4, redundant=8,
                       rebalance_every=10)
    mean = {}
    for predictor in ("window", "oracle"):
        imb = replay(trace, cfg.replace(predictor=predictor)).time_series()["gpu_imbalance"]
        mean[predictor] = [float(imb[a:a + 10].mean()) for a in range(0, 60, 10)]
    before, during, after = mean["window"][1], mean["window"][2], mean["window"][3]
    assert during > 1.25 * before, mean  # the spike, steps 20..29
    assert after < 1.1 * before, mean  # recovered after the rebalance at step 30
    assert max(mean["oracle"][2:]) < 1.1 * mean["oracle"][1], mean  # no spike
