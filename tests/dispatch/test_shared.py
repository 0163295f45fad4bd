"""Where the shared experts' work runs: the rules of `dispatch.shared` against a token-by-token
transcription of SGLang's Waterfill kernel, and the replay's accounting of that work."""

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES, DispatchContext
from eplbsim.dispatch.shared import (MIN_BATCH, SharedInputs, local_rule, per_gpu,
                                     waterfill_dynamic, waterfill_static)
from eplbsim.replay import compare, replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace

U32 = 1 << 32


def _kernel_one(gpu_row, load, target, allow_all, source, index):
    """One token of one layer as the kernel computes it, scalar by scalar."""
    G = len(load)
    valid = [g for g in gpu_row if g >= 0]
    if not valid:
        return -1
    best, best_count = source, load[source]
    candidates = {source}
    if allow_all:
        candidates = set(range(G))
        for r in range(G):
            if load[r] * 11 < best_count * 10:
                best, best_count = r, load[r]
    else:
        for g in gpu_row:
            if g < 0:
                continue
            candidates.add(g)
            if load[g] * 11 < best_count * 10:
                best, best_count = g, load[g]
    weights = []
    for r in range(G):
        w = max(target - load[r], 0)
        if r != source:
            w = (w * 10) // 11
        weights.append(w if r in candidates else 0)
    total = sum(weights)
    if total == 0:
        return best
    seed = (index ^ ((source * 0x9E3779B9) % U32)) % U32
    seed = (seed * 1664525 + 1013904223) % U32
    u = seed % total
    cum = 0
    for r in range(G):
        if cum <= u < cum + weights[r]:
            return r
        cum += weights[r]
    raise AssertionError("u outside the weights")


