"""`lpt` and `lpt-hier`: water-filling replication, largest-first packing, improving swaps.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes,
`R` rows (independent packing problems: layers, or (layer, node) pairs), `X` items (replicas)
of a row, `Gr` GPUs of a row, `S = X / Gr` slots per GPU.
Slot `p` lives on GPU `p // (P // G)`; GPU `g` is on node `g // (G // N)`.

`lpt` (global):
  1. replicate: water-filling (each extra replica to the expert with the highest load per
     replica, lowest index on ties; with `anti_colocation` at most `G` replicas per expert);
  2. pack: replicas (each weighing `load_e / c_e`) in descending weight (stable: equal weights
     in replica order) into the least-loaded GPU with a free slot, lowest GPU on ties (with
     `anti_colocation`, one holding no replica of the same expert; should none be left, a
     replica of another expert moves from the lightest GPU lacking the expert to the lightest
     GPU with room, which always exists);
  3. refine: let `M` be the load of the most-loaded GPU (lowest index on ties). Among swaps of a
     replica `a` on it with a lighter replica `b` on another GPU `h` such that both new loads
     fall below `M` (and, with `anti_colocation`, neither GPU then holds an expert twice), apply
     the one with the smallest `max(M - d, load_h + d)`, `d = w_a - w_b` (ties: the lighter
     `h`, then the lighter `a`); repeat until no swap qualifies. A swap may leave another GPU
     at `M` (a tie at the top, or the second-highest GPU above `M - d`): it still lowers the
     sorted load vector lexicographically, so such GPUs are worked off one at a time and the
     loop ends. Swaps must improve by more than `1e-12` of the mean GPU load.
`lpt-hier` keeps each expert group (contiguous blocks of `E / num_groups` experts) on one node,
`num_groups / N` groups per node (needs `num_groups % N == 0` and more than one node, else it is
`lpt`): the group -> node assignment minimizing the hierarchical lower bound (by enumeration
when there are at most `bounds.MAX_PARTITIONS` assignments; else largest-first packing of group
loads improved by swapping groups between the node with the highest bound and the others), then
steps 1-3 inside each node with its `P / N` slots and `G / N` GPUs.

Packing and refinement are compiled with numba and run in parallel over rows; every row is
solved on its own, so the result does not depend on the number of threads.
"""

from __future__ import annotations

import numpy as np

from ..base.compiled import JIT, jit, prange
from ..base.errors import InputError
from ..placement.topology import Topology
from .bounds import hierarchical_assignment, replicate
from .deepseek import balanced_packing


@jit(**JIT)
def _sift_down(heap, size, load, i):  # pragma: no cover - compiled
    """Restore the min-heap `heap[:size]` of GPUs keyed by `(load[g], g)` below position `i`."""
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size:
            a, b = heap[child], heap[child + 1]
            if load[b] < load[a] or (load[b] == load[a] and b < a):
                child += 1
        g, c = heap[i], heap[child]
        if load[g] < load[c] or (load[g] == load[c] and g < c):
            return
        heap[i], heap[child] = c, g
        i = child


@jit(**JIT)
def _pack_greedy(weight, order, table, load):  # pragma: no cover - compiled
    """Items in `order` each to the least-loaded GPU with a free slot (lowest index on ties):
    fills `table [Gr, S]` and `load [Gr]`."""
    num_gpus, S = table.shape
    cnt = np.zeros(num_gpus, np.int64)
    heap = np.arange(num_gpus)  # all loads 0: already a heap
    size = num_gpus
    for x in order:
        g = heap[0]
        table[g, cnt[g]] = x
        cnt[g] += 1
        load[g] += weight[x]
        if cnt[g] == S:
            size -= 1
            heap[0] = heap[size]
        _sift_down(heap, size, load, 0)


@jit(**JIT)
def _pack_anti(weight, expert, order, table, load, holds):  # pragma: no cover - compiled
    """`_pack_greedy` skipping GPUs that hold the item's expert (`holds [Gr, E]`, kept up to
    date); at a dead end a replica of another expert moves from the lightest GPU lacking the
    expert to the lightest GPU with room. Such a replica exists: that GPU is full of distinct
    experts, and the one with room holds the expert and fewer other experts than slots - 1."""
    num_gpus, S = table.shape
    cnt = np.zeros(num_gpus, np.int64)
    for x in order:
        e = expert[x]
        best = -1
        for g in range(num_gpus):
            if cnt[g] < S and not holds[g, e] and (best < 0 or load[g] < load[best]):
                best = g
        if best >= 0:
            table[best, cnt[best]] = x
            cnt[best] += 1
            load[best] += weight[x]
            holds[best, e] = True
            continue
        full, room = -1, -1
        for g in range(num_gpus):
            if not holds[g, e] and (full < 0 or load[g] < load[full]):
                full = g
            if cnt[g] < S and (room < 0 or load[g] < load[room]):
                room = g
        pick, pick_cost = -1, np.inf
        for j in range(S):
            y = table[full, j]
            cost = max(load[full] - weight[y] + weight[x], load[room] + weight[y])
            if not holds[room, expert[y]] and cost < pick_cost:
                pick, pick_cost = j, cost
        y = table[full, pick]
        table[room, cnt[room]] = y
        cnt[room] += 1
        load[room] += weight[y]
        holds[room, expert[y]] = True
        holds[full, expert[y]] = False
        table[full, pick] = x
        load[full] += weight[x] - weight[y]
        holds[full, e] = True


