"""Tests of eplbsim.solvers.bounds and metrics.placement_gap: the bounds hold for every solver and
for brute-force optima of tiny instances.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from eplbsim.metrics import placement_gap
from eplbsim.placement.topology import Topology
from eplbsim.solvers import SOLVERS, bounds, solve, solver_options
from eplbsim.solvers.bounds import (
    group_partitions,
    hierarchical_assignment,
    hierarchical_lower_bound,
    lower_bound,
    replicate,
    water_fill_counts,
)
from solver_helpers import fits, inputs


def _peaks(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Max GPU load under the even split of placements `[..., P]` of one layer `load [E]`."""
    E = load.shape[0]
    counts = (phy2log[..., None] == np.arange(E)).sum(-2)  # [..., E]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_replica = load / counts  # [..., E]
    slot = np.take_along_axis(per_replica, phy2log, -1)  # [..., P]
    return slot.reshape(*slot.shape[:-1], num_gpus, -1).sum(-1).max(-1)


def _all_placements(E: int, P: int) -> np.ndarray:
    """Every `phy2log [P]` holding each of `E` experts at least once: `[n, P]`."""
    every = np.array(list(itertools.product(range(E), repeat=P)), dtype=np.int64)
    return every[(every[:, :, None] == np.arange(E)).any(1).all(1)]


def _hierarchical(phy2log: np.ndarray, E: int, P: int, topo: Topology, groups: int) -> np.ndarray:
    """Which placements `[n, P]` keep each group on one node, `groups / N` groups per node."""
    node = (np.arange(P) // (P // topo.num_gpus)) // topo.gpus_per_node  # [P]
    group = phy2log // (E // groups)  # [n, P]
    ok = np.ones(len(phy2log), dtype=bool)
    group_node = np.full((len(phy2log), groups), -1)
    for g in range(groups):
        on = group == g  # [n, P]
        nodes = np.where(on, node, -1)
        first = nodes.max(1)
        ok &= (np.where(on, node, first[:, None]) == first[:, None]).all(1)
        group_node[:, g] = first
    per_node = (group_node[:, :, None] == np.arange(topo.num_nodes)).sum(1)  # [n, N]
    return ok & (per_node == groups // topo.num_nodes).all(1)


# (E, P, G) small enough to enumerate every placement
TINY = [(2, 4, 2), (3, 4, 2), (3, 6, 3), (4, 6, 2), (4, 6, 3), (3, 6, 2), (5, 6, 2)]


@pytest.mark.parametrize("E,P,G", TINY)
def test_lower_bound_below_brute_force_optimum(E, P, G):
    rng = np.random.default_rng(E * 100 + P * 10 + G)
    every = _all_placements(E, P)
    load = np.vstack([np.round(rng.lognormal(0, 1.5, size=(6, E)) * 10),
                      np.ones((1, E)), np.eye(1, E) * 7])  # [L, E], ties included
    bound = lower_bound(load, P, G)
    topo = Topology(G)
    for layer, row in enumerate(load):
        best = _peaks(every, row, G).min()
        assert bound[layer] <= best + 1e-9
        # no solver beats the enumeration (water-filling counts need not pack best: lpt may
        # lose to it on such tiny instances)
        for name in ("deepseek", "lpt"):
            peak = _peaks(solve(name, row[None], P, topo).phy2log.numpy()[0], row, G)
            assert peak >= best - 1e-9


def naive_water_fill(weight, num_phy):
    """The definition, one replica at a time with every ratio recomputed: logcnt `[L, X]`."""
    logcnt = np.ones(weight.shape, dtype=np.int64)
    for _ in range(weight.shape[1], num_phy):
        hottest = np.argmax(weight / logcnt, axis=1)  # first maximum = lowest index
        logcnt[np.arange(len(weight)), hottest] += 1
    return logcnt


def test_water_fill_counts_are_optimal_and_match_the_definition():
    rng = np.random.default_rng(7)
    load = np.round(rng.lognormal(0, 1, size=(5, 4)) * 10)  # [L, E]
    P = 9
    counts = water_fill_counts(load, P)
    assert counts.dtype == np.int64 and (counts >= 1).all() and (counts.sum(1) == P).all()
    assert np.array_equal(counts, naive_water_fill(load, P))
    choices = np.array([c for c in itertools.product(range(1, P - 2), repeat=4) if sum(c) == P])
    for row, c in zip(load, counts):
        assert (row / c).max() == pytest.approx((row / choices).max(1).min())


def test_replicate_cap():
    rng = np.random.default_rng(3)
    weight = rng.lognormal(0, 2, size=(6, 5))  # [L, X]
    for cap in (3, 4):
        phy2log, counts = replicate(weight, 12, cap)
        assert (counts <= cap).all() and (counts.sum(1) == 12).all()
        assert np.array_equal(np.apply_along_axis(np.bincount, 1, phy2log, minlength=5), counts)
    for w in (weight, np.round(weight), np.zeros((2, 5)), np.ones((2, 5))):  # ties included
        for cap in (None, 8):  # a cap that never binds changes nothing
            phy2log, counts = replicate(w, 12, cap)
            assert np.array_equal(counts, naive_water_fill(w, 12))
            assert np.array_equal(np.apply_along_axis(np.bincount, 1, phy2log, minlength=5),
                                  counts)
    # all loads zero: the cap still spreads replicas, lowest index first
    assert replicate(np.zeros((1, 3)), 6, 2)[1].tolist() == [[2, 2, 2]]


def test_lower_bound_examples():
    assert lower_bound(np.ones((1, 8)), 8, 4).tolist() == [2.0]
    # one hot expert: 600 over 3 replicas beats the total / G = 630 / 6
    assert lower_bound(np.array([[600.0, 10, 10, 10]]), 6, 6).tolist() == [200.0]
    # the example: total / G = 1450 / 8
    load = np.array([[600.0, 560, 120, 120, 20, 10, 10, 10]])
    assert lower_bound(load, 16, 8).tolist() == [181.25]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 20), st.integers(0, 2**31 - 1))