def _inputs(rng, T, L, K, G, pad=0.1):
    gpu = torch.from_numpy(rng.integers(0, G, (T, L, K)))
    gpu[torch.from_numpy(rng.random((T, L)) < pad)] = -1  # whole padding rows in a layer
    local = per_gpu(gpu, G)
    routed = local + torch.from_numpy(rng.integers(0, 3 * T * K // G + 1, (L, G)))
    tokens = torch.from_numpy(rng.integers(T // 2, 2 * T, G))
    return SharedInputs(gpu, local, routed, tokens)


def _expected(inputs, rank, dynamic):
    T, L, K = inputs.gpu.shape
    G = inputs.local.shape[1]
    out = torch.full((T, L), -1, dtype=torch.int64)
    for layer in range(L):
        if dynamic:
            load = (inputs.routed[layer] + inputs.tokens).tolist()
            routed_total = int(inputs.routed[layer].sum())
            target = (sum(load) + routed_total // K + G - 1) // G
            allow_all = max(load) <= target
        else:
            load = inputs.local[layer].tolist()
            target = (sum(load) + sum(load) // K + G - 1) // G
            allow_all = True
        for t in range(T):
            out[t, layer] = _kernel_one(inputs.gpu[t, layer].tolist(), load, target, allow_all,
                                        rank, t)
    return out


@pytest.mark.parametrize("rule,dynamic", [(waterfill_static, False), (waterfill_dynamic, True)])
@pytest.mark.parametrize("case", range(6))
def test_waterfill_matches_the_kernel_token_by_token(rule, dynamic, case):
    rng = np.random.default_rng(case)
    G = int(rng.choice([2, 4, 8]))
    inputs = _inputs(rng, int(rng.integers(MIN_BATCH, 160)), 3, int(rng.integers(1, 5)), G)
    rank = int(rng.integers(0, G))
    got = rule(inputs, DispatchContext(rank=rank, mode="a2a"))
    assert torch.equal(got, _expected(inputs, rank, dynamic))


def test_waterfill_falls_back_to_the_least_loaded_scan_when_no_gpu_has_room():
    T, L, K, G = MIN_BATCH, 1, 2, 4
    gpu = torch.tensor([[[1, 2]]]).expand(T, L, K).contiguous()
    # fill level 100, GPU 0 above it (so only the own and routed GPUs are candidates), and no
    # room on any candidate: the scan moves to GPU 1, the first more than 10% below GPU 0
    inputs = SharedInputs(gpu, per_gpu(gpu, G), torch.zeros(L, G, dtype=torch.int64),
                          torch.tensor([200, 100, 100, 0]))
    got = waterfill_dynamic(inputs, DispatchContext(rank=0))
    expected = _expected(inputs, 0, True)
    assert torch.equal(got, expected)
    assert set(got.flatten().tolist()) == {1}


def test_small_batches_and_padding_keep_their_shared_work_home():
    rng = np.random.default_rng(1)
    inputs = _inputs(rng, MIN_BATCH - 1, 2, 4, 8, pad=0.3)
    ctx = DispatchContext(rank=5)
    for rule in (waterfill_static, waterfill_dynamic, local_rule):
        got = rule(inputs, ctx)
        assert torch.equal(got, local_rule(inputs, ctx))
        assert ((got == -1) == (inputs.gpu < 0).all(-1)).all()


def _spec(**values):
    return RunSpec.of(gpus=4, redundant=4, **values)


@pytest.fixture(scope="module")
def trace():
    return synthesize("skewed", steps=3, tokens=512, layers=2, experts=16, top_k=4, seed=3)


def test_every_token_runs_its_shared_work_once_in_a2a_and_split_in_none(trace):
    tokens = trace.tokens_per_step.to(torch.float64)
    for name in ("row", "waterfill", "waterfill-dynamic", "static"):
        result = replay(trace, _spec(policy=name, mode="a2a", shared_experts=1))
        shared = result.counters.shared  # [S, L, G]
        assert torch.equal(shared.sum(-1), tokens.view(-1, 1).expand(-1, 2))
    home = replay(trace, _spec(policy="row", mode="a2a", shared_experts=1)).counters.shared
    assert (home == home[:, :, :1]).all()  # contiguous equal shares: each rank keeps its own
    split = replay(trace, _spec(policy="row", mode="none", shared_experts=2))
    assert torch.allclose(split.counters.shared * 4, tokens.view(-1, 1, 1))


BALANCE = ("gpu_imbalance", "balancedness", "placement_imbalance", "placement_gap",
           "factor_solver", "factor_prediction", "factor_dispatch")


def test_shared_work_has_its_own_figure_and_leaves_balance_alone(trace):
    plain = replay(trace, _spec(policy="row", mode="a2a"))
    shared = replay(trace, _spec(policy="row", mode="a2a", shared_experts=1))
    assert plain.counters.shared.shape[-1] == 0
    assert torch.equal(plain.slot_load, shared.slot_load)  # the routed pairs are unchanged
    assert {k: shared.metrics[k] for k in BALANCE} == {k: plain.metrics[k] for k in BALANCE}
    assert plain.metrics["gpu_imbalance_with_shared"] is None
    assert shared.metrics["gpu_imbalance_with_shared"] < shared.metrics["gpu_imbalance"]


def test_balance_is_the_same_with_and_without_a_cost_model(trace):
    for mode in ("none", "a2a"):
        rows = [replay(trace, _spec(policy="ordinal", mode=mode, **extra)).metrics
                for extra in ({}, {"cost": "roofline"},
                              {"cost": "roofline", "model": "qwen1.5-moe-a2.7b"})]
        assert rows[1]["gpu_imbalance_with_shared"] is not None
        for row in rows[1:]:
            assert {k: row[k] for k in BALANCE} == {k: rows[0][k] for k in BALANCE}
            assert row["placement_gap"] <= row["placement_imbalance"]


def test_waterfill_balances_the_gpus_better_than_keeping_shared_work_home(trace):
    rows = {r.policy: r.metrics["gpu_imbalance_with_shared"]
            for r in compare(trace, ["row", "waterfill", "waterfill-dynamic"], ["a2a"],
                             _spec())}
    assert rows["waterfill"] < rows["row"] and rows["waterfill-dynamic"] < rows["row"]


def test_compare_counts_the_shared_expert_in_every_row_when_a_policy_places_it(trace):
    results = compare(trace, ["row", "waterfill"], ["a2a"], _spec())
    assert [r.spec.dispatch.shared_experts for r in results] == [1, 1]  # deepseek-v3 has one
    alone = compare(trace, ["row"], ["a2a"], _spec())[0]
    assert alone.spec.dispatch.shared_experts is None and alone.spec.shared_work() == 0


def test_waterfill_refuses_none_mode_and_a_model_without_shared_experts(trace):
    with pytest.raises(InputError, match="only in a2a"):
        _spec(policy="waterfill", mode="none")
    with pytest.raises(InputError, match="has none"):
        replay(trace, _spec(policy="waterfill", mode="a2a", model="mixtral-8x7b"))
    spec = _spec(policy="waterfill", mode="a2a", model="mixtral-8x7b", shared_experts=1)
    assert spec.shared_work() == 1.0
    assert RunSpec.of(model="qwen1.5-moe-a2.7b", shared_experts=1).shared_work() == 4.0


def test_waterfill_sends_shared_work_off_a_rank_with_a_hot_expert():
    T, L, K, G = 256, 1, 2, 4
    ids = torch.zeros(T, L, K, dtype=torch.int32)
    ids[:, 0, 1] = torch.arange(T) % 15 + 1  # expert 0 in every token, the rest spread
    trace = Trace(ids.unsqueeze(0).reshape(T, L, K), np.array([0, T]), num_experts=16)
    result = replay(trace, RunSpec.of(gpus=G, redundant=0, policy="waterfill", mode="a2a",
                                      solver="trivial"))
    shared = result.counters.shared[0, 0]
    hot = int(result.segments[0].placement.slot_gpu[0])  # the GPU holding expert 0
    assert shared[hot] < T / G and shared.sum() == T
    assert POLICIES["waterfill"].invariance() == "a2a only"
