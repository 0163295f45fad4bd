"""Tests of eplbsim.metrics on hand-computed examples (DESIGN.md §4).

Dimensions: `S` steps, `L` layers, `E` experts, `P` slots, `G` GPUs, `R` max replicas.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplbsim.metrics import (
    METRICS,
    PER_LAYER,
    PER_STEP,
    WHOLE,
    balancedness,
    gini,
    gpu_imbalance,
    gpu_loads,
    idle_replicas,
    mean,
    multiplicity_counts,
    nanmax_or_none,
    nanmean_or_none,
    overhead,
    peak,
    ratio,
    replica_loads,
    replica_skew,
    replica_stats,
    root_ratio,
    shares,
    step_time,
    throughput,
    top_share,
    total,
)
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize

NAN = math.nan


def _same(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64),
                               equal_nan=True)


def test_metric_keys_cover_the_design_and_every_replay_reports_exactly_them():
    design = ["gpu_imbalance", "balancedness", "replica_skew_mean", "replica_skew_max",
              "replica_skew_cumulative", "idle_replica_frac", "placement_imbalance",
              "placement_gap", "rank_agreement", "multiplicity", "output_rel_error"]  # §4
    assert [k for k in METRICS if k in design] == design  # in the design's order
    trace = synthesize("uniform", steps=2, tokens=16, layers=1, experts=8, top_k=2)
    for mode in ("none", "a2a"):
        metrics = replay(trace, RunSpec.of(gpus=2, redundant=2, mode=mode)).metrics
        assert list(metrics) == list(METRICS)


@pytest.mark.parametrize("key", sorted(METRICS))
def test_every_metric_declares_a_way_to_its_value_and_its_columns(key):
    metric = METRICS[key]
    assert (metric.parts is None) != (metric.whole is None), "components or a whole-run value"
    headers = metric.header if metric.subkeys else (metric.header,)
    assert len(headers) == len(metric.subkeys or (1,)) and all(headers)
    assert [h for h, _, _ in metric.columns(key)] == list(headers)
    assert metric.flat_keys(key)[0].startswith(key)
    assert metric.tables <= {"main", "decomposition", "time"}
    assert metric.needs in (None, "executed", "counters", "cost", "solved", "spill")
    assert metric.fmt in ("ratio", "time", "count", "percent")


def test_time_reductions_sum_layers_into_steps():
    t = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.5, 0.5]])  # [S, L] seconds of each layer
    _same(step_time(t, dims=WHOLE), 3.0)  # steps of 4, 4 and 1
    _same(step_time(t, dims=PER_STEP), [4.0, 4.0, 1.0])
    _same(step_time(t, dims=PER_LAYER), t.tolist())
    tokens = torch.tensor([[8, 8], [4, 4], [2, 2]])  # each step's tokens on every layer
    _same(throughput(tokens, t, dims=WHOLE), 14 / 9.0)
    _same(throughput(tokens, t, dims=PER_STEP), [2.0, 1.0, 2.0])
    _same(throughput(tokens, t, dims=PER_LAYER), [[8.0, 8 / 3], [2.0, 2.0], [4.0, 4.0]])
    _same(overhead(t, t / 2, dims=WHOLE), 1.0)
    _same(overhead(t, t, dims=PER_STEP), [0.0, 0.0, 0.0])


def test_reductions_over_the_run_per_step_and_per_layer():
    x = torch.tensor([[1.0, NAN, 3.0], [NAN, NAN, NAN]], dtype=torch.float64)  # [S, L]
    _same(mean(x, dims=WHOLE), 2.0)
    _same(mean(x, dims=PER_STEP), [2.0, NAN])
    _same(mean(x, dims=PER_LAYER), [[1.0, NAN, 3.0], [NAN, NAN, NAN]])
    _same(peak(x, dims=WHOLE), 3.0)
    _same(peak(x, dims=PER_STEP), [3.0, NAN])
    counts = torch.tensor([[1, 2, 0], [0, 0, 0]])
    assert total(counts, dims=WHOLE).item() == 3 and total(counts, dims=WHOLE).dtype == torch.int64
    num, den = torch.tensor([[1, 0], [3, 0]]), torch.tensor([[2, 0], [2, 0]])
    _same(ratio(num, den, dims=WHOLE), 1.0)  # pooled: (1 + 3) / (2 + 2)
    _same(ratio(num, den, dims=PER_STEP), [0.5, 1.5])
    _same(ratio(num, den, dims=PER_LAYER), [[0.5, NAN], [1.5, NAN]])
    _same(root_ratio(num, den, dims=WHOLE), 1.0)


def test_shares_are_each_count_over_their_sum():
    c0, c1, c2 = (torch.tensor([[v]]) for v in (1, 2, 1))
    _same(shares(c0, c1, c2, dims=WHOLE), [0.25, 0.5, 0.25])
    zero = torch.zeros(1, 1, dtype=torch.int64)
    _same(shares(zero, zero, zero, dims=WHOLE), [NAN, NAN, NAN])
    _same(shares(zero, c1, zero, dims=PER_STEP), [[0.0, 1.0, 0.0]])


# ---------------------------------------------------------------- GPU loads and balance


def test_gpu_loads_hand_example():
    slot = torch.tensor([1, 2, 3, 4, 5, 6])
    out = gpu_loads(slot, 3)
    assert out.dtype == torch.float64
    _same(out, [3, 7, 11])
    _same(gpu_loads(slot, 2), [6, 15])
    _same(gpu_loads(slot, 1), [21])
    _same(gpu_loads(slot, 6), [1, 2, 3, 4, 5, 6])


def test_gpu_loads_leading_axes():
    slot = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # [S, L, P]
    out = gpu_loads(slot, 2)
    assert out.shape == (2, 3, 2)
    _same(out, slot.reshape(2, 3, 2, 2).sum(-1).double().tolist())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_gpu_loads_conserve_total(G, per_gpu, seed):
    slot = torch.from_numpy(np.random.default_rng(seed).integers(0, 100, size=(3, G * per_gpu)))
    out = gpu_loads(slot, G)
    torch.testing.assert_close(out.sum(-1), slot.sum(-1).double())
    for g in range(G):
        torch.testing.assert_close(out[:, g], slot[:, g * per_gpu:(g + 1) * per_gpu].sum(-1).double())


def test_gpu_imbalance_and_balancedness():
    load = torch.tensor([[2.0, 4.0, 6.0], [5.0, 5.0, 5.0], [0.0, 0.0, 0.0], [0.0, 0.0, 9.0]],
                        dtype=torch.float64)
    _same(gpu_imbalance(load), [1.5, 1.0, NAN, 3.0])
    _same(balancedness(load), [4 / 6, 1.0, NAN, 1 / 3])


def test_max_over_mean():
    from eplbsim.metrics import max_over_mean
    _same(max_over_mean(torch.tensor([[1.0, 3.0], [0.0, 0.0]], dtype=torch.float64)), [1.5, NAN])


def test_imbalance_zero_load_is_nan_without_warning_values():
    out = gpu_imbalance(torch.zeros(2, 3, 4, dtype=torch.float64))
    assert out.shape == (2, 3) and out.isnan().all()
    assert balancedness(torch.zeros(4, dtype=torch.float64)).isnan()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8))
def test_balancedness_is_inverse_of_imbalance(values):
    load = torch.tensor(values, dtype=torch.float64)
    imb, bal = gpu_imbalance(load), balancedness(load)
    if sum(values) == 0:
        assert imb.isnan() and bal.isnan()
    else:
        assert float(imb) >= 1.0 - 1e-12 and 0 < float(bal) <= 1.0 + 1e-12
        assert math.isclose(float(imb) * float(bal), 1.0, rel_tol=1e-12)
        assert math.isclose(float(imb), max(values) / (sum(values) / len(values)), rel_tol=1e-12)


# ---------------------------------------------------------------- replica loads and skew

# L = 1, E = 3, P = 6 on 2 GPUs: e0 on slots 0, 1, 2; e1 on 3, 4; e2 on 5.
PL = Placement([[0, 0, 0, 1, 1, 2]], 3, Topology(2))


def test_replica_loads_hand_example():
    slot = torch.tensor([[3, 0, 0, 2, 2, 7]])  # [L, P]
    _same(replica_loads(slot, PL), [[[3, 0, 0], [2, 2, NAN], [7, NAN, NAN]]])


def test_replica_loads_follow_log2phy_not_slot_order():
    pl = Placement([[2, 0, 1, 0]], 3, Topology(2))  # e0 on 1, 3; e1 on 2; e2 on 0
    slot = torch.tensor([[10, 20, 30, 40]])
    _same(replica_loads(slot, pl), [[[20, 40], [30, NAN], [10, NAN]]])


def test_replica_stats_hand_example():
    slot = torch.tensor([[3, 0, 0, 2, 2, 7]])  # [L, P]
    stats = replica_stats(slot, PL)
    _same(stats.peak, [[3, 2, 7]])
    _same(stats.total, [[3, 4, 7]])
    assert stats.idle.tolist() == [[2, 0, 0]]


def test_replica_stats_follow_phy2log_not_slot_order():
    pl = Placement([[2, 0, 1, 0]], 3, Topology(2))  # e0 on 1, 3; e1 on 2; e2 on 0
    stats = replica_stats(torch.tensor([[[10, 20, 0, 40]], [[0, 0, 0, 0]]]), pl)  # [S, L, P]
    _same(stats.peak, [[[40, 0, 10]], [[0, 0, 0]]])
    _same(stats.total, [[[60, 0, 10]], [[0, 0, 0]]])
    assert stats.idle.tolist() == [[[0, 1, 0]], [[2, 1, 1]]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_replica_metrics_equal_their_per_replica_definitions(S, E, seed):
    """Against the definitions written replica by replica: every expert's replicas are its
    slots; skew = max / mean of their loads; idle counts the eligible replicas at 0."""
    g = torch.Generator().manual_seed(seed)
    L, G = 2, 2
    P = G * (E + int(torch.randint(0, 3, (), generator=g)))
    phy2log = torch.cat([torch.arange(E).repeat(L, 1),
                         torch.randint(0, E, (L, P - E), generator=g)], 1)
    pl = Placement(phy2log, E, Topology(G))
    slot = torch.randint(0, 4, (S, L, P), generator=g) * torch.randint(0, 2, (S, L, P),
                                                                        generator=g)
    true = torch.randint(0, 6, (S, L, E), generator=g)
    skew = replica_skew(slot, pl)
    idle, eligible = idle_replicas(slot, true, pl)
    for s in range(S):
        want_idle = want_eligible = 0
        for layer in range(L):
            for e in range(E):
                loads = slot[s, layer][phy2log[layer] == e].double()
                n = loads.numel()
                if n >= 2 and loads.sum() > 0:
                    assert skew[s, layer, e] == loads.max() / loads.mean()
                else:
                    assert skew[s, layer, e].isnan()
                if n >= 2 and true[s, layer, e] >= n:
                    want_idle += int((loads == 0).sum())
                    want_eligible += n
        assert (int(idle[s].sum()), int(eligible[s].sum())) == (want_idle, want_eligible)


def test_replica_skew_hand_example():
    slot = torch.tensor([
        [[3, 0, 0, 2, 2, 7]],   # e0: max 3 / mean 1 = 3; e1: 2/2 = 1; e2 single -> NaN
        [[1, 1, 4, 0, 0, 5]],   # e0: 4 / 2 = 2; e1 zero load -> NaN; e2 single -> NaN
        [[0, 0, 0, 0, 6, 0]],   # e0 zero load -> NaN; e1: 6 / 3 = 2
    ])  # [S, L, P]
    out = replica_skew(slot, PL)
    assert out.shape == (3, 1, 3)
    _same(out, [[[3.0, 1.0, NAN]], [[2.0, NAN, NAN]], [[NAN, 2.0, NAN]]])


def test_replica_skew_multi_layer_uses_each_layers_placement():
    pl = Placement([[0, 0, 1, 1], [0, 1, 1, 1]], 2, Topology(2))
    slot = torch.tensor([[4, 0, 1, 1], [9, 0, 3, 6]])  # [L, P]
    # layer 0: e0 {0,1}: 4/2 = 2; e1 {2,3}: 1. layer 1: e0 single; e1 {1,2,3}: 6/3 = 2
    _same(replica_skew(slot, pl), [[2.0, 1.0], [NAN, 2.0]])


# ---------------------------------------------------------------- idle replicas


def _idle(slot, true, placement):
    idle, eligible = idle_replicas(slot, true, placement)
    assert idle.shape == eligible.shape == true.shape[:-1]
    return int(idle.sum()), int(eligible.sum())


def test_idle_replicas_hand_example():
    slot = torch.tensor([[3, 0, 0, 2, 0, 7]])
    # e0 eligible (3 replicas, 3 pairs >= 3): 3 eligible, 2 idle; e1 eligible (2 >= 2): 1 idle;
    # e2 has one replica: never eligible
    assert _idle(slot, torch.tensor([[3, 2, 7]]), PL) == (3, 5)
    # e0 has fewer pairs (2) than replicas (3): not eligible
    assert _idle(slot, torch.tensor([[2, 2, 7]]), PL) == (1, 2)
    # nothing eligible
    assert _idle(slot, torch.tensor([[0, 1, 9]]), PL) == (0, 0)


def test_idle_replicas_leading_axes():
    slot = torch.tensor([[[3, 0, 0, 2, 0, 7]], [[1, 1, 1, 0, 4, 0]]])  # [S, L, P]
    true = torch.tensor([[[3, 2, 7]], [[3, 4, 0]]])  # [S, L, E]
    # step 0: 3 idle of 5 eligible (as above); step 1: e0 none idle of 3, e1 one idle of 2
    assert _idle(slot, true, PL) == (4, 10)


# ---------------------------------------------------------------- multiplicity and summaries


def test_multiplicity_counts():
    m = torch.tensor([[0, 1, 2], [3, 1, 0], [1, 1, 5]])  # [T, K], one layer
    valid = torch.tensor([[True, True, True], [True, True, False], [False, True, True]])
    assert multiplicity_counts(m.unsqueeze(1), valid.unsqueeze(1)).tolist() == [[1, 3, 3]]
    none = torch.zeros_like(valid).unsqueeze(1)
    assert multiplicity_counts(m.unsqueeze(1), none).tolist() == [[0, 0, 0]]
    two_layers = torch.stack([m, 2 * m], 1)  # [T, L, K]: layer 1 has no c = 1
    assert multiplicity_counts(two_layers, torch.stack([valid, valid], 1)).tolist() == [
        [1, 3, 3], [1, 0, 6]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=20), st.data())
def test_multiplicity_counts_partition_valid_pairs(values, data):
    valid_list = data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values)))
    m, valid = torch.tensor(values).view(-1, 1, 1), torch.tensor(valid_list).view(-1, 1, 1)
    counts = multiplicity_counts(m, valid)[0].tolist()
    kept = [v for v, ok in zip(values, valid_list) if ok]
    assert counts == [kept.count(0), kept.count(1), sum(1 for v in kept if v >= 2)]
    fr = shares(*(torch.tensor([[c]]) for c in counts), dims=WHOLE)
    if kept:
        assert math.isclose(float(fr.sum()), 1.0)


def test_nanmean_and_nanmax_or_none():
    t = torch.tensor([[NAN, 1.0], [3.0, NAN]], dtype=torch.float64)
    assert nanmean_or_none(t) == 2.0
    assert nanmax_or_none(t) == 3.0
    assert isinstance(nanmean_or_none(t), float) and isinstance(nanmax_or_none(t), float)
    for empty in (torch.full((2, 3), NAN), torch.empty(0, dtype=torch.float64)):
        assert nanmean_or_none(empty) is None
        assert nanmax_or_none(empty) is None


def test_summaries_of_skew_ignore_undefined_entries():
    slot = torch.tensor([[[3, 0, 0, 2, 2, 7]], [[0, 0, 0, 0, 0, 0]]])
    skew = replica_skew(slot, PL)
    assert nanmean_or_none(skew) == 2.0  # mean of 3 and 1
    assert nanmax_or_none(skew) == 3.0
    assert nanmean_or_none(replica_skew(torch.zeros(1, 6, dtype=torch.int64), PL)) is None


@pytest.mark.parametrize("fn", [gpu_imbalance, balancedness])
def test_balance_metrics_do_not_mutate_input(fn):
    load = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    fn(load)
    assert load.tolist() == [1.0, 2.0, 3.0]


# ---------------------------------------------------------------- concentration


def test_top_share_and_gini_hand_examples():
    load = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 8], [4, 2, 1, 1], [0, 0, 0, 0]])
    _same(top_share(load, 1), [0.25, 1.0, 0.5, NAN])
    _same(top_share(load, 2), [0.5, 1.0, 0.75, NAN])
    # Gini = sum_ij |x_i - x_j| / (2 E^2 mean): [4,2,1,1]: pairs sum 2*(2+3+3+1+1+0) = 20,
    # over 2 * 16 * 2 = 64 -> 0.3125
    _same(gini(load), [0.0, 0.75, 0.3125, NAN])


def test_gini_brute_force_on_random_loads():
    gen = torch.Generator().manual_seed(0)
    load = torch.randint(0, 50, (5, 7), generator=gen).double()
    diffs = (load.unsqueeze(-1) - load.unsqueeze(-2)).abs().sum((-1, -2))
    want = diffs / (2 * 7 * load.sum(-1))
    assert torch.allclose(gini(load), want)


BALANCE_KEYS = ("gpu_imbalance", "balancedness", "placement_imbalance", "placement_gap",
                "factor_solver", "factor_prediction", "factor_dispatch")


@settings(max_examples=12, deadline=None)
@given(scenario=st.sampled_from(["skewed", "template", "uniform", "drift"]),
       mode=st.sampled_from(["none", "a2a"]), gpus=st.sampled_from([2, 4, 8]),
       shared=st.sampled_from([None, 0, 2]), seed=st.integers(0, 2**16),
       rebalance=st.sampled_from([None, 2]))
def test_balance_counts_routed_pairs_whatever_the_cost_and_gap_stays_under_promise(
        scenario, mode, gpus, shared, seed, rebalance):
    from eplbsim import RunSpec, replay, synthesize
    trace = synthesize(scenario, steps=6, tokens=40, layers=2, experts=16, top_k=4, seed=seed)
    spec = RunSpec.of(gpus=gpus, mode=mode, policy="ordinal", shared_experts=shared,
                      rebalance_every=rebalance, window=2 if rebalance else None, seed=seed)
    costs = ({}, {"cost": "roofline"}, {"cost": "roofline", "model": "qwen1.5-moe-a2.7b"})
    rows = [replay(trace, spec.replace(**extra)).metrics for extra in costs]
    for row in rows:
        assert {k: row[k] for k in BALANCE_KEYS} == {k: rows[0][k] for k in BALANCE_KEYS}
        assert row["placement_gap"] <= row["placement_imbalance"] + 1e-12
        counted = row["gpu_imbalance_with_shared"] is not None
        assert counted == (shared != 0 and (shared is not None or row is not rows[0]))


def test_active_experts_counts_each_gpus_distinct_experts_with_load():
    """`active_experts` against a count made here: a GPU with two replicas of one expert that
    both ran counts it once; a slot without load does not count; `active_imbalance` is its max
    over the mean."""
    from eplbsim.placement.loads import active_experts
    phy2log = torch.tensor([[0, 0, 1, 2, 3, 4, 5, 1]])  # [L=1, P=8], 4 GPUs of 2 slots
    placement = Placement(phy2log, 6, Topology(4))
    load = torch.tensor([[[3, 2, 0, 1, 4, 0, 2, 2]], [[0, 0, 0, 0, 1, 1, 1, 1]]])  # [S, L, P]
    want = [[[len({int(phy2log[0, p]) for p in range(2 * g, 2 * g + 2) if load[s, 0, p] > 0})
              for g in range(4)]] for s in range(2)]
    got = active_experts(load, placement)
    assert got.tolist() == want == [[[1, 1, 1, 2]], [[0, 0, 2, 2]]]
    trace = synthesize("skewed", steps=4, tokens=16, layers=2, experts=16, top_k=4)
    row = replay(trace, RunSpec.of(gpus=4, redundant=4)).row()
    assert row["active_imbalance"] >= 1


def test_no_metric_shares_its_name_with_a_setting():
    """A row holds the run's settings, then its metrics (`Results.row`): a metric named as a
    setting (the dispatch cap given, and the cap a run used) would overwrite it in every row
    and drop a CSV column."""
    from eplbsim.replay.results import flat_row
    from eplbsim.runspec import RunSpec
    labels = set(flat_row(RunSpec().labels()))
    keys = {name for key, metric in METRICS.items() for name in metric.flat_keys(key)}
    assert not labels & keys, labels & keys
