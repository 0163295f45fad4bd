"""`trtllm-online`: TensorRT-LLM's online EPLB replication and placement (eplbsim.solvers.trtllm):
the solver contract, hand-computed cases pinned to what the engine's host code does, and the
replica counts TensorRT-LLM's own unit tests expect.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs, `S = P / G` slots a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplbsim.placement.topology import Topology
from eplbsim.solvers import SOLVERS, solve
from eplbsim.solvers.trtllm import place_replicas, replica_counts, trtllm_online


def _random_load(rng: np.random.Generator, L: int, E: int, kind: int) -> np.ndarray:
    """`[L, E]` loads: skewed reals, small integers (many ties), or mostly idle experts."""
    if kind == 0:
        return np.round(rng.random((L, E)) * np.exp(3 * rng.standard_normal((L, E))) * 100)
    if kind == 1:
        return rng.integers(0, 3, (L, E)).astype(np.float64)
    return np.where(rng.random((L, E)) < 0.7, 0.0, rng.random((L, E)) * 1000)


def _gpu_loads(load: np.ndarray, phy2log: np.ndarray, G: int) -> np.ndarray:
    """Per-GPU load under the even split of each expert's load over its replicas: `[L, G]`."""
    counts = np.stack([np.bincount(row, minlength=load.shape[1]) for row in phy2log])  # [L, E]
    per_slot = np.take_along_axis(load / counts, phy2log, 1)  # [L, P]
    return per_slot.reshape(len(phy2log), G, -1).sum(-1)


def test_registered():
    assert SOLVERS["trtllm-online"] is trtllm_online


