"""`trtllm-online`: TensorRT-LLM's online EP load balancer (its greedy replication and
placement), written from its source (NVIDIA/TensorRT-LLM `doReplication` and `doPlacement` in
`cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp` at 65b31db1).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs (the engine's EP
ranks), `S = P / G` slots a GPU. Slot `p` lives on GPU `p // S`.

Read (their code is not copied; this is our own implementation of what it does):
- `cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp` @
  65b31db1b401d3752b8ebe7c29093cbfb6af04b7: `doReplication` (replica counts), `doPlacement`
  (replica -> rank slot), and `SingleLayerMoeLoadBalancer::updateWeightsRoutine`, which runs
  the two on the layer's load statistic `expertLoadFactor` and then, in
  `copyPlacementInfoToGpu`, clears that statistic to 0;
- `cpp/tensorrt_llm/kernels/moeLoadBalance/moeLoadBalanceKernels.cu` @
  ada8389ee4c35f398d95701e231e8b2405ebc606 and `moeLoadBalanceCommon.h` @
  3e6a30e43304848062444d64928ab18b4b34867f: how that statistic is kept (the `decay` predictor,
  `schedule.predictors`);
- `examples/wide_ep/ep_load_balancer/generate_eplb_config.py` @
  76a646e90c8e863629009ea5d365697da147348f: the offline EPLB runs the same two functions on the
  summed counts of a range of iterations.

Per layer, with `w = load[layer]`:
1. replication (`doReplication`): with `P == E` every expert gets one replica; with no load
   (`sum(w) == 0`) every expert gets `P // E` and the first `P % E` experts (lowest ids) one
   more; otherwise every expert starts at `c_e = 1` and each of the `P - E` extra replicas goes,
   one at a time, to the expert with the largest `w_e / c_e`, ties to the HIGHEST expert id (the
   engine pops a max-heap of `(w_e / c_e, e)` pairs, which compares the id second).
2. placement (`doPlacement`): each replica of expert `e` weighs `w_e / c_e`; the replicas, by
   weight descending, ties by expert id ascending, go one at a time to the GPU with the least
   load among those with a free slot, ties to the LOWEST GPU (a min-heap of `(load, g)` pairs),
   into that GPU's next free slot (a GPU's slots fill in order). A GPU's load is the running
   float64 sum of the weights given to it, in that order, as the engine sums it.

Where this differs from the engine (deliberately):
- the engine keeps its statistic in float32 and divides it in double; here `load` is used as
  the float64 it is given, so a tie that exists only after rounding to float32 is not one here;
- the engine re-solves a few layers an iteration in turn (`layer_updates_per_iter`), each from
  scratch without regard to the placement in service (it then copies only the slots whose
  expert changed); a rebalance here re-solves every layer at once, and `solve(previous=...)`
  (the schedule's `--migration-aware`, on by default) lays the result over the placement in
  service, which the engine does not: `--no-migration-aware` keeps the engine's own layout.
The engine's balancer knows only EP ranks: expert groups (`num_groups`) and nodes are ignored.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..placement.topology import Topology


def replica_counts(weight: np.ndarray, num_slots: int) -> np.ndarray:
    """TensorRT-LLM's `doReplication` (module doc, step 1) for one layer: replicas per expert,
    int64 `[E]` summing to `num_slots`, each at least 1. `weight`: float64 `[E]`, `num_slots >=
    E`."""
    num_experts = len(weight)
    if num_slots == num_experts:
        return np.ones(num_experts, dtype=np.int64)
    if weight.sum() == 0.0:
        base, extra = divmod(num_slots, num_experts)
        return base + (np.arange(num_experts) < extra).astype(np.int64)
    counts = np.ones(num_experts, dtype=np.int64)
    # heapq is a min-heap: (-w/c, -e) pops the largest w/c first, then the highest id
    heap = [(-float(w), -e) for e, w in enumerate(weight)]
    heapq.heapify(heap)
    for _ in range(num_slots - num_experts):
        _, neg_e = heapq.heappop(heap)
        e = -neg_e
        counts[e] += 1
        heapq.heappush(heap, (-(float(weight[e]) / float(counts[e])), neg_e))
    return counts


def place_replicas(weight: np.ndarray, counts: np.ndarray, num_gpus: int) -> np.ndarray:
    """TensorRT-LLM's `doPlacement` (module doc, step 2) for one layer: the expert of each slot,
    int64 `[P]` (`P = counts.sum()`, slot `p` on GPU `p // (P // G)`)."""
    num_slots = int(counts.sum())
    per_gpu = num_slots // num_gpus
    size = weight / counts  # [E] weight of one replica of each expert
    replicas = sorted(((-float(size[e]), e) for e in range(len(weight))
                       for _ in range(int(counts[e]))))  # weight descending, then id ascending
    table = np.empty((num_gpus, per_gpu), dtype=np.int64)  # [G, S]
    filled = [0] * num_gpus
    heap = [(0.0, g) for g in range(num_gpus)]  # (load, g): already a heap
    for neg_size, e in replicas:
        load, g = heapq.heappop(heap)
        table[g, filled[g]] = e
        filled[g] += 1
        if filled[g] < per_gpu:  # a full GPU leaves the heap
            heapq.heappush(heap, (load - neg_size, g))
    return table.reshape(num_slots)


def trtllm_online(load: np.ndarray, num_slots: int, topology: Topology,
                  num_groups: int = 1) -> np.ndarray:
    """TensorRT-LLM's online EPLB: greedy replication by load per replica, then greedy placement
    of the replicas, heaviest first, each on the least-loaded GPU with a free slot (module doc).

    load: float64 `[L, E]`; num_slots: `P`, a multiple of `G`, at least `E`; topology: only its
    GPU count is read; num_groups: ignored (the engine does not group experts) -> int64 `[L, P]`
    phy2log. Deterministic: ties as the engine breaks them (module doc)."""
    num_layers = load.shape[0]
    out = np.empty((num_layers, num_slots), dtype=np.int64)  # [L, P]
    for layer in range(num_layers):
        weight = np.asarray(load[layer], dtype=np.float64)  # [E]
        counts = replica_counts(weight, num_slots)
        out[layer] = place_replicas(weight, counts, topology.num_gpus)
    return out
