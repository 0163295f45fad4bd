"""Contract tests for eplbsim.traces.synth: every SCENARIOS entry, then scenario-specific properties.

Dimensions: `S` steps, `T` tokens per step, `L` layers, `E` experts, `K` top-k.
"""

import json

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces.synth import SCENARIOS, synthesize
from eplbsim.traces.trace import Trace, load_trace, save_trace

SIZES = dict(steps=6, tokens=40, layers=3, experts=32, top_k=4)


def _ids(trace: Trace) -> np.ndarray:
    return trace.topk_ids.numpy()


@pytest.fixture(params=sorted(SCENARIOS))
def name(request):
    return request.param


def test_shapes_and_ids(name):
    tr = synthesize(name, seed=1, **SIZES)
    S, T, L, E, K = (SIZES[k] for k in ("steps", "tokens", "layers", "experts", "top_k"))
    assert isinstance(tr, Trace)
    assert tuple(tr.topk_ids.shape) == (S * T, L, K)
    assert tr.num_steps == S and tr.num_experts == E and tr.src_rank is None
    assert tr.tokens_per_step.tolist() == [T] * S
    ids = _ids(tr)
    assert ids.min() >= 0 and ids.max() < E  # no padding, ids in range
    srt = np.sort(ids, axis=-1)
    assert (np.diff(srt, axis=-1) != 0).all(), "a token repeats an expert"
    assert int(tr.counts().sum()) == S * T * L * K


def test_direct_call_matches_synthesize(name):
    direct = SCENARIOS[name](seed=3, **SIZES)
    assert torch.equal(direct.topk_ids, synthesize(name, seed=3, **SIZES).topk_ids)


def test_deterministic(name):
    a = synthesize(name, seed=7, **SIZES)
    b = synthesize(name, seed=7, **SIZES)
    c = synthesize(name, seed=8, **SIZES)
    assert torch.equal(a.topk_ids, b.topk_ids) and a.meta == b.meta
    assert not torch.equal(a.topk_ids, c.topk_ids)


def test_meta_records_parameters(name):
    tr = synthesize(name, seed=5, **SIZES)
    meta = tr.meta
    assert meta["source"] == "synth" and meta["scenario"] == name
    params = meta["params"]
    assert {**SIZES, "seed": 5}.items() <= params.items()
    json.dumps(meta)  # JSON-serialisable
    again = synthesize(meta["scenario"], **params)  # the meta alone rebuilds the trace
    assert torch.equal(again.topk_ids, tr.topk_ids)


def test_roundtrip(name, tmp_path):
    tr = synthesize(name, seed=2, **SIZES)
    path = tmp_path / f"{name}.npz"
    save_trace(tr, path)
    back = load_trace(path)
    assert torch.equal(back.topk_ids, tr.topk_ids)
    assert torch.equal(back.step_offsets, tr.step_offsets)
    assert back.meta["params"] == tr.meta["params"] and back.meta["source"] == "synth"


@pytest.mark.parametrize("bad, msg", [
    (dict(steps=0), "steps"), (dict(tokens=0), "tokens"), (dict(layers=0), "layers"),
    (dict(experts=0), "experts"), (dict(top_k=0), "top_k"), (dict(top_k=33), "top_k"),
    (dict(steps=2.5), "steps"), (dict(tokens=True), "tokens"), (dict(seed=-1), "seed"),
])
def test_bad_sizes(name, bad, msg):
    with pytest.raises(InputError, match=msg):
        synthesize(name, **{**SIZES, **bad})


def test_unknown_scenario_lists_choices():
    with pytest.raises(InputError) as exc:
        synthesize("nope")
    for key in SCENARIOS:
        assert key in str(exc.value)


def test_unknown_option():
    with pytest.raises(InputError, match="sigmaa"):
        synthesize("skewed", sigmaa=2.0, **SIZES)
    with pytest.raises(InputError, match="noise"):
        synthesize("uniform", noise=0.1, **SIZES)


def test_callable_scenario():
    def mine(*, steps, tokens, layers, experts, top_k, seed):
        ids = np.zeros((steps * tokens, layers, top_k), dtype=np.int64) + np.arange(top_k)
        return Trace(ids, np.arange(steps + 1) * tokens, experts, meta={"source": "synth"})
    tr = synthesize(mine, **SIZES)
    assert tuple(tr.topk_ids.shape) == (SIZES["steps"] * SIZES["tokens"], 3, 4)
    with pytest.raises(InputError, match="top_k"):
        synthesize(mine, **{**SIZES, "top_k": 99})