@jit(**JIT)
def _sort_slots(wt, table, j):  # pragma: no cover - compiled
    """Move entry `j` of `wt [S]` (and `table [S]` alongside) to its place in ascending order,
    the rest of `wt` being ascending."""
    S = wt.shape[0]
    w, t = wt[j], table[j]
    while j > 0 and wt[j - 1] > w:
        wt[j], table[j] = wt[j - 1], table[j - 1]
        j -= 1
    while j + 1 < S and wt[j + 1] < w:
        wt[j], table[j] = wt[j + 1], table[j + 1]
        j += 1
    wt[j], table[j] = w, t


@jit(**JIT)
def _refine(weight, expert, table, load, anti, holds):  # pragma: no cover - compiled
    """Improving swaps with the most-loaded GPU until none lowers it (module docstring, step 3);
    updates `table [Gr, S]`, `load [Gr]` and, with `anti`, `holds [Gr, E]`."""
    num_gpus, S = table.shape
    tol = 1e-12 * load.sum() / num_gpus
    wt = np.empty((num_gpus, S))  # [Gr, S] weight of each slot's item, ascending per GPU
    for g in range(num_gpus):
        for j in range(S):
            wt[g, j] = weight[table[g, j]]
            _sort_slots(wt[g, :j + 1], table[g, :j + 1], j)
    by_load = np.argsort(load, kind="mergesort")  # GPUs by (load, index), lightest first
    for _ in range(100 * num_gpus * S + 100):
        top = np.argmax(load)  # the lowest index among the most loaded
        peak = load[top]
        best_val = peak - tol
        best_a, best_h, best_b = -1, -1, -1
        for h in by_load:
            load_h = load[h]
            mid = 0.5 * (peak + load_h)
            if mid >= best_val:  # no swap with h or a heavier GPU can do better
                break
            if h == top:
                continue
            gap = peak - load_h
            if anti:  # every pair, skipping those that would put an expert twice on a GPU
                for ja in range(S):
                    if holds[h, expert[table[top, ja]]]:
                        continue
                    for jb in range(S):
                        d = wt[top, ja] - wt[h, jb]
                        val = mid + abs(d - 0.5 * gap)
                        if 0.0 < d < gap and val < best_val \
                                and not holds[top, expert[table[h, jb]]]:
                            best_val, best_a, best_h, best_b = val, ja, h, jb
                continue
            # both rows ascending: for each a, the b nearest to w_a - gap / 2 (two pointers)
            jb = 0
            for ja in range(S):
                target = wt[top, ja] - 0.5 * gap
                while jb < S and wt[h, jb] <= target:
                    jb += 1
                for j in range(max(jb - 1, 0), min(jb + 1, S)):
                    d = wt[top, ja] - wt[h, j]
                    val = mid + abs(d - 0.5 * gap)
                    if 0.0 < d < gap and val < best_val:
                        best_val, best_a, best_h, best_b = val, ja, h, j
        if best_a < 0:
            return
        h = best_h
        a, b = table[top, best_a], table[h, best_b]
        d = wt[top, best_a] - wt[h, best_b]
        table[top, best_a], table[h, best_b] = b, a
        wt[top, best_a], wt[h, best_b] = weight[b], weight[a]
        _sort_slots(wt[top], table[top], best_a)
        _sort_slots(wt[h], table[h], best_b)
        load[top] -= d
        load[h] += d
        if anti:
            holds[top, expert[a]] = False
            holds[top, expert[b]] = True
            holds[h, expert[b]] = False
            holds[h, expert[a]] = True
        for i in range(1, num_gpus):  # insertion sort: by_load was sorted but for two GPUs
            g = by_load[i]
            k = i
            while k > 0 and (load[by_load[k - 1]] > load[g]
                             or (load[by_load[k - 1]] == load[g] and by_load[k - 1] > g)):
                by_load[k] = by_load[k - 1]
                k -= 1
            by_load[k] = g


