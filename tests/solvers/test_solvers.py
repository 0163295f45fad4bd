"""Tests of eplbsim.solvers: the registry contract, DeepSeek EPLB, and solve()'s input checks.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplbsim.base.errors import InputError
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.solvers import SOLVERS, placement_slots, solve, solver_options
from eplbsim.solvers.bounds import replicate
from eplbsim.solvers.deepseek import balanced_packing
from solver_helpers import fits, inputs

PUBLISHED_LOAD = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
PUBLISHED_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                     [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]

# (L, E, P, G, gpus_per_node, num_groups)
CASES = [
    (1, 1, 1, 1, 1, 1),      # one expert, one slot
    (2, 4, 4, 4, 4, 1),      # P = E, P/G = 1
    (3, 6, 8, 2, 1, 3),      # E not a power of two, 2 nodes, groups % nodes != 0 (global)
    (2, 12, 16, 8, 4, 4),    # the published shape
    (2, 5, 7, 1, 1, 5),      # G = 1, odd P, one expert per group
    (4, 6, 12, 6, 2, 3),     # 3 nodes, hierarchical, P/G = 2
    (2, 8, 8, 8, 2, 4),      # P = E = G, 4 nodes
    (1, 3, 9, 3, 1, 1),      # heavy redundancy
]


def _check_contract(solver, load: np.ndarray, P: int, topo: Topology,
                    groups: int) -> Placement | None:
    """Run `solver` through solve() and check the registry contract; return the placement
    (None where the solver refuses redundant slots, as it must)."""
    L, E = load.shape
    before = load.copy()
    fn = SOLVERS[solver]
    budgeted = "node_limit" in solver_options(fn)  # a work budget: the same result every run
    options = {"node_limit": 5} if budgeted else {}
    options.update(inputs(solver, load, topo.num_gpus))  # what affinity, topology-aware take
    if not fits(solver, E, P):
        with pytest.raises(InputError, match="places no redundant experts"):
            solve(solver, load, P, topo, groups, **options)
        return None
    placement = solve(solver, load, P, topo, groups, **options)
    assert np.array_equal(load, before), "caller's load array was modified"
    p2l = placement.phy2log
    width = placement_slots(solver, E, P, topo)  # P, or a budget's wider shape
    assert p2l.shape == (L, width) and p2l.dtype == torch.int64
    assert (placement.logcnt >= 1).all()
    assert int(placement.logcnt.sum()) == L * P, "P slots a layer: the memory spent"
    slots_per_gpu = torch.bincount(placement.slot_gpu, minlength=topo.num_gpus)
    assert (slots_per_gpu == width // topo.num_gpus).all()
    if not budgeted:  # a MILP's budget is work, not seconds: test_exact checks it reruns alike
        again = solve(solver, load, P, topo, groups, **options)
        assert torch.equal(again.phy2log, p2l), "solver is not deterministic"
    raw = fn(load.copy(), P, topo, groups, **options)
    raw = np.asarray(raw[0] if isinstance(raw, tuple) else raw)  # (phy2log, info) or phy2log
    assert raw.dtype == np.int64 and raw.shape == (L, width)
    return placement


def test_deepseek_published_example():
    placement = solve("deepseek", np.array(PUBLISHED_LOAD, dtype=np.float64), 16,
                      Topology(8, 4), 4)
    assert placement.phy2log.tolist() == PUBLISHED_PHY2LOG


def test_deepseek_accepts_torch_and_lists_unchanged():
    tensor = torch.tensor(PUBLISHED_LOAD, dtype=torch.float32)
    before = tensor.clone()
    assert solve("deepseek", tensor, 16, Topology(8, 4), 4).phy2log.tolist() == PUBLISHED_PHY2LOG
    assert torch.equal(tensor, before)
    assert solve("deepseek", PUBLISHED_LOAD, 16, Topology(8, 4), 4).phy2log.tolist() == \
        PUBLISHED_PHY2LOG


def test_trivial_is_p_mod_e():
    placement = solve("trivial", np.ones((3, 5)), 10, Topology(2), 1)
    assert (placement.phy2log == torch.arange(10) % 5).all()


def _skip_structured(name):
    """Skip a solver that takes only the shapes of its redundancy topology (`lplb`: its own
    contract tests are in tests/dispatch/test_lplb.py)."""
    if "redundancy" in solver_options(SOLVERS[name]):
        pytest.skip(f"{name} takes only the shapes of its redundancy topologies")


@pytest.mark.parametrize("name", list(SOLVERS))
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_contract_cases(name, case):
    _skip_structured(name)
    L, E, P, G, gpn, groups = case
    rng = np.random.default_rng(sum(case))
    load = rng.integers(0, 100, size=(L, E)).astype(np.float64)
    _check_contract(name, load, P, Topology(G, gpn), groups)
    _check_contract(name, np.zeros((L, E)), P, Topology(G, gpn), groups)


@st.composite
def shapes(draw):
    """(L, E, P, G, gpus_per_node, num_groups, seed) with E | groups, G | P, P >= E."""
    gpn = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.integers(1, 3))
    G = gpn * nodes
    groups = draw(st.sampled_from([1, 2, 3, 4, 6]))
    E = groups * draw(st.integers(1, 5))
    spg = draw(st.integers(-(-E // G), -(-E // G) + 3))
    L = draw(st.integers(1, 4))
    return L, E, G * spg, G, gpn, groups, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("name", list(SOLVERS))
@settings(max_examples=30, deadline=None)
@given(shape=shapes(), skew=st.sampled_from([0.0, 1.0, 3.0]))
def test_contract_random(name, shape, skew):
    L, E, P, G, gpn, groups, seed = shape
    _skip_structured(name)
    if "node_limit" in solver_options(SOLVERS[name]):
        pytest.skip("a MILP (exact): random small instances live in tests/solvers/test_exact.py")
    rng = np.random.default_rng(seed)
    load = rng.random((L, E)) * np.exp(skew * rng.standard_normal((L, E))) * 1000
    if seed % 3 == 0:
        load = np.round(load)  # integer counts with many ties
    _check_contract(name, load, P, Topology(G, gpn), groups)


def _max_gpu_load(placement: Placement, load: np.ndarray) -> torch.Tensor:
    """Max over GPUs of the even-split promise, per layer: `[L]`."""
    slot_load = placement.expected_load(torch.from_numpy(load))  # [L, P]
    L, P = slot_load.shape
    per_gpu = slot_load.reshape(L, placement.topology.num_gpus, -1).sum(-1)  # [L, G]
    return per_gpu.max(-1).values


@pytest.mark.parametrize("E,P,G,gpn,groups", [(16, 24, 8, 4, 4), (32, 40, 8, 8, 1),
                                               (12, 18, 6, 3, 4), (64, 80, 16, 8, 8)])
def test_deepseek_beats_trivial_on_skew(E, P, G, gpn, groups):
    rng = np.random.default_rng(E * P)
    load = np.round(rng.zipf(1.5, size=(4, E)).clip(max=10_000) * 10.0)  # [L, E] skewed
    topo = Topology(G, gpn)
    ds = _max_gpu_load(solve("deepseek", load, P, topo, groups), load)
    tr = _max_gpu_load(solve("trivial", load, P, topo, groups), load)
    assert (ds <= tr + 1e-9).all()
    assert ds.sum() < tr.sum()


@pytest.mark.parametrize("L,E,P,G,gpn,groups", [(3, 12, 16, 8, 4, 4), (2, 24, 32, 8, 2, 8),
                                                 (4, 18, 24, 6, 2, 6), (2, 8, 16, 4, 1, 4)])
def test_deepseek_hierarchical_groups_stay_on_one_node(L, E, P, G, gpn, groups):
    rng = np.random.default_rng(L * E + P)
    load = rng.random((L, E)) * np.exp(2 * rng.standard_normal((L, E)))
    topo = Topology(G, gpn)
    placement = solve("deepseek", load, P, topo, groups)
    N = topo.num_nodes
    assert groups % N == 0
    node = placement.slot_node  # [P]
    group_of_slot = placement.phy2log // (E // groups)  # [L, P]
    for layer in range(L):
        group_node = {}
        for p in range(P):
            g = int(group_of_slot[layer, p])
            assert group_node.setdefault(g, int(node[p])) == int(node[p])
        assert len(group_node) == groups
        counts = np.bincount(list(group_node.values()), minlength=N)
        assert (counts == groups // N).all()  # each node gets the same number of groups


def test_balanced_packing_ties_and_one_per_pack():
    pack, rank = balanced_packing(np.array([[1.0, 1.0, 1.0, 1.0]]), 2)
    assert pack.tolist() == [[0, 1, 0, 1]] and rank.tolist() == [[0, 0, 1, 1]]
    pack, rank = balanced_packing(np.array([[1.0, 5.0, 3.0]]), 3)
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]


def test_replicate_ties_to_lowest_index():
    phy2log, logcnt = replicate(np.array([[4.0, 4.0, 1.0]]), 6)
    assert phy2log.tolist() == [[0, 1, 2, 0, 1, 0]] and logcnt.tolist() == [[3, 2, 1]]


GOOD = dict(load=np.ones((2, 4)), num_slots=8, topology=Topology(4, 2), num_groups=2)


@pytest.mark.parametrize("change,match", [
    (dict(solver="nope"), r"unknown solver 'nope'.*trivial.*deepseek"),
    (dict(load=np.ones(4)), r"2-D"),
    (dict(load=np.ones((2, 3, 4))), r"2-D"),
    (dict(load=np.array([[1.0, np.nan, 1.0, 1.0]] * 2)), r"NaN or infinite"),
    (dict(load=np.array([[1.0, np.inf, 1.0, 1.0]] * 2)), r"NaN or infinite"),
    (dict(load=np.array([[1.0, -1.0, 1.0, 1.0]] * 2)), r"negative"),
    (dict(num_slots=3, topology=Topology(1)), r"fewer slots than experts"),
    (dict(num_slots=6), r"6 slots are not divisible by 4 GPUs"),
    (dict(num_groups=0), r"the number of groups must be a positive integer, got 0"),
    (dict(load=[["a", "b"]]), r"load must hold numbers"),
    (dict(load=[["1", "2", "3", "4"]] * 2), r"load must hold numbers"),
    (dict(load=[[True, 1, 1, 1]] * 2), r"load holds true/false values"),
    (dict(load=[[1.5, True, 1, 1]] * 2), r"load holds true/false values"),  # numpy: floats
    (dict(load=np.ones((2, 4), dtype=bool)), r"load holds true/false values"),
    (dict(load=[[1, None, 1, 1]] * 2), r"must hold numbers \(pair counts\), got a value that "
                                        r"is not one \(null"),
    (dict(load=[[1, [2], 1, 1]] * 2), r"not a numeric|must hold numbers"),
    (dict(load=np.full((2, 4), 1e308)), r"above 2\*\*53"),
])
def test_solve_input_errors(change, match):
    args = dict(GOOD, solver="deepseek") | change
    with pytest.raises(InputError, match=match):
        solve(args["solver"], args["load"], args["num_slots"], args["topology"],
              args["num_groups"])


@pytest.mark.parametrize("options, match", [
    (dict(anti_colocation="maybe"), "solver option anti_colocation must be true or false"),
    (dict(migration_tolerance=-1), "solver option migration_tolerance must be a finite number"),
    (dict(migration_tolerance=float("nan")), "migration_tolerance must be a finite number"),
    (dict(nope=1), "solver deepseek has no option nope"),
])
def test_solver_options_are_checked_by_kind(options, match):
    with pytest.raises(InputError, match=match):
        solve("deepseek", GOOD["load"], 8, GOOD["topology"], 2, **options)


def test_solve_accepts_callable_and_checks_its_shape():
    def first_e(load, num_slots, topology, num_groups=1):
        return np.arange(num_slots)[None, :].repeat(load.shape[0], 0) % load.shape[1]

    assert solve(first_e, np.ones((2, 4)), 8, Topology(4), 1).phy2log.shape == (2, 8)
    with pytest.raises(InputError, match="returned shape"):
        solve(lambda *a: np.zeros((1, 8), dtype=np.int64), np.ones((2, 4)), 8, Topology(4))


REAL_COUNTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "olmoe-routing-counts" \
    / "expert_counts.csv"


@pytest.mark.skipif(not REAL_COUNTS.exists(), reason="../shared/data is absent")
@pytest.mark.parametrize("domain", ["arxiv", "github"])
def test_deepseek_beats_trivial_on_real_olmoe_counts(domain):
    """Real popularity (OLMoE, 64 experts, 3 recorded layers) on 8 GPUs with 8 spare slots."""
    import csv
    rows = [r for r in csv.DictReader(REAL_COUNTS.open())
            if r["model"] == "olmoe" and r["domain"] == domain]
    layers = sorted({int(r["layer"]) for r in rows})
    load = np.zeros((len(layers), 64))
    for r in rows:
        load[layers.index(int(r["layer"])), int(r["expert"])] = float(r["count"])
    assert (load.sum(1) > 0).all()
    topo = Topology(8)

    def promised_peak(name):
        placement = solve(name, load, 72, topo)
        gpu = placement.expected_load(torch.from_numpy(load)).view(len(layers), 8, 9).sum(-1)
        return gpu.amax(-1) / gpu.mean(-1)  # [L]

    trivial, deepseek = promised_peak("trivial"), promised_peak("deepseek")
    assert (deepseek >= 1).all() and (deepseek < trivial).all()
    assert float(deepseek.max()) < 1.2