def _max_over_mean(tr: Trace) -> float:
    load = tr.counts().sum(0).double()  # [L, E]
    return float((load.max(1).values / load.mean(1)).mean())


def test_skewed_is_skewed():
    kw = dict(steps=8, tokens=256, layers=4, experts=64, top_k=8, seed=0)
    skew, flat = _max_over_mean(synthesize("skewed", **kw)), _max_over_mean(synthesize("uniform", **kw))
    assert flat < 1.3
    assert skew > 2.0 * flat


def test_skewed_order_is_descending_popularity():
    """Slot 0 (the top score) lands on popular experts more often than slot K-1."""
    tr = synthesize("skewed", steps=4, tokens=256, layers=2, experts=64, top_k=8, seed=0,
                    drift=0.0)
    load = tr.counts().sum((0,)).double()  # [L, E]
    ids = tr.topk_ids.long()  # [S*T, L, K]
    pop = torch.gather(load.unsqueeze(0).expand(ids.shape[0], -1, -1), 2, ids)  # [S*T, L, K]
    assert pop[..., 0].mean() > pop[..., -1].mean()


def test_skewed_drift_changes_popularity():
    def shift(drift):
        tr = synthesize("skewed", steps=32, tokens=256, layers=2, experts=64, top_k=8, seed=0,
                        drift=drift)
        c = tr.counts().double()  # [S, L, E]
        early, late = c[:8].sum(0), c[-8:].sum(0)  # [L, E]
        return float(((early - late).abs().sum(1) / early.sum(1)).mean())  # total variation x2
    assert shift(0.1) > 2.0 * shift(0.0)
    assert shift(0.02) > shift(0.0)


@pytest.mark.parametrize("period, template_len", [(2, 8), (4, 8), (3, 6)])
def test_template_residue_classes(period, template_len):
    S, T, L, E, K = 4, 96, 3, 48, 4
    tr = synthesize("template", steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=0,
                    period=period, template_len=template_len)
    ids = tr.topk_ids.long().view(S, T, L, K)
    res = (torch.arange(T) % period).view(1, T, 1, 1).expand_as(ids)  # row % period
    for layer in range(L):
        cnt = torch.zeros(period, E, dtype=torch.int64)  # [period, E] pairs per (residue, expert)
        cnt.index_put_((res[:, :, layer].reshape(-1), ids[:, :, layer].reshape(-1)),
                       torch.ones(S * T * K, dtype=torch.int64), accumulate=True)
        assert ((cnt > 0).sum(0) <= 1).all(), "an expert appears on two residue classes"
        assert ((cnt > 0).sum(0) == 1).sum() > E // 2  # most experts are used at all


def test_template_noise_mixes_classes():
    kw = dict(steps=4, tokens=96, layers=2, experts=32, top_k=4, seed=0)
    clean, noisy = synthesize("template", **kw), synthesize("template", noise=0.3, **kw)
    rows = torch.arange(kw["steps"] * kw["tokens"]) % kw["tokens"] % 2  # [S*T] row parity

    def mixed(tr):
        ids = tr.topk_ids.long()[:, 0]  # layer 0, [S*T, K]
        seen = torch.zeros(2, 32, dtype=torch.bool)
        seen[rows.view(-1, 1).expand_as(ids), ids] = True
        return int(seen.all(0).sum())  # experts seen on both parities
    assert mixed(clean) == 0 and mixed(noisy) > 0


@pytest.mark.parametrize("opts, msg", [
    (dict(period=4, experts=12, top_k=4), "classes"),
    (dict(template_len=6, period=4), "multiple"),
    (dict(noise=1.5), "noise"),
    (dict(period=0), "period"),
])
def test_template_bad_options(opts, msg):
    with pytest.raises(InputError, match=msg):
        synthesize("template", **{**SIZES, **opts})


@pytest.mark.parametrize("kind", ["distinct", "ties", "minus_inf", "nan"])
def test_compiled_top_k_is_numpys(kind):
    """`_topk_desc` (compiled, numpy's for rows with ties) equals numpy's argpartition and
    stable argsort bit for bit, whatever the rows hold: the traces stay what they were."""
    from eplbsim.traces.synth import _topk_desc, _topk_numpy
    rng = np.random.default_rng(3)
    for _ in range(40):
        E = int(rng.integers(2, 60))
        k = int(rng.integers(1, E + 1))
        x = rng.random((int(rng.integers(1, 30)), 2, E))  # [R, 2, E]
        if kind == "ties":
            x = rng.integers(0, 4, x.shape).astype(np.float32)
        elif kind == "minus_inf":
            x[x < 0.4] = -np.inf
        elif kind == "nan":
            x[x < 0.05] = np.nan
        got = _topk_desc(x, k)
        assert got.shape == x.shape[:-1] + (k,) and got.dtype == np.int64
        assert np.array_equal(got, _topk_numpy(x, k)), (E, k)


