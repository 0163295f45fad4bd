"""The compiled counting loops (`counting`, `loops`) equal their straightforward torch/numpy definitions, and the
replay counted fast equals the straightforward rank model bit for bit (hypothesis over
policies, modes, views, rng relations, schedules, source ranks and padding).

Dimensions: `S` steps, `T` tokens, `L` layers, `K` top-k, `E` experts, `P` slots, `G` GPUs.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from eplbsim.base import loops
from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.kernels import cpu as cpu_kernels
from eplbsim.ranks import counting
from eplbsim.ranks import UNMEASURED
from eplbsim.replay import routed_loads, run_steps, schedule_of
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace


def _ids(rng, rows, layers, k, experts, pad=0.2, dtype=np.int16):
    """Distinct ids per (row, layer) with a share `pad` of padding, `[rows, L, K]`."""
    ids = np.argsort(rng.random((rows, layers, experts)), -1)[..., :k]
    ids[rng.random(ids.shape) < pad] = -1
    return ids.astype(dtype)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_expert_and_slot_counts_equal_bincount(dtype):
    rng = np.random.default_rng(1)
    ids = _ids(rng, 300, 3, 4, 11, dtype=dtype)
    offsets = np.array([0, 0, 120, 300])
    got = loops.expert_counts(ids, offsets, 11)
    for s in range(3):
        part = torch.from_numpy(ids[offsets[s]:offsets[s + 1]].astype(np.int64))
        for layer in range(3):
            want = torch.bincount(part[:, layer][part[:, layer] >= 0], minlength=11)
            assert got[s, layer].tolist() == want.tolist()
    hist, valid = counting.slot_counts(ids.astype(np.int64), 11)
    assert np.array_equal(hist, got.sum(0)) and np.array_equal(valid, (ids >= 0).sum((0, 2)))


def test_first_duplicate_finds_the_lowest_row_then_layer_then_expert():
    rng = np.random.default_rng(2)
    ids = _ids(rng, 5000, 3, 4, 20)
    assert loops.first_duplicate(ids) is None
    ids[4321, 2, :] = [7, 3, 7, 3]
    ids[4321, 1, :] = [-1, 9, -1, 9]
    ids[4999, 0, :2] = [5, 5]
    assert loops.first_duplicate(ids) == (4321, 1, 9)
    ids[0, 0, :] = -1  # padding repeats freely
    assert loops.first_duplicate(ids) == (4321, 1, 9)


def test_execute_and_pair_counts_equal_the_straightforward_counts():
    rng = np.random.default_rng(3)
    T, L, K, P, G = 200, 2, 3, 12, 4
    ids = _ids(rng, T, L, K, P)
    slot_gpu = np.repeat(np.arange(G), P // G)
    groups = [rng.integers(-1, P, (T, L, K)) for _ in range(3)]
    for phys in groups:
        phys[ids < 0] = -1
    members = [np.array([1, 0, 0, 1], bool), np.array([0, 1, 0, 0], bool),
               np.array([0, 0, 1, 0], bool)]
    done = counting.Executed.start(groups[0], P)
    for phys, member in zip(groups, members):
        counting.execute(done, phys, member, slot_gpu)
    mult = sum(np.where(phys >= 0, member[slot_gpu[np.maximum(phys, 0)]], False)
               for phys, member in zip(groups, members))
    assert np.array_equal(done.mult, mult)
    load = sum(np.stack([np.bincount(phys[:, l][(phys[:, l] >= 0) & member[slot_gpu[
        np.maximum(phys[:, l], 0)]]], minlength=P) for l in range(L)])
        for phys, member in zip(groups, members))
    assert np.array_equal(done.slot_load, load)
    counts, agreed = counting.pair_counts(ids, done)
    valid = ids >= 0
    want = [((mult == c) & valid).sum((0, 2)) for c in (0, 1)] + [((mult >= 2) & valid).sum((0, 2))]
    assert np.array_equal(counts, np.stack(want, 1))
    same = valid & (groups[1] == groups[0]) & (groups[2] == groups[0])
    assert np.array_equal(agreed, same.sum((0, 2)))


def test_pair_table_looks_up_every_pair():
    rng = np.random.default_rng(4)
    ids = _ids(rng, 50, 2, 3, 9)
    table = rng.integers(0, 5, (2, 9)).astype(np.int32)
    got = loops.pair_table(table, ids)
    want = np.where(ids >= 0, table[np.arange(2).reshape(1, 2, 1), np.maximum(ids, 0)], 0)
    assert got.dtype == np.int32 and np.array_equal(got, want)



def test_table_and_sent_loads_add_pairs_on_each_ranks_table_slots():
    rng = np.random.default_rng(6)
    G, L, E, P, T, K = 3, 2, 5, 7, 20, 2
    tables = rng.integers(0, P, (G, L, E))
    counts = rng.integers(0, 9, (L, E)).astype(np.int32)
    executed = rng.random((G, L, E)) < 0.6
    want = np.zeros((L, P), np.int64)
    for r, layer, e in zip(*np.nonzero(executed)):
        want[layer, tables[r, layer, e]] += counts[layer, e]
    got = counting.table_loads(tables, counts, executed, P)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    ids = _ids(rng, T, L, K, E, dtype=np.int32)
    offsets = np.array([0, 8, 8, T])
    want = np.zeros((L, P), np.int64)
    for r in range(G):
        for t in range(offsets[r], offsets[r + 1]):
            for layer in range(L):
                for e in ids[t, layer][ids[t, layer] >= 0]:
                    want[layer, tables[r, layer, e]] += 1
    got = counting.sent_loads(tables, ids, offsets, P)
    assert got.dtype == np.int64 and np.array_equal(got, want)


@pytest.mark.parametrize("hidden", [1, 3, 8, 12, 16, 24])
def test_layer_sums_equal_the_definition_in_vector_and_single_lanes(hidden):
    """Lanes in `simd.LANES` blocks and the rest one by one give the scalar definition's bits:
    float32 products summed over the hidden index in order, rounded once to the grid."""
    rng = np.random.default_rng(hidden)
    L, E, T, K, D = 2, 7, 40, 3, hidden
    w = rng.standard_normal((L, E, D, D)).astype(np.float32)  # W[l, e, i, j]
    x = rng.standard_normal((T, D)).astype(np.float32)
    gates = rng.random((T, L, K)).astype(np.float32)
    ids = _ids(rng, T, L, K, E)
    mult = rng.integers(0, 4, ids.shape).astype(np.int32)
    wt = np.ascontiguousarray(w.transpose(0, 1, 3, 2))
    exact, weighted = counting.layer_sums(wt, x, gates, ids, mult)
    alone, same = counting.layer_sums(wt, x, gates, ids, None)
    want = np.zeros((L, T, D))
    want_weighted = np.zeros((L, T, D))
    for t in range(T):
        for layer in range(L):
            for k in range(K):
                e = ids[t, layer, k]
                if e < 0:
                    continue
                acc = w[layer, e, :, 0] * x[t, 0]
                for j in range(1, D):
                    acc = acc + w[layer, e, :, j] * x[t, j]  # float32, one rounding per step
                v = np.rint((acc * gates[t, layer, k]).astype(np.float64) * counting.GRID) \
                    * counting.INV_GRID
                want[layer, t] += v
                want_weighted[layer, t] += mult[t, layer, k] * v
    assert np.array_equal(exact, want) and np.array_equal(weighted, want_weighted)
    assert np.array_equal(alone, want) and same is alone

def test_square_sums_are_math_fsum_of_the_squares():
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((6, 3000)) * 10.0 ** rng.integers(-150, 150, (6, 3000))
    rows[2] = 0.0
    rows[3, ::2] = 0.0
    got = counting.square_sums(rows)
    assert [float(g) for g in got] == [math.fsum(v * v for v in row.tolist()) for row in rows]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_square_sums_of_grid_rows_are_math_fsum_too(seed):
    """Rows of multiples of 1 / GRID below 128 (summed in integers) beside rows off the grid or
    too large (summed by fsum): each is `math.fsum` of its squares."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400))
    rows = rng.integers(-2**31 + 1, 2**31, (5, n)) * counting.INV_GRID  # |v| < 128 on the grid
    rows[1] = rows[1] * 2.0 ** int(rng.integers(-30, 0))  # still on it, or partly not
    if n:
        rows[2, 0] = 128.0  # too large
        rows[3, int(rng.integers(0, n))] += counting.INV_GRID / 2  # off the grid
    got = counting.square_sums(rows)
    assert [float(g) for g in got] == [math.fsum(v * v for v in row.tolist()) for row in rows]


