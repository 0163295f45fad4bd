"""Per-batch LP dispatch: the split of each expert's pairs over its replicas that minimises the
max GPU load of one batch, as real fractions and as integer quotas.

Dimensions: `E` logical experts, `R` max candidates of one expert (columns of `log2phy`),
`P` physical slots, `G` GPUs.

Inputs shared by every function (one layer of one rank's view):
- `counts [E]` int64: pairs routed to each expert in the batch (padding never counted);
- `log2phy [E, R]` int64: candidate slots of each expert, -1 padded;
- `logcnt [E]` int64: number of candidates (>= 1); only the first `logcnt[e]` columns count;
- `slot_gpu [P]` int64: GPU of every slot; `num_gpus` = G.

The LP (`optimal_fractions`). Pairs of an expert whose candidates all live on one GPU load that
GPU whatever the split (single-candidate experts included): they are fixed, split evenly over
the expert's candidates. Every other expert `e` with `counts[e] > 0` gets one variable
`y[e, g] >= 0` per distinct GPU `g` among its candidates (pairs of `e` sent to `g`), and

    minimise z  s.t.  sum_g y[e, g] = counts[e]              for every such e
                      fixed[g] + sum_e y[e, g] <= z          for every GPU g

solved with scipy's HiGHS (deterministic: the same inputs give the same vertex). Many splits
share the optimum `z*`, and a bare LP vertex tends to pile an expert on one replica; a second
LP therefore picks, among the splits whose GPU loads stay within `z*` (plus 1e-9 relative
slack), the one closest in L1 distance to the placement's even split `counts[e] * m[e, g] /
logcnt[e]` (`m[e, g]` = candidates of `e` on `g`), so replicas are left unused only where the
batch's balance needs it. The pairs `y[e, g]` are split evenly over `e`'s candidates on `g`, so
GPU loads are those of the LP while replicas on one GPU share equally.

Integer quotas. The optimum `z*` is the max-flow/min-cut value of a bipartite transport problem
(experts -> GPUs), so it is a rational with denominator <= G, and because that network's
constraint matrix is totally unimodular an integer split with max GPU load `ceil(z*)` exists:
no integer split does better (GPU loads are integers >= z*). `optimal_quotas` returns such a
split, always a floor/ceil rounding of `counts * fractions` (see its docstring for the proof).
`integer_quotas` alone (largest-remainder rounding) keeps every row sum exact but may exceed
`ceil(z*)` by up to the number of rounded-up replicas on one GPU.

Results are cached (keyed by the bytes of the inputs): in "none" mode every rank solves the
same LP for the same batch, as a serving engine would after its all-reduce of the counts.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..base.errors import InputError

ROUND_TOL = 1e-6  # values within this of an integer count as that integer
STAGE2_SLACK = 1e-9  # relative room on z* for the second (even-split) stage
_CACHE_SIZE = 1024
_cache: OrderedDict[tuple, Any] = OrderedDict()


def _np(x: Any, dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x), dtype=dtype)


def _inputs(counts: Any, log2phy: Any, logcnt: Any, slot_gpu: Any,
            num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Validated numpy copies: counts, log2phy, logcnt, slot_gpu, G."""
    c, l2p, n, sg = (_np(counts, np.int64), _np(log2phy, np.int64), _np(logcnt, np.int64),
                     _np(slot_gpu, np.int64))
    if l2p.ndim != 2 or c.shape != (l2p.shape[0],) or n.shape != c.shape:
        raise InputError(f"expected counts [E], log2phy [E, R], logcnt [E]; got "
                         f"{c.shape}, {l2p.shape}, {n.shape}")
    G = int(num_gpus)
    if G < 1:
        raise InputError(f"num_gpus must be >= 1, got {num_gpus}")
    if c.size and int(c.min()) < 0:
        raise InputError("counts must be non-negative")
    if n.size and (int(n.min()) < 1 or int(n.max()) > l2p.shape[1]):
        raise InputError(f"logcnt must lie in [1, {l2p.shape[1]}]")
    valid = np.arange(l2p.shape[1]) < n[:, None]
    if ((l2p < 0) & valid).any() or (l2p[valid] >= sg.size).any():
        raise InputError("log2phy lists a slot outside slot_gpu")
    if sg.size and (int(sg.min()) < 0 or int(sg.max()) >= G):
        raise InputError(f"slot_gpu names a GPU outside [0, {G})")
    return c, l2p, n, sg, G


