"""Dead ranks (eplbsim/solvers/recovery.py): vLLM #38862's and #46370's recoveries as twins,
against a full re-solve on the survivors, with vLLM's coverage cases replayed
(`tests/distributed/test_eplb_coverage.py`, vllm-project/vllm commit
81b102001fbcb635e0a112baa182c570e0cb9c36: rebalancing on the survivors' slots covers every
expert when they hold at least as many slots as experts, and leaves at least E - P' uncovered
when they hold fewer)."""

import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.solvers import solve
from eplbsim.placement.topology import Topology
from eplbsim.solvers.recovery import (RECOVERIES, lost_pairs, mark_dead, recover_38862,
                                      recover_46370, repair_copies, replica_counts,
                                      resolve_survivors, strip_dead, survivor_slots)


def _deepseek(load, num_slots, topology):
    return solve("deepseek", load, num_slots, topology).phy2log


def _load(E=64, seed=0, lo=10, hi=200):
    return torch.randint(lo, hi, (1, E), generator=torch.Generator().manual_seed(seed)).double()


@pytest.mark.parametrize("slots, gpus, covered", [
    (66, 3, True),   # 88 slots on EP4, rank 0 masked (sufficient redundancy)
    (96, 3, True),   # 128 slots on EP4, rank 0 masked (64 redundant)
    (48, 3, False),  # 64 slots on EP4: 48 left for 64 experts
    (44, 1, False),  # 88 slots on EP2, one rank left
    (44, 2, False),  # 88 slots on EP4, two ranks masked
])
def test_vllm_coverage_cases_on_a_full_resolve(slots, gpus, covered):
    load = _load()
    counts = replica_counts(resolve_survivors(_deepseek, load, slots, gpus), 64)
    if covered:
        assert (counts >= 1).all() and int(counts.sum()) == slots
    else:
        assert int((counts == 0).sum()) >= 64 - slots
        assert int(counts.sum()) == slots


def _initial(E=64, P=88, G=4, seed=0):
    return solve("deepseek", _load(E, seed), P, Topology(G)).phy2log.long()


@pytest.mark.parametrize("name", sorted(RECOVERIES))
@pytest.mark.parametrize("seed", range(3))
def test_a_recovery_restores_coverage_when_redundancy_allows(name, seed):
    before = _initial(seed=seed)
    after = RECOVERIES[name](before, [1], 4, 64)
    counts = replica_counts(after, 64)
    assert (counts >= 1).all()
    survivors = strip_dead(before, [1], 4) if name == "recover-38862" else \
        mark_dead(before, [1], 4)
    assert after.shape == survivors.shape and (after[survivors < 0] == -1).all()
    # only slots of experts that keep a replica were taken; nothing else moved
    changed = after != survivors
    assert int(changed.sum()) == int((replica_counts(survivors, 64) == 0).sum())
    assert torch.equal(RECOVERIES[name](before, [1], 4, 64), after)  # the same on every rank


def test_46370_interleaves_the_donors_over_the_ranks():
    # 8 experts, 16 slots on EP4: rank 0 holds experts 0..3, ranks 1..3 each hold 4..7; rank 0
    # dies. 38862 takes the most-replicated donors from the top slots: every repaired expert
    # lands on rank 3; 46370 takes a surviving rank's donor in turn (rank 3's donor of expert
    # 7 is skipped once 7 is down to one replica)
    before = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7]])
    after = recover_46370(before, [0], 4, 8)
    assert after[0, :4].tolist() == [-1] * 4
    assert {p: int(after[0, p]) for p in (7, 11, 6, 10)} == {7: 0, 11: 1, 6: 2, 10: 3}
    old = recover_38862(before, [0], 4, 8)  # compacted: slot q is old slot q + 4
    assert old[0, 8:].tolist() == [3, 2, 1, 0]
    for recovered in (after, old):
        assert (replica_counts(recovered, 8) >= 1).all()


def test_fewer_slots_than_experts_are_lost_pairs_not_an_error():
    before = solve("deepseek", _load(), 64, Topology(4)).phy2log.long()
    for recover in RECOVERIES.values():
        after = recover(before, [0], 4, 64)
        counts = replica_counts(after, 64)
        assert int((counts == 0).sum()) == 16  # no donor has a second replica
        load = _load()
        pairs, frac = lost_pairs(load, after)
        assert pairs == float(load[counts == 0].sum()) and 0 < frac < 1


def test_repair_copies_count_the_changed_slots_and_the_disk_reloads():
    before = torch.tensor([[0, 1, 2, 3, 0, 1, 4, 5]])  # EP4: rank 3 holds 4 and 5 only
    after = recover_38862(before, [3], 4, 6)
    slots = survivor_slots(8, [3], 4)
    moved = repair_copies(before, after, slots, 6)
    assert moved == {"copies": 2, "from_disk": 2}
    dead_two = recover_46370(before, [0], 4, 6)  # 0 and 1 survive on rank 2
    assert repair_copies(before, dead_two, range(8), 6) == {"copies": 0, "from_disk": 0}


def test_bad_dead_ranks():
    before = _initial()
    with pytest.raises(InputError, match="0..3"):
        mark_dead(before, [4], 4)
    with pytest.raises(InputError, match="every rank"):
        strip_dead(before, range(4), 4)
