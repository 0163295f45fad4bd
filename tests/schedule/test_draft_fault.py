"""A draft's own placement beside its target's: SGLang #16044's fault and the EP sizes both
admit."""

from __future__ import annotations

import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.schedule.draft_fault import draft_fault, ep_sizes, route_slots, shared_redundancy
from eplbsim.traces.draft import Drafted
from eplbsim.traces.synth import synthesize


def _drafted(draft_experts=32, seed=0):
    target = synthesize("skewed", steps=6, tokens=64, layers=3, experts=32, top_k=4, seed=seed)
    draft = synthesize("skewed", steps=6, tokens=48, layers=1, experts=draft_experts, top_k=4,
                       seed=seed + 7)
    return Drafted(target, draft)


def test_sglang_7893_a_288_expert_target_and_a_256_expert_draft():
    assert shared_redundancy(288, 256, 72) is None  # the target alone: 288 / 72
    assert shared_redundancy(288, 256, 144) is None
    assert shared_redundancy(288, 256, 32) == 0
    rows = {r["gpus"]: r for r in ep_sizes(288, 256, [32, 64, 72])}
    assert rows[72]["target_redundant"] == 0 and rows[72]["shared_redundant"] is None
    assert rows[64]["target_redundant"] == 32 and rows[64]["shared_redundant"] is None
    assert (rows[32]["target_slots_per_gpu"], rows[32]["draft_slots_per_gpu"]) == (9, 8)


@pytest.mark.parametrize("E,Ed", [(288, 256), (256, 256), (384, 256), (64, 48)])
@pytest.mark.parametrize("G", [1, 4, 8, 16, 24, 32, 48, 64, 72, 96])
def test_shared_redundancy_is_the_fewest_both_admit(E, Ed, G):
    both = [r for r in range(3 * G) if (E + r) % G == 0 and (Ed + r) % G == 0]
    assert shared_redundancy(E, Ed, G) == (both[0] if both else None)


def test_route_slots_reads_row_mod_replicas():
    placement = Placement(torch.tensor([[0, 1, 2, 0, 1, 0]]), 3, Topology(2))
    ids = torch.tensor([[0, 2], [0, 1], [0, -1], [5, 1]])
    slots = route_slots(ids, placement, 0)
    assert slots.tolist() == [[0, 2], [3, 4], [5, -1], [-1, 4]]


def test_the_fault_sends_draft_pairs_to_wrong_slots_and_misrecords():
    fault = draft_fault(_drafted(), Topology(8), 8)
    assert fault.own_wrong_pairs == 0  # the healthy path: the draft's own map
    assert fault.wrong_pairs > 0 and 0 < fault.wrong_frac <= 1
    assert fault.misrecorded == fault.pairs and fault.dropped == 0
    assert fault.promise >= 1.0 and fault.recorded_promise >= 1.0


def test_the_fault_is_nothing_when_the_maps_agree():
    """A draft whose trace is the target's first layer, recording nowhere new: the same loads,
    the same placement; the maps agree and no pair is wrong."""
    d = _drafted()
    same = Drafted(d.target, d.target)
    fault = draft_fault(same, Topology(8), 8, into=[0, 1, 2])
    assert fault.own_wrong_pairs == 0
    assert fault.promise == fault.recorded_promise  # doubled loads: the same placement
    assert fault.wrong_pairs == 0


def test_a_draft_of_more_experts_has_pairs_the_target_map_cannot_route():
    fault = draft_fault(_drafted(draft_experts=40), Topology(8), 8)
    assert fault.dropped > 0 and fault.wrong_pairs >= fault.dropped


def test_sizes_both_must_admit():
    with pytest.raises(InputError, match="redundant 0"):
        draft_fault(_drafted(draft_experts=24), Topology(8), 4)
    with pytest.raises(InputError, match="no redundancy does"):
        draft_fault(_drafted(draft_experts=28), Topology(8), 0)


def test_models_says_the_ep_sizes_a_model_and_its_own_draft_admit(capsys):
    from cli_helpers import run
    from eplbsim.cost.catalog import model_shape
    from eplbsim.schedule.draft_fault import EP_CANDIDATES
    code, out, err = run(capsys, "models")
    assert code == 0, err
    shape = model_shape("deepseek-v4.1-flash")
    assert shape.draft_experts != shape.experts
    line = next(x for x in out.splitlines() if x.startswith("deepseek-v4.1-flash: "))
    both = [G for G in EP_CANDIDATES
            if shared_redundancy(shape.experts, shape.draft_experts, G) is not None]
    said = line.split("both admit: ")[1].split(";")[0].split(", ")
    assert [int(w.split()[0]) for w in said] == both
    assert not any(x.startswith("deepseek-v3: ") for x in out.splitlines())  # its draft: 256