def _candidate_gpus(l2p: np.ndarray, n: np.ndarray, sg: np.ndarray) -> np.ndarray:
    """GPU of every candidate, -1 beyond logcnt: int64 `[E, R]`."""
    valid = np.arange(l2p.shape[1]) < n[:, None]
    return np.where(valid, sg[np.clip(l2p, 0, None)], -1)


def _cached(key: tuple, compute: Any) -> Any:
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    value = compute()
    _cache[key] = value
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return value


def _key(kind: str, c: np.ndarray, l2p: np.ndarray, n: np.ndarray, sg: np.ndarray,
         G: int) -> tuple:
    return (kind, c.tobytes(), l2p.shape, l2p.tobytes(), n.tobytes(), sg.tobytes(), G)


def gpu_load(split: Any, log2phy: Any, logcnt: Any, slot_gpu: Any, num_gpus: int) -> torch.Tensor:
    """Load of every GPU, float64 `[G]`, when candidate `j` of expert `e` serves `split[e, j]`
    pairs (`[E, R]`, real or integer; columns beyond `logcnt[e]` are ignored)."""
    s = _np(split, np.float64)
    _, l2p, n, sg, G = _inputs(np.zeros(s.shape[0], np.int64), log2phy, logcnt, slot_gpu,
                               num_gpus)
    gpu = _candidate_gpus(l2p, n, sg)
    keep = gpu >= 0
    return torch.from_numpy(np.bincount(gpu[keep], weights=s[keep], minlength=G))


def optimal_fractions(counts: Any, log2phy: Any, logcnt: Any, slot_gpu: Any,
                      num_gpus: int) -> torch.Tensor:
    """LP-optimal split of each expert's pairs over its candidates, float64 `[E, R]` (CPU).

    counts [E] int64, log2phy [E, R] int64, logcnt [E] int64, slot_gpu [P] int64 (tensors or
    arrays, any device). Row `e` is non-negative, sums to 1 over its first `logcnt[e]` entries
    and is 0 beyond. `counts[:, None] * fractions` minimises the max GPU load of the batch over
    all real splits (module docstring). Experts with zero count or all candidates on one GPU
    get the even split. Deterministic; cached on the inputs' bytes.
    """
    c, l2p, n, sg, G = _inputs(counts, log2phy, logcnt, slot_gpu, num_gpus)
    frac = _cached(_key("frac", c, l2p, n, sg, G), lambda: _solve_fractions(c, l2p, n, sg, G))
    return torch.from_numpy(frac.copy())


