"""Tests of eplbsim.placement.topology: slot -> GPU -> node maps and input checks.

Dimensions: `P` physical slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.placement.topology import Topology


def test_one_node_by_default():
    topo = Topology(4)
    assert topo.gpus_per_node == 4
    assert topo.num_nodes == 1
    assert topo.slot_node(8).tolist() == [0] * 8


@pytest.mark.parametrize("G, gpn, P", [(1, None, 3), (2, 1, 6), (4, 2, 8), (8, 4, 16), (6, 3, 6),
                                       (4, 4, 12)])
def test_slot_gpu_and_node_follow_design(G, gpn, P):
    topo = Topology(G, gpn)
    per_gpu = topo.slots_per_gpu(P)
    assert per_gpu == P // G
    gpu = topo.slot_gpu(P)
    node = topo.slot_node(P)
    assert gpu.dtype == torch.int64 and node.dtype == torch.int64
    assert gpu.shape == (P,) and node.shape == (P,)
    gpus_per_node = gpn or G
    for p in range(P):
        assert int(gpu[p]) == p // (P // G)
        assert int(node[p]) == (p // (P // G)) // gpus_per_node
    # every GPU holds exactly P/G slots and every node G/N GPUs' worth of them
    assert torch.bincount(gpu, minlength=G).tolist() == [P // G] * G
    assert torch.bincount(node, minlength=topo.num_nodes).tolist() == \
        [P // topo.num_nodes] * topo.num_nodes
    assert [topo.node_of_gpu(g) for g in range(G)] == [g // gpus_per_node for g in range(G)]


def test_hand_example_two_nodes():
    topo = Topology(4, 2)
    assert topo.num_nodes == 2
    assert topo.slot_gpu(8).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert topo.slot_node(8).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_gpus_not_divisible_by_gpus_per_node():
    with pytest.raises(InputError, match=r"6 GPUs cannot be split into nodes of 4 GPUs"):
        Topology(6, 4)


@pytest.mark.parametrize("G, P", [(4, 6), (3, 4), (2, 1), (4, 0)])
def test_slots_not_divisible_by_gpus(G, P):
    topo = Topology(G)
    for fn in (topo.slots_per_gpu, topo.slot_gpu, topo.slot_node):
        with pytest.raises(InputError, match=rf"{P} physical slots cannot be spread evenly "
                                             rf"over {G} GPUs"):
            fn(P)


@pytest.mark.parametrize("G", [0, -2, 2.0, "4", None])
def test_bad_num_gpus(G):
    with pytest.raises(InputError, match="number of GPUs must be a positive integer"):
        Topology(G)


@pytest.mark.parametrize("gpn", [0, -1, 1.5, "2"])
def test_bad_gpus_per_node(gpn):
    with pytest.raises(InputError, match="GPUs per node must be a positive integer"):
        Topology(4, gpn)


def test_input_error_is_value_error():
    assert issubclass(InputError, ValueError)
    with pytest.raises(ValueError):
        Topology(0)


def test_frozen():
    topo = Topology(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.num_gpus = 3  # type: ignore[misc]