@jit(**JIT)
def _solve_row(weight, expert, num_gpus, anti, num_experts, out):  # pragma: no cover - compiled
    """Pack items `weight [X]` (of experts `expert [X]`) onto `num_gpus` GPUs of `X / num_gpus`
    slots and refine; writes the item held by each local slot into `out [X]`, GPU-major."""
    S = weight.shape[0] // num_gpus
    order = np.argsort(-weight, kind="mergesort")  # heaviest first, stable
    load = np.zeros(num_gpus)
    table = np.empty((num_gpus, S), np.int64)  # [Gr, S] item in each slot
    holds = np.zeros((num_gpus, num_experts if anti else 1), np.bool_)  # [Gr, E] (anti only)
    if anti:
        _pack_anti(weight, expert, order, table, load, holds)
    else:
        _pack_greedy(weight, order, table, load)
    _refine(weight, expert, table, load, anti, holds)
    out[:] = table.ravel()


@jit(parallel=True, **JIT)
def _pack_rows(weight, expert, num_gpus, anti, num_experts, out):  # pragma: no cover - compiled
    """`_solve_row` for every row of `weight [R, X]`, `expert [R, X]` into `out [R, X]`."""
    for r in prange(weight.shape[0]):
        _solve_row(weight[r], expert[r], num_gpus, anti, num_experts, out[r])


def pack_items(weight: np.ndarray, expert: np.ndarray, num_gpus: int, anti: bool) -> np.ndarray:
    """Items `weight [R, X]` of experts `expert [R, X]` (ids < X) -> item of each local slot
    int64 `[R, X]`, slot `s` on the row's GPU `s // (X / num_gpus)`."""
    out = np.empty(weight.shape, np.int64)
    _pack_rows(np.ascontiguousarray(weight, dtype=np.float64),
               np.ascontiguousarray(expert, dtype=np.int64), int(num_gpus), bool(anti),
               int(weight.shape[1]), out)
    return out


def _core(load: np.ndarray, num_slots: int, num_gpus: int, anti: bool) -> np.ndarray:
    """Replicate, pack and refine every row: load `[R, X]` -> phy2log int64 `[R, num_slots]`
    (row-local expert ids; local slot `s` on the row's GPU `s // (num_slots / num_gpus)`)."""
    items, counts = replicate(load, num_slots, num_gpus if anti else None)  # [R, P], [R, X]
    weight = np.take_along_axis(load / counts, items, axis=1)  # [R, P] load of each replica
    slot_item = pack_items(weight, items, num_gpus, anti)  # [R, P]
    return np.take_along_axis(items, slot_item, axis=1)