# ---------------------------------------------------------------- fast replay == oracle

POLICY_NAMES = sorted(POLICIES)


def _user_policy(ids, view, ctx):
    """An unregistered prototype: the row's replica, offset by the rank (rank-variant)."""
    n = view.logcnt[ctx.layer][ids.clamp(min=0)]
    rows = torch.arange(ids.shape[0]).unsqueeze(1) + ctx.rank
    slots = view.log2phy[ctx.layer][ids.clamp(min=0), rows % n]
    return torch.where(ids >= 0, slots, -1)


@st.composite
def cases(draw):
    G = draw(st.sampled_from([1, 2, 4]))
    per_node = draw(st.sampled_from([g for g in (1, 2, 4) if G % g == 0]))
    E = draw(st.sampled_from([4, 8, 12]))
    redundant = draw(st.sampled_from([r for r in (0, 2, 4, 8) if (E + r) % G == 0]))
    K = draw(st.integers(1, min(3, E)))
    L = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    if sum(sizes) == 0:
        sizes[0] = 1
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    ids = _ids(rng, sum(sizes), L, K, E, pad=draw(st.sampled_from([0.0, 0.3])))
    src = rng.integers(0, G, sum(sizes)) if draw(st.booleans()) else None
    trace = Trace(ids, np.cumsum([0] + sizes), E, src)
    policy = draw(st.sampled_from(POLICY_NAMES + ["user"]))
    every = draw(st.sampled_from([None, 1, 2]))
    modes = ["none", "a2a"] if policy == "user" else list(POLICIES[policy].modes)
    spec = RunSpec.of(
        policy=_user_policy if policy == "user" else policy,
        mode=draw(st.sampled_from(modes)), shared_experts=draw(st.sampled_from([None, 1])),
        view=draw(st.sampled_from(["full", "sglang-0.5.14"])),
        rng=draw(st.sampled_from(["independent", "shared", "drift"])), drift_p=0.5,
        rank_offset=draw(st.booleans()), seed=seed % 97, hidden=draw(st.sampled_from([2, 8])),
        cost=draw(st.sampled_from([None, "roofline"])),
        gpus=G, gpus_per_node=per_node, redundant=redundant, rebalance_every=every,
        **({} if every is None else {"window": 2}))
    return trace, spec