@pytest.mark.parametrize("seed", range(40))
def test_contract_and_greedy_guarantees(seed):
    rng = np.random.default_rng(seed)
    L, G = int(rng.integers(1, 4)), int(rng.integers(1, 7))
    E = int(rng.integers(1, 30))
    S = int(rng.integers(-(-E // G), -(-E // G) + 5))
    P = G * S
    load = _random_load(rng, L, E, seed % 3)
    kept = load.copy()
    raw = trtllm_online(load, P, Topology(G), 1)
    assert np.array_equal(load, kept)  # the caller's array is untouched
    assert raw.dtype == np.int64 and raw.shape == (L, P)
    assert np.array_equal(trtllm_online(load, P, Topology(G), 1), raw)  # deterministic
    placement = solve("trtllm-online", load, P, Topology(G))
    assert np.array_equal(placement.phy2log.numpy(), raw)
    counts = np.stack([np.bincount(row, minlength=E) for row in raw])  # [L, E]
    assert (counts >= 1).all() and (counts.sum(1) == P).all()
    for layer in range(L):
        w, c = load[layer], counts[layer]
        if w.sum() == 0:  # no load: P // E each, the lowest ids one more
            assert c.tolist() == [P // E + (e < P % E) for e in range(E)]
            continue
        # replicas follow load: a heavier expert never has fewer replicas; equal loads differ
        # by at most one replica, the higher id first (the engine's tie-break)
        for a in range(E):
            for b in range(E):
                if w[a] > w[b]:
                    assert c[a] >= c[b]
                elif w[a] == w[b] and a < b:
                    assert c[a] <= c[b] <= c[a] + 1
        # water-filling: each expert's last replica went to it when its load per replica was
        # the largest, which only falls, so taking one back leaves it at least the final max
        top = (w / c).max()
        assert all(w[e] / (c[e] - 1) >= top for e in range(E) if c[e] > 1)
    # greedy placement: every GPU within the heaviest replica of the mean GPU load (the list-
    # scheduling bound; with each GPU taking exactly S replicas no instance broke it either)
    per_gpu = _gpu_loads(load, raw, G)  # [L, G]
    heaviest = (load / counts).max(1)  # [L]
    assert (per_gpu.max(1) <= load.sum(1) / G + heaviest + 1e-9 * (1 + load.sum(1))).all()


def test_hand_example_pins_replication_and_placement():
    """w = [6, 3, 3, 2], 6 slots on 2 GPUs of 3, followed by hand through the engine's code
    (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp @ 65b31db1):

    doReplication ("Greedy Replication using Priority Queue"): counts start at 1; the 2 extra
    replicas pop the max of the (w / c, e) max-heap: (6, 0) -> c0 = 2; then (3, 0), (3, 1),
    (3, 2) tie and the pair compares the id second, so (3, 2) -> c2 = 2. counts [2, 1, 2, 1]
    (lowest-index water-filling, `lpt`'s, would give [3, 1, 1, 1]).

    doPlacement: replicas sorted by ReplicaInfo::operator< (slotSize descending, expertId
    ascending): e0 3, e0 3, e1 3, e3 2, e2 1.5, e2 1.5; each to the top of the (load, rank)
    min-heap, a full rank leaving it:
      e0 -> GPU 0 (0 = 0, lower rank)  loads 3, 0
      e0 -> GPU 1                      loads 3, 3
      e1 -> GPU 0 (3 = 3, lower rank)  loads 6, 3
      e3 -> GPU 1                      loads 6, 5
      e2 -> GPU 1 (5 < 6; now full)    loads 6, 6.5
      e2 -> GPU 0 (the only one left)  loads 7.5, 6.5
    """
    w = np.array([6.0, 3.0, 3.0, 2.0])
    assert replica_counts(w, 6).tolist() == [2, 1, 2, 1]
    assert place_replicas(w, np.array([2, 1, 2, 1]), 2).tolist() == [0, 1, 2, 0, 3, 2]
    out = trtllm_online(w[None], 6, Topology(2))
    assert out.tolist() == [[0, 1, 2, 0, 3, 2]]
    assert _gpu_loads(w[None], out, 2).tolist() == [[7.5, 6.5]]


def test_no_load_and_no_redundancy_edge_cases():
    """doReplication's two early returns, then doPlacement on all-zero weights: every pop ties
    at load 0, so GPU 0 takes replicas until full (two replicas of expert 0 on one GPU)."""
    zero = np.zeros((1, 4))
    assert replica_counts(zero[0], 6).tolist() == [2, 2, 1, 1]
    assert trtllm_online(zero, 6, Topology(2)).tolist() == [[0, 0, 1, 1, 2, 3]]
    # P == E: one replica each, whatever the load; placed heaviest first, ties to GPU 0
    w = np.array([[1.0, 5.0, 3.0, 2.0]])
    assert replica_counts(w[0], 4).tolist() == [1, 1, 1, 1]
    # 5 -> GPU 0, 3 -> GPU 1, 2 -> GPU 1 (3 < 5; full), 1 -> GPU 0
    assert trtllm_online(w, 4, Topology(2)).tolist() == [[1, 0, 2, 3]]


# TensorRT-LLM's own expectations for doReplication (NVIDIA/TensorRT-LLM
# cpp/tests/unit_tests/runtime/moeLoadBalancerTest.cpp @ c37fbf3950be55bb63f7047dee50bacaec4f3ad5,
# ReplicationTests): (load factors, slots a rank, ranks, expected replica counts).
TRTLLM_REPLICATION_CASES = [
    ([1.0, 2.0, 3.0, 4.0], 2, 2, [1, 1, 1, 1]),        # "Equal slots and experts"
    ([0.0, 0.0, 0.0, 0.0], 3, 2, [2, 2, 1, 1]),        # "Zero load factors"
    ([1.0, 4.0, 2.0, 1.0], 4, 2, [1, 4, 2, 1]),        # "Varied load factors"
    ([10.0, 5.0, 2.0, 15.0, 8.0], 3, 3, [2, 1, 1, 3, 2]),  # "Complex load distribution"
    ([0.0, 10.0, 0.0], 2, 2, [1, 2, 1]),               # "Single expert with load"
]


@pytest.mark.parametrize("w, S, G, expected", TRTLLM_REPLICATION_CASES)
def test_trtllm_unit_test_replica_counts(w, S, G, expected):
    assert replica_counts(np.array(w), S * G).tolist() == expected
    out = solve("trtllm-online", [w], S * G, Topology(G))
    assert out.logcnt[0].tolist() == expected


# The same file's PlacementTests: (load factors, slots a rank, ranks, replica counts, the most
# two ranks' loads may differ by).
TRTLLM_PLACEMENT_CASES = [
    ([1.0, 1.0, 1.0, 1.0], 2, 2, [1, 1, 1, 1], 0.001),
    ([1.0, 3.0, 2.0, 1.0], 3, 2, [1, 2, 2, 1], 0.01),
    ([10.0, 5.0, 2.0, 15.0, 8.0], 3, 3, [2, 1, 1, 3, 2], 2.0),
    ([1.0, 100.0, 10.0], 2, 2, [1, 2, 1], 9.0),
    ([2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 3, 2, [1, 1, 1, 1, 1, 1], 1.0),
]


@pytest.mark.parametrize("w, S, G, counts, spread", TRTLLM_PLACEMENT_CASES)
def test_trtllm_unit_test_placements(w, S, G, counts, spread):
    w, counts = np.array(w), np.array(counts)
    slots = place_replicas(w, counts, G)
    assert np.bincount(slots, minlength=len(w)).tolist() == counts.tolist()
    per_gpu = (w / counts)[slots].reshape(G, S).sum(1)
    assert per_gpu.max() - per_gpu.min() <= spread


def test_groups_and_nodes_are_ignored():
    rng = np.random.default_rng(7)
    load = rng.integers(0, 100, (3, 12)).astype(np.float64)
    flat = solve("trtllm-online", load, 16, Topology(4, 4), 1).phy2log
    for topo, groups in ((Topology(4, 2), 4), (Topology(4, 1), 2), (Topology(4, 4), 3)):
        assert torch.equal(solve("trtllm-online", load, 16, topo, groups).phy2log, flat)
