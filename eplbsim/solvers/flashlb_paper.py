"""`flashlb-paper`: FlashLB's risk-aware replication and placement (DESIGN.md §10), written from
its published description before any code of it was read. `flashlb` (`solvers.flashlb`) is the
code vLLM ships as FlashLB; the two differ: on the README's layer 0 (16 slots, 8 GPUs) vLLM's
counts are `[1, 1, 1, 2, 1, 2, 1, 1, 2, 1, 2, 1]` with no GPU holding two replicas of one
expert, these `[1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 3, 1]` with two replicas of expert 10 on GPU 7:
this variant scores a GPU by its mean plus `z` standard deviations and searches the counts by
moving replicas one at a time, vLLM's counts greedily, searches them by groups of experts and
spreads an expert's replicas over distinct GPUs (`tests/solvers/test_peers.py`).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `S = P / G` slots per
GPU, `W` steps of history.

Per layer, from a window of past loads `history [W, L, E]` (an option; without it the layer's
`load` is the mean and every variance and covariance is 0): the mean `mu_e`, variance and
covariance of each expert's load per step, and an expert's risk `mu_e + z sigma_e`.
1. **Replica counts:** one replica each, then every redundant slot to the expert with the
   largest risk per replica (`risk_e / r_e`; lowest index on ties).
2. **Placement of given counts:** replicas in descending `mu_e / r_e` (stable), each onto the
   GPU with a free slot that minimises its risk after taking it:
   `mu_dev + mu_e / r_e + z sqrt(var_dev + var_e / r_e^2 + 2 sum_{e' on dev} cov(e, e') /
   (r_e r_e'))` (lowest GPU on ties). A placement is judged by its riskiest GPU,
   `max_dev mu_dev + z sigma_dev`.
3. **Bounded search over the counts:** up to `depth` rounds. Each round tries moving one
   replica from each of the `width` experts with `r_e >= 2` and the lowest risk per replica to
   each of the `width` other experts with the highest, placing every candidate as in step 2.
   It takes the best candidate of the round not tried before, which may be worse than the
   current counts, and keeps the best placement seen. Round after round, this lets the
   search replicate a small expert into fillers that pair with the heavy replicas, which a
   greedy count never does.

FlashLB's Hungarian step (each GPU's unchanged experts keep their old slots) is the one every
solver gets with `previous` (`solve`: `migration.align_to_previous`'s GPU matching by
`scipy.optimize.linear_sum_assignment`). Expert groups are not kept on nodes (global, as
`deepseek` with one group).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..base.errors import InputError
from ..placement.topology import Topology

Z_RISK = 0.674  # FlashLB's risk quantile (the 75th percentile of a normal)


def flashlb_paper(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
                  history: Any = None, z: float = Z_RISK, depth: int = 8,
                  width: int = 4) -> np.ndarray:
    """FlashLB as published: risk-aware counts, greedy risk-aware placement, a bounded search.

    load:       float64 `[L, E]` pairs per logical expert
    num_slots:  `P`, a multiple of `G`, at least `E`
    topology:   the cluster; num_groups: ignored
    history:    float `[W, L, E]` the window's per-step loads, whose means and covariances
                the risk reads (default: `load` as one step, no variance)
    z:          the risk quantile (`Z_RISK`); depth, width: the search's rounds and candidates
    Returns phy2log int64 `[L, P]` (module doc).
    """
    L, E = load.shape
    G = topology.num_gpus
    stats = _stats(load, history)
    out = np.empty((L, num_slots), dtype=np.int64)
    for layer in range(L):
        mu, var, cov = (x[layer] for x in stats)
        counts = _risk_counts(mu + z * np.sqrt(var), num_slots)
        best = _place(counts, mu, var, cov, G, num_slots // G, z)
        current, seen = counts, {counts.tobytes()}
        for _ in range(int(depth)):
            moves = [c for c in _moves(current, mu + z * np.sqrt(var), int(width))
                     if c.tobytes() not in seen]
            if not moves:
                break
            seen.update(c.tobytes() for c in moves)
            tried = [(_place(c, mu, var, cov, G, num_slots // G, z), c) for c in moves]
            (score, slots), current = min(tried, key=lambda t: t[0][0])
            if score < best[0] - 1e-12 * max(mu.sum(), 1.0):
                best = (score, slots)
        out[layer] = best[1]
    return out


def _stats(load: np.ndarray, history: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(mu [L, E], var [L, E], cov [L, E, E])` per step: from `history [W, L, E]` when given,
    else `load` with no variance."""
    L, E = load.shape
    if history is None:
        return load, np.zeros((L, E)), np.zeros((L, E, E))
    try:
        h = np.asarray(history, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"flashlb-paper's history must be loads [steps, {L}, {E}], got "
                         f"{type(history).__name__}") from None
    if h.ndim != 3 or h.shape[1:] != (L, E) or not np.isfinite(h).all() or (h < 0).any():
        raise InputError(f"flashlb-paper's history must be finite, non-negative loads [steps, {L}, "
                         f"{E}], got shape {list(h.shape)}")
    if h.shape[0] < 2:
        return h.mean(0), np.zeros((L, E)), np.zeros((L, E, E))
    centred = h - h.mean(0)
    cov = np.einsum("wle,wlf->lef", centred, centred) / (h.shape[0] - 1)
    return h.mean(0), np.einsum("lee->le", cov), cov