def _check_anti(num_experts: int, num_slots: int, num_gpus: int, where: str = "") -> None:
    """InputError when `num_slots` slots cannot hold `num_experts` experts on `num_gpus` GPUs
    with no GPU holding two replicas of one expert."""
    if num_slots > num_experts * num_gpus:
        need = -(-num_slots // num_experts)
        raise InputError(
            f"anti_colocation is impossible{where}: {num_slots} slots for {num_experts} experts "
            f"need at least {need} replicas of some expert, more than the {num_gpus} GPUs "
            f"(each GPU may hold one replica of an expert)")


def lpt(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
        anti_colocation: bool = False) -> np.ndarray:
    """Water-filling replication, largest-first packing onto all GPUs, improving swaps.

    load:            float64 `[L, E]` pairs per logical expert
    num_slots:       `P`, a multiple of `G`, at least `E`
    topology:        the cluster; num_groups: ignored (`lpt_hier` keeps groups on nodes)
    anti_colocation: no GPU holds two replicas of one expert (InputError when `P > E * G`
                     makes that impossible)
    Returns phy2log int64 `[L, P]`.
    """
    load = np.asarray(load, dtype=np.float64)
    num_experts, num_gpus = load.shape[1], topology.num_gpus
    if anti_colocation:
        _check_anti(num_experts, num_slots, num_gpus)
    return _core(load, num_slots, num_gpus, bool(anti_colocation))


@jit(**JIT)
def _node_cost(load, group_ids, group_size, slots, gpus):  # pragma: no cover - compiled
    """`bounds.lower_bound` of the node holding groups `group_ids` (water-filled ratio bound
    and load over its GPUs)."""
    n = group_ids.shape[0] * group_size
    w = np.empty(n)
    for i in range(group_ids.shape[0]):
        for j in range(group_size):
            w[i * group_size + j] = load[group_ids[i] * group_size + j]
    cnt = np.ones(n)
    for _ in range(slots - n):
        top = 0
        for x in range(1, n):
            if w[x] / cnt[x] > w[top] / cnt[top]:
                top = x
        cnt[top] += 1
    ratio = 0.0
    for x in range(n):
        ratio = max(ratio, w[x] / cnt[x])
    return max(w.sum() / gpus, ratio)


@jit(parallel=True, **JIT)
def _improve_groups(load, node_groups, group_size, slots, gpus):  # pragma: no cover - compiled
    """Swap groups between the node with the highest cost and another while that lowers the
    larger of the two costs: `node_groups [L, N, k]` is updated in place."""
    L, N, k = node_groups.shape
    for layer in prange(L):
        groups = node_groups[layer]
        cost = np.empty(N)
        for n in range(N):
            cost[n] = _node_cost(load[layer], groups[n], group_size, slots, gpus)
        tol = 1e-12 * max(cost.max(), 1e-300)
        for _ in range(100 * N * k + 100):
            top = np.argmax(cost)
            best_val, best = cost[top] - tol, (-1, -1, -1)
            best_costs = (0.0, 0.0)
            for i in range(k):
                for n in range(N):
                    if n == top:
                        continue
                    for j in range(k):
                        a, b = groups[top, i], groups[n, j]
                        groups[top, i], groups[n, j] = b, a
                        c_top = _node_cost(load[layer], groups[top], group_size, slots, gpus)
                        c_n = _node_cost(load[layer], groups[n], group_size, slots, gpus)
                        groups[top, i], groups[n, j] = a, b
                        if max(c_top, c_n) < best_val:
                            best_val, best, best_costs = max(c_top, c_n), (i, n, j), (c_top, c_n)
            i, n, j = best
            if i < 0:
                break
            groups[top, i], groups[n, j] = groups[n, j], groups[top, i]
            cost[top], cost[n] = best_costs


def _group_nodes(load: np.ndarray, num_slots: int, topology: Topology,
                 num_groups: int) -> np.ndarray:
    """Groups of each node, int64 `[L, N, num_groups / N]` ascending, minimizing the max node
    bound: exact by enumeration when small, else packing plus group swaps."""
    num_layers, num_experts = load.shape
    num_nodes = topology.num_nodes
    k = num_groups // num_nodes
    group_size = num_experts // num_groups
    exact = hierarchical_assignment(load, num_slots, topology, num_groups)
    if exact is not None:
        group_node = exact[1]  # [L, groups]
    else:
        group_load = load.reshape(num_layers, num_groups, group_size).sum(-1)  # [L, groups]
        group_node = balanced_packing(group_load, num_nodes)[0]  # [L, groups]
    node_groups = np.argsort(group_node * num_groups + np.arange(num_groups), axis=1)
    node_groups = np.ascontiguousarray(node_groups.reshape(num_layers, num_nodes, k))
    if exact is None:
        _improve_groups(load, node_groups, group_size, num_slots // num_nodes,
                        topology.num_gpus // num_nodes)
        node_groups.sort(axis=2)
    return node_groups


def lpt_hier(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
             anti_colocation: bool = False) -> np.ndarray:
    """`lpt` with each expert group kept on one node (`num_groups / N` groups per node).

    load:            float64 `[L, E]` pairs per logical expert
    num_slots:       `P`, a multiple of `G`, at least `E`
    topology:        the cluster (`N` nodes); num_groups: expert groups (contiguous blocks)
    anti_colocation: no GPU holds two replicas of one expert (InputError when a node's
                     `P / N` slots cannot hold its `E / N` experts that way on its `G / N` GPUs)
    Returns phy2log int64 `[L, P]`; `lpt`'s unless `num_groups % N == 0` and `N > 1`.
    """
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_experts = load.shape
    num_nodes, num_gpus = topology.num_nodes, topology.num_gpus
    if num_nodes == 1 or num_groups % num_nodes:
        return lpt(load, num_slots, topology, num_groups, anti_colocation=anti_colocation)
    gpus_per_node, slots_per_node = num_gpus // num_nodes, num_slots // num_nodes
    if anti_colocation:
        _check_anti(num_experts // num_nodes, slots_per_node, gpus_per_node, " within a node")
    node_groups = _group_nodes(load, num_slots, topology, num_groups)  # [L, N, k]
    group_size = num_experts // num_groups
    node_experts = (node_groups[..., None] * group_size
                    + np.arange(group_size)).reshape(num_layers * num_nodes, -1)  # [L*N, E/N]
    rows = np.repeat(np.arange(num_layers), num_nodes)[:, None]  # [L*N, 1]
    local = _core(load[rows, node_experts], slots_per_node, gpus_per_node,
                  bool(anti_colocation))  # [L*N, P/N] node-local expert ids
    phy2log = np.take_along_axis(node_experts, local, axis=1)  # [L*N, P/N]
    return phy2log.reshape(num_layers, num_slots)
