"""`flashlb`: vLLM's FlashLB policy (`FlashlbEplbPolicy.rebalance_experts`), written from its
code (vllm/distributed/eplb/policy/flashlb.py, commit 90caa233d597, whose algorithm is the one
of d2e5d5958ab5): the same placements from the same loads, float32 rounding and sort ties
included. `flashlb-paper` (`solvers.flashlb_paper`) is FlashLB as its paper describes it.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs (vLLM's `M`
ranks), `S = P / G` slots per GPU, `W` stages (FlashLB's window of loads), `K` experts of a
sub-problem.

Per layer, FlashLB reads its stages `X [W, E]`, each a load vector plus one (vLLM adds one to
every count), and weighs stage `w` by its total over the largest stage total:
1. **Greedy counts** (`compute_piece_counts`): one replica each, then each further replica to
   the expert that gains most, summed over the stages (one stage: the largest load per replica,
   lowest index on ties).
2. **Placement** (`lpt_placement`): experts in descending load per replica (summed over the
   stages), every replica of an expert onto a different GPU with a free slot: the one that
   least raises the stages' maxima relative to their means (`max(load_g + w, max load) /
   (mean + w + 0.01)`, summed with the stage weights; lowest GPU on ties). An expert with more
   replicas than GPUs have room for (it already sits on every GPU with a free slot) loses the
   rest, and vLLM fills each slot left over with an expert that GPU lacks, drawn at random
   (numba's unseeded generator); the twin takes the lowest such expert and reports the slots
   in `info["random_slots"]`. A GPU that already holds all `E` experts (`S > E`) is left with
   -1 by vLLM, which its engine cannot serve; there the twin puts the lost replicas (vLLM's
   own counts, which it reports as `logcnt`), the only placement with these counts.
3. **Group search** (`group_based_adaptive_searching_kernel`, from `G >= 2`): the experts by
   descending load are cut into `S` consecutive groups, each given exactly `G` replicas (the
   greedy counts of step 1 within the group), each group's size chosen by bisection on how
   flat the sorted per-GPU loads stay against the greedy counts' slopes.
4. The group search's counts, placed as in step 2, replace the greedy ones unless their max
   GPU load (loads summed over the stages, split evenly over replicas) is larger.

The arithmetic is vLLM's numba code's: float32 where it stores float32 (per-replica loads,
GPU loads, the search's slices and slopes), float64 where it computes in float64, sums in its
order, and its sorts' tie order (numba's quicksort: insertion sort up to 16 items, median-of-
three partitions above, `_numba_argsort`), so equal loads land where vLLM puts them.

vLLM ignores the expert groups and nodes (global balancing) and so does the twin. Where vLLM's
group search fails, with many slots an expert (well above two: it runs out of experts before
it runs out of slots, and raises ValueError or reads out of bounds), vLLM gives no placement;
the twin keeps the greedy one of steps 1 and 2 there, which vLLM computed before failing, lists
the layers in `info["vllm_fails"]` and says so in an InputWarning.

`solve(previous=...)` lays the result over the placement in service by eplbsim's rule (GPU
matching, then each staying expert in its old slot; `few_moves`), keeping FlashLB's one
replica of an expert per GPU (`SEPARATE_REPLICAS`). vLLM's own warm start keeps the old
placement for layers whose imbalance does not improve by its threshold (kept across calls), and
changes at most 8 layers a call: a schedule, not a placement, which this function does not
model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.errors import InputError, InputWarning, warn_caller
from ..placement.topology import Topology

MAX_STAGES = 32  # vLLM's window: the last 32 load vectors a layer was given
SMALL_SORT = 15  # numba's quicksort: ranges with fewer than 16 items are insertion-sorted


def flashlb(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
            history: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
    """vLLM's FlashLB: greedy counts, a group search over them, one replica per GPU.

    load:       float64 `[L, E]` pairs per logical expert (one stage, as vLLM's first call)
    num_slots:  `P`, a multiple of `G`, at least `E`
    topology:   the cluster (only `G` is read); num_groups: ignored, as vLLM ignores them
    history:    float `[W, L, E]` FlashLB's window of stages (vLLM keeps one per rebalance,
                the last 32); given, its last 32 stages replace `load`
    Returns (phy2log int64 `[L, P]`, info): `info["random_slots"]` counts the slots vLLM fills
    with an expert drawn at random in the placements it compares, `info["vllm_empty_slots"]`
    those it leaves at -1 (module doc, step 2); `info["vllm_fails"]` lists the layers where
    vLLM's search fails (module doc), which keep the greedy placement, with an InputWarning
    saying so.
    """
    L, E = load.shape
    stages = _stages(load, history)  # [W, L, E] float64
    G = topology.num_gpus
    out = np.empty((L, num_slots), dtype=np.int64)
    odd = np.zeros(2, dtype=np.int64)  # slots vLLM fills at random, slots it leaves at -1
    failed, why = [], ""
    for layer in range(L):
        X = stages[:, layer] + 1.0  # [W, E]
        totals = X.sum(1)  # [W]
        weights = totals / totals.max()  # [W] float64
        deployment, filled, fails = _adaptive_search(X, num_slots, G, weights)
        out[layer] = deployment.reshape(-1)
        odd += filled
        if fails:
            failed.append(layer)
            why = why or fails
    info: dict[str, Any] = {key: int(n) for key, n in zip(("random_slots", "vllm_empty_slots"),
                                                          odd) if n}
    if failed:
        info["vllm_fails"] = failed
        warn_caller(f"vLLM's FlashLB fails on {len(failed)} of {L} layers ({E} experts in "
                    f"{num_slots} slots on {G} GPUs: {why}); flashlb keeps its greedy "
                    f"placement there (layers {_span(failed)})", InputWarning)
    return out, info


def _span(layers: list[int]) -> str:
    """Layer numbers for a message: all of them, or the first few and how many more."""
    shown = ", ".join(map(str, layers[:5]))
    return shown if len(layers) <= 5 else f"{shown} and {len(layers) - 5} more"


def _stages(load: np.ndarray, history: Any) -> np.ndarray:
    """FlashLB's stages `[W, L, E]` float64: `history`'s last `MAX_STAGES`, else `load`."""
    L, E = load.shape
    if history is None:
        return np.asarray(load, dtype=np.float64)[None]
    try:
        h = np.asarray(history, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"flashlb's history must be loads [steps, {L}, {E}], got "
                         f"{type(history).__name__}") from None
    if (h.ndim != 3 or h.shape[0] == 0 or h.shape[1:] != (L, E) or not np.isfinite(h).all()
            or (h < 0).any()):
        raise InputError(f"flashlb's history must be finite, non-negative loads [steps, {L}, "
                         f"{E}], got shape {list(h.shape)}")
    return h[-MAX_STAGES:]


def _adaptive_search(X: np.ndarray, P: int, G: int,
                     weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """`group_based_adaptive_searching`: steps 1 to 4 (module doc) for one layer's stages
    `X [W, E]` -> (deployment int64 `[G, S]`, the slots vLLM fills at random and leaves at -1
    in the placements it compares `[2]`, why vLLM's search fails or "")."""
    greedy = _piece_counts(X, P, weights)
    placed, filled = _place(X, greedy, G, weights)
    if G < 2:
        return placed, filled, ""
    try:
        searched = _group_search(X.astype(np.float32), P, G, greedy, weights.astype(np.float32))
    except _SearchFails as fails:
        return placed, filled, str(fails)
    placed_s, filled_s = _place(X, searched, G, weights)
    total = X.sum(0)  # [E]
    if (total / searched)[placed_s].sum(-1).max() > (total / greedy)[placed].sum(-1).max():
        return placed, filled + filled_s, ""
    return placed_s, filled + filled_s, ""


def _piece_counts(X: np.ndarray, P: int, weights: np.ndarray) -> np.ndarray:
    """`compute_piece_counts`: replica counts int64 `[K]` summing to `P` for stages `X [W, K]`
    (float64, or float32 inside the group search, where vLLM's per-replica loads are float32
    too). Each further replica goes to the expert whose summed gain is largest: per stage, the
    expert with the largest load per replica (the first of equals) gains by how much its load
    per replica would drop below the next largest, weighted (or the stage's weight if it would
    not drop); gains add up in float32, as vLLM keeps them."""
    W, K = X.shape
    pieces = np.ones(K, dtype=np.int64)
    unit = (X / pieces).astype(X.dtype)  # [W, K]
    for _ in range(P - K):
        if W == 1:  # one stage: only its top expert gains, and it gains something
            top = int(np.argmax(unit[0]))
        else:
            gains = np.zeros(K, dtype=np.float32)
            for s in range(W):
                top = int(np.argmax(unit[s]))
                second = np.partition(unit[s], K - 2)[K - 2] if K > 1 else unit[s, 0]
                after = float(X[s, top]) / (pieces[top] + 1)
                drop = float(unit[s, top]) - max(after, float(second))
                gains[top] = np.float32(float(gains[top]) + (drop * float(weights[s]) if drop
                                                             else float(weights[s])))
            top = int(np.argmax(gains))
        pieces[top] += 1
        unit[:, top] = X[:, top] / pieces[top]
    return pieces


def _place(X: np.ndarray, pieces: np.ndarray, G: int,
           weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`lpt_placement` (module doc, step 2) of `pieces [E]` replicas for stages `X [W, E]`:
    (deployment int64 `[G, S]`, the slots vLLM fills at random and leaves at -1 `[2]`)."""
    W, E = X.shape
    S = int(pieces.sum()) // G
    unit = (X / pieces).astype(np.float32)  # [W, E]
    score = unit[0].copy()
    for s in range(1, W):
        score = score + unit[s]  # float32, stage by stage
    loads = np.zeros((W, G), dtype=np.float32)  # [W, G]
    deployment = np.full((G, S), -1, dtype=np.int64)
    held = np.zeros(G, dtype=np.int64)
    lost: list[int] = []
    for e in _numba_argsort(-score):
        w = unit[:, e]  # [W] float32
        used = np.zeros(G, dtype=bool)
        for _ in range(int(pieces[e])):
            peak = loads.max(1)  # [W] float32
            grown = loads + w[:, None]  # [W, G] float32
            denom = (np.cumsum(grown.astype(np.float64), 1)[:, -1] / G + 1e-2).astype(
                np.float32)  # [W], summed GPU by GPU as vLLM's loop
            rise = np.maximum(grown, peak[:, None]) / denom[:, None]  # [W, G] float32
            cost = np.zeros(G)
            for s in range(W):
                cost += weights[s] * rise[s].astype(np.float64)
            cost[(held >= S) | used] = np.inf
            g = int(np.argmin(cost))
            if cost[g] == np.inf:
                lost.append(int(e))
                continue
            used[g] = True
            loads[:, g] += w
            deployment[g, held[g]] = e
            held[g] += 1
    odd = np.zeros(2, dtype=np.int64)
    for g in range(G):  # the slots left over, GPU by GPU (module doc, step 2)
        for k in range(S):
            if deployment[g, k] >= 0:
                continue
            absent = np.setdiff1d(np.arange(E), deployment[g])
            if len(absent):
                deployment[g, k] = absent[0]  # vLLM: one drawn at random
                odd[0] += 1
            else:
                deployment[g, k] = lost.pop(0)  # vLLM: -1
                odd[1] += 1
    return deployment, odd


class _SearchFails(Exception):
    """Where vLLM's group search raises or reads out of bounds; the message says how."""


def _group_search(X: np.ndarray, P: int, G: int, greedy: np.ndarray,
                  weights: np.ndarray) -> np.ndarray:
    """`group_based_adaptive_searching_kernel` (module doc, step 3): replica counts int64 `[E]`
    for float32 stages `X [W, E]`, from the greedy counts `greedy [E]`; _SearchFails where
    vLLM's kernel fails."""
    W, E = X.shape
    total = _stage_sum(X)  # [E] float32
    order = _numba_argsort(-total)  # [E] experts by descending load
    ranked = X[:, order]  # [W, E]
    slices = np.sort(_slices(total, greedy))[::-1]  # [P] float32, descending
    slopes = (slices[:P - G + 1] - slices[G - 1:]) / np.float32(G)  # [P - G + 1] float32
    loads = np.zeros(G, dtype=np.float32)
    pieces = np.zeros(E, dtype=np.int64)
    spare, start = P - E, 0
    for _ in range(P // G):
        window = ranked[:, start:start + 2 * G]
        low, high = max(0, start + G - E), min(spare, G - 1)
        while high - low > 1:
            mid = (high + low) // 2
            keep = G - mid
            group = window[:, :keep]
            grown = loads + np.sort(_slices(_stage_sum(group), _piece_counts(group, G,
                                                                               weights)))
            slope = float(grown.max() - grown.min()) / G
            ahead = slopes[start + keep:]
            if not len(ahead):
                raise _SearchFails("its search takes the maximum of no slopes, a ValueError")
            if abs(slope) > abs(float(ahead.max())):
                low = mid
            else:
                high = mid
        keep = G - high
        group = window[:, :keep]
        if group.shape[1] == 0:
            raise _SearchFails("its search runs out of experts before it runs out of slots, "
                               "and counts replicas for none, a ValueError")
        if group.shape[1] < keep:
            raise _SearchFails("its search runs out of experts before it runs out of slots, "
                               "and reads past them")
        counts = _piece_counts(group, G, weights)
        pieces[order[start:start + keep]] = counts
        loads = np.sort(loads + np.sort(_slices(_stage_sum(group), counts)))[::-1]
        start += keep
        spare -= high
    if start < E:
        raise _SearchFails(f"its search leaves {E - start} experts without a replica, and "
                           f"divides by zero")
    return pieces


def _stage_sum(X: np.ndarray) -> np.ndarray:
    """`X [W, K]` summed over the stages in float32, stage by stage: `[K]`."""
    out = X[0].copy()
    for s in range(1, X.shape[0]):
        out = out + X[s]
    return out


def _slices(total: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """`slice_values`: each expert's load per replica, once per replica, float32 `[sum]`."""
    return np.repeat((total / pieces).astype(np.float32), pieces)


def _numba_argsort(keys: np.ndarray) -> np.ndarray:
    """The order numba's `np.argsort(keys)` (quicksort) gives `keys [K]` (no NaN): ranges of
    fewer than `SMALL_SORT + 1` items by insertion sort (stable), longer ones partitioned
    around the median of their first, middle and last items. int64 `[K]`."""
    keys = np.asarray(keys)
    order = np.arange(len(keys), dtype=np.int64)
    if len(keys) < 2:
        return order
    a, r = keys.tolist(), order.tolist()
    stack = [(0, len(a) - 1)]
    while stack:
        low, high = stack.pop()
        while high - low >= SMALL_SORT:
            i = _partition(a, r, low, high)
            if high - i > i - low:  # the larger side waits on the stack
                if high > i:
                    stack.append((i + 1, high))
                high = i - 1
            else:
                if i > low:
                    stack.append((low, i - 1))
                low = i + 1
        for i in range(low + 1, high + 1):  # insertion sort of [low, high]
            k, j = r[i], i
            while j > low and a[k] < a[r[j - 1]]:
                r[j] = r[j - 1]
                j -= 1
            r[j] = k
    return np.array(r, dtype=np.int64)


def _partition(a: list, r: list, low: int, high: int) -> int:
    """Partition `r[low..high]` (indices into `a`) around the median of three, numba's way;
    returns the pivot's final position."""
    mid = (low + high) >> 1
    if a[r[mid]] < a[r[low]]:
        r[low], r[mid] = r[mid], r[low]
    if a[r[high]] < a[r[mid]]:
        r[high], r[mid] = r[mid], r[high]
    if a[r[mid]] < a[r[low]]:
        r[low], r[mid] = r[mid], r[low]
    pivot = a[r[mid]]
    r[high], r[mid] = r[mid], r[high]
    i, j = low, high - 1
    while True:
        while i < high and a[r[i]] < pivot:
            i += 1
        while j >= low and pivot < a[r[j]]:
            j -= 1
        if i >= j:
            break
        r[i], r[j] = r[j], r[i]
        i += 1
        j -= 1
    r[i], r[high] = r[high], r[i]
    return i
