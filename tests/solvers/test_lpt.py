"""Tests of the `lpt` and `lpt-hier` solvers: quality against deepseek and the bounds,
anti-colocation, groups kept on their node, determinism.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplbsim.base.errors import InputError
from eplbsim.metrics import placement_gap
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.solvers import bounds, solve
from eplbsim.solvers.bounds import hierarchical_lower_bound
from eplbsim.solvers.lpt import lpt, lpt_hier


def _peak(placement: Placement, load: np.ndarray) -> np.ndarray:
    """Max GPU load under the even split, per layer: `[L]`."""
    slot = placement.expected_load(torch.from_numpy(load)).numpy()  # [L, P]
    return slot.reshape(load.shape[0], placement.topology.num_gpus, -1).sum(-1).max(1)


def _no_colocation(placement: Placement) -> bool:
    L, P = placement.phy2log.shape
    per_gpu = placement.phy2log.reshape(L, placement.topology.num_gpus, -1)  # [L, G, P/G]
    return all(len(set(row.tolist())) == len(row) for row in per_gpu.reshape(-1, P // (
        placement.topology.num_gpus)))


def _groups_on_one_node(placement: Placement, num_groups: int) -> bool:
    """Every group's replicas on one node, `num_groups / N` groups per node."""
    E, N = placement.num_experts, placement.topology.num_nodes
    group = (placement.phy2log // (E // num_groups)).numpy()  # [L, P]
    node = placement.slot_node.numpy()  # [P]
    for layer in range(group.shape[0]):
        nodes_of = [set(node[group[layer] == g].tolist()) for g in range(num_groups)]
        if any(len(s) != 1 for s in nodes_of):
            return False
        per_node = np.bincount([s.pop() for s in nodes_of], minlength=N)
        if not (per_node == num_groups // N).all():
            return False
    return True


def _skewed(seed: int, L: int, E: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.round(rng.lognormal(0, 2, size=(L, E)) * 100)


def test_deepseek_v3_shape_targets():
    """The issue's targets on the DeepSeek-V3 shape (fixed seed): lpt within 0.1% of the bound
    with 32 GPUs, 0.3% with 64; lpt-hier within 0.1% of the hierarchical bound."""
    load = np.random.default_rng(0).lognormal(0, 1, size=(58, 256))  # [L, E]
    topo = Topology(32, 8)
    assert float(placement_gap(solve("lpt", load, 288, topo, 8), load).mean()) <= 1.001
    assert float(placement_gap(solve("lpt", load, 320, Topology(64, 8), 8), load).mean()) \
        <= 1.003
    hier = solve("lpt-hier", load, 288, topo, 8)
    assert _groups_on_one_node(hier, 8)
    assert (_peak(hier, load) / hierarchical_lower_bound(load, 288, topo, 8)).mean() <= 1.001


@pytest.mark.parametrize("seed", range(4))
def test_lpt_never_worse_than_deepseek(seed):
    """lpt refines the greedy packing deepseek's global variant ends with: never worse per
    layer; on average better than deepseek's hierarchical variant too (lpt-hier likewise)."""
    load = _skewed(seed, 8, 64)  # [L, E]
    topo = Topology(16, 4)
    lpt_peak = _peak(solve("lpt", load, 80, topo, 8), load)
    assert (lpt_peak <= _peak(solve("deepseek", load, 80, topo, 1), load) + 1e-9).all()
    ds_hier = _peak(solve("deepseek", load, 80, topo, 8), load)
    assert lpt_peak.mean() <= ds_hier.mean()
    assert _peak(solve("lpt-hier", load, 80, topo, 8), load).mean() <= ds_hier.mean()


@st.composite
def shapes(draw, hierarchical=False):
    """(load [L, E], P, topology, num_groups); `hierarchical`: groups a multiple of nodes."""
    gpn = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.integers(1, 3))
    G = gpn * nodes
    if hierarchical:
        groups = nodes * draw(st.integers(1, 2))
    else:
        groups = draw(st.sampled_from([1, 2, 3, 4, 6]))
    E = groups * draw(st.integers(1, 4))
    P = G * draw(st.integers(-(-E // G), -(-E // G) + 2))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    load = rng.lognormal(0, draw(st.sampled_from([0.0, 1.0, 3.0])), size=(2, E)) * 100
    if seed % 3 == 0:
        load = np.round(load)  # ties
    if seed % 5 == 0:
        load[:, : E // 2] = 0  # idle experts
    return load, P, Topology(G, gpn), groups


def _anti_possible(name: str, E: int, P: int, topo: Topology, groups: int) -> bool:
    """Whether `name` can place `E` experts in `P` slots with no expert twice on a GPU."""
    N = topo.num_nodes
    if name == "lpt-hier" and N > 1 and groups % N == 0:
        return P // topo.num_gpus <= E // N  # within each node
    return P <= E * topo.num_gpus


@pytest.mark.parametrize("name", ["lpt", "lpt-hier"])
@settings(max_examples=40, deadline=None)
@given(case=shapes())
def test_anti_colocation(name, case):
    load, P, topo, groups = case
    if not _anti_possible(name, load.shape[1], P, topo, groups):
        with pytest.raises(InputError, match="anti_colocation is impossible"):
            solve(name, load, P, topo, groups, anti_colocation=True)
        return
    before = load.copy()
    placement = solve(name, load, P, topo, groups, anti_colocation=True)
    assert np.array_equal(load, before)
    assert _no_colocation(placement)
    again = solve(name, load, P, topo, groups, anti_colocation=True)
    assert torch.equal(placement.phy2log, again.phy2log)
    assert (placement_gap(placement, load).nan_to_num(1.0) >= 1 - 1e-9).all()


@settings(max_examples=40, deadline=None)
@given(case=shapes(hierarchical=True), anti=st.booleans())
def test_lpt_hier_keeps_groups_on_their_node(case, anti):
    load, P, topo, groups = case
    anti = anti and _anti_possible("lpt-hier", load.shape[1], P, topo, groups)
    placement = solve("lpt-hier", load, P, topo, groups, anti_colocation=anti)
    assert _groups_on_one_node(placement, groups)
    peak = _peak(placement, load)
    assert (peak >= hierarchical_lower_bound(load, P, topo, groups) * (1 - 1e-9)).all()


def test_anti_colocation_impossible():
    load = np.ones((1, 3))
    with pytest.raises(InputError, match=r"anti_colocation is impossible: 12 slots for 3 "
                                         r"experts need at least 4 replicas .* 2 GPUs"):
        solve("lpt", load, 12, Topology(2), 1, anti_colocation=True)
    # 4 experts per node but 6 slots per GPU
    with pytest.raises(InputError, match="within a node"):
        solve("lpt-hier", np.ones((1, 8)), 24, Topology(4, 2), 2, anti_colocation=True)
    # without the option the same shapes are fine
    assert solve("lpt", load, 12, Topology(2), 1).logcnt.tolist() == [[4, 4, 4]]


def _greedy_gets_stuck(load: np.ndarray, P: int, G: int) -> bool:
    """Whether plain greedy anti-colocated packing (no repair) of one layer `load [E]` runs out
    of GPUs that have room and lack the next replica's expert."""
    phy2log, counts = bounds.replicate(load[None], P, G)
    weight = load[phy2log[0]] / counts[0, phy2log[0]]  # [P]
    gpu_load, held = np.zeros(G), [set() for _ in range(G)]
    for item in np.argsort(-weight, kind="stable"):
        e = phy2log[0, item]
        room = [g for g in range(G) if len(held[g]) < P // G and e not in held[g]]
        if not room:
            return True
        g = min(room, key=lambda g: (gpu_load[g], g))
        gpu_load[g] += weight[item]
        held[g].add(e)
    return False


def test_anti_colocation_dead_end_is_repaired():
    cases = [([2.0, 1.0, 4.0, 1.0], 8, 4), ([1.0, 2.0, 5.0, 1.0], 6, 2),
             ([4.0, 2.0, 4.0, 1.0, 1.0], 12, 4), ([2.0, 2.0, 2.0], 6, 3)]
    for load, P, G in cases:
        load = np.array(load)
        assert _greedy_gets_stuck(load, P, G)
        placement = solve("lpt", load[None], P, Topology(G), 1, anti_colocation=True)
        assert _no_colocation(placement)
        assert (placement.logcnt == torch.from_numpy(bounds.replicate(load[None], P, G)[1])).all()


def test_options_and_fallback():
    load = _skewed(9, 3, 12)
    topo = Topology(8, 4)
    with pytest.raises(InputError, match="has no option time_limit"):
        solve("lpt", load, 16, topo, 4, time_limit=1)
    # 3 groups on 2 nodes: lpt-hier is lpt
    assert np.array_equal(lpt_hier(load, 16, topo, 3), lpt(load, 16, topo, 3))
    assert np.array_equal(lpt_hier(load, 16, Topology(8), 4), lpt(load, 16, Topology(8), 4))
    assert not np.array_equal(lpt_hier(load, 16, topo, 4), lpt(load, 16, topo, 4))


def test_ties_and_degenerate_loads():
    topo = Topology(4, 2)
    for load in (np.ones((2, 8)), np.zeros((2, 8)), np.array([[1e6] + [1.0] * 7] * 2),
                 np.array([[5.0, 5, 5, 5, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 3]])):
        for name in ("lpt", "lpt-hier"):
            for anti in (False, True):
                placement = solve(name, load, 12, topo, 4, anti_colocation=anti)
                assert torch.equal(placement.phy2log,
                                   solve(name, load, 12, topo, 4, anti_colocation=anti).phy2log)
    uniform = solve("lpt", np.ones((1, 8)), 8, Topology(4))
    assert placement_gap(uniform, np.ones((1, 8))).tolist() == [1.0]


def test_lpt_hier_without_enumeration(monkeypatch):
    """Above `MAX_PARTITIONS` assignments, lpt-hier packs group loads and swaps groups."""
    load = _skewed(3, 6, 64)  # [L, E]
    topo = Topology(16, 4)
    exact = solve("lpt-hier", load, 80, topo, 8)
    monkeypatch.setattr(bounds, "MAX_PARTITIONS", 0)
    heuristic = solve("lpt-hier", load, 80, topo, 8)
    assert _groups_on_one_node(heuristic, 8)
    ds = _peak(solve("deepseek", load, 80, topo, 8), load)
    assert _peak(heuristic, load).mean() <= ds.mean()
    assert _peak(heuristic, load).mean() <= _peak(exact, load).mean() * 1.02


def test_lpt_against_exact_on_small_random_instances():
    """Where exact proves its optimum, lpt is never below it (the optimum is optimal) and stays
    within 4/3 of it; on these 20 instances it matches the optimum on a good share of them."""
    from eplbsim.solvers import solve_with_info
    from eplbsim.solvers.bounds import peak_gpu_load
    matched = proven = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        G, E = int(rng.integers(2, 5)), int(rng.integers(2, 7))
        P = G * int(rng.integers(-(-E // G), -(-E // G) + 3))
        load = np.round(rng.random((1, E)) * np.exp(1.5 * rng.standard_normal((1, E))) * 100) + 1
        _, info = solve_with_info("exact", load, P, Topology(G))
        if not info["optimal"][0]:
            continue
        proven += 1
        ours = peak_gpu_load(load, solve("lpt", load, P, Topology(G)).phy2log.numpy(), G)[0]
        optimum = info["objective"][0]
        assert optimum <= ours * (1 + 1e-9)
        assert ours <= optimum * 4 / 3
        matched += bool(ours <= optimum * (1 + 1e-9))
    assert proven >= 15 and matched >= proven // 4
