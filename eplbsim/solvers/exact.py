"""Exact placement for small instances: replication and packing in one mixed-integer model.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `S = P / G` slots per
GPU, `C` the most replicas one expert may get (`P - E + 1`; at most `G` with anti-colocation).

Per layer, with `l_e` the expert loads (scaled so that the mean GPU load is 1 in the model):
  u[e, c] in {0, 1}       expert `e` has exactly `c` replicas (c = 1..C), sum_c u[e, c] = 1
  w[e, c, g] in Z, >= 0   replicas of `e` on GPU `g` when it has `c` replicas:
                          sum_g w[e, c, g] = c u[e, c], w <= min(c, S) (w <= 1 with anti-colocation)
  sum_{e, c} w[e, c, g] = S                          every GPU holds exactly `S` slots
  z >= sum_{e, c} (l_e / c) w[e, c, g]               the GPU's load under the even split
  minimise z
plus valid inequalities that only cut symmetric or dominated solutions: GPU loads are
non-increasing in `g`, experts of equal load have non-increasing replica counts in expert order,
and z >= sum_c (l_e / c) ceil(c / G) u[e, c] (some GPU holds ceil(c / G) replicas of `e`).
DeepSeek's global placement gives an upper bound `z <= known`, which also rules out the replica
counts that cannot beat it (c < l_e / known, or so many that the others' least counts no longer
fit); when nothing beats it, HiGHS reports the model infeasible and that placement is optimal.
HiGHS stops at a relative gap of 1e-6 (MIP_REL_GAP) or when its work budget is spent:
`node_limit` branch-and-bound nodes a layer (`NODE_LIMIT` by default). A budget of work, not of
seconds, gives the same placement on every machine; a wall-clock `time_limit` may be added, and
then the result depends on the machine's speed. The gap a layer proved is reported (`gap`).

Measured (2-core guest, highspy 1.16, one thread): loads [600, 560, 120, 120, 20, 10, 10, 10],
16 slots on 8 GPUs, optimum 590 / 3 = 196.67 found and proven in 228 nodes, about 2 s (DeepSeek:
232). Instances with many near-equal loads and 2 slots per GPU (e.g. 12 experts, 16 slots, 8
GPUs) end at the default budget, 1000 nodes in about 7 s a layer here, with a proven gap of a
few percent (8.9% on uniform loads in [100, 200)): the model's LP relaxation is weak there.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import numpy as np

from ..base.errors import InputError
from ..base.progress import bar
from ..placement.topology import Topology
from .bounds import peak_gpu_load
from .deepseek import deepseek

# The largest model built: E * C * G integer variables w (8 experts, 16 slots, 8 GPUs: 576).
MAX_INTEGER_VARIABLES = 20_000
# HiGHS stops when (incumbent - bound) / incumbent <= this; "optimal" means within it.
MIP_REL_GAP = 1e-6
NODE_LIMIT = 1000  # branch-and-bound nodes a layer by default: the work budget (module doc)

_STATUS = {0: "optimal", 1: "budget", 2: "infeasible", 3: "unbounded", 4: "other"}


def exact(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
          node_limit: int = NODE_LIMIT, time_limit: float | None = None,
          anti_colocation: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
    """The placement minimising the max GPU load under the even split, per layer, by MILP.

    load: float64 `[L, E]` pairs per logical expert, `num_slots` = `P`
    node_limit: HiGHS's branch-and-bound nodes a layer (default `NODE_LIMIT`): the work budget,
      the same on every machine; the best placement found within it is returned
    time_limit: seconds a layer as well (default none: a wall clock makes the placement depend
      on the machine)
    anti_colocation: no GPU holds two replicas of one expert (InputError when `P / G > E`)
    -> (phy2log int64 `[L, P]`, info) with the slots of each GPU filled in ascending expert id,
    and info (lists over layers):
      objective  the max GPU load of the returned placement (even split)
      bound      a proven lower bound on that optimum: HiGHS's dual bound, or the simple bound
                 max(total / G, max_e l_e / C) where that is higher (e.g. at the budget)
      gap        (objective - bound) / objective: how far from optimal it may be, proven
      optimal    the placement is proven optimal (within a relative gap of 1e-6)
      status     "optimal", "budget" (the node or time budget spent), ... (HiGHS's status)
      nodes      branch-and-bound nodes HiGHS explored
      seconds    wall time of the layer's solve
    A progress bar over the layers shows on a terminal (stderr).
    The model is global: `num_groups` and the nodes of `topology` are ignored (no hierarchical
    constraint), so its optimum is a lower bound for hierarchical placements as well.
    DeepSeek's global placement is also evaluated and returned instead when it is better than the
    MILP's incumbent (only possible at the budget), so `exact` is never worse than it.
    Only for small instances: InputError when `E * C * G` exceeds MAX_INTEGER_VARIABLES (20,000).
    """
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_experts = load.shape
    num_gpus = topology.num_gpus
    per_gpu = num_slots // num_gpus
    if isinstance(node_limit, bool) or not isinstance(node_limit, (int, np.integer)) \
            or node_limit < 1:
        raise InputError(f"node_limit must be a positive whole number of branch-and-bound "
                         f"nodes, got {node_limit!r}")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(
            time_limit, (int, float, np.number)) or not time_limit > 0):
        raise InputError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    if anti_colocation and per_gpu > num_experts:
        raise InputError(f"anti_colocation is impossible: each GPU holds {per_gpu} slots but there "
                         f"are only {num_experts} experts, so some GPU holds two replicas of one")
    max_copies = num_slots - num_experts + 1
    if anti_colocation:
        max_copies = min(max_copies, num_gpus)
    size = num_experts * max_copies * num_gpus
    if size > MAX_INTEGER_VARIABLES:
        raise InputError(f"the exact solver's model is too large: {num_experts} experts x "
                         f"{max_copies} replica counts x {num_gpus} GPUs = {size} integer "
                         f"variables, more than its limit of {MAX_INTEGER_VARIABLES}; use a "
                         f"heuristic solver (e.g. deepseek) for this size")

    model = _Model(num_experts, max_copies, num_gpus, per_gpu, anti_colocation)
    fallback = _fallback(load, num_slots, num_gpus, anti_colocation)  # [L, P] or None
    phy2log = np.empty((num_layers, num_slots), dtype=np.int64)
    info: dict[str, list] = {"objective": [], "bound": [], "gap": [], "optimal": [],
                             "status": [], "nodes": [], "seconds": []}
    budget = {"node_limit": int(node_limit),
              **({} if time_limit is None else {"time_limit": float(time_limit)})}
    with bar(num_layers, "exact", "layer") as shown:
        for layer in range(num_layers):
            _solve_layer(model, load[layer], fallback, layer, num_gpus, max_copies, budget,
                         phy2log, info)
            shown.update(1)
    return phy2log, info


def _solve_layer(model: "_Model", load: np.ndarray, fallback: np.ndarray | None, layer: int,
                 num_gpus: int, max_copies: int, budget: dict[str, Any], phy2log: np.ndarray,
                 info: dict[str, list]) -> None:
    """Layer `layer` of `exact`: its row of `phy2log` and its entries of `info` filled."""
    start = time.perf_counter()
    known = np.inf if fallback is None else _peak(load, fallback[layer], num_gpus)
    row, bound, status, nodes = model.solve(load, budget, known)
    best, objective = None, np.inf
    for candidate in (row, None if fallback is None else fallback[layer]):
        if candidate is not None:
            value = _peak(load, candidate, num_gpus)
            if value < objective:
                best, objective = candidate, value
    if best is None:
        given = ", ".join(f"{k}={v}" for k, v in budget.items())
        raise InputError(f"the exact solver found no placement for layer {layer} within "
                         f"{given} (HiGHS status: {_STATUS.get(status)}); raise node_limit")
    bound = min(max(bound, _simple_bound(load, num_gpus, max_copies)), objective)
    phy2log[layer] = best
    info["objective"].append(float(objective))
    info["bound"].append(float(bound))
    info["gap"].append(float((objective - bound) / objective) if objective > 0 else 0.0)
    proven = status in (0, 2) or objective <= bound * (1 + 1e-9) + 1e-12
    info["optimal"].append(bool(proven))
    info["status"].append("optimal" if proven else _STATUS.get(status, "other"))
    info["nodes"].append(nodes)
    info["seconds"].append(time.perf_counter() - start)


class _Model:
    """The constraint matrix of one layer's model; only the load coefficients change per layer.

    Variables: u `[E, C]`, then w `[E, C, G]`, then z.
    """

    def __init__(self, num_experts: int, max_copies: int, num_gpus: int, per_gpu: int,
                 anti_colocation: bool) -> None:
        E, C, G = num_experts, max_copies, num_gpus
        self.E, self.C, self.G, self.S = E, C, G, per_gpu
        self.num_u, self.num_w = E * C, E * C * G
        self.z = self.num_u + self.num_w
        self.copies = np.arange(1, C + 1, dtype=np.float64)  # [C]
        self.u = np.arange(self.num_u).reshape(E, C)
        self.w = self.num_u + np.arange(self.num_w).reshape(E, C, G)
        self.upper = np.ones(self.z + 1)
        cap = np.ones(C) if anti_colocation else np.minimum(self.copies, per_gpu)  # [C]
        self.upper[self.w] = np.broadcast_to(cap[None, :, None], (E, C, G))
        self.upper[self.z] = np.inf
        self.integrality = np.ones(self.z + 1)
        self.integrality[self.z] = 0
        self.cost = np.zeros(self.z + 1)
        self.cost[self.z] = 1.0

    def solve(self, load: np.ndarray, budget: dict[str, Any],
              known: float) -> tuple[np.ndarray | None, float, int, int]:
        """load `[E]`, `budget` HiGHS's limits (`node_limit`, maybe `time_limit`), `known` the
        max GPU load of a known placement (inf if none) -> (phy2log `[P]` or None, proven
        lower bound, status (`_STATUS`), nodes explored).

        Status "infeasible" means nothing beats `known` (then the bound returned is `known`).
        """
        total = float(load.sum())
        if total <= 0:  # any placement is optimal; p % E also has anti-colocation (S <= E)
            return np.arange(self.S * self.G, dtype=np.int64) % self.E, 0.0, 0, 0
        scale = total / self.G  # the model's loads have mean GPU load 1
        lower, upper = self._bounds(load / scale, known / scale * (1 + 1e-9))
        x, status, dual, nodes = _run_highs(self.cost, self.integrality, lower, upper,
                                            *self._constraints(load / scale), budget)
        if status == 2 and np.isfinite(known):
            return None, known, 2, nodes
        bound = dual * scale if np.isfinite(dual) else 0.0
        if x is None:
            return None, bound, status, nodes
        count = np.rint(x[self.w]).astype(np.int64).sum(1)  # [E, G] replicas on each GPU
        if (count.sum(0) != self.S).any() or (count.sum(1) < 1).any():
            return None, bound, 4, nodes  # rounding broke the solution (never seen): fallback
        experts = np.arange(self.E)  # each GPU's slots in ascending expert id
        return (np.concatenate([np.repeat(experts, count[:, g]) for g in range(self.G)]), bound,
                status, nodes)

    def _bounds(self, load: np.ndarray, known: float) -> tuple[np.ndarray, np.ndarray]:
        """Variable bounds `(lower, upper)` for loads `[E]`, with z <= `known` and the replica
        counts that cannot beat it excluded: c < l_e / known (a replica alone would exceed it)
        or c so large that the other experts' least counts do not fit in the slots."""
        upper = self.upper.copy()
        upper[self.z] = known
        if np.isfinite(known):
            most_on_one = np.ceil(self.copies / self.G)  # [C]
            allowed = load[:, None] / self.copies * most_on_one <= known  # [E, C]
            if allowed.any(1).all():
                least = allowed.argmax(1) + 1  # [E] fewest replicas each expert may have
                most = self.S * self.G - (least.sum() - least)  # [E]
                allowed &= self.copies[None, :] <= most[:, None]
            if allowed.any(1).all():
                upper[self.u[~allowed]] = 0
                upper[self.w[~allowed]] = 0
        return np.zeros(self.z + 1), upper

    def _constraints(self, load: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
        """The rows `(matrix, lower, upper)` for loads `[E]`: the CSR matrix and each row's
        bounds."""
        E, C, G, S = self.E, self.C, self.G, self.S
        per_replica = load[:, None] / self.copies[None, :]  # [E, C]
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        lower: list[float] = []
        upper: list[float] = []

        def add(col: np.ndarray, val: np.ndarray, lo: float, hi: float) -> None:
            rows.append(np.full(col.size, len(lower)))
            cols.append(col.ravel())
            vals.append(np.broadcast_to(val, col.shape).ravel().astype(np.float64))
            lower.append(lo)
            upper.append(hi)

        for e in range(E):
            add(self.u[e], np.ones(C), 1, 1)  # exactly one replica count
            for c in range(C):  # its replicas spread over the GPUs
                add(np.append(self.w[e, c], self.u[e, c]),
                    np.append(np.ones(G), -(c + 1.0)), 0, 0)
        for g in range(G):
            add(self.w[:, :, g], np.ones((E, C)), S, S)  # S slots on every GPU
            add(np.append(self.w[:, :, g], self.z), np.append(per_replica, -1.0),
                -np.inf, 0)  # z >= its load
        for g in range(G - 1):  # GPU loads non-increasing (GPU symmetry)
            add(np.concatenate([self.w[:, :, g].ravel(), self.w[:, :, g + 1].ravel()]),
                np.concatenate([per_replica.ravel(), -per_replica.ravel()]), 0, np.inf)
        most_on_one = np.ceil(self.copies / G)  # [C]
        for e in range(E):  # some GPU holds ceil(c / G) replicas of e
            add(np.append(self.u[e], self.z), np.append(per_replica[e] * most_on_one, -1.0),
                -np.inf, 0)
        order = np.argsort(load, kind="stable")
        for a, b in itertools.pairwise(order):  # equal loads: counts non-increasing in id
            if load[a] == load[b]:
                first, second = min(a, b), max(a, b)
                add(np.concatenate([self.u[first], self.u[second]]),
                    np.concatenate([self.copies, -self.copies]), 0, np.inf)
        from scipy.sparse import csr_matrix

        matrix = csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(len(lower), self.z + 1))
        return matrix, np.array(lower), np.array(upper)


_HIGHS_STATUS = {"kOptimal": 0, "kSolutionLimit": 1, "kTimeLimit": 1, "kIterationLimit": 1,
                 "kInfeasible": 2, "kUnbounded": 3}  # HiGHS's model status -> `_STATUS`'s


def _run_highs(cost: np.ndarray, integrality: np.ndarray, lower: np.ndarray,
               upper: np.ndarray, matrix: Any, row_lower: np.ndarray, row_upper: np.ndarray,
               budget: dict[str, Any]) -> tuple[np.ndarray | None, int, float, int]:
    """Minimise `cost @ x` over `lower <= x <= upper`, `row_lower <= matrix @ x <= row_upper`
    (`matrix` CSR), `x` integer where `integrality`, with HiGHS (highspy) on one thread within
    `budget` (`node_limit` branch-and-bound nodes, maybe `time_limit` seconds) and relative gap
    `MIP_REL_GAP` -> (the best `x` found or None, status as `_STATUS` keys it, the proven
    dual bound, nodes explored). highspy rather than scipy's `milp`: scipy returns no
    solution when HiGHS stops at its node limit, and a budget of nodes is what makes the
    placement the same on every machine."""
    import highspy  # loads on first use, not with eplbsim

    highs = _quiet_highs(highspy)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), matrix.shape[0]
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, lower, upper
    lp.row_lower_, lp.row_upper_ = row_lower, row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_, lp.a_matrix_.index_ = matrix.indptr, matrix.indices
    lp.a_matrix_.value_ = matrix.data
    kinds = highspy.HighsVarType
    lp.integrality_ = [kinds.kInteger if i else kinds.kContinuous for i in integrality]
    highs.passModel(lp)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    highs.setOptionValue("mip_max_nodes", int(budget["node_limit"]))
    if "time_limit" in budget:
        highs.setOptionValue("time_limit", float(budget["time_limit"]))
    highs.run()
    status = _HIGHS_STATUS.get(highs.getModelStatus().name, 4)
    info = highs.getInfo()
    x = np.asarray(highs.getSolution().col_value) if info.primal_solution_status == 2 else None
    dual = float(info.mip_dual_bound)
    return x, status, dual if np.isfinite(dual) else -np.inf, int(info.mip_node_count)


def _quiet_highs(highspy: Any) -> Any:
    """A `highspy.Highs` printing nothing: the first one a process makes prints HiGHS's banner
    on file descriptor 1 before any option can stop it, which would break `--json`; that
    descriptor points at /dev/null while it is made."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    highs.setOptionValue("output_flag", False)
    return highs


def _peak(load: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> float:
    """Max GPU load of one layer's placement `[P]` under the even split of `load [E]`."""
    return float(peak_gpu_load(load[None], phy2log[None], num_gpus)[0])


def _simple_bound(load: np.ndarray, num_gpus: int, max_copies: int) -> float:
    """A lower bound on any placement's max GPU load: the mean, and the hottest expert spread
    over the most replicas it may get."""
    return max(float(load.sum()) / num_gpus, float(load.max()) / max_copies)


def _fallback(load: np.ndarray, num_slots: int, num_gpus: int,
              anti_colocation: bool) -> np.ndarray | None:
    """DeepSeek's global placement `[L, P]` (None where it cannot honour anti-colocation)."""
    try:
        return np.asarray(deepseek(load, num_slots, Topology(num_gpus), 1,
                                   anti_colocation=anti_colocation)[0])
    except InputError:
        return None
