"""ROCm ATOM's placement policies (`eplbsim.solvers.atom`, twins of `atom/model_ops/eplb.py`
@ 05c3036dd41f, ATOM #1210) and its per-rank dispatch lists (`placement.atom_view`): small
cases worked by hand from the rules the module doc states."""

import numpy as np
import torch

from eplbsim.placement import Placement, atom_view
from eplbsim.placement.topology import Topology
from eplbsim.solvers import solve


def test_naive_replicates_greedily_and_packs_largest_first():
    # extra replicas: 10/1 -> expert 0; then 10/2 = 5/1, the lower id: expert 0 again.
    # weights 5 (e2), 10/3 x3 (e0), 2 (e3), 1 (e1) into 2 GPUs of 3: least load, then fewest
    placement = solve("atom-naive", [[10, 1, 5, 2]], 6, Topology(2))
    assert placement.phy2log.tolist() == [[2, 0, 1, 0, 0, 3]]


def test_biased_puts_the_hottest_on_every_gpu_and_packs_the_rest():
    # H = (8 - 4) // 2 = 2 hot experts (0 and 2) on both GPUs; experts 1 and 3 share the 4
    # other slots: 3 takes the first extra (2/1 > 1/1), 1 the second (1/1 ties 2/2: lower id)
    placement = solve("atom-biased", [[10, 1, 5, 2]], 8, Topology(2))
    assert placement.phy2log.tolist() == [[0, 2, 3, 1, 0, 2, 3, 1]]


def test_biased_without_a_budget_for_one_hot_expert_is_naive():
    load = np.random.default_rng(0).lognormal(0, 1, (3, 20))  # (24 - 20) // 8 = 0 hot
    assert torch.equal(solve("atom-biased", load, 24, Topology(8)).phy2log,
                       solve("atom-naive", load, 24, Topology(8)).phy2log)


def test_biased_holds_the_hottest_on_every_gpu_on_a_v4_pro_shape():
    load = np.random.default_rng(1).lognormal(0, 1.5, (2, 384))
    placement = solve("atom-biased", load, 448, Topology(8))
    hot = np.argsort(-load, kind="stable", axis=1)[:, :8]  # (448 - 384) // 8
    for layer in range(2):
        gpus = placement.phy2log[layer].reshape(8, 56)
        for g in range(8):
            assert set(hot[layer].tolist()) <= set(gpus[g].tolist())
    assert (placement.logcnt >= 1).all()


def test_atoms_view_keeps_a_local_replica_else_every_replica():
    # GPU 0 holds [0, 0], GPU 1 [1, 2], GPU 2 [1, 2]
    placement = Placement(torch.tensor([[0, 0, 1, 2, 1, 2]]), 3, Topology(3))
    for rank, expected in ((0, [[0, -1], [2, 4], [3, 5]]), (1, [[0, 1], [2, -1], [3, -1]]),
                           (2, [[0, 1], [4, -1], [5, -1]])):
        for mode in ("none", "a2a"):
            assert atom_view(placement, rank, mode).log2phy[0].tolist() == expected