def _solve_fractions(c: np.ndarray, l2p: np.ndarray, n: np.ndarray, sg: np.ndarray,
                     G: int) -> np.ndarray:
    from scipy.optimize import linprog  # scipy loads on first use, not with eplbsim
    from scipy.sparse import csr_matrix

    E, R = l2p.shape
    gpu = _candidate_gpus(l2p, n, sg)  # [E, R]
    valid = gpu >= 0
    frac = np.where(valid, 1.0 / n[:, None], 0.0)  # even split, the default
    if E == 0 or R == 0:
        return frac
    spread = (gpu != gpu[:, :1]) & valid  # candidates off the first one's GPU
    lp = (c > 0) & spread.any(1)  # experts that get LP variables
    if not lp.any():
        return frac
    fixed = np.bincount(gpu[~lp, 0], weights=c[~lp].astype(np.float64), minlength=G)
    # one variable per distinct (expert, GPU) of an LP expert, in ascending (expert, GPU)
    experts = np.flatnonzero(lp)
    pair = np.unique((experts[:, None] * G + gpu[experts])[valid[experts]])
    var_e, var_g = pair // G, pair % G
    V, m = pair.size, experts.size
    row_of = np.full(E, -1)
    row_of[experts] = np.arange(m)
    cost = np.zeros(V + 1)
    cost[V] = 1.0  # minimise z, the last variable
    a_eq = csr_matrix((np.ones(V), (row_of[var_e], np.arange(V))), shape=(m, V + 1))
    a_ub = csr_matrix((np.concatenate([np.ones(V), -np.ones(G)]),
                       (np.concatenate([var_g, np.arange(G)]),
                        np.concatenate([np.arange(V), np.full(G, V)]))), shape=(G, V + 1))
    b_eq = c[experts].astype(np.float64)
    res = linprog(cost, A_ub=a_ub, b_ub=-fixed, A_eq=a_eq, b_eq=b_eq,
                  bounds=[(0, None)] * V + [(None, None)], method="highs")
    if res.status != 0:  # cannot happen for this always-feasible, bounded LP
        raise RuntimeError(f"batch LP failed: {res.message}")
    y = np.clip(res.x[:V], 0.0, None)
    # stage 2: among the splits with max GPU load z*, the one closest (L1) to the even split
    z = float(res.x[V])
    on_gpu = np.zeros((E, G))
    np.add.at(on_gpu, (np.nonzero(valid)[0], gpu[valid]), 1.0)  # [E, G] candidates per GPU
    even = c[var_e] * on_gpu[var_e, var_g] / n[var_e]  # [V] the even split's pairs
    eye = np.arange(V)
    a_ub_y = csr_matrix((np.ones(V), (var_g, eye)), shape=(G, 3 * V))
    a_eq2 = csr_matrix((np.concatenate([np.ones(V), np.ones(V), -np.ones(V), np.ones(V)]),
                        (np.concatenate([row_of[var_e], m + eye, m + eye, m + eye]),
                         np.concatenate([eye, eye, V + eye, 2 * V + eye]))),
                       shape=(m + V, 3 * V))
    res2 = linprog(np.concatenate([np.zeros(V), np.ones(2 * V)]), A_ub=a_ub_y,
                   b_ub=z + STAGE2_SLACK * max(1.0, abs(z)) - fixed, A_eq=a_eq2,
                   b_eq=np.concatenate([b_eq, even]), bounds=[(0, None)] * (3 * V),
                   method="highs")
    if res2.status == 0:  # else keep stage 1's split (equally optimal in the max load)
        y = np.clip(res2.x[:V], 0.0, None)
    # pairs y[e, g] split evenly over e's candidates on g
    per_gpu = np.zeros((E, G))
    per_gpu[var_e, var_g] = y
    same = (gpu[:, :, None] == gpu[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    multiplicity = np.maximum(same.sum(2), 1)  # [E, R] e's candidates on this one's GPU
    share = np.where(valid, per_gpu[np.arange(E)[:, None], np.clip(gpu, 0, None)]
                     / multiplicity, 0.0)
    rows = share[experts]
    rows /= rows.sum(1, keepdims=True)
    frac[experts] = rows
    return frac


def integer_quotas(counts: Any, fractions: Any, logcnt: Any) -> torch.Tensor:
    """Largest-remainder rounding of `counts[:, None] * fractions`, int64 `[E, R]` (CPU).

    Each entry is the floor or ceil of its real share, row `e` sums to `counts[e]` exactly and
    is 0 beyond `logcnt[e]`; the pairs left after flooring go to the largest remainders, ties
    to the lower replica index. InputError unless rows of `fractions` are non-negative and sum
    to 1 over the first `logcnt[e]` entries.
    """
    c, f, n = _np(counts, np.int64), _np(fractions, np.float64), _np(logcnt, np.int64)
    if f.ndim != 2 or c.shape != (f.shape[0],) or n.shape != c.shape:
        raise InputError(f"expected counts [E], fractions [E, R], logcnt [E]; got "
                         f"{c.shape}, {f.shape}, {n.shape}")
    valid = np.arange(f.shape[1]) < n[:, None]
    if f.size and ((f < -ROUND_TOL).any() or (np.abs(f[~valid]) > ROUND_TOL).any()
                   or (np.abs(np.where(valid, f, 0.0).sum(1) - 1) > ROUND_TOL).any()):
        raise InputError("fraction rows must be non-negative and sum to 1 over the candidates")
    exact = c[:, None] * np.where(valid, np.clip(f, 0.0, None), 0.0)
    return torch.from_numpy(_largest_remainder(c, exact, valid))


def _largest_remainder(c: np.ndarray, exact: np.ndarray, valid: np.ndarray) -> np.ndarray:
    base = np.where(valid, np.floor(exact + ROUND_TOL), 0).astype(np.int64)
    over = np.maximum(base.sum(1) - c, 0)  # only from noise: take back from the last entries
    for e in np.flatnonzero(over):
        for j in reversed(np.flatnonzero(base[e] > 0)):
            cut = min(int(over[e]), int(base[e, j]))
            base[e, j] -= cut
            over[e] -= cut
            if not over[e]:
                break
    left = c - base.sum(1)  # [E] in [0, n_e)
    remainder = np.round(np.clip(exact - base, 0.0, None), 9)  # rounding makes near-ties ties
    key = np.where(valid, -remainder, np.inf)
    order = np.argsort(key, axis=1, kind="stable")  # largest first, ties to lower index
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :].repeat(len(c), 0), 1)
    return base + ((rank < left[:, None]) & valid)


