"""Tests of eplbsim.dispatch.observe: an engine's own dispatch shares one call among the ranks
whose inputs are equal exactly when a probe sees it draw nothing, and the shared path gives
every row's numbers bit for bit as one call a rank does.

Dimensions: `G` GPUs, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from eplbsim import engines
from eplbsim.dispatch import resolve_policy
from eplbsim.dispatch import observe
from eplbsim.dispatch.observe import observed_groups, probe_ids, inputs_equal
from eplbsim.placement import rank_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks import make_ranks, rank_context
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize


def _fetched(engine):
    if engines.release(engine) is None:
        pytest.skip(f"{engine} is not fetched (eplbsim engines fetch)")


def test_same_compares_tensors_sequences_and_attributes():
    class Info:
        def __init__(self, t):
            self.map, self.n = t, 3
    a, b = torch.arange(4), torch.arange(4)
    assert inputs_equal((a, [Info(a)], {"k": 1}), (b, [Info(b)], {"k": 1}))
    assert not inputs_equal(a, a.to(torch.int32)) and not inputs_equal(a, a[:3])
    assert not inputs_equal(a, a + 1)
    assert not inputs_equal([Info(a)], [Info(a + 1)]) and not inputs_equal((a,), [a])
    assert probe_ids(5, 3).tolist()[4] == [4, 0, 1]


def test_a_probe_sees_every_generator_a_call_could_draw_from():
    ids = probe_ids(8, 2)
    ctx = rank_context(0, make_ranks("independent", 0, 1)[0], "none", 0, None)
    quiet = lambda t, view, c: t  # noqa: E731
    assert observe.probe(quiet, ids, None, [ctx], 3) == observe.Probe()
    for draw in (lambda c: torch.rand(1), lambda c: random.random(), lambda c: np.random.rand(),
                 lambda c: torch.randint(0, 9, (1,), generator=c.generator),
                 lambda c: c.layer == 2 and torch.rand(1)):  # only at the last layer
        seen = observe.probe(lambda t, view, c, draw=draw: (draw(c), t)[1], ids, None, [ctx],
                             3)
        assert seen.draws and seen.says() == "draws from a generator"


def _views(placement, G, mode="none", rng="independent"):
    ranks = make_ranks(rng, 0, G)
    views = [rank_view("full", placement, r.rank, mode) for r in ranks]
    return views, [rank_context(0, r, mode, 0, None) for r in ranks]


@pytest.mark.parametrize("name, shared", [("vllm:hash", True), ("sglang:dynamic", True),
                                          ("sglang:static", False), ("sglang:fake", False)])
def test_engine_policies_share_a_call_only_when_they_draw_nothing(name, shared):
    _fetched(name.partition(":")[0])
    _, policy = resolve_policy(name)
    rng = np.random.default_rng(3)
    load = rng.random((2, 16)) * 100
    from eplbsim.solvers import solve
    placement = solve("deepseek", load, 24, Topology(4, 2))
    views, contexts = _views(placement, 4)
    groups = observed_groups(views, contexts, policy, 4)
    assert (groups == ((0, 1, 2, 3),)) == shared
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", ["vllm:hash", "sglang:dynamic", "sglang:static"])
@pytest.mark.parametrize("mode, rng, nodes", [("none", "independent", 1), ("none", "shared", 2),
                                              ("a2a", "independent", 2)])
def test_the_shared_path_gives_every_number_of_one_call_a_rank(name, mode, rng, nodes):
    """Random placements (a solver on random loads, re-solved mid-trace): the rows of the
    engine's policy equal, key for key, those of the same policy without `observed`."""
    _fetched(name.partition(":")[0])
    trace = synthesize("skewed", steps=4, tokens=48, layers=2, experts=16, top_k=4, seed=7)
    _, policy = resolve_policy(name)
    alone = dataclasses.replace(policy, observed=None)
    spec = RunSpec.of(mode=mode, rng=rng, gpus=4, gpus_per_node=4 // nodes, redundant=8,
                      rebalance_every=2)
    shared = replay(trace, spec.replace(policy=policy)).metrics
    per_rank = replay(trace, spec.replace(policy=alone)).metrics
    assert shared == per_rank


