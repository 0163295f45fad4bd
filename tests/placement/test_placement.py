"""Tests of eplbsim.placement: derived maps, validation, the promise, and rank views.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs, `R` max replicas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplbsim.base.errors import InputError
from eplbsim.placement import (
    VIEWS,
    Placement,
    View,
    as_placement,
    full_view,
    sglang_0_5_14_view,
    rank_view,
    trivial_placement,
)
from eplbsim.placement.topology import Topology

# ---------------------------------------------------------------- reference implementations


def _ref_log2phy(phy2log: list[list[int]], E: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(logcnt [L][E], replica lists [L][E][...] ascending) by brute force."""
    cnt = [[sum(1 for x in row if x == e) for e in range(E)] for row in phy2log]
    reps = [[[p for p, x in enumerate(row) if x == e] for e in range(E)] for row in phy2log]
    return cnt, reps


def _ref_nearest(phy2log: list[list[int]], E: int, topo: Topology, rank: int):
    """Candidates of every expert in the nearest view of `rank`, DESIGN.md §3, by brute force."""
    P = len(phy2log[0])
    per_gpu = P // topo.num_gpus
    node = rank // topo.gpus_per_node
    out = []
    for row in phy2log:
        layer = []
        for e in range(E):
            reps = [p for p, x in enumerate(row) if x == e]
            on_gpu = [p for p in reps if p // per_gpu == rank]
            on_node = [p for p in reps if (p // per_gpu) // topo.gpus_per_node == node]
            layer.append([min(on_gpu)] if on_gpu else [min(on_node)] if on_node else reps)
        out.append(layer)
    return out


def _view_lists(view: View) -> list[list[list[int]]]:
    """Candidate lists of a view with padding stripped; checks padding is only at the end."""
    out = []
    for l_row, c_row in zip(view.log2phy.tolist(), view.logcnt.tolist()):
        layer = []
        for cands, n in zip(l_row, c_row):
            assert all(c >= 0 for c in cands[:n]) and all(c == -1 for c in cands[n:])
            layer.append(cands[:n])
        out.append(layer)
    return out


@st.composite
def placements(draw, max_layers=3, max_experts=8, max_gpus=4):
    """(phy2log [L][P], E, topology) with every expert present in every layer."""
    G = draw(st.integers(1, max_gpus))
    gpn = draw(st.sampled_from([d for d in range(1, G + 1) if G % d == 0]))
    E = draw(st.integers(1, max_experts))
    per_gpu = draw(st.integers(-(-E // G), -(-E // G) + 3))
    P = G * per_gpu
    L = draw(st.integers(1, max_layers))
    rows = []
    for _ in range(L):
        extra = draw(st.lists(st.integers(0, E - 1), min_size=P - E, max_size=P - E))
        rows.append(draw(st.permutations(list(range(E)) + extra)))
    return rows, E, Topology(G, gpn)


# ---------------------------------------------------------------- derived maps


@settings(max_examples=80, deadline=None)
@given(placements())
def test_log2phy_inverts_phy2log(case):
    rows, E, topo = case
    pl = Placement(torch.tensor(rows), E, topo)
    L, P = len(rows), len(rows[0])
    cnt, reps = _ref_log2phy(rows, E)
    assert pl.num_layers == L and pl.num_slots == P
    assert pl.phy2log.dtype == torch.int64 and pl.phy2log.tolist() == rows
    assert pl.logcnt.dtype == torch.int64 and pl.logcnt.tolist() == cnt
    assert (pl.logcnt >= 1).all() and (pl.logcnt.sum(1) == P).all()
    log2phy = pl.log2phy
    assert log2phy.dtype == torch.int64
    R = max(max(c) for c in cnt)
    assert log2phy.shape == (L, E, R)
    for layer in range(L):
        seen = []
        for e in range(E):
            slots = log2phy[layer, e].tolist()
            n = cnt[layer][e]
            assert slots == reps[layer][e] + [-1] * (R - n)  # ascending, -1 padded
            for p in slots[:n]:
                assert rows[layer][p] == e
            seen += slots[:n]
        assert sorted(seen) == list(range(P))  # every slot exactly once
    assert pl.slot_gpu.tolist() == topo.slot_gpu(P).tolist()
    assert pl.slot_node.tolist() == topo.slot_node(P).tolist()


def test_log2phy_hand_example():
    pl = Placement([[2, 0, 2, 1, 0, 2]], 3, Topology(2))
    assert pl.logcnt.tolist() == [[2, 1, 3]]
    assert pl.log2phy.tolist() == [[[1, 4, -1], [3, -1, -1], [0, 2, 5]]]


def test_placement_does_not_alias_input():
    p2l = torch.tensor([[0, 1, 1, 0]])
    pl = Placement(p2l, 2, Topology(2))
    p2l[0, 0] = 1
    assert pl.phy2log.tolist() == [[0, 1, 1, 0]]


def test_accepts_numpy_and_lists_and_narrow_ints():
    for p2l in ([[0, 1]], np.array([[0, 1]], dtype=np.int16), torch.tensor([[0, 1]],
                                                                          dtype=torch.int32)):
        pl = Placement(p2l, 2, Topology(1))
        assert pl.phy2log.dtype == torch.int64 and pl.phy2log.tolist() == [[0, 1]]


# ---------------------------------------------------------------- validation


def test_expert_without_replica():
    with pytest.raises(InputError, match="expert 2 has no replica in layer 1"):
        Placement([[0, 1, 2, 0], [0, 1, 1, 0]], 3, Topology(2))


@pytest.mark.parametrize("p2l", [[[0, 1, 3, 0]], [[0, 1, -2, 2]], [[0, 1, 2, 300]]])
def test_ids_out_of_range(p2l):  # -1 is an empty slot (tests/placement/test_empty_slots.py)
    with pytest.raises(InputError, match=r"expert ids outside \[0, 3\)"):
        Placement(p2l, 3, Topology(2))


def test_fewer_slots_than_experts():
    with pytest.raises(InputError, match="2 physical slots are fewer than the 3 logical experts"):
        Placement([[0, 1]], 3, Topology(1))


def test_slots_not_divisible_by_gpus():
    with pytest.raises(InputError, match="6 physical slots cannot be spread evenly over 4 GPUs"):
        Placement([[0, 1, 2, 0, 1, 2]], 3, Topology(4))


@pytest.mark.parametrize("p2l", [[0, 1, 2, 3], [[[0, 1]]], 3])
def test_wrong_ndim(p2l):
    with pytest.raises(InputError, match=r"phy2log must have shape \[layers, slots\]"):
        Placement(p2l, 2, Topology(1))


@pytest.mark.parametrize("p2l", [torch.zeros(1, 2), np.array([[True, False]])])
def test_non_integer_phy2log(p2l):
    with pytest.raises(InputError, match="phy2log must hold integers"):
        Placement(p2l, 2, Topology(1))


def test_trivial_placement():
    topo = Topology(4, 2)
    pl = trivial_placement(3, 6, 12, topo)
    assert pl.phy2log.tolist() == [[p % 6 for p in range(12)]] * 3
    assert pl.logcnt.tolist() == [[2] * 6] * 3
    assert pl.log2phy[0].tolist() == [[e, e + 6] for e in range(6)]
    assert pl.topology is topo and pl.num_experts == 6
    uneven = trivial_placement(1, 3, 4, Topology(2))
    assert uneven.logcnt.tolist() == [[2, 1, 1]]
    with pytest.raises(InputError):
        trivial_placement(1, 5, 4, Topology(2))


def test_as_placement():
    pl = trivial_placement(1, 2, 2, Topology(1))
    assert as_placement(pl, 2, Topology(1)) is pl
    assert as_placement([[1, 0]], 2, Topology(1)).phy2log.tolist() == [[1, 0]]


# ---------------------------------------------------------------- the promise


@settings(max_examples=50, deadline=None)
@given(placements(), st.integers(0, 2**31 - 1), st.integers(1, 3))
def test_expected_load_conserves_total(case, seed, S):
    rows, E, topo = case
    pl = Placement(rows, E, topo)
    L, P = len(rows), len(rows[0])
    load = torch.from_numpy(np.random.default_rng(seed).integers(0, 50, size=(S, L, E)))
    promise = pl.expected_load(load)
    assert promise.dtype == torch.float64 and promise.shape == (S, L, P)
    torch.testing.assert_close(promise.sum(-1), load.sum(-1).to(torch.float64))
    for layer in range(L):
        for p in range(P):
            e = rows[layer][p]
            torch.testing.assert_close(promise[:, layer, p],
                                       load[:, layer, e].double() / pl.logcnt[layer, e].double())
    # without a leading step axis too
    torch.testing.assert_close(pl.expected_load(load[0]), promise[0])


def test_expected_load_hand_example():
    pl = Placement([[0, 1, 0, 0]], 2, Topology(2))
    assert pl.expected_load(torch.tensor([[9, 4]])).tolist() == [[3.0, 4.0, 3.0, 3.0]]


# ---------------------------------------------------------------- rank views

# 2 nodes x 2 GPUs, 3 slots per GPU:
#   GPU0 (node 0): slots 0 1 2 | GPU1 (node 0): 3 4 5 | GPU2 (node 1): 6 7 8 | GPU3 (node 1): 9 10 11
HAND_TOPO = Topology(4, 2)
HAND_P2L = [[0, 1, 2, 2, 4, 5, 3, 0, 0, 1, 1, 5]]
# replicas: e0 {0, 7, 8}, e1 {1, 9, 10}, e2 {2, 3}, e3 {6}, e4 {4}, e5 {5, 11}
HAND_NEAREST = {
    # rank 0: e0, e1, e2 on its GPU; e4, e5 only on its node; e3 only remote (single replica)
    0: [[0], [1], [2], [6], [4], [5]],
    # rank 1: e2 on GPU (slot 3, though slot 2 on its node is lower); e0, e1 on node only
    1: [[0], [1], [3], [6], [4], [5]],
    # rank 2: e0 twice on its GPU -> lowest (7), not the lower remote 0; e1 on node -> 9 not 10;
    #         e2 only remote -> all replicas; e5 on node -> 11
    2: [[7], [9], [2, 3], [6], [4], [11]],
    # rank 3: e0 on node -> 7; e1 on GPU -> 9; e2 remote -> all; e3 on node; e5 on GPU
    3: [[7], [9], [2, 3], [6], [4], [11]],
}


def test_full_view_equals_placement_maps():
    pl = Placement(HAND_P2L, 6, HAND_TOPO)
    for rank in (None, 0, 3):
        v = full_view(pl, rank)
        assert torch.equal(v.log2phy, pl.log2phy) and torch.equal(v.logcnt, pl.logcnt)
        assert v.placement is pl and v.rank == rank
        assert rank_view("full", pl, rank if rank is not None else 0).log2phy.tolist() == \
            pl.log2phy.tolist()


@pytest.mark.parametrize("rank", sorted(HAND_NEAREST))
def test_nearest_view_hand_example(rank):
    pl = Placement(HAND_P2L, 6, HAND_TOPO)
    v = sglang_0_5_14_view(pl, rank)
    assert v.rank == rank and v.placement is pl
    assert _view_lists(v) == [HAND_NEAREST[rank]]
    assert v.log2phy.shape == pl.log2phy.shape
    assert v.logcnt.tolist() == [[len(c) for c in HAND_NEAREST[rank]]]


def test_nearest_view_each_case_explicitly():
    """The three branches of DESIGN.md §3, named, on rank 2 (GPU 2 = slots 6-8, node 1)."""
    pl = Placement(HAND_P2L, 6, HAND_TOPO)
    v = sglang_0_5_14_view(pl, 2)
    # replica on this rank's GPU (two there: the lowest one)
    assert v.log2phy[0, 0].tolist() == [7, -1, -1] and int(v.logcnt[0, 0]) == 1
    # replicas only on this rank's node (slots 9, 10 on GPU 3): the lowest one
    assert v.log2phy[0, 1].tolist() == [9, -1, -1] and int(v.logcnt[0, 1]) == 1
    # replicas only on the other node: all of them
    assert v.log2phy[0, 2].tolist() == [2, 3, -1] and int(v.logcnt[0, 2]) == 2


def test_nearest_views_differ_between_ranks():
    pl = Placement(HAND_P2L, 6, HAND_TOPO)
    views = [sglang_0_5_14_view(pl, r).log2phy for r in range(4)]
    assert not torch.equal(views[0], views[2])


@settings(max_examples=80, deadline=None)
@given(placements())
def test_nearest_view_matches_reference_and_picks_replicas(case):
    rows, E, topo = case
    pl = Placement(rows, E, topo)
    for rank in range(topo.num_gpus):
        v = rank_view("sglang-0.5.14", pl, rank)
        lists = _view_lists(v)
        assert lists == _ref_nearest(rows, E, topo, rank)
        for layer, per_expert in enumerate(lists):
            for e, cands in enumerate(per_expert):
                assert len(cands) >= 1
                assert cands == sorted(cands)
                assert all(rows[layer][p] == e for p in cands)  # a replica of the expert


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.data())
def test_zero_redundancy_nearest_equals_full(G, per_gpu, L, data):
    gpn = data.draw(st.sampled_from([d for d in range(1, G + 1) if G % d == 0]))
    E = G * per_gpu  # P == E: no redundancy
    rows = [data.draw(st.permutations(list(range(E)))) for _ in range(L)]
    pl = Placement(rows, E, Topology(G, gpn))
    for rank in range(G):
        v = sglang_0_5_14_view(pl, rank)
        assert torch.equal(v.log2phy, pl.log2phy)
        assert torch.equal(v.logcnt, pl.logcnt)


def test_single_node_nearest_has_one_candidate():
    pl = trivial_placement(2, 4, 8, Topology(4))
    for rank in range(4):
        assert (sglang_0_5_14_view(pl, rank).logcnt == 1).all()


@pytest.mark.parametrize("rank", [-1, 4, 10])
def test_nearest_view_rank_out_of_range(rank):
    pl = Placement(HAND_P2L, 6, HAND_TOPO)
    with pytest.raises(InputError, match=rf"rank {rank} is outside \[0, 4\)"):
        sglang_0_5_14_view(pl, rank)


def test_rank_view_by_name_and_callable():
    pl = Placement(HAND_P2L, 6, HAND_TOPO)
    assert set(VIEWS) >= {"full", "sglang-0.5.14", "sglang"}
    assert _view_lists(rank_view("sglang-0.5.14", pl, 1)) == [HAND_NEAREST[1]]
    assert torch.equal(rank_view("full", pl, 1).log2phy, pl.log2phy)
    calls = []

    def custom(placement, rank):
        calls.append(rank)
        return full_view(placement, rank)

    v = rank_view(custom, pl, 3)
    assert calls == [3] and v.rank == 3
    assert rank_view(sglang_0_5_14_view, pl, 2).log2phy.tolist() == sglang_0_5_14_view(pl, 2).log2phy.tolist()


def test_rank_view_unknown_name():
    pl = trivial_placement(1, 2, 2, Topology(1))
    with pytest.raises(InputError, match=r"unknown view 'closest'; choose one of full, sglang, sglang-0.5.14, sglang-0.5.16"):
        rank_view("closest", pl, 0)


def test_view_to_device_keeps_content():
    pl = Placement(HAND_P2L, 6, HAND_TOPO)
    v = sglang_0_5_14_view(pl, 2).to("cpu")
    assert v.rank == 2 and v.placement is pl
    assert _view_lists(v) == [HAND_NEAREST[2]]
