"""Empty slots (-1 in `phy2log`, issue 51: per-layer redundancy under one memory budget): a
placement whose layers spend different numbers of redundant slots keeps one shape `[L, P]`.
Every consumer treats an empty slot as holding nothing; what hands the map to SGLang's or
vLLM's own code refuses it in one line.

Dimensions: `S` steps, `L` layers, `E` experts, `P` slots, `G` GPUs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eplbsim import engines
from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.kernels import check_choices
from eplbsim.migration import migrate
from eplbsim.placement import Placement, refuse_empty_slots, trivial_placement
from eplbsim.placement.io import load_placement, sglang_placement
from eplbsim.placement.loads import active_experts, idle_replicas, replica_skew, replica_stats
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.review.measures import replica_shares
from eplbsim.runspec import RunSpec
from eplbsim.schedule.transfers import transfer_counts, transfer_kinds
from eplbsim.solvers import solve_with_info
from eplbsim.solvers.bounds import peak_gpu_load
from eplbsim.solvers.few_moves import align_to_previous, colocation_free, moved_slots
from eplbsim.traces.synth import synthesize

from cli_helpers import assert_input_error

E = 8
TOPO = Topology(4, 2)  # 3 slots a GPU, 2 GPUs a node
# layer 0: 4 redundant replicas (of 0, 1, 2, 3); layer 1: 2 (of 0, 1) and 2 empty slots
EMPTY = Placement(torch.tensor([[0, 1, 2, 0, 3, 4, 5, 1, 6, 7, 2, 3],
                                [0, 1, -1, 2, 3, 4, 5, 6, 7, 0, 1, -1]]), E, TOPO)
# the same layer 0; layer 1 fills slot 2 with expert 2 and slot 11 with expert 7
FULL = Placement(torch.tensor([[0, 1, 2, 0, 3, 4, 5, 1, 6, 7, 2, 3],
                               [0, 1, 2, 2, 3, 4, 5, 6, 7, 0, 1, 7]]), E, TOPO)
TRACE = synthesize("skewed", steps=3, tokens=32, layers=2, experts=E, top_k=2, seed=1)


def _fetched(engine: str) -> None:
    if engines.release(engine) is None:
        pytest.skip(f"{engine} is not fetched (eplbsim engines fetch)")


def test_the_maps_by_hand():
    assert EMPTY.has_empty and not FULL.has_empty
    assert EMPTY.filled[1].tolist() == [True, True, False] + [True] * 8 + [False]
    assert EMPTY.logcnt.tolist() == [[2, 2, 2, 2, 1, 1, 1, 1], [2, 2, 1, 1, 1, 1, 1, 1]]
    assert EMPTY.log2phy.tolist() == [
        [[0, 3], [1, 7], [2, 10], [4, 11], [5, -1], [6, -1], [8, -1], [9, -1]],
        [[0, 9], [1, 10], [3, -1], [4, -1], [5, -1], [6, -1], [7, -1], [8, -1]]]
    expected = EMPTY.expected_load(torch.full((2, E), 6.0))
    assert expected.tolist() == [[3, 3, 3, 3, 3, 6, 6, 3, 6, 6, 3, 3],
                                 [3, 3, 0, 6, 6, 6, 6, 6, 6, 3, 3, 0]]
    assert peak_gpu_load(np.full((2, E), 6.0), EMPTY.phy2log.numpy(), 4).tolist() == [15, 18]
    assert not trivial_placement(2, E, 12, TOPO).has_empty


@pytest.mark.parametrize("p2l, match", [
    ([[0, 1, 2, -2]], "outside"),
    ([[0, 1, -1, -1]], "expert 2 has no replica in layer 0"),
])
def test_bad_ids_and_a_lost_expert_are_still_refused(p2l, match):
    with pytest.raises(InputError, match=match):
        Placement(torch.tensor(p2l), 3, Topology(2))


def test_replica_metrics_count_no_empty_slot():
    slot_load = torch.tensor([[4, 0, 2, 1, 3, 0, 5, 2, 1, 0, 1, 1],
                              [3, 0, 0, 2, 0, 1, 1, 1, 1, 5, 2, 0]])  # [L, P]
    stats = replica_stats(slot_load, EMPTY)
    assert stats.total[1].tolist() == [8, 2, 2, 0, 1, 1, 1, 1]
    assert stats.peak[1].tolist() == [5, 2, 2, 0, 1, 1, 1, 1]
    assert stats.idle[1].tolist() == [0, 1, 0, 1, 0, 0, 0, 0]  # empty slots 2, 11 are nobody's
    skew = replica_skew(slot_load, EMPTY, stats)[1]
    assert skew[0] == pytest.approx(5 / 4) and skew[1] == pytest.approx(2.0)
    assert skew[2:].isnan().all()
    true_load = torch.tensor([[9, 3, 4, 4, 3, 5, 1, 1], [8, 2, 2, 1, 1, 1, 1, 1]])
    idle, eligible = idle_replicas(slot_load, true_load, EMPTY, stats)
    assert idle.tolist() == [1, 1] and eligible.tolist() == [8, 4]
    # GPU 0 of layer 1 holds experts 0, 1 and an empty slot: it ran expert 0 only
    assert active_experts(slot_load, EMPTY)[1].tolist() == [1, 2, 3, 2]


@pytest.mark.parametrize("mode", ["none", "a2a"])
def test_no_policy_sends_a_pair_to_an_empty_slot(mode):
    ran = 0
    for name, entry in POLICIES.items():
        if mode not in entry.modes:
            continue
        res = replay(TRACE, RunSpec.of(gpus=4, gpus_per_node=2, policy=name, mode=mode,
                                       placement=EMPTY))
        executed = res.slot_load.sum(0)  # [L, P]
        assert executed[~EMPTY.filled].tolist() == [0, 0], name
        if entry.spill is None and (mode == "a2a" or entry.rank_invariant):
            assert int(executed.sum()) == int(res.true_load.sum()), name  # each pair once
        ran += 1
    assert ran >= 15
    shares = replica_shares(res)  # the review's replicated slots: no empty one
    assert len(shares) <= int((EMPTY.filled & (EMPTY.logcnt.gather(
        1, EMPTY.phy2log.clamp(min=0)) > 1)).sum())


def test_a_choice_of_an_empty_slot_is_refused_and_so_is_a_policy_that_reroutes():
    ids = torch.tensor([[[0], [0]]])  # [T, L, K]: expert 0 in both layers
    with pytest.raises(InputError, match="to slot 2, which is empty"):
        check_choices(torch.tensor([[[0], [2]]]), ids, EMPTY, "mine", reroutes=True)
    with pytest.raises(InputError, match="to slot 2, which is empty"):
        check_choices(torch.tensor([[[0], [2]]]), ids, EMPTY, "mine")
    check_choices(torch.tensor([[[0], [9]]]), ids, EMPTY, "mine")
    with pytest.raises(InputError, match=r"^policy unmapped \(it reroutes pairs to any slot\) "
                       r"requires every slot to hold an expert.*in layer 1$"):
        replay(TRACE, RunSpec.of(gpus=4, gpus_per_node=2, policy="unmapped", placement=EMPTY))


def test_a_placement_file_keeps_its_empty_slots(tmp_path):
    for i, data in enumerate([{"phy2log": EMPTY.phy2log.tolist()}, EMPTY.phy2log.tolist()]):
        path = tmp_path / f"p{i}.json"
        path.write_text(json.dumps(data))
        back = load_placement(path, E, TOPO, 2)
        assert torch.equal(back.phy2log, EMPTY.phy2log)


def test_sglangs_map_refuses_empty_slots_in_one_line(tmp_path, capsys):
    with pytest.raises(InputError) as err:
        sglang_placement(EMPTY.phy2log, E, 3, [0, 2])
    assert str(err.value) == ("SGLang's physical_to_logical_map requires every slot to hold an "
                              "expert, equal slots in every layer; the placement has empty "
                              "slots (-1) in layer 1")
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"phy2log": EMPTY.phy2log.tolist()}))
    assert_input_error(capsys, "export", "--format", "sglang", "--placement", path,
                       "--num-model-layers", "2", "--out", tmp_path / "out.json",
                       match="requires every slot to hold an expert")
    with pytest.raises(InputError, match="layers 0, 1, 2, 3, 4, 5, 6, 7 and 2 more$"):
        refuse_empty_slots(torch.full((10, 2), -1), "it")


def test_the_engines_updaters_refuse_empty_slots_in_one_line(tmp_path, capsys):
    for engine in ("sglang", "vllm"):
        with pytest.raises(InputError, match=f"^--migration {engine} .* the new placement has "
                           "empty slots \\(-1\\) in layer 1$"):
            migrate(engine, FULL.phy2log, EMPTY.phy2log, E, TOPO)
    with pytest.raises(InputError, match="the old placement has empty"):
        migrate("vllm", EMPTY.phy2log, FULL.phy2log, E, TOPO)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(EMPTY.phy2log.tolist()))
    assert_input_error(capsys, "run", "--scenario", "skewed", "--steps", "4", "--tokens", "16",
                       "--layers", "2", "--experts", "8", "--top-k", "2", "--gpus", "4",
                       "--gpus-per-node", "2", "--initial", path, "--rebalance-every", "2",
                       "--migration", "sglang", "--policies", "row",
                       match="the placement serving from step 0 has empty slots (-1) in layer 1")


@pytest.mark.parametrize("engine, policy", [("sglang", "sglang:static"),
                                            ("vllm", "vllm:hash")])
def test_the_engines_dispatch_code_refuses_empty_slots(engine, policy):
    _fetched(engine)
    with pytest.raises(InputError, match="requires every slot to hold an expert.*in layer 1$"):
        replay(TRACE, RunSpec.of(gpus=4, gpus_per_node=2, policy=policy, placement=EMPTY))


def test_a_rebalance_copies_into_filled_slots_only():
    # emptying slots 2 and 11 of layer 1 copies nothing
    assert transfer_counts(FULL, EMPTY).tolist() == [[0, 0, 0], [0, 0, 0]]
    assert moved_slots(FULL.phy2log.numpy(), EMPTY.phy2log.numpy()).tolist() == [0, 0]
    # filling them: expert 2 into slot 2 (GPU 0) from slot 3 (GPU 1, same node), expert 7
    # into slot 11 (GPU 3) from slot 8 (GPU 2, same node); an empty slot is no source
    assert transfer_counts(EMPTY, FULL).tolist() == [[0, 0, 0], [0, 2, 0]]
    assert transfer_kinds(EMPTY, FULL)[1].tolist() == [-1, -1, 1] + [-1] * 8 + [1]
    assert moved_slots(EMPTY.phy2log.numpy(), FULL.phy2log.numpy()).tolist() == [0, 2]


def test_the_migration_aware_layout_handles_empty_slots():
    prev = EMPTY.phy2log.numpy()
    shuffled = prev.reshape(2, 4, 3)[:, [3, 2, 1, 0]][..., [2, 0, 1]].reshape(2, 12)
    assert (align_to_previous(shuffled, prev, TOPO, E) == prev).all()  # nothing moves
    assert colocation_free(prev, TOPO).tolist() == [True, True]  # two empties are no pair
    load = np.array([[9, 3, 4, 4, 3, 5, 1, 1], [8, 2, 2, 1, 1, 1, 1, 1]], dtype=float)
    placement, info = solve_with_info("deepseek", load, 12, TOPO, previous=EMPTY)
    assert not placement.has_empty
    assert info["moved_slots"] == int(transfer_counts(EMPTY, placement).sum())