def test_lower_bound_water_fills_only_the_heaviest_with_the_value_of_all(E, extra, seed):
    rng = np.random.default_rng(seed)
    load = rng.lognormal(0, 2, size=(3, 2, E)) * rng.integers(0, 3, (3, 2, E))
    load[0] = np.round(load[0])  # ties
    G = math.gcd(E + extra, 4)
    counts = water_fill_counts(load.reshape(-1, E), E + extra).reshape(load.shape)
    every = np.maximum(load.sum(-1) / G, (load / counts).max(-1))  # [3, 2]
    assert np.array_equal(lower_bound(load, E + extra, G), every)


def test_group_partitions():
    parts = group_partitions(6, 3)
    assert parts.shape == (15, 3, 2)  # 6! / (2!^3 3!)
    for p in parts:
        assert sorted(p.ravel().tolist()) == list(range(6))
    assert len({tuple(map(tuple, p)) for p in parts.tolist()}) == 15
    assert group_partitions(8, 4).shape == (105, 4, 2)
    assert group_partitions(4, 4).shape == (1, 4, 1) and group_partitions(4, 1).shape == (1, 1, 4)
    assert group_partitions(16, 4) is None and group_partitions(6, 3, limit=10) is None


# (E, P, G, gpus_per_node, groups) with every hierarchical placement enumerable
TINY_HIER = [(4, 6, 2, 1, 2), (4, 8, 4, 2, 2), (4, 6, 2, 1, 4), (4, 8, 4, 2, 4), (4, 8, 2, 1, 2)]


@pytest.mark.parametrize("E,P,G,gpn,groups", TINY_HIER)
def test_hierarchical_bound_below_brute_force_optimum(E, P, G, gpn, groups):
    topo = Topology(G, gpn)
    rng = np.random.default_rng(E + P + G + groups)
    every = _all_placements(E, P)
    every = every[_hierarchical(every, E, P, topo, groups)]
    load = np.vstack([np.round(rng.lognormal(0, 1.5, size=(5, E)) * 10), np.ones((1, E))])
    bound = hierarchical_lower_bound(load, P, topo, groups)
    assert (bound >= lower_bound(load, P, G) - 1e-12).all()
    for layer, row in enumerate(load):
        assert bound[layer] <= _peaks(every, row, G).min() + 1e-9


def test_hierarchical_bound_is_min_over_assignments_of_node_bounds():
    rng = np.random.default_rng(11)
    load = rng.lognormal(0, 1, size=(3, 24))  # [L, E], 6 groups of 4
    topo = Topology(6, 2)  # 3 nodes
    bound, group_node = hierarchical_assignment(load, 12 * 3, topo, 6)
    assert np.allclose(hierarchical_lower_bound(load, 36, topo, 6), bound)
    for layer in range(3):
        costs = []
        for part in group_partitions(6, 3):
            experts = [np.concatenate([np.arange(g * 4, g * 4 + 4) for g in block])
                       for block in part]
            costs.append(max(lower_bound(load[layer, e][None], 12, 2)[0] for e in experts))
        assert bound[layer] == pytest.approx(min(costs))
        # the assignment returned attains it, with two groups on each node
        assert (np.bincount(group_node[layer], minlength=3) == 2).all()
        experts = [np.flatnonzero(np.repeat(group_node[layer], 4) == n) for n in range(3)]
        assert max(lower_bound(load[layer, e][None], 12, 2)[0] for e in experts) == \
            pytest.approx(bound[layer])