# ----------------------------------------------------------------------------- drift, burst, phases

def _layer_corr(x: np.ndarray, y: np.ndarray) -> float:
    """Mean over layers of the Pearson correlation of two `[L, E]` load matrices."""
    return float(np.mean([np.corrcoef(x[l], y[l])[0, 1] for l in range(x.shape[0])]))


def test_drift_rotates_popularity():
    """Loads at step period/2 anti-correlate with step 0 (log w flips sign), consecutive steps
    stay close, and the pattern repeats after a full period."""
    tr = synthesize("drift", steps=17, tokens=256, layers=2, experts=32, top_k=4, seed=0,
                    sigma=1.5, period=16)
    c = tr.counts().double().numpy()  # [S, L, E]
    consecutive = [_layer_corr(c[s], c[s + 1]) for s in range(16)]
    assert min(consecutive) > 0.6 and np.mean(consecutive) > 0.8
    assert _layer_corr(c[0], c[8]) < -0.2  # half a period: hot and cold experts swap
    assert _layer_corr(c[0], c[16]) > 0.9  # a full period: back where it started
    # With a very long period nothing moves within the trace: the same check comes out high.
    still = synthesize("drift", steps=9, tokens=256, layers=2, experts=32, top_k=4, seed=0,
                       sigma=1.5, period=1e6).counts().double().numpy()
    assert _layer_corr(still[0], still[8]) > 0.8


def test_drift_float_period_rebuilds():
    tr = synthesize("drift", seed=4, period=12.5, **SIZES)
    assert tr.meta["params"]["period"] == 12.5 and tr.meta["params"]["sigma"] == 1.0
    assert torch.equal(synthesize("drift", **tr.meta["params"]).topk_ids, tr.topk_ids)


@pytest.mark.parametrize("share", [0.2, 0.5, 0.8])
def test_burst_hot_expert_share(share):
    S, T, L, E, K = 10, 400, 2, 32, 4
    tr = synthesize("burst", steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=0,
                    share=share)
    params, hot = tr.meta["params"], np.array(tr.meta["hot_experts"])  # hot: [L]
    assert params["start"] == (2 * S) // 5 and params["length"] == max(1, S // 4)
    assert hot.shape == (L,) and ((0 <= hot) & (hot < E)).all()
    ids = _ids(tr).reshape(S, T, L, K)
    first = ids[..., 0] == hot  # [S, T, L] the hot expert is the token's first pick
    inside = np.zeros(S, dtype=bool)
    inside[params["start"]:params["start"] + params["length"]] = True
    assert abs(first[inside].mean() - share) < 0.05
    assert first[~inside].mean() < 0.03  # cold before and after the burst
    assert (ids == hot[:, None]).any(-1)[~inside].mean() < 0.05  # rarely picked at all


def test_burst_clipped_at_end_and_rebuilds():
    S = 6
    tr = synthesize("burst", seed=1, start=S - 1, length=100, share=0.9, **SIZES)
    hot = np.array(tr.meta["hot_experts"])
    first = (_ids(tr).reshape(S, SIZES["tokens"], SIZES["layers"], -1)[..., 0] == hot)  # [S, T, L]
    assert first[-1].mean() > 0.75 and first[:-1].mean() < 0.1
    again = synthesize("burst", **tr.meta["params"])
    assert torch.equal(again.topk_ids, tr.topk_ids) and again.meta == tr.meta