def test_a_call_that_chooses_by_its_rank_through_an_unwatched_channel_runs_once_a_rank():
    """The differential probe: equal inputs, no draw, no watched read, yet rank 0 and rank 3
    choose differently: the ranks do not share its call, and the probe says why."""
    from eplbsim.dispatch import DispatchPolicy
    from eplbsim.dispatch.observe import probed_groups
    from eplbsim.solvers import solve
    placement = solve("deepseek", np.random.default_rng(2).random((2, 16)) * 100, 24,
                      Topology(4, 2))
    views, contexts = _views(placement, 4)

    def fn(topk_ids, view, ctx, last=[3]):  # the rank learnt as a branch might: not from ctx
        return view.log2phy[ctx.layer][topk_ids, 0] if ctx.rank != last[0] else \
            view.log2phy[ctx.layer][topk_ids, view.logcnt[ctx.layer][topk_ids] - 1]

    policy = DispatchPolicy(fn, observed=lambda view, ctx: view.placement.phy2log)
    groups, seen = probed_groups(views, contexts, policy, 4)
    assert groups == ((0,), (1,), (2,), (3,))
    assert seen.differs == (0, 3) and "rank 0 and rank 3" in seen.says()
    quiet = DispatchPolicy(lambda t, view, ctx: view.log2phy[ctx.layer][t, 0],
                           observed=lambda view, ctx: view.placement.phy2log)
    assert probed_groups(views, contexts, quiet, 4) == (((0, 1, 2, 3),), observe.Probe())


def test_the_review_says_how_an_engines_calls_were_observed():
    from eplbsim.review.invariance import _claimed
    from eplbsim.solvers import solve
    _fetched("vllm")
    _fetched("sglang")
    placement = solve("deepseek", np.random.default_rng(1).random((2, 16)) * 100, 24,
                      Topology(4, 2))
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8)
    shared = _claimed("vllm:hash", (), placement, spec, 4)
    assert shared.endswith("observed: draws nothing and reads no rank, 1 call(s) serve its 4 "
                           "ranks (one a group of equal inputs)")
    assert _claimed("sglang:static", (), placement, spec, 4).endswith("one call a rank")
    assert _claimed("row", (), placement, spec, 4) == "invariant"


def test_vllms_kernel_as_one_block_maps_as_at_its_own_block_size():
    """The one-block launch (`engines.vllm.WholeLaunch`) gives the slots and the recorded load
    of vLLM's own launch at its block of 256, on a batch of several blocks with padding."""
    _fetched("vllm")
    run = engines.adapter("vllm")
    rng = np.random.default_rng(5)
    log2phy = torch.from_numpy(rng.integers(0, 40, (16, 3)))
    counts = torch.from_numpy(rng.integers(1, 4, 16))
    ids = torch.from_numpy(np.stack([rng.permutation(16)[:4] for _ in range(150)]))  # 600 ids
    ids[[3, 77], [1, 2]] = -1
    try:
        run.whole_launch(False)
        theirs = run.dispatch(ids, log2phy, counts)
    finally:
        run.whole_launch(True)
    ours = run.dispatch(ids, log2phy, counts)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert (ours[0][3, 1] == -1) and int(ours[1].sum()) == 598


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vllms_kernel_compiled_on_cuda_maps_as_interpreted():
    """On a CUDA device vLLM's map kernel runs compiled at its own block size (`native`) and
    gives the slots and recorded load the interpreted one-block launch gives on the CPU."""
    _fetched("vllm")
    run = engines.adapter("vllm")
    rng = np.random.default_rng(6)
    log2phy = torch.from_numpy(rng.integers(0, 40, (16, 3)))
    counts = torch.from_numpy(rng.integers(1, 4, 16))
    ids = torch.from_numpy(np.stack([rng.permutation(16)[:4] for _ in range(700)]))
    ids[[3, 500], [1, 2]] = -1
    cpu = run.dispatch(ids, log2phy, counts)
    gpu = run.dispatch(ids.cuda(), log2phy, counts)
    assert gpu[0].is_cuda and gpu[1].is_cuda
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_policies_on_cuda_give_the_cpu_numbers():
    """`run --device cuda` with the engines' own dispatch gives the CPU run's metrics where the
    dispatch draws nothing (vLLM's hash in both modes, SGLang's dynamic without an a2a
    backend)."""
    trace = synthesize("skewed", steps=2, tokens=256, layers=3, experts=32, top_k=4, seed=1)
    for name, modes in (("vllm:hash", ("none", "a2a")), ("sglang:dynamic", ("none",))):
        _fetched(name.split(":")[0])
        for mode in modes:
            spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8, policy=name, mode=mode)
            cpu = replay(trace, spec).metrics
            assert replay(trace, spec.replace(device="cuda")).metrics == cpu, (name, mode)


def test_nested_watches_each_see_the_reads_made_while_open():
    with observe.watching() as outer:
        with observe.watching() as inner:  # equal lists while empty: closed by identity
            pass
        observe.note("a", "x.py:1")
        with observe.watching() as last:
            observe.note("b", "x.py:2")
    assert inner == [] and outer == [("a", "x.py:1"), ("b", "x.py:2")]
    assert last == [("b", "x.py:2")]
    observe.note("c", "x.py:3")  # no block open: told to nobody
