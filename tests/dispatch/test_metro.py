"""eplbsim.dispatch.metro and eplbsim.solvers.metro: every pair of an expert on one candidate,
the fewest activated experts a GPU, checked on a batch worked by hand and against ordinal on a
skewed trace; the placement balancing the experts each GPU expects to activate, against lpt,
and where it loses."""

import numpy as np
import pytest
import torch

from eplbsim import RunSpec, compare, synthesize
from eplbsim.dispatch import DispatchContext
from eplbsim.dispatch.metro import metro_policy
from eplbsim.placement import Placement, full_view
from eplbsim.placement.loads import active_experts, gpu_loads
from eplbsim.placement.topology import Topology
from eplbsim.solvers import solve
from eplbsim.solvers.metro import activation


def test_a_batch_worked_by_hand():
    """4 GPUs of 2 slots: experts 0 and 1 have two replicas, 2..5 one each. The
    single-replica experts go first (GPUs 1, 2, 3, 3); expert 0 (3 pairs) then takes GPU 0,
    which has activated none, and expert 1 GPU 2 over GPU 0 (one activated each: the fewer
    pairs)."""
    phy2log = torch.tensor([[0, 1, 2, 0, 3, 1, 4, 5]])  # GPU g holds slots 2g, 2g + 1
    placement = Placement(phy2log, 6, Topology(4))
    ids = torch.tensor([[0, 2], [0, 3], [0, 4], [1, 5], [-1, 2]])  # [T, K]
    phys = metro_policy(ids, full_view(placement), DispatchContext())
    assert phys.tolist() == [[0, 2], [0, 4], [0, 6], [5, 7], [-1, 2]]
    load = torch.bincount(phys[phys >= 0], minlength=8)[None]  # [L, P] pairs a slot
    assert active_experts(load, placement).tolist() == [[1, 1, 2, 2]]
    assert gpu_loads(load, 4).tolist() == [[3, 2, 2, 2]]


def test_metro_activates_fewer_experts_a_gpu_than_ordinal_on_small_batches():
    trace = synthesize("skewed", steps=4, tokens=4, layers=2, experts=32, top_k=4, seed=1)
    rows = {r.spec.dispatch.policy: r.metrics
            for r in compare(trace, ["ordinal", "metro"], ["none"],
                             RunSpec.of(gpus=8, redundant=32))}
    assert rows["metro"]["rank_agreement"] == 1.0
    assert rows["metro"]["active_imbalance"] < rows["ordinal"]["active_imbalance"]


def _expected_active(phy2log: np.ndarray, load: np.ndarray, batch_pairs: float,
                     num_gpus: int) -> np.ndarray:
    """Each GPU's expected activated replicas in a step of `batch_pairs` pairs, `[L, G]`."""
    counts = np.stack([np.bincount(row, minlength=load.shape[1]) for row in phy2log])
    per_replica = activation(load, counts, batch_pairs)  # [L, E]
    return np.take_along_axis(per_replica, phy2log, 1).reshape(len(load), num_gpus, -1).sum(-1)


@pytest.mark.parametrize("seed", range(3))
def test_the_metro_solver_balances_expected_activations_better_than_lpt(seed):
    rng = np.random.default_rng(seed)
    load = rng.gamma(0.3, size=(4, 32)) * 100  # [L, E] a few hot experts
    topo = Topology(8)
    for batch_pairs in (8.0, 32.0):
        mine = solve("metro", load, 48, topo, batch_pairs=batch_pairs).phy2log.numpy()
        other = solve("lpt", load, 48, topo).phy2log.numpy()
        peak = [_expected_active(p, load, batch_pairs, 8).max(1).sum() for p in (mine, other)]
        assert peak[0] <= peak[1] + 1e-9


def test_the_metro_solver_loses_token_balance_at_prefill():
    """Prefill-sized steps activate every replica: metro's packing sees equal weights and
    leaves the tokens unbalanced, where a token-balancing solver does not."""
    trace = synthesize("skewed", steps=4, tokens=2048, layers=2, experts=64, top_k=8, seed=1)
    rows = {r.spec.solver.solver: r.metrics for r in (
        compare(trace, ["ordinal"], ["none"], RunSpec.of(gpus=8, redundant=16, solver=s))[0]
        for s in ("deepseek", "metro"))}
    assert rows["metro"]["gpu_imbalance"] > rows["deepseek"]["gpu_imbalance"]
