"""Fan-out (`eplbsim.ranks.fanout`, the `fanout_*` and `remote_frac` metrics): the compiled sets
equal a count with Python sets, and a replay's figures equal a recount from every rank's
choices."""

import numpy as np
import pytest
import torch

from eplbsim.dispatch import resolve_policy
from eplbsim.placement import Placement, rank_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks import fanout
from eplbsim.ranks import MODES, Epoch, make_ranks, rank_groups, token_owners
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces import synthesize
from solver_helpers import fits


def _by_sets(gpus, per_node, src):
    """Fan-out counts `[L, 3]` (GPUs, nodes, remote GPUs) of the GPU arrays `gpus` united, with
    Python sets."""
    T, L, _ = gpus[0].shape
    out = np.zeros((L, 3), np.int64)
    for t in range(T):
        for layer in range(L):
            reached = {int(g) for a in gpus for g in a[t, layer] if g >= 0}
            out[layer] += [len(reached), len({g // per_node for g in reached}),
                           len(reached - {src[t]})]
    return out


@pytest.mark.parametrize("num_gpus, per_node", [(8, 4), (130, 10), (64, 8)])
def test_tally_counts_what_python_sets_count(num_gpus, per_node):
    rng = np.random.default_rng(num_gpus)
    gpus = [rng.integers(-1, num_gpus, (40, 3, 5)) for _ in range(3)]
    src = rng.integers(0, num_gpus, 40)
    sets = fanout.empty(40, 3, num_gpus)
    for a in gpus:
        fanout.mark(sets, a)
    tokens = np.arange(3)
    counts = fanout.tally(sets, tokens, per_node, src)
    assert np.array_equal(counts[:, 0], tokens)
    assert np.array_equal(counts[:, 1:], _by_sets(gpus, per_node, src))
    no_src = fanout.tally(sets, tokens, per_node)
    assert np.array_equal(no_src[:, 3], no_src[:, 1])  # no source: every GPU is remote


def _recount(mode, choices, ids, placement, owners):
    """Fan-out counts `[L, 4]` from every rank's choices `[G, T, L, K]` as DESIGN.md §13 reads
    them: in "none", rank `r` executes its choices on GPU `r` and no GPU is a token's source;
    in "a2a", a token's owner's choices are its destinations."""
    gpu_of = placement.slot_gpu.numpy()
    G = choices.shape[0]
    gpu = np.where(choices >= 0, gpu_of[np.clip(choices, 0, None)], -1)  # [G, T, L, K]
    if mode == "none":
        executed = [np.where(gpu[r] == r, r, -1) for r in range(G)]
    else:
        executed = [np.where((owners == r)[:, None, None], gpu[r], -1) for r in range(G)]
    src = [-1] * len(owners) if mode == "none" else owners.tolist()
    counts = _by_sets(executed, placement.topology.gpus_per_node, src)
    tokens = (ids >= 0).any(-1).sum(0)
    return np.concatenate([tokens[:, None], counts], 1)


@pytest.mark.parametrize("mode", ["none", "a2a"])
@pytest.mark.parametrize("policy", ["ordinal", "random", "colocate", "static"])
def test_a_step_counts_the_gpus_its_executed_choices_reach(mode, policy):
    trace = synthesize("clustered", seed=1, steps=1, tokens=64, layers=2, experts=16, top_k=4)
    topo = Topology(8, 4)
    placement = _placement(topo)
    name, entry = resolve_policy(policy)
    ranks = make_ranks("independent", 5, 8)
    views = tuple(rank_view("sglang-0.5.14" if policy == "random" else "full", placement, r, mode)
                  for r in range(8))
    ids = trace.step(0)
    ids[3, 1, 2] = -1  # padding
    for fast in (False, True):
        epoch = Epoch(name=name, policy=entry, placement=placement, ranks=ranks, views=views,
                      groups=rank_groups(views, entry), num_ranks=8, mode=mode, seed=5,
                      fast=fast, count_links=True, keep_choices=not fast)
        out = MODES[mode](epoch, 0, ids, None)
        if not fast:
            owners = token_owners(64, 8).numpy()
            expected = _recount(mode, out.choices.numpy(), ids.numpy(), placement, owners)
            assert np.array_equal(out.fanout.numpy(), expected)
            slow = out.fanout
        else:
            assert torch.equal(out.fanout, slow)


def _placement(topo):
    """16 experts on 24 slots of 8 GPUs, the first 8 experts replicated on another node."""
    phy2log = torch.tensor(list(range(16)) + list(range(8)))
    order = torch.tensor([0, 9, 18, 3, 12, 21, 6, 15, 1, 10, 19, 4, 13, 22, 7, 16, 2, 11, 20,
                          5, 14, 23, 8, 17])
    return Placement(phy2log[order].repeat(2, 1), 16, topo)


def test_the_metrics_are_the_counts_pooled_and_need_a_cost_model():
    trace = synthesize("clustered", seed=2, steps=3, tokens=96, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(policy="ordinal", mode="a2a", gpus=8, gpus_per_node=4, redundant=8,
                      cost="roofline")
    r = replay(trace, spec)
    f = r.counters.fanout.sum((0, 1)).double()
    assert r.metrics["fanout_gpus"] == pytest.approx(float(f[1] / f[0]))
    assert r.metrics["fanout_nodes"] == pytest.approx(float(f[2] / f[0]))
    assert r.metrics["remote_frac"] == pytest.approx(float(f[3] / f[1]))
    assert 1 <= r.metrics["fanout_nodes"] <= 2 and r.metrics["fanout_gpus"] <= 4
    bare = replay(trace, spec.replace(cost=None))
    assert bare.metrics["fanout_gpus"] is None and bare.metrics["remote_frac"] is None
    none = replay(trace, spec.replace(mode="none"))
    assert none.metrics["remote_frac"] is None and none.metrics["fanout_gpus"] > 1


@pytest.mark.parametrize("mode", ["none", "a2a"])
def test_colocate_fans_out_no_wider_than_ordinal_on_every_placement(mode):
    """Each colocate pair reuses a GPU its token already reaches, or is ordinal's choice: on
    the placement of every solver (and on two nodes), its fan-out is at most ordinal's."""
    from eplbsim.solvers import SOLVERS

    trace = synthesize("clustered", seed=5, steps=2, tokens=96, layers=2, experts=16, top_k=4)
    for solver in [s for s in SOLVERS if s not in ("lplb", "exact")  # exact: test_exact
                   and fits(s, 16, 24)]:  # topology-aware places no redundant experts
        for per_node in (4, 2):
            spec = RunSpec.of(mode=mode, gpus=4, gpus_per_node=per_node, redundant=8,
                              cost="roofline", solver=solver)
            ordinal, colocate = (replay(trace, spec.replace(policy=p)).metrics
                                 for p in ("ordinal", "colocate"))
            assert colocate["fanout_gpus"] <= ordinal["fanout_gpus"], (solver, per_node)
            assert colocate["fanout_nodes"] <= ordinal["fanout_nodes"] + 1e-12


def test_reviews_search_finds_no_counterexample_for_colocate():
    from eplbsim.review import review

    trace = synthesize("clustered", seed=0, steps=8, tokens=64, layers=2, experts=16, top_k=4)
    report = review(trace, "colocate", spec=RunSpec.of(gpus=4, redundant=8), seeds=1,
                    windows=1)
    inv = report.invariance
    assert inv["claimed"] == "invariant" and inv["observed"].startswith("invariant")
    assert inv["counterexample"] is None and inv["searched"] > 0
    assert inv["rank_agreement"] == 1.0 and inv["output_rel_error"] == 0.0
