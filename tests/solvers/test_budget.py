"""eplbsim.solvers.budget: `R x L` redundant slots spent where they cut the max GPU load most,
every layer one shape with empty slots, never a larger total max GPU load than equal
redundancy, and a run on it end to end."""

import numpy as np
import pytest
import torch

from eplbsim import RunSpec, replay, synthesize
from eplbsim.placement.topology import Topology
from eplbsim.solvers import placement_slots, solve, solve_with_info
from eplbsim.solvers.budget import peak_loads, spend, widened


def test_the_budget_is_spent_exactly_and_every_expert_kept():
    rng = np.random.default_rng(0)
    load = rng.gamma(0.3, size=(5, 16)) * 100  # [L, E] skewed, unevenly across layers
    topo = Topology(4)
    placement, info = solve_with_info("budget", load, 24, topo)
    assert placement.phy2log.shape == (5, widened(16, 24, topo)) == (5, 32)
    assert int((placement.phy2log >= 0).sum()) == 5 * 24, "R x L redundant slots, no more"
    assert (placement.logcnt >= 1).all()
    assert sum(info["redundant_per_layer"]) == 8 * 5
    assert info["redundant_per_layer"] != [8] * 5, "unevenly skewed layers take unevenly"


def test_a_skewed_layer_takes_the_slots_a_flat_one_does_not_need():
    """2 GPUs. Layer 0 is flat (every expert 10: 40 a GPU, whatever it holds), layer 1's
    expert 0 carries 300: the 4 redundant slots in all go to layer 1, its hot expert on 5
    replicas of 60 (max GPU load 190, against 200 with 3 replicas of 100 and 300 alone)."""
    load = np.array([[10.0] * 8, [300.0] + [10.0] * 7])
    placement, info = solve_with_info("budget", load, 10, Topology(2))
    assert info["redundant_per_layer"] == [0, 4]
    assert placement.logcnt[1, 0] == 5 and (placement.logcnt[0] == 1).all()


@pytest.mark.parametrize("seed", range(4))
def test_never_a_larger_total_max_gpu_load_than_equal_redundancy(seed):
    rng = np.random.default_rng(seed)
    L, E, G = 6, 12, 4
    load = rng.gamma(0.4, size=(L, E)) * rng.gamma(2.0, size=(L, 1)) * 100
    topo = Topology(G)
    for slots in (12, 16, 24):
        mine = solve("budget", load, slots, topo).phy2log.numpy()
        equal = solve("lpt", load, slots, topo).phy2log.numpy()
        assert peak_loads(mine, load[None], G).sum() <= peak_loads(equal, load[None], G).sum() \
            + 1e-9
        steps = load[None] * rng.dirichlet(np.ones(3), size=(L, E)).transpose(2, 0, 1)  # [3, L, E]
        mine = solve("budget", load, slots, topo, history=steps).phy2log.numpy()
        assert peak_loads(mine, steps, G).sum() <= peak_loads(equal, steps, G).sum() + 1e-9


def test_spend_is_the_cheapest_split_of_the_units():
    cost = np.array([[9.0, 5.0, 4.0], [6.0, 5.0, 1.0], [5.0, 5.0, 0.5]])  # [K, L]
    picked = spend(cost, 3)
    assert picked.sum() == 3
    best = min((cost[a, 0] + cost[b, 1] + cost[3 - a - b, 2], (a, b))
               for a in range(3) for b in range(3) if 0 <= 3 - a - b <= 2)
    assert cost[picked, range(3)].sum() == best[0]


def test_a_run_with_rebalances_serves_budget_placements_end_to_end():
    trace = synthesize("skewed", steps=8, tokens=128, layers=3, experts=16, top_k=4, seed=2)
    spec = RunSpec.of(gpus=4, redundant=8, solver="budget", rebalance_every=4)
    for mode in ("none", "a2a"):
        res = replay(trace, spec.replace(policy="ordinal", mode=mode))
        width = placement_slots("budget", 16, 24, Topology(4))
        assert res.slot_load.shape[-1] == width
        empty = torch.stack([seg.placement.phy2log < 0 for seg in res.segments[1:]])
        assert empty.any(), "the budget's placements have empty slots"
        assert res.metrics["multiplicity"] == {"0": 0.0, "1": 1.0, "2+": 0.0}
        for seg in res.segments:  # nothing ran on an empty slot
            held = seg.placement.phy2log < 0  # [L, W]
            assert int(res.slot_load[seg.start:seg.stop][:, held].sum()) == 0