def _risk_counts(risk: np.ndarray, num_slots: int) -> np.ndarray:
    """One replica each, then each further slot to the largest risk per replica: int `[E]`."""
    counts = np.ones(risk.shape[0], dtype=np.int64)
    for _ in range(num_slots - risk.shape[0]):
        counts[int(np.argmax(risk / counts))] += 1
    return counts


def _moves(counts: np.ndarray, risk: np.ndarray, width: int) -> list[np.ndarray]:
    """The candidate counts of one search round (module doc, step 3)."""
    per = risk / counts
    donors = [e for e in np.argsort(per, kind="stable") if counts[e] >= 2][:width]
    takers = list(np.argsort(-per, kind="stable")[:width + 1])
    out = []
    for d in donors:
        for t in takers:
            if t != d:
                moved = counts.copy()
                moved[d] -= 1
                moved[t] += 1
                out.append(moved)
    return out


def _place(counts: np.ndarray, mu: np.ndarray, var: np.ndarray, cov: np.ndarray, G: int,
           S: int, z: float) -> tuple[float, np.ndarray]:
    """`(riskiest GPU's mu + z sigma, phy2log [P])` of step 2 (module doc) for `counts`."""
    experts = np.repeat(np.arange(len(counts)), counts)
    order = np.argsort(-(mu / counts)[experts], kind="stable")
    gpu_mu, gpu_var = np.zeros(G), np.zeros(G)
    shared = np.zeros((G, len(counts)))  # [G, E] sum over a GPU's replicas f of cov[:, f] / r_f
    held: list[list[int]] = [[] for _ in range(G)]
    full = np.zeros(G, dtype=bool)
    for e in experts[order]:
        r = counts[e]
        extra = var[e] / r ** 2 + 2 * shared[:, e] / r  # [G]
        risk = gpu_mu + mu[e] / r + z * np.sqrt(np.maximum(gpu_var + extra, 0))
        g = int(np.argmin(np.where(full, math.inf, risk)))
        held[g].append(int(e))
        full[g] = len(held[g]) >= S
        gpu_mu[g] += mu[e] / r
        gpu_var[g] += extra[g]
        shared[g] += cov[:, e] / r
    score = float((gpu_mu + z * np.sqrt(np.maximum(gpu_var, 0))).max())
    return score, np.array([e for g in range(G) for e in held[g]], dtype=np.int64)