def assert_fast_is_exact(trace, spec):
    """The replay counted fast (`Epoch.fast`) and straightforwardly give the same bits; norms
    the fast path leaves `UNMEASURED` only in a run whose error is 0 everywhere."""
    segments = schedule_of(trace, spec, routed_loads(trace))
    fast_load, fast = run_steps(trace, spec, segments, fast=True)
    slow_load, slow = run_steps(trace, spec, segments, fast=False)
    assert torch.equal(fast_load, slow_load)
    for name in ("agreed", "valid", "multiplicity_counts", "drifted", "tokens", "crossings", "shared",
                 "fanout"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert torch.equal(fast.error[..., 0], slow.error[..., 0])
    left = fast.error[..., 1] == UNMEASURED  # only where the whole run's error is 0
    assert not left.any() or (slow.error[..., 0] == 0).all()
    assert (slow.error[..., 1][left] > 0).all()
    assert torch.equal(fast.error[..., 1][~left], slow.error[..., 1][~left])


@settings(max_examples=150, deadline=None)
@given(cases())
def test_counting_fast_equals_the_straightforward_rank_model(case):
    assert_fast_is_exact(*case)


@pytest.mark.parametrize("policy, mode", [
    (p, m) for p in POLICY_NAMES + ["user"] for m in ("none", "a2a")
    if p == "user" or m in POLICIES[p].modes])
@pytest.mark.parametrize("view", ["full", "sglang-0.5.14"])
def test_counting_fast_is_exact_for_every_policy_mode_and_view(policy, mode, view):
    trace = synthesize("skewed", seed=3, steps=4, tokens=48, layers=2, experts=8, top_k=3)
    assert_fast_is_exact(trace, RunSpec.of(
        policy=_user_policy if policy == "user" else policy, mode=mode, view=view, gpus=4,
        gpus_per_node=2, redundant=4, rebalance_every=2, window=2))


@pytest.mark.parametrize("rng", ["independent", "drift"])
@pytest.mark.parametrize("eager", [0, 128])
def test_random_counted_fast_draws_all_streams_at_once_or_one_at_a_time(eager, rng,
                                                                        monkeypatch):
    """Up to `EAGER_STREAMS` distinct streams every stream's Philox block is made at once,
    beyond it each stream's alone: both give the straightforward model's bits, with streams of
    different keys (independent) and of one key at different shifts (drift)."""
    monkeypatch.setattr(cpu_kernels, "EAGER_STREAMS", eager)
    trace = synthesize("skewed", seed=5, steps=4, tokens=40, layers=2, experts=8, top_k=3)
    assert_fast_is_exact(trace, RunSpec.of(policy="random", mode="none", rng=rng,
                                           drift_p=0.5, gpus=4, gpus_per_node=2, redundant=8))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_one_pass_counts_and_finds_the_first_duplicate_as_the_two_passes_do(seed):
    from eplbsim.base.loops import counts_and_first_duplicate, expert_counts, first_duplicate
    rng = np.random.default_rng(seed)
    S, L, K, E = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 5)), 9
    sizes = rng.integers(0, 7, S)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = rng.integers(-1, E, (int(offsets[-1]), L, K)).astype(np.int16)
    counts, duplicate, bad = counts_and_first_duplicate(ids, offsets, E, np.int32)
    assert np.array_equal(counts, expert_counts(ids, offsets, E, np.int32))
    assert duplicate == first_duplicate(ids) and bad is None
    if ids.size:  # ids outside [-1, E): the first in row, layer, slot order is found
        wrong = rng.random(ids.shape) < 0.1
        ids[wrong] = rng.choice([-7, -2, E, 300], int(wrong.sum()))
        at = np.argwhere((ids < -1) | (ids >= E))
        assert counts_and_first_duplicate(ids, offsets, E)[2] == (
            tuple(int(x) for x in at[0]) if len(at) else None)


def test_a_trace_hands_its_validation_counts_to_the_first_counts_call():
    trace = synthesize("skewed", steps=3, tokens=16, layers=2, experts=8, top_k=2)
    first, again = trace.counts(), trace.counts()
    assert torch.equal(first, again) and first is not again and first.dtype == trace.load_dtype
    first[0, 0, 0] += 5  # the caller owns what it got
    assert torch.equal(trace.counts(), again)
