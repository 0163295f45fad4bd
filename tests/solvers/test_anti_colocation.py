"""The `anti_colocation` option of every solver that takes it: no GPU holds two replicas of one
expert, and a clear InputError where a solver cannot honour it.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.solvers import SOLVERS, placement_slots, solve, solver_options

ANTI = [name for name, fn in SOLVERS.items() if "anti_colocation" in solver_options(fn)]
PUBLISHED_LOAD = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
PUBLISHED_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                     [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]

# (L, E, P, G, gpus_per_node, num_groups), all with P / G <= E / nodes (anti-colocation possible)
CASES = [
    (2, 4, 8, 4, 4, 1),     # 2 slots per GPU, one node
    (2, 6, 12, 4, 4, 2),    # 3 slots per GPU
    (3, 5, 10, 5, 5, 1),    # P / G = 2, E odd
    (2, 8, 16, 8, 4, 4),    # hierarchical: 2 nodes, 2 slots per GPU, 4 experts per node
    (1, 6, 6, 3, 3, 1),     # no spare slot
    (2, 4, 12, 3, 3, 1),    # 4 slots per GPU = E: every GPU holds every expert once
    (1, 3, 6, 6, 2, 1),     # 1 slot per GPU
]


def _call(name: str, load, P: int, topo: Topology, groups: int = 1, **options) -> Placement:
    """solve() with `options`, plus a small work budget for solvers that take one."""
    if "node_limit" in solver_options(SOLVERS[name]):
        options.setdefault("node_limit", 100)
    return solve(name, load, P, topo, groups, **options)


def _colocated(placement: Placement) -> bool:
    """Does some GPU hold two replicas of one expert in some layer?"""
    L = placement.num_layers
    per_gpu = placement.phy2log.reshape(L, placement.topology.num_gpus, -1)  # [L, G, P/G]
    held = per_gpu.sort(-1).values
    return bool(((held.diff(dim=-1) == 0) & (held[..., 1:] >= 0)).any())  # -1: empty slots


def test_the_solvers_that_take_it():
    assert {"trivial", "deepseek", "exact"} <= set(ANTI)


@pytest.mark.parametrize("name", ANTI)
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_gpu_holds_two_replicas(name, case, seed):
    L, E, P, G, gpn, groups = case
    rng = np.random.default_rng([seed, *case])
    load = rng.random((L, E)) * np.exp(2 * rng.standard_normal((L, E))) * 1000  # [L, E] skewed
    if seed == 2:
        load = np.round(load / 100)  # small integer counts, many ties and zeros
    topo = Topology(G, gpn)
    placement = _call(name, load, P, topo, groups, anti_colocation=True)
    assert not _colocated(placement)
    assert (placement.logcnt >= 1).all() and (placement.logcnt <= G).all()
    again = _call(name, load, P, topo, groups, anti_colocation=True)  # budgets are work
    assert torch.equal(again.phy2log, placement.phy2log)


@pytest.mark.parametrize("name", ANTI)
def test_impossible_when_a_gpu_has_more_slots_than_experts(name):
    with pytest.raises(InputError, match="anti_colocation"):
        _call(name, np.ones((1, 3)), 8, Topology(2), anti_colocation=True)


@pytest.mark.parametrize("name", ANTI)
def test_off_by_default(name):
    # a hot expert on few GPUs: without the option some solvers colocate its replicas
    load = np.array([[1000.0, 1.0, 1.0, 1.0]])
    placement = _call(name, load, 8, Topology(2), anti_colocation=False)
    assert placement.phy2log.shape == (1, placement_slots(name, 4, 8, Topology(2)))


def test_deepseek_default_is_the_published_algorithm():
    load = np.array(PUBLISHED_LOAD, dtype=np.float64)
    assert solve("deepseek", load, 16, Topology(8, 4), 4).phy2log.tolist() == PUBLISHED_PHY2LOG
    assert solve("deepseek", load, 16, Topology(8, 4), 4,
                 anti_colocation=False).phy2log.tolist() == PUBLISHED_PHY2LOG


def test_deepseek_separates_replicas_it_would_colocate():
    # global, 4 slots per GPU: the published algorithm gives expert 0 five replicas on 2 GPUs
    load = np.array([[1000.0, 10.0, 9.0, 8.0]])
    topo = Topology(2)
    assert _colocated(solve("deepseek", load, 8, topo))
    placement = solve("deepseek", load, 8, topo, anti_colocation=True)
    assert not _colocated(placement)
    assert placement.logcnt.tolist() == [[2, 2, 2, 2]]  # capped at one replica per GPU


def test_deepseek_hierarchical_caps_replicas_at_the_node():
    # 2 nodes of 2 GPUs, 2 groups of 4 experts, 3 slots per GPU (<= 4 experts per node)
    load = np.array([[1000.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0]])
    topo = Topology(4, 2)
    placement = solve("deepseek", load, 12, topo, 2, anti_colocation=True)
    assert not _colocated(placement)
    assert int(placement.logcnt[0, 0]) == 2  # its node has 2 GPUs
    with pytest.raises(InputError, match=r"only 4 experts may be placed on it"):
        solve("deepseek", load, 20, topo, 2, anti_colocation=True)  # 5 slots per GPU


def test_deepseek_stuck_packing_is_an_input_error():
    # the greedy fills GPUs so that expert 2's last replica finds only GPUs that hold one
    load = np.array([[367.0, 12.0, 20.0, 4.0, 4.0]])
    with pytest.raises(InputError, match=r"deepseek cannot honour anti_colocation.*expert 2"):
        solve("deepseek", load, 15, Topology(5), anti_colocation=True)
    if "exact" in SOLVERS:  # yet a placement exists
        assert not _colocated(_call("exact", load, 15, Topology(5), anti_colocation=True))


def test_trivial_honours_it_exactly_when_slots_per_gpu_fit():
    load = np.ones((1, 4))
    assert not _colocated(solve("trivial", load, 8, Topology(2), anti_colocation=True))
    assert not _colocated(solve("trivial", load, 16, Topology(4), anti_colocation=True))
    with pytest.raises(InputError, match="trivial solver cannot honour anti_colocation"):
        solve("trivial", load, 10, Topology(2), anti_colocation=True)  # 5 slots, 4 experts
    assert _colocated(solve("trivial", load, 10, Topology(2)))  # and without the option