def test_phases_ragged_contract(tmp_path):
    """Ragged steps keep the generic contract: sizes, distinct ids, conserved load, rebuild."""
    kw = dict(SIZES, phase_len=2)  # steps 6, tokens 40 -> decode_tokens 40 // 16 = 2
    tr = synthesize("phases", seed=3, **kw)
    sizes = tr.tokens_per_step.tolist()
    assert sizes == [40, 40, 2, 2, 40, 40] and tr.meta["params"]["decode_tokens"] == 2
    assert tuple(tr.topk_ids.shape) == (sum(sizes), SIZES["layers"], SIZES["top_k"])
    ids = _ids(tr)
    assert ids.min() >= 0 and ids.max() < SIZES["experts"]
    assert (np.diff(np.sort(ids, axis=-1), axis=-1) != 0).all()
    assert int(tr.counts().sum()) == sum(sizes) * SIZES["layers"] * SIZES["top_k"]
    again = synthesize("phases", **tr.meta["params"])
    assert torch.equal(again.topk_ids, tr.topk_ids)
    assert torch.equal(again.step_offsets, tr.step_offsets)
    assert not torch.equal(synthesize("phases", seed=4, **kw).topk_ids, tr.topk_ids)
    save_trace(tr, tmp_path / "phases.npz")
    assert torch.equal(load_trace(tmp_path / "phases.npz").step_offsets, tr.step_offsets)


@pytest.mark.parametrize("phase_len", [1, 3])
def test_phases_step_sizes_alternate(phase_len):
    S = 10
    tr = synthesize("phases", steps=S, tokens=64, layers=1, experts=16, top_k=2, seed=0,
                    phase_len=phase_len, decode_tokens=5)
    expected = [64 if (s // phase_len) % 2 == 0 else 5 for s in range(S)]
    assert tr.tokens_per_step.tolist() == expected


@pytest.mark.parametrize("rho", [0.5, 1.0])
def test_phases_route_differently(rho):
    """Prefill and decode loads correlate less than prefill with prefill, unless rho = 1."""
    S = 16
    tr = synthesize("phases", steps=S, tokens=256, layers=2, experts=32, top_k=4, seed=0,
                    sigma=1.5, phase_len=2, decode_tokens=64, rho=rho)
    c = tr.counts().double().numpy()  # [S, L, E]
    pre = np.flatnonzero((np.arange(S) // 2) % 2 == 0)  # prefill steps
    dec = np.flatnonzero((np.arange(S) // 2) % 2 == 1)  # decode steps
    early, late, decode = c[pre[:4]].sum(0), c[pre[4:]].sum(0), c[dec].sum(0)  # [L, E]
    same, cross = _layer_corr(early, late), _layer_corr(early, decode)
    assert same > 0.9
    if rho < 1.0:
        assert cross < same - 0.3
    else:
        assert cross > same - 0.05


@pytest.mark.parametrize("scenario, opts, msg", [
    ("drift", dict(period=0.5), "period"),
    ("drift", dict(period="long"), "period"),
    ("drift", dict(period=float("inf")), "period"),
    ("drift", dict(sigma=-1.0), "sigma"),
    ("burst", dict(share=1.0), "share"),
    ("burst", dict(share=-0.1), "share"),
    ("burst", dict(start=6), "start"),  # steps = 6
    ("burst", dict(start=-1), "start"),
    ("burst", dict(start=1.5), "start"),
    ("burst", dict(length=0), "length"),
    ("phases", dict(phase_len=0), "phase_len"),
    ("phases", dict(decode_tokens=0), "decode_tokens"),
    ("phases", dict(decode_tokens=2.0), "decode_tokens"),
    ("phases", dict(rho=1.5), "rho"),
    ("phases", dict(rho=-1.01), "rho"),
])
def test_new_scenarios_bad_options(scenario, opts, msg):
    with pytest.raises(InputError, match=msg):
        synthesize(scenario, **{**SIZES, **opts})


def test_a_scenario_without_hash_layers_says_none_whatever_the_model_priced():
    """A scenario routes every layer by its own draws unless `hash_layers` says otherwise: a
    model priced with hash-routed layers (DeepSeek-V4-Flash: 3) does not relabel them."""
    from eplbsim.replay import replay
    from eplbsim.runspec import RunSpec
    from eplbsim.traces.layer_kinds import hash_layers
    trace = synthesize("skewed", seed=0, steps=2, tokens=32, layers=4, experts=16, top_k=2)
    assert trace.meta["hash_layers"] == [] and hash_layers(trace.meta, 4, 3) == ()
    metrics = replay(trace, RunSpec.of(model="deepseek-v4-flash", gpus=4, redundant=0,
                                       policy="ordinal")).metrics
    assert metrics["gpu_imbalance_hash"] is None
    hashed = synthesize("skewed", seed=0, steps=2, tokens=32, layers=4, experts=16, top_k=2,
                        hash_layers=2, vocab=64)
    assert hash_layers(hashed.meta, 4, 3) == (0, 1)
