"""Placement for traffic: `affinity` puts experts that tokens choose together on one GPU, and
groups of them on one node, within a slack on the balance solver's max GPU load (DESIGN.md §13).

Dimensions: `L` layers, `E` logical experts, `P` physical slots = items, `G` GPUs, `N` nodes,
`S = P / G` slots a GPU.

Per layer, replication is the balance solver's (`balance`, deepseek by default): each expert
keeps its replica count, and `affinity` only chooses which GPU each replica's slot is on. Item
`i` is one replica of expert `e_i` with `r_e` replicas, carrying `w_i = load_e / r_e` (the even
split) and affinity `A_ij = C[e_i, e_j] / (r_e_i r_e_j)` to the replicas of another expert, from
the predicted co-activation `C [L, E, E]` (`traces.coactivation`: tokens that chose both).

The objective is the pairwise communication term of MoETuner's ILP (Go et al., 2025: the
tokens whose co-chosen experts sit on different GPUs, the cross-node ones weighted by the link
cost) as TACG's placement also counts it: the co-chosen pairs a placement splits,
    J = sum_{i < j} A_ij (1[gpu_i != gpu_j] + omega 1[node_i != node_j]),
`omega` the NVLink/RDMA bandwidth ratio (`node_weight`, default the H200 profile's 450 / 50 = 9:
a token crossing nodes costs that many NVLink crossings). Constraints: every GPU holds `S`
slots, at most `ceil(r_e / G)` replicas of an expert on a GPU (or as many as the balance
placement puts on one), and the max GPU load at most `(1 + slack)` times
the balance placement's. With the window's per-step loads (`history [W, L, E]`, which the
schedule passes) the max is taken per step and averaged, as `gpu_imbalance` reads it: experts
chosen together also peak together, so a GPU of co-activated experts swings more from step to
step than its summed load says.

Method: a greedy build (GPU by GPU: the heaviest unplaced replica first, then the replica with
the most affinity to the GPU's replicas, plus `omega` times its node's, that fits under a cap
on the summed load; the heavier on a tie; a GPU over the cap is repaired by swaps) and the
balance placement itself, each improved by swaps (the best swap of two replicas on different
GPUs that lowers `J` and keeps the cap, until none does, at most `max_swaps` a layer); the
lower `J` that meets the constraint is kept. The cap starts at `(1 + slack)` times the balance
placement's summed max and tightens (slack / 2, / 4, / 8, 0) until a result meets the per-step
constraint; the balance placement itself when none does. A layer whose items and pairs are few
(`milp_vars`) is also solved exactly by HiGHS (`scipy.optimize.milp`), for the bound on `J`
under the same replication and the summed cap: the report gives both objectives and the gap.

Report (`info`): `objective` (J of the result, summed over layers), `balance_objective` (J of
the balance solver's placement), `max_load_ratio` (the largest over layers of the result's max
GPU load over the balance placement's), and when every layer's MILP ran, `bound` and `gap`
(`(objective - bound) / objective`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..base.errors import InputError
from ..cost.devices import DEVICES
from ..placement.topology import Topology
from .deepseek import deepseek

SLACK = 0.05  # the default slack on the balance solver's max GPU load
NODE_WEIGHT = DEVICES["h200"].nvlink / DEVICES["h200"].rdma  # 450 / 50 GB/s = 9
MILP_VARS = 400  # a layer's MILP runs when it has at most this many variables
TOL = 1e-9


def affinity(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
             coactivation: Any = None, history: Any = None, slack: float = SLACK,
             balance: Callable[..., Any] = deepseek,
             node_weight: float = NODE_WEIGHT, max_swaps: int = 2000,
             milp_vars: int = MILP_VARS, milp_seconds: float = 2.0
             ) -> tuple[np.ndarray, dict[str, Any]]:
    """Experts chosen together on one GPU, within a slack on the balance solver's max GPU load
    (greedy build, swaps; an MILP bound on small layers).

    Places `load [L, E]` on `num_slots` slots (module doc) given the predicted `coactivation
    [L, E, E]` (pair counts, symmetric; the schedule passes its window's) and, optionally, the
    window's per-step loads `history [W, L, E]`; `balance` is the solver whose replication
    and max GPU load are kept, a solver callable `(load, num_slots, topology, num_groups)`
    handed in by its caller (`solve` resolves a registry name into it, as the registry
    composes solvers; this module never reaches back into the registry).
    -> `(phy2log [L, P], info)`."""
    if not callable(balance):
        raise InputError(f"the affinity solver's balance solver must be a solver function, got "
                         f"{balance!r}; solve(..., balance=NAME) resolves a registry name")
    L, E = load.shape
    pairs = _checked_pairs(coactivation, L, E)
    base = balance(load, num_slots, topology, num_groups)
    base = np.asarray(base[0] if isinstance(base, tuple) else base)  # [L, P]
    out = np.empty_like(base)
    totals = {"objective": 0.0, "balance_objective": 0.0, "max_load_ratio": 0.0}
    bounds: list[float] | None = []
    steps = None if history is None else np.asarray(history, np.float64)  # [W, L, E]
    for layer in range(L):
        problem = _Layer(load[layer], pairs[layer], base[layer], topology, float(node_weight),
                         None if steps is None else steps[:, layer])
        best = problem.start
        target = problem.step_peak(problem.start) * (1 + slack)
        for factor in (1 + slack, 1 + slack / 2, 1 + slack / 4, 1 + slack / 8, 1.0):
            cap = problem.peak(problem.start) * factor
            for start in (problem.greedy(cap), problem.start):
                if start is None:
                    continue
                found = problem.swapped(start, cap, max_swaps)
                if (problem.cost(found) < problem.cost(best) - TOL
                        and problem.step_peak(found) <= target * (1 + TOL)):
                    best = found
            if best is not problem.start:
                break
        out[layer] = problem.phy2log(best)
        totals["objective"] += problem.cost(best)
        totals["balance_objective"] += problem.cost(problem.start)
        peak = problem.peak(problem.start)
        totals["max_load_ratio"] = max(totals["max_load_ratio"],
                                       problem.peak(best) / peak if peak else 1.0)
        if bounds is not None and problem.milp_size() <= milp_vars:
            bounds.append(problem.bound(peak * (1 + slack), milp_seconds))
        else:
            bounds = None
    info = dict(totals)
    if bounds is not None:
        info["bound"] = float(sum(bounds))
        info["gap"] = ((info["objective"] - info["bound"]) / info["objective"]
                       if info["objective"] > 0 else 0.0)
    return out, info


def _checked_pairs(coactivation: Any, num_layers: int, num_experts: int) -> np.ndarray:
    """`coactivation` as float64 `[L, E, E]`; InputError when absent or of another shape."""
    return checked_counts(coactivation, "coactivation", "layers, experts, experts",
                          (num_layers, num_experts, num_experts),
                          "the affinity solver needs the co-activation of the experts (which "
                          "experts tokens choose together): a trace with token rows gives it; "
                          "counts-only inputs cannot")


def checked_counts(value: Any, name: str, dims: str, shape: tuple[int, ...],
                   absent: str) -> np.ndarray:
    """A solver's window input `value` (counts a trace gives, e.g. `coactivation`) as float64
    of `shape`; InputError saying `absent` when it is None, naming `name [dims]` when it has
    another shape, and for negative, NaN or infinite counts."""
    if value is None:
        raise InputError(absent)
    counts = np.asarray(value, dtype=np.float64)
    if counts.shape != shape:
        raise InputError(f"{name} must be [{dims}] = {shape}, got {counts.shape}")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise InputError(f"{name} holds negative, NaN or infinite counts")
    return counts


class _Layer:
    """One layer's items (the balance placement's replicas) and their affinities; a
    placement of the items is `gpu [P]`, each item's GPU."""

    def __init__(self, load: np.ndarray, pairs: np.ndarray, base: np.ndarray,
                 topology: Topology, omega: float, steps: np.ndarray | None = None) -> None:
        G = topology.num_gpus
        self.G, self.S, self.per_node = G, len(base) // G, topology.gpus_per_node
        self.omega = omega
        self.expert = base.astype(np.int64)  # [P] item -> expert, in the base's slot order
        counts = np.bincount(self.expert, minlength=len(load)).astype(np.float64)  # [E]
        self.w = load[self.expert] / counts[self.expert]  # [P]
        a = pairs[np.ix_(self.expert, self.expert)] / np.outer(counts[self.expert],
                                                               counts[self.expert])
        a[self.expert[:, None] == self.expert[None, :]] = 0.0  # replicas of one expert
        self.a = a  # [P, P] symmetric, zero diagonal
        self.start = np.arange(len(base)) // self.S  # the base placement: item i in slot i
        self.limit = -(-counts.astype(np.int64) // G)  # [E] replicas of an expert a GPU holds
        self.limit = np.maximum(self.limit, self.held(self.start).max(1))  # as the base has
        self.steps = None if steps is None else \
            steps[:, self.expert] / counts[self.expert]  # [W, P] each step's even split

    def held(self, gpu: np.ndarray) -> np.ndarray:
        """Replicas of each expert on each GPU, int64 `[E, G]`."""
        out = np.zeros((len(self.limit), self.G), np.int64)
        np.add.at(out, (self.expert, gpu), 1)
        return out

    def node(self, gpu: np.ndarray) -> np.ndarray:
        return gpu // self.per_node

    def peak(self, gpu: np.ndarray) -> float:
        """The max GPU load of a placement."""
        return float(np.bincount(gpu, weights=self.w, minlength=self.G).max())

    def step_peak(self, gpu: np.ndarray) -> float:
        """The mean over the window's steps of a placement's max GPU load (the max GPU load
        of the summed loads without a window)."""
        if self.steps is None:
            return self.peak(gpu)
        per_gpu = np.zeros((self.steps.shape[0], self.G))
        np.add.at(per_gpu.T, gpu, self.steps.T)
        return float(per_gpu.max(1).mean())

    def cost(self, gpu: np.ndarray) -> float:
        """`J` of a placement (module doc)."""
        split = (gpu[:, None] != gpu[None, :]) + self.omega * (
            self.node(gpu)[:, None] != self.node(gpu)[None, :])
        return float((self.a * split).sum() / 2)

    def phy2log(self, gpu: np.ndarray) -> np.ndarray:
        """A placement as the layer's `phy2log [P]`: each GPU's experts in ascending order."""
        order = np.lexsort((self.expert, gpu))  # by GPU, then expert
        return self.expert[order]

    def greedy(self, cap: float) -> np.ndarray | None:
        """The greedy build (module doc); None when it cannot place every item within `cap`
        and the replicas-a-GPU limit. A GPU takes only a replica after which it can still
        carry what the GPUs after it cannot (the rest's load beyond their `cap` each)."""
        n, E = len(self.w), len(self.limit)
        gpu = np.full(n, -1)
        for g in range(self.G):
            if g % self.per_node == 0:
                near = np.zeros(n)  # affinity to the node's items so far
            here = np.zeros(n)  # affinity to the GPU's items so far
            load, held = 0.0, np.zeros(E, np.int64)
            need = self.w[gpu < 0].sum() - (self.G - g - 1) * cap  # what this GPU must carry
            for slot in range(self.S):
                free = (gpu < 0) & (held[self.expert] < self.limit[self.expert])
                left = self.S - slot  # slots to fill here, this one included
                heavy = np.sort(self.w[free])[::-1]
                top = heavy[:left].sum()  # the heaviest the GPU could still take
                bar = heavy[left - 1] if len(heavy) >= left else 0.0  # the left-th heaviest
                reach = np.where(self.w >= bar, top, top - bar + self.w)  # with item i in
                fits = (free & (load + self.w <= cap * (1 + TOL))
                        & (load + reach >= need - cap * TOL))
                if not fits.any():  # over the cap: the lightest, for `repaired` to fix
                    if not free.any():
                        return None
                    fits = free & (self.w == self.w[free].min())
                score = self.w if slot == 0 else here + self.omega * near
                candidates = np.flatnonzero(fits)
                pick = candidates[np.lexsort((-self.w[candidates], -score[candidates]))[0]]
                gpu[pick], load = g, load + self.w[pick]
                held[self.expert[pick]] += 1
                here += self.a[:, pick]
                near += self.a[:, pick]
        return self.repaired(gpu, cap)

    def repaired(self, gpu: np.ndarray, cap: float) -> np.ndarray | None:
        """`gpu` with its GPUs over `cap` brought under it by swaps, each the one that lowers
        the busiest GPU's load most while the other stays under `cap` (and one replica of an
        expert a GPU); None when no swap does."""
        gpu = gpu.copy()
        for _ in range(len(gpu)):
            loads = np.bincount(gpu, weights=self.w, minlength=self.G)
            h = int(loads.argmax())
            if loads[h] <= cap * (1 + TOL):
                return gpu
            mine, other = np.flatnonzero(gpu == h), np.flatnonzero(gpu != h)
            delta = self.w[mine][:, None] - self.w[other][None, :]  # load h sheds
            after = loads[gpu[other]][None, :] + delta
            full = self.held(gpu) >= self.limit[:, None]  # [E, G] no room for one more
            clash = (full[self.expert[mine]][:, gpu[other]]
                     | full[self.expert[other], h][None, :])
            ok = (delta > 0) & (after <= cap * (1 + TOL)) & ~clash \
                & (self.expert[mine][:, None] != self.expert[other][None, :])
            if not ok.any():
                return None
            i, j = np.unravel_index(np.where(ok, delta, -np.inf).argmax(), delta.shape)
            gpu[mine[i]], gpu[other[j]] = gpu[other[j]], h
        return None

    def swapped(self, gpu: np.ndarray, cap: float, max_swaps: int) -> np.ndarray:
        """`gpu` improved by the best load-feasible swap while one lowers `J` (module doc)."""
        gpu = gpu.copy()
        n, G = len(gpu), self.G
        a, w, omega = self.a, self.w, self.omega
        on_gpu = np.zeros((n, G))  # affinity of each item to each GPU's items
        np.add.at(on_gpu.T, gpu, a)
        loads = np.bincount(gpu, weights=w, minlength=G)
        held = self.held(gpu)  # [E, G]
        same_expert = self.expert[:, None] == self.expert[None, :]
        for _ in range(max_swaps):
            node = self.node(gpu)
            on_node = on_gpu.reshape(n, -1, self.per_node).sum(-1)  # [n, N]
            to_g = on_gpu[:, gpu]  # [a, b]: a's affinity to b's GPU
            own_g = to_g.diagonal()
            gain = to_g + to_g.T - own_g[:, None] - own_g[None, :] - 2 * a
            to_n = on_node[:, node]
            own_n = to_n.diagonal()
            apart = node[:, None] != node[None, :]
            gain += omega * apart * (to_n + to_n.T - own_n[:, None] - own_n[None, :] - 2 * a)
            moved = loads[gpu][:, None] - w[:, None] + w[None, :]  # a's GPU after the swap
            room = (held < self.limit[:, None])[self.expert]  # [i, g] g can take one of i's
            ok = ((gpu[:, None] != gpu[None, :]) & ~same_expert
                  & (moved <= cap * (1 + TOL)) & (moved.T <= cap * (1 + TOL))
                  & room[:, gpu] & room[:, gpu].T)
            gain = np.where(ok, gain, -np.inf)
            best = int(np.argmax(gain))
            i, j = divmod(best, n)
            if not gain[i, j] > TOL * max(1.0, a.sum()):
                break
            g, h = gpu[i], gpu[j]
            on_gpu[:, g] += a[:, j] - a[:, i]
            on_gpu[:, h] += a[:, i] - a[:, j]
            loads[g] += w[j] - w[i]
            loads[h] += w[i] - w[j]
            held[self.expert[i], g] -= 1
            held[self.expert[j], h] -= 1
            held[self.expert[i], h] += 1
            held[self.expert[j], g] += 1
            gpu[i], gpu[j] = h, g
        return gpu

    def milp_size(self) -> int:
        """Variables of the layer's MILP (`bound`)."""
        n = len(self.w)
        pairs = int(np.count_nonzero(np.triu(self.a, 1)))
        return n * self.G + pairs * (self.G + self.G // self.per_node)

    def bound(self, cap: float, time_limit: float) -> float:
        """The least `J` any placement of these items within `cap` has, by HiGHS (its dual
        bound when the time limit ends the solve first): x[i, g] item i on GPU g; z[p, g] <=
        x[i, g], x[j, g] pair p = (i, j) together on g, and sum over i's pairs of z[p, g] <=
        (S - 1) x[i, g]; u[p, n] the same on node n; maximise the pairs kept,
        sum A_p (sum_g z + omega sum_n u). Item 0 sits on GPU 0 (the GPUs are
        interchangeable)."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        n, G, N = len(self.w), self.G, self.G // self.per_node
        ii, jj = np.nonzero(np.triu(self.a, 1))
        m = len(ii)
        weight = self.a[ii, jj]
        total = float(weight.sum() * (1 + self.omega))
        if m == 0:
            return 0.0
        x = lambda i, g: i * G + g  # noqa: E731 - index maps
        z0, u0 = n * G, n * G + m * G
        size = u0 + m * N
        rows, cols, vals, lo, hi = [], [], [], [], []

        def add(entries: list[tuple[int, float]], low: float, high: float) -> None:
            r = len(lo)
            for c, v in entries:
                rows.append(r), cols.append(c), vals.append(v)
            lo.append(low), hi.append(high)

        for i in range(n):
            add([(x(i, g), 1.0) for g in range(G)], 1, 1)
        for g in range(G):
            add([(x(i, g), 1.0) for i in range(n)], self.S, self.S)
            add([(x(i, g), float(self.w[i])) for i in range(n)], -np.inf, cap * (1 + TOL))
            for e in np.unique(self.expert):
                members = np.flatnonzero(self.expert == e)
                if len(members) > self.limit[e]:
                    add([(x(i, g), 1.0) for i in members], -np.inf, float(self.limit[e]))
        partners: list[list[int]] = [[] for _ in range(n)]  # the pairs each item is in
        for p, (i, j) in enumerate(zip(ii, jj)):
            partners[i].append(p), partners[j].append(p)
            for g in range(G):
                for k in (i, j):
                    add([(z0 + p * G + g, 1.0), (x(k, g), -1.0)], -np.inf, 0)
        for i in range(n):  # item i has at most S - 1 partners on its GPU (tightens the LP)
            for g in range(G):
                add([(z0 + p * G + g, 1.0) for p in partners[i]] + [(x(i, g), 1.0 - self.S)],
                    -np.inf, 0)
            for nd in range(N if N > 1 else 0):
                gpus = range(nd * self.per_node, (nd + 1) * self.per_node)
                for k in (i, j):
                    add([(u0 + p * N + nd, 1.0)] + [(x(k, g), -1.0) for g in gpus], -np.inf, 0)
        c = np.zeros(size)
        for p in range(m):
            c[z0 + p * G: z0 + (p + 1) * G] = -weight[p]
            if N > 1:
                c[u0 + p * N: u0 + (p + 1) * N] = -weight[p] * self.omega
        upper = np.ones(size)
        if N == 1:  # one node: every pair shares it
            upper[u0:] = 0.0
            total = float(weight.sum())
        lower = np.zeros(size)
        lower[x(0, 0)] = 1.0
        integrality = np.zeros(size)
        integrality[:n * G] = 1
        matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), size)).tocsr()
        res = milp(c, constraints=LinearConstraint(matrix, lo, hi),
                   integrality=integrality, bounds=Bounds(lower, upper),
                   options={"time_limit": float(time_limit)})
        if res.status not in (0, 1) or getattr(res, "mip_dual_bound", None) is None:
            raise InputError(f"the affinity solver's MILP bound failed: {res.message}")
        kept = -float(res.mip_dual_bound)  # the most pairs any placement keeps
        return max(0.0, total - kept)