def optimal_quotas(counts: Any, log2phy: Any, logcnt: Any, slot_gpu: Any,
                   num_gpus: int) -> torch.Tensor:
    """Integer quotas of the LP split, int64 `[E, R]` (CPU), with the least possible max GPU
    load: exactly `ceil(z*)`, `z*` the LP optimum of `optimal_fractions`.

    Row `e` sums to `counts[e]` and is 0 beyond `logcnt[e]`; after steps 1 and 2 (always, but
    for the numerical safety net of step 3) every entry is the floor or ceil of
    `counts[e] * fractions[e, j]`. Construction and proof:
    1. `integer_quotas` (largest remainder); kept when its max GPU load is already `ceil(z*)`.
    2. Otherwise flow rounding: fix every entry at its floor and route each expert's leftover
       pairs (source -> expert, capacity `counts[e] - sum of floors`) over its fractional
       candidates (expert -> GPU, capacity = number of its fractional candidates there) to the
       GPUs (GPU -> sink, capacity `ceil(z*) - load of the floors`). The LP split minus the
       floors is a feasible real flow saturating the source, and networks with integer
       capacities have integral maximum flows, so an integral saturating flow exists
       (max-flow integrality; the classical flow-rounding theorem) and scipy's Dinic finds one.
       Each expert's units on a GPU go to its fractional candidates there by largest remainder.
    3. Should floating-point noise in the LP solution defeat step 2, the same integral max flow
       is run on the plain network (expert -> GPU capacity `counts[e]`, no floors), which by the
       same integrality argument saturates at capacity `ceil(z*) - fixed load`.
    No integer split beats `ceil(z*)` (integer loads >= z*), so the result is optimal.
    Deterministic; cached on the inputs' bytes.
    """
    c, l2p, n, sg, G = _inputs(counts, log2phy, logcnt, slot_gpu, num_gpus)
    q = _cached(_key("quota", c, l2p, n, sg, G), lambda: _solve_quotas(c, l2p, n, sg, G))
    return torch.from_numpy(q.copy())


def _solve_quotas(c: np.ndarray, l2p: np.ndarray, n: np.ndarray, sg: np.ndarray,
                  G: int) -> np.ndarray:
    frac = optimal_fractions(c, l2p, n, sg, G).numpy()
    gpu = _candidate_gpus(l2p, n, sg)
    valid = gpu >= 0
    exact = c[:, None] * frac

    def loads(split: np.ndarray) -> np.ndarray:  # [G]
        return np.bincount(gpu[valid], weights=split[valid].astype(np.float64), minlength=G)

    z = float(loads(exact).max()) if c.size else 0.0
    target = max(math.ceil(z - ROUND_TOL), 0)
    quotas = _largest_remainder(c, exact, valid)
    if loads(quotas).max(initial=0) <= target:
        return quotas
    rounded = _flow_rounding(c, exact, gpu, valid, G, target)
    if rounded is not None:
        return rounded
    return _plain_flow(c, gpu, valid, G, target)