def test_hierarchical_relaxed_bound_is_weaker(monkeypatch):
    rng = np.random.default_rng(5)
    load = rng.lognormal(0, 1.5, size=(6, 32))  # [L, E]
    topo = Topology(8, 2)
    exact = hierarchical_lower_bound(load, 48, topo, 8)
    monkeypatch.setattr(bounds, "MAX_PARTITIONS", 0)
    relaxed = hierarchical_lower_bound(load, 48, topo, 8)
    assert (relaxed <= exact + 1e-9).all()
    assert (relaxed >= lower_bound(load, 48, 8) - 1e-12).all()


def test_hierarchical_bound_without_constraint_is_global():
    load = np.random.default_rng(2).lognormal(0, 1, size=(2, 12))
    assert np.array_equal(hierarchical_lower_bound(load, 16, Topology(8, 4), 3),
                          lower_bound(load, 16, 8))  # 3 groups on 2 nodes
    assert np.array_equal(hierarchical_lower_bound(load, 16, Topology(8), 4),
                          lower_bound(load, 16, 8))  # one node


@st.composite
def instances(draw):
    """(load [L, E], P, topology, num_groups) small enough for every registered solver."""
    gpn = draw(st.sampled_from([1, 2]))
    nodes = draw(st.integers(1, 2))
    G = gpn * nodes
    groups = draw(st.sampled_from([1, 2, 4]))
    E = groups * draw(st.integers(1, 2))
    spg = draw(st.integers(-(-E // G), -(-E // G) + 2))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    load = rng.lognormal(0, draw(st.sampled_from([0.5, 2.0])), size=(2, E)) * 100
    if seed % 2:
        load = np.round(load)  # ties
    return load, G * spg, Topology(G, gpn), groups


# lplb takes only the shapes of its redundancy topologies: its bound check is in test_lplb.py
@pytest.mark.parametrize("name", [n for n, fn in SOLVERS.items()
                                  if "redundancy" not in solver_options(fn)])
@settings(max_examples=15, deadline=None)
@given(case=instances())
@example(case=(np.array([[0.0], [106.0]]), 1, Topology(1, 1), 1))  # a layer without load
def test_every_solver_is_above_the_bounds(name, case):
    load, P, topo, groups = case
    limit = {"node_limit": 50} if name == "exact" else {}  # any feasible placement is above
    if not fits(name, load.shape[1], P):
        return  # a solver of no redundant experts: test_solvers checks it refuses
    placement = solve(name, load, P, topo, groups, **limit, **inputs(name, load, topo.num_gpus))
    gap = placement_gap(placement, load)
    assert gap.shape == (load.shape[0],) and gap.dtype == torch.float64
    idle = torch.from_numpy(load.sum(-1) == 0)  # a layer without load has no gap (NaN)
    assert torch.where(idle, gap.isnan(), gap >= 1 - 1e-9).all()
    if name in ("deepseek", "lpt-hier") and groups % topo.num_nodes == 0:
        slot = placement.expected_load(torch.from_numpy(load)).numpy()
        peak = slot.reshape(load.shape[0], topo.num_gpus, -1).sum(-1).max(1)
        assert (peak >= hierarchical_lower_bound(load, P, topo, groups) * (1 - 1e-9)).all()


def test_placement_gap_values():
    topo = Topology(4)
    uniform = np.ones((2, 8))
    placement = solve("lpt", uniform, 8, topo)
    assert placement_gap(placement, uniform).tolist() == [1.0, 1.0]
    assert placement_gap(placement, torch.ones(2, 8)).tolist() == [1.0, 1.0]
    zero = placement_gap(placement, np.vstack([np.zeros(8), np.ones(8)]))
    assert math.isnan(zero[0]) and zero[1] == 1.0
    # trivial placement of a skewed load: peak 600 + 10 on GPU 0 over the bound 600 / 1
    skewed = np.array([[600.0, 10, 10, 10]])
    trivial = solve("trivial", skewed, 4, Topology(2))
    assert placement_gap(trivial, skewed).tolist() == [pytest.approx(610 / 600)]
