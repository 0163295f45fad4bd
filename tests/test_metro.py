"""eplbsim.dispatch.metro: every pair of an expert on one candidate, the fewest activated
experts a GPU, checked on a batch worked by hand and against ordinal on a skewed trace."""

import torch

from eplbsim import RunSpec, compare, synthesize
from eplbsim.dispatch import DispatchContext
from eplbsim.dispatch.metro import metro_policy
from eplbsim.placement import Placement, full_view
from eplbsim.placement.loads import active_experts, gpu_loads
from eplbsim.placement.topology import Topology


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
