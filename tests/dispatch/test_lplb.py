"""DeepSeek LPLB (`solvers.lplb`, the `lplb` and `lplb-atomic` policies): the redundancy
topologies as published, the placement's two replicas on linked GPUs, and the permuted-ordinal
mapping's exact split."""

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.batch_lp import optimal_fractions
from eplbsim.dispatch.policies import DispatchContext
from eplbsim.placement import full_view
from eplbsim.placement.topology import Topology
from eplbsim.solvers import solve
from eplbsim.solvers.lplb import redundancy_links


def test_redundancy_topologies_are_the_published_ones():
    assert redundancy_links("ring")[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert redundancy_links("cube").T.tolist() == [[3, 0, 1, 2, 7, 4, 5, 6],
                                                   [6, 7, 4, 5, 0, 1, 2, 3]]
    hyper = redundancy_links("hypercube")
    assert hyper[:8, 0].tolist() == [3, 0, 1, 2, 7, 4, 5, 6] and hyper[0, 1] == 12
    torus = redundancy_links("torus", 32, 8)  # 8 x 4: g = 4 i + j
    assert torus[5].tolist() == [9, 6] and torus[31].tolist() == [3, 28]
    for kind, n in (("ring", None), ("cube", None), ("hypercube", None), ("torus", 32)):
        links = redundancy_links(kind, n, 8)
        assert all(sorted(col) == list(range(len(links))) for col in links.T)  # permutations


@pytest.mark.parametrize("kind, gpus, redundant", [("cube", 16, 2), ("ring", 8, 1),
                                                   ("hypercube", 16, 2), ("torus", 16, 2)])
def test_each_copy_of_a_gpus_heaviest_experts_sits_on_a_linked_gpu(kind, gpus, redundant):
    rng = np.random.default_rng(0)
    load = rng.uniform(1, 100, (2, 64))
    placement = solve("lplb", load, 64 + gpus * redundant, Topology(gpus), redundancy=kind,
                      torus_rows=4)
    p2l = placement.phy2log.numpy().reshape(2, gpus, -1)
    per_gpu = 64 // gpus
    n = {"ring": 8, "cube": 8, "hypercube": 16}.get(kind, gpus)
    links = redundancy_links(kind, n, 4)
    for layer in range(2):
        assert sorted(p2l[layer, :, :per_gpu].ravel().tolist()) == list(range(64))
        assert np.bincount(p2l[layer].ravel()).max() == 2  # an original and one copy
        for g in range(gpus):
            for slot in range(redundant):
                c, d = divmod(slot, links.shape[1])
                source = g - g % n + links[g % n, d]
                own = sorted(p2l[layer, source, :per_gpu], key=lambda e: -load[layer, e])
                assert p2l[layer, g, per_gpu + slot] == own[c * links.shape[1] + d]


def test_lplb_keeps_its_linked_layout_when_laid_over_a_previous_placement():
    from eplbsim.solvers import solve_with_info
    rng = np.random.default_rng(3)
    topo = Topology(8)
    old = solve("lplb", rng.uniform(1, 100, (2, 64)), 80, topo, redundancy="cube")
    load = rng.uniform(1, 100, (2, 64))
    fresh = solve("lplb", load, 80, topo, redundancy="cube")
    laid, info = solve_with_info("lplb", load, 80, topo, previous=old, redundancy="cube")
    assert torch.equal(laid.phy2log, fresh.phy2log)  # no GPU permuted, nothing repaired
    assert info["moved_slots"] == int((old.phy2log != fresh.phy2log).sum())
    with pytest.raises(InputError, match="previous placement has shape"):
        solve_with_info("lplb", load, 80, topo, previous=old.phy2log[:1], redundancy="cube")
    # another solver is laid out over it: fewer moves than the fresh solve
    moved = solve_with_info("deepseek", load, 80, topo, previous=old)[1]
    assert moved["moved_slots"] <= moved["fresh_moved_slots"]


def test_lplb_is_above_the_lower_bound_and_balances_its_originals():
    from eplbsim.metrics import placement_gap
    load = np.random.default_rng(2).lognormal(0, 1, (3, 64))
    placement = solve("lplb", load, 80, Topology(8), redundancy="cube")
    assert (placement_gap(placement, load) >= 1 - 1e-9).all()
    assert placement.logcnt.max() == 2 and placement.logcnt.min() == 1


def test_lplb_that_does_not_fit_its_topology_is_refused():
    with pytest.raises(InputError, match="do not fit it"):
        solve("lplb", np.ones((1, 48)), 48 + 12 * 2, Topology(12), redundancy="cube")
    with pytest.raises(InputError, match="unknown redundancy topology"):
        solve("lplb", np.ones((1, 64)), 80, Topology(8), redundancy="star")


def test_the_mapping_splits_each_expert_exactly_as_floor_of_its_fraction():
    placement = solve("lplb", np.random.default_rng(1).uniform(1, 9, (1, 16)), 24,
                      Topology(8), redundancy="ring")
    view = full_view(placement, 0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (4000, 1), generator=gen)  # ~30 pairs a block of 132
    phys = POLICIES["lplb"](ids, view, DispatchContext())
    counts = torch.bincount(ids.view(-1), minlength=16)
    frac = optimal_fractions(counts, view.log2phy[0], view.logcnt[0], placement.slot_gpu, 8)
    for e in range(16):
        if view.logcnt[0, e] == 2 and counts[e] > 0:
            first = int((phys[ids == e] == view.log2phy[0, e, 0]).sum())
            assert first == int(np.floor(float(frac[e, 0]) * int(counts[e])))
    atomic = [POLICIES["lplb-atomic"](ids, view, DispatchContext(
        rank=r, generator=torch.Generator().manual_seed(r))) for r in range(2)]
    loads = [torch.bincount(a.view(-1), minlength=24) for a in atomic]
    assert torch.equal(loads[0], torch.bincount(phys.view(-1), minlength=24))  # same split
    assert torch.equal(loads[0], loads[1]) and not torch.equal(atomic[0], atomic[1])
