"""Tests of eplbsim.migration: weights that say whose they are, torch.distributed's
point-to-point calls simulated in one process, and the engines' own updaters (SGLang's
expert_location_updater, vLLM's rearrange_expert_weights_inplace) moving them so that every
slot holds what the new map names; real gloo processes move the same slots and bytes.

Dimensions: `G` ranks, `L` layers, `E` experts, `P` slots.
"""

from __future__ import annotations

import pytest
import torch

from eplbsim import engines
from eplbsim.errors import InputError
from eplbsim.migration import migrate, plan
from eplbsim.migration.simdist import SimWorld, simulated
from eplbsim.migration.weights import held, lost_experts, rank_weights, slot_mismatch
from eplbsim.topology import Topology

ENGINES = ("sglang", "vllm")


def _fetched(engine):
    if engines.release(engine) is None:
        pytest.skip(f"{engine} is not fetched (eplbsim engines fetch)")


def _placement(gen, L, E, P):
    """Every expert once and `P - E` random replicas, shuffled over the slots, per layer."""
    return torch.stack([torch.cat([torch.randperm(E, generator=gen),
                                   torch.randint(0, E, (P - E,), generator=gen)])
                        [torch.randperm(P, generator=gen)] for _ in range(L)])


def test_weights_read_back_as_the_expert_they_hold_and_nothing_else():
    p2l = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, -1]])
    weights = rank_weights(p2l, 4, 3)
    assert len(weights) == 3 and weights[0][1][0].shape == (2, 4, 8)
    assert torch.equal(held(weights, 4), p2l)
    weights[1][0][2][0, 1] += 1  # one element of slot 2's scale
    weights[2][1][0][0] = weights[0][1][0][1]  # layer 1 slot 4 gets slot 1's w13 only
    weights[0][0][1][1] = rank_weights(p2l.roll(1, 0), 4, 3)[0][0][1][1]  # another layer's
    holds = held(weights, 4)
    assert holds[0].tolist() == [0, -1, -1, 3, 0, 1] and holds[1].tolist() == [3, 2, 1, 0, -1, -1]
    assert slot_mismatch(holds, p2l).tolist() == [2, 1]  # the empty slot is not counted
    assert lost_experts(holds, 4) == [(0, 2)]
    with pytest.raises(InputError, match="do not divide"):
        rank_weights(p2l, 4, 4)


def test_the_simulated_world_matches_sends_in_order_and_names_a_broken_plan():
    world = SimWorld(2, wait_s=0.2)

    def body(rank):
        dist = torch.distributed
        if rank == 0:
            ops = [dist.P2POp(dist.isend, torch.full((2,), float(i)), 1) for i in range(3)]
        else:
            got = [torch.empty(2) for _ in range(3)]
            ops = [dist.P2POp(dist.irecv, t, 0) for t in got]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return None if rank == 0 else [t[0].item() for t in got]
    with simulated(world):
        assert world.run(body) == [None, [0.0, 1.0, 2.0]]
    assert world.sent == [(0, 1, 8)] * 3
    lonely = SimWorld(2, wait_s=0.2)
    with simulated(lonely), pytest.raises(InputError, match="rank 1 waits for a message from "
                                                            "rank 0"):
        lonely.run(lambda r: r and torch.distributed.irecv(torch.empty(1), 0).wait())
    extra = SimWorld(2, wait_s=0.2)
    with simulated(extra), pytest.raises(InputError, match="rank 0 sent 1 message"):
        extra.run(lambda r: r or torch.distributed.isend(torch.ones(1), 1))
    assert torch.distributed.isend is not world.isend  # put back


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("gpus, per_node, seed", [(4, 4, 0), (4, 2, 1), (8, 4, 2)])
def test_the_engines_updater_leaves_every_slot_holding_what_the_new_map_names(
        engine, gpus, per_node, seed):
    _fetched(engine)
    gen = torch.Generator().manual_seed(seed)
    E, P, L = 16, 24, 3
    old, new = _placement(gen, L, E, P), _placement(gen, L, E, P)
    topology = Topology(gpus, per_node)
    moved = migrate(engine, old, new, E, topology)
    assert torch.equal(moved.holds, new) and moved.mismatch.sum() == 0 and moved.lost == []
    summary = plan(moved.sent, topology)
    assert summary["p2p_ops"] == len(moved.sent) > 0
    assert summary["nvlink_bytes"] + summary["rdma_bytes"] == sum(b for *_, b in moved.sent)
    if per_node == gpus:
        assert summary["rdma_bytes"] == 0
    same = migrate(engine, new, new, E, topology)  # nothing changes: nothing is sent
    assert same.sent == [] and torch.equal(same.holds, new)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tensor_the_updater_is_not_given_leaves_slots_wrong(engine):
    """vLLM #47588's shape: the scale is left out of the list the updater moves."""
    _fetched(engine)
    gen = torch.Generator().manual_seed(3)
    old, new = _placement(gen, 2, 16, 24), _placement(gen, 2, 16, 24)
    moved = migrate(engine, old, new, 16, Topology(4, 2), drop=[2])
    changed = (old != new).sum(1)
    assert torch.equal(moved.mismatch, changed) and moved.mismatch.sum() > 0
    assert moved.lost  # some experts kept no slot whose scale is theirs


@pytest.mark.parametrize("engine", ENGINES)
def test_two_replicas_of_one_expert_on_one_rank_move_in_and_out(engine):
    """DeepSeek EPLB #22's placement: expert 5 twice on rank 1, moved into and out of."""
    _fetched(engine)
    E, G = 8, 4
    start = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    twice = torch.tensor([[0, 1, 2, 5, 4, 5, 6, 7, 3, 1, 2, 3]])  # rank 1: slots 3 and 5
    assert (twice[0, 3:6] == 5).sum() == 2
    topology = Topology(G, 2)
    into = migrate(engine, start, twice, E, topology)
    assert torch.equal(into.holds, twice) and into.lost == []
    back = migrate(engine, twice, start, E, topology)
    assert torch.equal(back.holds, start) and back.lost == []


def test_real_ranks_move_the_same_slots_and_bytes_as_the_simulation():
    from eplbsim.migration.real import migrate_on_processes
    gen = torch.Generator().manual_seed(4)
    old, new = _placement(gen, 2, 16, 24), _placement(gen, 2, 16, 24)
    topology = Topology(4, 2)
    for engine in ENGINES:
        _fetched(engine)
        sim = migrate(engine, old, new, 16, topology)
        real = migrate_on_processes(engine, old, new, 16, topology)
        assert torch.equal(real.holds, sim.holds) and torch.equal(real.holds, new)
        assert sorted(real.sent) == sorted(sim.sent)


def test_bad_requests_are_input_errors():
    old = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(InputError, match="unknown migration"):
        migrate("deepspeed", old, old, 4, Topology(2))
    with pytest.raises(InputError, match="differ in shape"):
        migrate("vllm", old, old[:, :4], 4, Topology(2))
