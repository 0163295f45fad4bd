"""`topology-aware`: the twin of SGLang's topology-aware planner, which places each expert on
the rank its tokens come from, at no cost in the busiest rank's load (DESIGN.md §13).

Dimensions: `L` layers, `E` logical experts = `P` physical slots (no redundant experts), `G`
GPUs = EP ranks, source and destination alike.

SGLang main's `python/sglang/srt/eplb/eplb_algorithms/topology_aware.py` (commit a82469114dbc,
tested by `test/registered/unit/eplb/test_topology_aware.py` @ 2112426b4b1e) plans from one
more input than the balance solvers: `source_load [L, G, E]`, the pairs each source rank sent
each expert, and a cost `C [G, G]` of sending one pair from rank `s` to rank `d` (zero on the
diagonal; SGLang reads it from `--eplb-topology`'s JSON `rank_cost_matrix`). Sending expert
`e`'s pairs to rank `r` costs `comm[e, r] = sum_s source_load[s, e] C[s, r]`. Per layer:

1. The seed is the engine's default layout: rank `r` holds experts `r E/G .. (r+1) E/G - 1`.
   Its busiest rank's load is the envelope no swap may exceed.
2. Traffic phase: repeatedly swap the two experts (on different ranks) whose exchange lowers
   the summed `comm` most, keeping both ranks within the envelope; stop when no swap lowers it.
3. Load phase, with the rest of the swap budget: swaps that lower the busiest rank's load (or
   keep it and lower the sum of squared rank loads), the lowest new maximum first, then the
   lowest sum of squares, while the summed `comm` stays within `1 + comm_budget` times its
   value after phase 2.
4. If the result's summed `comm` exceeds the seed's, the seed.

The swap budget is `5 E / G` a layer (at least 1); with a communication budget, phase 2 gets
half of it (at least 1). Ties go to the lower first expert, then the lower second: the same
inputs give the same placement. Experts fill their rank's slots in ascending id. The rank loads
are the balance input `load [L, E]` (the predictor's; SGLang's is the source counts' sum, which
the schedule's window makes equal). SGLang's planner has no redundant experts yet: `solve`
refuses `P > E` (`NO_REDUNDANCY`), as SGLang raises NotImplementedError.

Report (`info`): `traffic` (summed `comm` of the result over layers), `seed_traffic` (the
seed's), `max_load_ratio` (the largest over layers of the busiest rank's load over the seed's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..base.errors import InputError
from ..placement.topology import Topology
from .affinity import NODE_WEIGHT, checked_counts

COMM_BUDGET = 5e-4  # SGLang's `_MAX_COMM_REGRESSION_RATIO`: the load phase's traffic allowance
TRAFFIC_SHARE = 0.5  # of the swap budget, phase 2's when there is a communication budget
EPS = 1e-12


def topology_aware(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1,
                   *, source_load: Any = None, rank_costs: Any = None,
                   max_swaps: int | None = None, comm_budget: float = COMM_BUDGET
                   ) -> tuple[np.ndarray, dict[str, Any]]:
    """Each expert on the rank its tokens come from, within the default layout's busiest-rank
    load (module doc): `load [L, E]` on `num_slots == E` slots (`solve` checks it).

    source_load: `[L, G, E]` pairs each source rank sent each expert (the schedule passes its
      window's, the trace's `src_rank` or contiguous shares as "a2a" owns tokens); required
    rank_costs: `[G, G]` cost of a pair sent from rank `s` to rank `d`, zero diagonal, or a path
      to a JSON file holding it (a list, or SGLang's `{"rank_cost_matrix": ...}`); default 0 on
      the same GPU, 1 within a node, `1 + NODE_WEIGHT` across nodes (affinity's pricing)
    max_swaps: swaps a layer (default `max(1, 5 E / G)`); comm_budget: phase 3's allowance
    `num_groups` is ignored (SGLang passes none). -> `(phy2log [L, P], info)`."""
    L, E = load.shape
    G = topology.num_gpus
    src = checked_counts(source_load, "source_load", "layers, GPUs, experts", (L, G, E),
                         "the topology-aware planner needs source-rank expert counts "
                         "(source_load [layers, GPUs, experts]): a token trace gives them, "
                         "a counts-only input cannot")
    costs = rank_cost_matrix(rank_costs, topology)
    swaps = max(1, 5 * (E // G)) if max_swaps is None else int(max_swaps)
    seed = np.arange(E) // (E // G)  # [E] the default layout's rank of each expert
    out = np.empty((L, E), np.int64)
    info = {"traffic": 0.0, "seed_traffic": 0.0, "max_load_ratio": 0.0}
    for layer in range(L):
        comm = src[layer].T @ costs  # [E, G] cost of sending expert e's pairs to rank r
        ranks = improved(seed, load[layer], comm, G, swaps, comm_budget)
        if _traffic(ranks, comm) > _traffic(seed, comm):
            ranks = seed
        out[layer] = slots_of(ranks, G)
        info["traffic"] += _traffic(ranks, comm)
        info["seed_traffic"] += _traffic(seed, comm)
        peak = rank_loads(seed, load[layer], G).max()
        info["max_load_ratio"] = max(info["max_load_ratio"], rank_loads(
            ranks, load[layer], G).max() / peak if peak > 0 else 1.0)
    return out, info


def improved(ranks: np.ndarray, weight: np.ndarray, comm: np.ndarray, num_ranks: int,
             max_swaps: int, comm_budget: float = 0.0, envelope: float | None = None
             ) -> np.ndarray:
    """Phases 2 and 3 of the module doc from `ranks [E]` (each expert's rank; a copy is
    changed), expert loads `weight [E]` and `comm [E, G]`: at most `max_swaps` swaps, the
    rank loads within `envelope` (default the busiest rank's load of `ranks`). -> `[E]`."""
    ranks = np.array(ranks, np.int64)
    weight = np.asarray(weight, np.float64)
    loads = rank_loads(ranks, weight, num_ranks)
    cap = loads.max() if envelope is None else float(envelope)
    first = max_swaps if comm_budget == 0 else max(1, int(max_swaps * TRAFFIC_SHARE))
    used = 0
    while used < first:
        mask, new_a, new_b, delta = _swaps(ranks, weight, comm, loads, cap)
        delta = np.where(mask & (delta < -EPS), delta, np.inf)
        best = int(np.argmin(delta))
        if not np.isfinite(delta.flat[best]):
            break
        _swap(ranks, loads, new_a, new_b, *divmod(best, len(ranks)))
        used += 1
    if comm_budget == 0:
        return ranks
    limit = _traffic(ranks, comm) * (1 + comm_budget)
    for _ in range(max_swaps - used):
        mask, new_a, new_b, delta = _swaps(ranks, weight, comm, loads, cap)
        mask &= _traffic(ranks, comm) + delta <= limit + EPS
        a, b = ranks[:, None], ranks[None, :]
        new_max = np.maximum(np.maximum(new_a, new_b), _other_max(loads, a, b))
        old_max = loads.max()
        squares = (loads ** 2).sum() - loads[a] ** 2 - loads[b] ** 2 + new_a ** 2 + new_b ** 2
        mask &= (new_max < old_max - EPS) | ((np.abs(new_max - old_max) <= EPS)
                                             & (squares < (loads ** 2).sum() - EPS))
        if not mask.any():
            break
        lowest = new_max[mask].min()
        squares = np.where(mask & (np.abs(new_max - lowest) <= EPS), squares, np.inf)
        _swap(ranks, loads, new_a, new_b, *divmod(int(np.argmin(squares)), len(ranks)))
    return ranks


def rank_loads(ranks: np.ndarray, weight: np.ndarray, num_ranks: int) -> np.ndarray:
    """float64 `[G]`: the summed `weight [E]` of the experts each rank holds (`ranks [E]`)."""
    return np.bincount(ranks, weights=np.asarray(weight, np.float64), minlength=num_ranks)


def slots_of(ranks: np.ndarray, num_ranks: int) -> np.ndarray:
    """phy2log `[E]` of an assignment `ranks [E]` holding `E / G` experts a rank: each rank's
    slots hold its experts in ascending id."""
    order = np.argsort(ranks, kind="stable")  # experts by rank, ascending id within a rank
    if not np.array_equal(np.bincount(ranks, minlength=num_ranks),
                          np.full(num_ranks, len(ranks) // num_ranks)):
        raise InputError("an assignment must give every rank the same number of experts")
    return order.astype(np.int64)


def rank_cost_matrix(value: Any, topology: Topology) -> np.ndarray:
    """The `[G, G]` cost of a pair sent from rank `s` to rank `d` (`topology_aware`'s
    `rank_costs`): the given matrix or JSON file, else the topology's default. InputError
    unless square over the GPUs, finite, non-negative, with a zero diagonal."""
    G = topology.num_gpus
    if value is None:
        node = np.arange(G) // (topology.gpus_per_node or G)
        return ((np.arange(G)[:, None] != np.arange(G)[None, :])
                + NODE_WEIGHT * (node[:, None] != node[None, :])).astype(np.float64)
    if isinstance(value, (str, Path)):
        value = _read_costs(Path(value))
    try:
        costs = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise InputError(f"rank_costs must be a [GPUs, GPUs] matrix of numbers: {e}") from None
    if costs.shape != (G, G):
        raise InputError(f"rank_costs has shape {costs.shape}, which does not match the "
                         f"[GPUs, GPUs] = {(G, G)} of the topology")
    if not np.isfinite(costs).all() or (costs < 0).any():
        raise InputError("rank_costs holds negative, NaN or infinite costs")
    if np.diagonal(costs).any():
        raise InputError("rank_costs must cost nothing on its diagonal (a rank's own pairs)")
    return costs


def _read_costs(path: Path) -> Any:
    """The matrix a rank-cost JSON file holds: a list, or SGLang's `{"rank_cost_matrix": ...}`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read the rank costs {path}: {e}") from None
    if isinstance(data, dict):
        if "rank_cost_matrix" not in data:
            raise InputError(f"{path} holds no rank_cost_matrix")
        data = data["rank_cost_matrix"]
    return data



def _traffic(ranks: np.ndarray, comm: np.ndarray) -> float:
    """The summed cost of sending every expert's pairs to its rank."""
    return float(comm[np.arange(len(ranks)), ranks].sum())


def _swaps(ranks: np.ndarray, weight: np.ndarray, comm: np.ndarray, loads: np.ndarray,
           cap: float) -> tuple[np.ndarray, ...]:
    """Every swap of experts `i < j` on different ranks that keeps both ranks within `cap`:
    (feasible `[E, E]`, the new loads of `i`'s and `j`'s ranks `[E, E]`, the change in
    summed traffic `[E, E]`)."""
    a, b = ranks[:, None], ranks[None, :]
    new_a = loads[a] - weight[:, None] + weight[None, :]
    new_b = loads[b] - weight[None, :] + weight[:, None]
    mask = np.triu(a != b, 1) & (new_a <= cap + EPS) & (new_b <= cap + EPS)
    own = comm[np.arange(len(ranks)), ranks]
    delta = comm[:, ranks] + comm[:, ranks].T - own[:, None] - own[None, :]
    return mask, new_a, new_b, delta


def _other_max(loads: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The busiest load among ranks other than `a` and `b` (broadcast), -inf when none is."""
    top = np.argsort(-loads, kind="stable")[:3]
    top = np.concatenate([top, np.full(3 - len(top), -1)])
    value = np.append(loads, -np.inf)  # index -1: no such rank
    out = np.full(np.broadcast(a, b).shape, -np.inf)
    for r in top[::-1]:  # the busiest rank that is neither a nor b wins
        out = np.where((a != r) & (b != r), value[r], out)
    return out


def _swap(ranks: np.ndarray, loads: np.ndarray, new_a: np.ndarray, new_b: np.ndarray,
          i: int, j: int) -> None:
    """Exchange the ranks of experts `i` and `j` in place, with their ranks' loads."""
    ra, rb = ranks[i], ranks[j]
    loads[ra], loads[rb] = new_a[i, j], new_b[i, j]
    ranks[i], ranks[j] = rb, ra