def _max_flow(num_nodes: int, edges: list[tuple[int, int, int]]) -> tuple[int, dict]:
    """Integral max flow from node 0 to node num_nodes - 1 (scipy's Dinic): value and the flow
    on each given edge, keyed (tail, head)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    tails, heads, caps = (np.array([edge[i] for edge in edges], dtype=np.int64)
                          for i in range(3))
    graph = csr_matrix((caps.astype(np.int32), (tails, heads)), shape=(num_nodes, num_nodes))
    result = maximum_flow(graph, 0, num_nodes - 1, method="dinic")
    flow = result.flow.tocsr()
    return int(result.flow_value), {(int(t), int(h)): int(flow[t, h])
                                    for t, h in zip(tails, heads)}


def _flow_rounding(c: np.ndarray, exact: np.ndarray, gpu: np.ndarray, valid: np.ndarray,
                   G: int, target: int) -> np.ndarray | None:
    """Step 2 of `optimal_quotas`; None when no saturating flow is found (numerical noise)."""
    E = c.size
    base = np.where(valid, np.floor(exact + ROUND_TOL), 0).astype(np.int64)
    left = c - base.sum(1)
    if (left < 0).any():
        return None
    frac_part = valid & (exact - base > ROUND_TOL)
    room = target - np.bincount(gpu[valid], weights=base[valid], minlength=G).astype(np.int64)
    if (room < 0).any():
        return None
    experts = np.flatnonzero(left > 0)
    sink = 1 + experts.size + G
    edges = [(0, 1 + i, int(left[e])) for i, e in enumerate(experts)]
    for i, e in enumerate(experts):
        for g in np.unique(gpu[e][frac_part[e]]):
            edges.append((1 + i, 1 + experts.size + int(g), int((gpu[e] == g)[frac_part[e]].sum())))
    edges += [(1 + experts.size + g, sink, int(room[g])) for g in range(G)]
    value, flow = _max_flow(sink + 1, edges)
    if value != int(left.sum()):
        return None
    quotas = base.copy()
    remainder = np.round(exact - base, 9)
    for i, e in enumerate(experts):
        for g in np.unique(gpu[e][frac_part[e]]):
            units = flow[(1 + i, 1 + experts.size + int(g))]
            cand = np.flatnonzero(frac_part[e] & (gpu[e] == g))
            best = cand[np.argsort(-remainder[e, cand], kind="stable")][:units]
            quotas[e, best] += 1
    assert (quotas.sum(1) == c).all() and E == quotas.shape[0]
    return quotas


def _plain_flow(c: np.ndarray, gpu: np.ndarray, valid: np.ndarray, G: int,
                target: int) -> np.ndarray:
    """Step 3 of `optimal_quotas`: an integral split with max GPU load `target` (raised only if
    the LP's `z*` was numerically wrong), each expert's pairs on a GPU split evenly over its
    candidates there (leftovers to the lower index)."""
    E, R = gpu.shape
    spread = (gpu != gpu[:, :1]) & valid
    free = (c > 0) & spread.any(1)
    fixed = np.bincount(gpu[~free, 0], weights=c[~free], minlength=G).astype(np.int64)
    experts = np.flatnonzero(free)
    sink = 1 + experts.size + G
    per_gpu = np.zeros((E, G), np.int64)
    per_gpu[~free, gpu[~free, 0]] = c[~free]
    need = int(c[experts].sum())
    for cap in range(max(target, int(fixed.max(initial=0))), int(c.sum()) + 1):
        edges = [(0, 1 + i, int(c[e])) for i, e in enumerate(experts)]
        edges += [(1 + i, 1 + experts.size + int(g), int(c[e]))
                  for i, e in enumerate(experts) for g in np.unique(gpu[e][valid[e]])]
        edges += [(1 + experts.size + g, sink, int(cap - fixed[g])) for g in range(G)]
        value, flow = _max_flow(sink + 1, edges)
        if value == need:
            for (t, h), f in flow.items():
                if 1 <= t <= experts.size:
                    per_gpu[experts[t - 1], h - 1 - experts.size] = f
            break
    quotas = np.zeros((E, R), np.int64)
    for e in range(E):
        for g in np.unique(gpu[e][valid[e]]):
            cand = np.flatnonzero(valid[e] & (gpu[e] == g))
            q, r = divmod(int(per_gpu[e, g]), cand.size)
            quotas[e, cand] = q
            quotas[e, cand[:r]] += 1
    return quotas
