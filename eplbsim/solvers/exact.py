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
HiGHS stops at a relative gap of 1e-6 (MIP_REL_GAP) or at the time limit.

Measured (2 CPU cores, scipy 1.17 / HiGHS): loads [600, 560, 120, 120, 20, 10, 10, 10], 16 slots
on 8 GPUs, optimum 590 / 3 = 196.67 found and proven in about 3.6 s (DeepSeek: 232). Instances
with many near-equal loads and 2 slots per GPU (e.g. 12 experts, 16 slots, 8 GPUs) can still end
at the time limit with the bound at the mean GPU load: the model's LP relaxation is weak there.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..base.errors import InputError
from ..placement.topology import Topology
from .bounds import peak_gpu_load
from .deepseek import deepseek

if TYPE_CHECKING:  # scipy loads on first use, not with eplbsim
    from scipy.optimize import Bounds, LinearConstraint

# The largest model built: E * C * G integer variables w (8 experts, 16 slots, 8 GPUs: 576).
MAX_INTEGER_VARIABLES = 20_000
# HiGHS stops when (incumbent - bound) / incumbent <= this; "optimal" means within it.
MIP_REL_GAP = 1e-6

_STATUS = {0: "optimal", 1: "time_limit", 2: "infeasible", 3: "unbounded", 4: "other"}


def exact(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
          time_limit: float = 30.0,
          anti_colocation: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
    """The placement minimising the max GPU load under the even split, per layer, by MILP.

    load: float64 `[L, E]` pairs per logical expert, `num_slots` = `P`
    time_limit: seconds per layer for HiGHS; the best placement found by then is returned
    anti_colocation: no GPU holds two replicas of one expert (InputError when `P / G > E`)
    -> (phy2log int64 `[L, P]`, info) with the slots of each GPU filled in ascending expert id,
    and info (lists over layers):
      objective  the max GPU load of the returned placement (even split)
      bound      a proven lower bound on that optimum: HiGHS's dual bound, or the simple bound
                 max(total / G, max_e l_e / C) where that is higher (e.g. after a time-out)
      optimal    the placement is proven optimal (within a relative gap of 1e-6)
      status     "optimal", "time_limit", ... (HiGHS's exit status)
      seconds    wall time of the layer's solve
    The model is global: `num_groups` and the nodes of `topology` are ignored (no hierarchical
    constraint), so its optimum is a lower bound for hierarchical placements as well.
    DeepSeek's global placement is also evaluated and returned instead when it is better than the
    MILP's incumbent (only possible after a time-out), so `exact` is never worse than it.
    Only for small instances: InputError when `E * C * G` exceeds MAX_INTEGER_VARIABLES (20,000).
    """
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_experts = load.shape
    num_gpus = topology.num_gpus
    per_gpu = num_slots // num_gpus
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float, np.number)) \
            or not time_limit > 0:
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
    info: dict[str, list] = {"objective": [], "bound": [], "optimal": [], "status": [],
                             "seconds": []}
    for layer in range(num_layers):
        start = time.perf_counter()
        known = np.inf if fallback is None else _peak(load[layer], fallback[layer], num_gpus)
        row, bound, status = model.solve(load[layer], float(time_limit), known)
        best, objective = None, np.inf
        for candidate in (row, None if fallback is None else fallback[layer]):
            if candidate is not None:
                value = _peak(load[layer], candidate, num_gpus)
                if value < objective:
                    best, objective = candidate, value
        if best is None:
            raise InputError(f"the exact solver found no placement for layer {layer} within "
                             f"time_limit={time_limit} s (HiGHS status: {_STATUS.get(status)}); "
                             f"raise time_limit")
        bound = min(max(bound, _simple_bound(load[layer], num_gpus, max_copies)), objective)
        phy2log[layer] = best
        info["objective"].append(float(objective))
        info["bound"].append(float(bound))
        proven = status in (0, 2) or objective <= bound * (1 + 1e-9) + 1e-12
        info["optimal"].append(bool(proven))
        info["status"].append("optimal" if proven else _STATUS.get(status, "other"))
        info["seconds"].append(time.perf_counter() - start)
    return phy2log, info


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

    def solve(self, load: np.ndarray, time_limit: float,
              known: float) -> tuple[np.ndarray | None, float, int]:
        """load `[E]`, `known` the max GPU load of a known placement (inf if none) ->
        (phy2log `[P]` or None, proven lower bound, HiGHS status).

        Status "infeasible" means nothing beats `known` (then the bound returned is `known`).
        """
        total = float(load.sum())
        if total <= 0:  # any placement is optimal; p % E also has anti-colocation (S <= E)
            return np.arange(self.S * self.G, dtype=np.int64) % self.E, 0.0, 0
        from scipy.optimize import milp  # scipy loads on first use, not with eplbsim

        scale = total / self.G  # the model's loads have mean GPU load 1
        res = milp(self.cost, integrality=self.integrality,
                   bounds=self._bounds(load / scale, known / scale * (1 + 1e-9)),
                   constraints=self._constraints(load / scale),
                   options={"time_limit": time_limit, "mip_rel_gap": MIP_REL_GAP})
        if res.status == 2 and np.isfinite(known):
            return None, known, 2
        dual = getattr(res, "mip_dual_bound", None)
        bound = float(dual) * scale if dual is not None and np.isfinite(dual) else 0.0
        if res.x is None:
            return None, bound, int(res.status)
        count = np.rint(res.x[self.w]).astype(np.int64).sum(1)  # [E, G] replicas on each GPU
        if (count.sum(0) != self.S).any() or (count.sum(1) < 1).any():
            return None, bound, 4  # rounding broke the solution (never seen); use the fallback
        experts = np.arange(self.E)  # each GPU's slots in ascending expert id
        return np.concatenate([np.repeat(experts, count[:, g]) for g in range(self.G)]), bound, \
            int(res.status)

    def _bounds(self, load: np.ndarray, known: float) -> Bounds:
        """Variable bounds for loads `[E]`, with z <= `known` and the replica counts that
        cannot beat it excluded: c < l_e / known (a replica alone would exceed it) or c so large
        that the other experts' least counts do not fit in the slots."""
        from scipy.optimize import Bounds

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
        return Bounds(np.zeros(self.z + 1), upper)

    def _constraints(self, load: np.ndarray) -> LinearConstraint:
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
        from scipy.optimize import LinearConstraint
        from scipy.sparse import csr_matrix

        matrix = csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(len(lower), self.z + 1))
        return LinearConstraint(matrix, np.array(lower), np.array(upper))


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
