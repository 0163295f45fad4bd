"""`eplbsim.ranks.window`: a window of steps dispatched in one call counts what `none_step`
counts step by step, bit for bit, and the windows cut a run where they should."""

import importlib
from dataclasses import fields

import pytest
import torch

from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.kernels import reference_step, window_kernel
from eplbsim.dispatch.policies import DispatchContext
from eplbsim.placement import Placement, full_view, rank_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks import Epoch, make_ranks, rank_groups, window
from eplbsim.replay import dispatch_steps, routed_loads, schedule_of, spec_for_trace
from eplbsim.runspec import RunSpec
from eplbsim.traces.trace import Trace

from id_helpers import distinct


def _ragged(seed=0, sizes=(5, 0, 9, 3, 12, 7, 1, 8), L=2, K=3, E=10):
    """Steps of unequal sizes (one empty) with -1 padding."""
    g = torch.Generator().manual_seed(seed)
    steps = [distinct(torch.where(torch.rand(T, L, K, generator=g) < 0.2, -1,
                                  torch.randint(0, E, (T, L, K), generator=g))) for T in sizes]
    return Trace.from_steps(steps, num_experts=E)


def _run(trace, spec, **kw):
    segments = schedule_of(trace, spec, routed_loads(trace))
    return dispatch_steps(trace, spec, segments, range(trace.num_steps), **kw)


@pytest.mark.parametrize("pairs", [1, 40, 1 << 30])
def test_a_window_of_steps_counts_what_step_by_step_counts(monkeypatch, pairs):
    """Windows of one step, of a few and of the whole run, on ragged steps with padding, drifting
    ranks and a rebalance every 3 steps: the slot loads and every counter equal the steps'."""
    monkeypatch.setattr(window, "WINDOW_PAIRS", pairs)
    counts_fast = Epoch.counts_fast
    monkeypatch.setattr(Epoch, "counts_fast", lambda self, device: False)  # as on a GPU
    trace = _ragged()
    spec = spec_for_trace(trace, RunSpec.of(gpus=4, gpus_per_node=2, redundant=6, policy="row",
                                            rng="drift", drift_p=0.5, rebalance_every=3))
    calls = []
    real = window.none_window
    monkeypatch.setattr(importlib.import_module("eplbsim.replay"), "none_window",
                        lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    windowed = _run(trace, spec, device="cpu", resident=True)
    assert sum(calls) == trace.num_steps and (len(calls) > 3) == (pairs < 1 << 30)
    stepwise = _run(trace, spec, device="cpu", fast=False)  # the straightforward rank step
    monkeypatch.setattr(Epoch, "counts_fast", counts_fast)
    taken = len(calls)
    compiled = _run(trace, spec, device="cpu", resident=True)  # compiled CPU counts come first
    assert len(calls) == taken
    for other in (stepwise, compiled):
        assert torch.equal(windowed[0], other[0])
        for f in fields(windowed[1]):
            if f.name != "error":  # the norms: exact in the straightforward step, left to fill
                assert torch.equal(getattr(windowed[1], f.name), getattr(other[1], f.name)), f.name
    assert torch.equal(windowed[0], compiled[0]) and torch.equal(windowed[1].error,
                                                                 compiled[1].error)
    assert (stepwise[1].error[:, :, 0] == 0).all()  # every pair executed once: no error


def test_only_a_provably_simple_run_takes_windows():
    """Windows need a policy with a window kernel, "none", nothing counted beyond the slot
    loads, and one group holding every rank counted `fast` (each pair executed once)."""
    trace = _ragged()
    for settings, fast, expected in [
            (dict(policy="row"), True, True), (dict(policy="row"), False, False),
            (dict(policy="ordinal"), True, False), (dict(policy="row", mode="a2a"), True, False),
            (dict(policy="row", cost="roofline"), True, False)]:
        spec = spec_for_trace(trace, RunSpec.of(gpus=4, redundant=6, **settings))
        placement = schedule_of(trace, spec, routed_loads(trace))[0].placement
        d = spec.dispatch
        ranks = make_ranks(d.rng, d.seed, 4)
        views = tuple(rank_view(d.view, placement, r.rank, d.mode) for r in ranks)
        policy = POLICIES[d.policy]
        epoch = Epoch(name=d.policy, policy=policy, placement=placement, ranks=ranks,
                      views=views, groups=rank_groups(views, policy), num_ranks=4, mode=d.mode,
                      fast=fast, count_links=spec.cost.cost is not None)
        assert (window.window_dispatch(epoch) is not None) == expected, (settings, fast)


def test_windows_hold_at_most_their_pairs_or_one_step(monkeypatch):
    monkeypatch.setattr(window, "WINDOW_PAIRS", 100)
    assert window.windows([10, 10, 30, 5, 0, 50], 2) == [(0, 3), (3, 5), (5, 6)]
    assert window.windows([80, 80], 2) == [(0, 1), (1, 2)]  # a step over the bound: alone
    assert window.windows([], 2) == []


@pytest.mark.parametrize("name", sorted(n for n, p in POLICIES.items() if p.window_kernels))
def test_every_window_kernel_is_its_policy_step_by_step(name):
    """Over the registry: each policy's window kernel (on CPU tensors), on several steps'
    tokens at their rows, equals its reference policy step by step and layer by layer."""
    policy = POLICIES[name]
    assert policy.rank_invariant and not policy.table and not policy.streamed
    g = torch.Generator().manual_seed(3)
    p2l = torch.stack([torch.cat([torch.arange(8), torch.randint(0, 8, (4,), generator=g)])
                       for _ in range(2)])
    view = full_view(Placement(p2l, 8, Topology(4)))
    steps = [distinct(torch.randint(-1, 8, (T, 2, 3), generator=g)) for T in (4, 7, 0, 1)]
    rows = torch.cat([torch.arange(len(s)) for s in steps])
    for s in (0, 5):  # the steps' index does not matter
        want = torch.cat([reference_step(policy, ids, view, DispatchContext(step=s + i))
                          for i, ids in enumerate(steps)])
        assert torch.equal(window_kernel(policy, "cpu")(torch.cat(steps), view, rows), want)
