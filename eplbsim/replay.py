"""replay(trace, config) -> Results: one readable loop from routing trace to metrics.

Dimensions: `S` steps, `T` tokens in a step, `L` layers, `E` logical experts, `K` top-k,
`P` physical slots, `G` GPUs = EP ranks.

Data flows one way: trace -> loads -> solver -> placement -> per-rank views -> dispatch per
rank -> executed loads -> metrics. By default one placement is solved from the whole trace's
loads; with `rebalance_every = N` the first `N` steps run on the trivial placement (there is no
history yet) and at every step `s = kN` the placement is re-solved from steps `s-N .. s-1`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from . import metrics as M
from .counts import CountsTrace
from .dispatch import DispatchContext, Policy, resolve_policy
from .errors import InputError
from .moe import make_toy_moe, step_error_terms
from .placement import Placement, View, rank_view, trivial_placement
from .ranks import (MODES, drift_before_step, execute_a2a, execute_none, make_rank_generators,
                    rank_groups, token_owners)
from .registry import name_of
from .solvers import Solver, solve
from .topology import Topology
from .trace import Trace


SUMMARY_CHUNK = 128  # steps summarized at a time


@dataclass(frozen=True)
class ReplayConfig:
    """One simulated configuration. `placement`, when given, is used for every step instead
    of solving; `num_groups=None` takes the trace's `num_groups` (else 1)."""

    policy: str | Policy = "ordinal"
    solver: str | Solver = "deepseek"
    mode: str = "none"
    view: str | Callable[[Placement, int], View] = "full"
    rng: str = "independent"
    drift_p: float = 0.05
    num_gpus: int = 8
    gpus_per_node: int | None = None
    num_redundant: int = 16
    num_groups: int | None = None
    rebalance_every: int | None = None
    seed: int = 0
    device: str = "cpu"
    hidden: int = 8
    rank_offset: bool = False
    placement: Placement | None = None


@dataclass(frozen=True)
class Counters:
    """Per-(step, layer) counts of the rank model.

    agreed: int64 `[S, L]` pairs on which all ranks chose the same slot (0 in "a2a")
    valid:  int64 `[S, L]` non-padding pairs
    mult:   int64 `[S, L, 3]` pairs executed 0, 1, >= 2 times
    error:  float64 `[S, L, 2]` (||Y - Y_exact||^2, ||Y_exact||^2) of the toy layer ("none")
    drift:  bool `[S, G]` ranks that consumed an extra batch of draws before the step
    """

    agreed: torch.Tensor
    valid: torch.Tensor
    mult: torch.Tensor
    error: torch.Tensor
    drift: torch.Tensor


@dataclass(frozen=True)
class Results:
    """What one replay measured.

    metrics:   the DESIGN.md §4 keys (None where undefined)
    slot_load: int64 `[S, L, P]` executed pairs per slot
    true_load: int64 `[S, L, E]` routed pairs per logical expert
    epochs:    `(first step, placement)` of every placement used, in step order
    counters:  the per-(step, layer) rank counts behind the agreement metrics
    """

    config: ReplayConfig
    metrics: dict[str, Any]
    slot_load: torch.Tensor
    true_load: torch.Tensor
    epochs: tuple[tuple[int, Placement], ...]
    counters: "Counters"

    @property
    def policy(self) -> str:
        return name_of(self.config.policy)

    @property
    def solver(self) -> str:
        if self.config.placement is not None:
            return "given"
        return name_of(self.config.solver)

    def row(self) -> dict[str, Any]:
        """The metrics with `policy`, `solver`, `mode`, `view` and `rng`: one table row."""
        cfg = self.config
        return {"policy": self.policy, "solver": self.solver, "mode": cfg.mode,
                "view": name_of(cfg.view), "rng": cfg.rng, **self.metrics}


def replay(trace: Trace, config: ReplayConfig = ReplayConfig()) -> Results:
    """Replay `trace` under `config`; the same inputs give the same numbers."""
    cfg = config
    policy = resolve_policy(cfg.policy)
    if cfg.mode not in MODES:
        raise InputError(f"unknown mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
    topo = Topology(cfg.num_gpus, cfg.gpus_per_node)
    S, L, E, K, G = trace.num_steps, trace.num_layers, trace.num_experts, trace.top_k, topo.num_gpus
    true_load = trace.counts()  # [S, L, E]
    place_for = _placement_schedule(trace, cfg, topo, true_load)
    gens = make_rank_generators(cfg.rng, cfg.seed, G, cfg.device, cfg.drift_p)
    moe = make_toy_moe(L, E, cfg.hidden, cfg.seed, cfg.device) if cfg.mode == "none" else None

    epochs: list[tuple[int, Placement]] = []
    slot_load = None
    agreed = torch.zeros(S, L, dtype=torch.int64)
    valid = torch.zeros(S, L, dtype=torch.int64)
    mult = torch.zeros(S, L, 3, dtype=torch.int64)
    error = torch.zeros(S, L, 2, dtype=torch.float64)
    drifted = torch.zeros(S, G, dtype=torch.bool)
    for s in range(S):
        placement = place_for(s)
        if not epochs or placement is not epochs[-1][1]:
            epochs.append((s, placement))
            views = [rank_view(cfg.view, placement, r).to(cfg.device) for r in range(G)]
            groups = rank_groups(views, policy)
            if slot_load is None:
                slot_load = torch.zeros(S, L, placement.num_slots, dtype=torch.int64)
        ids = trace.step(s).to(cfg.device)  # [T, L, K]
        T = ids.shape[0]
        owners = token_owners(T, G, trace.step_src_rank(s)) if cfg.mode == "a2a" else None
        draws = [T * K] * G if owners is None else (torch.bincount(owners, minlength=G) * K)
        drifted[s] = torch.tensor(drift_before_step(gens, list(map(int, draws))))
        ctxs = [DispatchContext(s, 0, r, cfg.seed, gens.generators[r], cfg.mode,
                                cfg.rank_offset) for r in range(G)]
        if cfg.mode == "none":
            out = execute_none(ids, views, policy, ctxs, groups)
            agreed[s] = out.agreed
            error[s] = step_error_terms(moe, s, ids, out.multiplicity)
        else:
            out = execute_a2a(ids, owners, views, policy, ctxs)
        slot_load[s] = out.slot_load
        valid[s] = out.valid
        mult[s] = M.multiplicity_counts(out.multiplicity, ids >= 0)

    counters = Counters(agreed, valid, mult, error, drifted)
    summary = summarize(slot_load, true_load, epochs, topo.num_gpus)
    summary.update(summarize_ranks(counters, cfg.mode))
    return Results(cfg, summary, slot_load, true_load, tuple(epochs), counters)


def promise_only(trace: CountsTrace, config: ReplayConfig = ReplayConfig()) -> dict[str, Any]:
    """A counts-only trace has no token rows, so nothing can be dispatched: the placement's
    even-split promise under `config`'s solver and schedule is all there is to report.
    Returns a table row with `placement_imbalance` and `placement_gap`; every dispatch metric
    is None, `policy` is "(even split)" and `mode` "-"."""
    topo = Topology(config.num_gpus, config.gpus_per_node)
    true_load = torch.from_numpy(trace.counts)  # [S, L, E]
    place_for = _placement_schedule(trace, config, topo, true_load)
    epochs: list[tuple[int, Placement]] = []
    for s in range(trace.num_steps):
        placement = place_for(s)
        if not epochs or placement is not epochs[-1][1]:
            epochs.append((s, placement))
    idle = torch.zeros(*true_load.shape[:2], epochs[0][1].num_slots)  # nothing executed
    promised = summarize(idle, true_load, epochs, topo.num_gpus)
    metrics = {key: None for key in M.METRIC_KEYS}
    metrics.update(placement_imbalance=promised["placement_imbalance"],
                   placement_gap=promised["placement_gap"])
    solver = "given" if config.placement is not None else name_of(config.solver)
    return {"policy": "(even split)", "solver": solver, "mode": "-", "view": "-", "rng": "-",
            **metrics}


def _placement_schedule(trace: Trace | CountsTrace, cfg: ReplayConfig, topo: Topology,
                        true_load: torch.Tensor) -> Callable[[int], Placement]:
    """`step -> placement` for the configured schedule (solving lazily, once per epoch)."""
    E = trace.num_experts
    num_slots = E + cfg.num_redundant
    if cfg.num_redundant < 0:
        raise InputError(f"the number of redundant slots must be >= 0, got {cfg.num_redundant}")
    groups = cfg.num_groups or trace.num_groups or 1
    if cfg.placement is not None:
        given = cfg.placement
        if given.num_experts != E or given.num_layers != trace.num_layers:
            raise InputError(f"the given placement is for {given.num_layers} layers and "
                             f"{given.num_experts} experts; the trace has {trace.num_layers} "
                             f"layers and {E} experts")
        if given.topology != topo:
            raise InputError(f"the given placement is laid out on {given.topology}, but the "
                             f"configuration asks for {topo}")
        return lambda s: given
    if cfg.rebalance_every is None:
        whole = solve(cfg.solver, true_load.sum(0), num_slots, topo, groups)
        return lambda s: whole
    every = cfg.rebalance_every
    if not isinstance(every, int) or every < 1:
        raise InputError(f"rebalance_every must be a positive integer, got {every!r}")
    initial = trivial_placement(trace.num_layers, E, num_slots, topo)
    solved: dict[int, Placement] = {}

    def place_for(s: int) -> Placement:
        start = (s // every) * every
        if start == 0:
            return initial
        if start not in solved:
            solved[start] = solve(cfg.solver, true_load[start - every:start].sum(0), num_slots,
                                  topo, groups)
        return solved[start]

    return place_for


def summarize(slot_load: torch.Tensor, true_load: torch.Tensor,
              epochs: list[tuple[int, Placement]], num_gpus: int) -> dict[str, Any]:
    """Load metrics over all steps and layers; each epoch judged with its own placement, in
    chunks of `SUMMARY_CHUNK` steps so the per-replica intermediates stay small on long runs.

    slot_load: `[S, L, P]` executed; true_load: `[S, L, E]` routed.
    """
    S = slot_load.shape[0]
    executed_gpu = M.gpu_loads(slot_load, num_gpus)  # [S, L, G]
    skews, promised, gaps, cumulative = [], [], [], []
    idle = eligible = 0
    bounds = [start for start, _ in epochs] + [S]
    for (start, placement), stop in zip(epochs, bounds[1:]):
        cumulative.append(M.replica_skew(slot_load[start:stop].sum(0), placement).flatten())
        for lo in range(start, stop, SUMMARY_CHUNK):
            executed = slot_load[lo:min(stop, lo + SUMMARY_CHUNK)]  # [chunk, L, P]
            routed = true_load[lo:min(stop, lo + SUMMARY_CHUNK)]  # [chunk, L, E]
            skew = M.replica_skew(executed, placement).flatten()
            skews.append(skew[~skew.isnan()])
            promised.append(M.gpu_imbalance(M.gpu_loads(placement.expected_load(routed),
                                                         num_gpus)).flatten())
            gaps.append(M.placement_gap(placement, routed).flatten())
            i, e = M.idle_replicas(executed, routed, placement)
            idle, eligible = idle + i, eligible + e
    skew = torch.cat(skews)
    return {
        "gpu_imbalance": M.nanmean_or_none(M.gpu_imbalance(executed_gpu)),
        "balancedness": M.nanmean_or_none(M.balancedness(executed_gpu)),
        "replica_skew_mean": M.nanmean_or_none(skew),
        "replica_skew_max": M.nanmax_or_none(skew),
        "replica_skew_cumulative": M.nanmax_or_none(torch.cat(cumulative)),
        "idle_replica_frac": idle / eligible if eligible else None,
        "placement_imbalance": M.nanmean_or_none(torch.cat(promised)),
        "placement_gap": M.nanmean_or_none(torch.cat(gaps)),
    }


def summarize_ranks(counters: Counters, mode: str) -> dict[str, Any]:
    """rank_agreement, multiplicity and output_rel_error over all steps and layers; the first
    and last are None in "a2a", where each pair is dispatched once by construction."""
    valid = int(counters.valid.sum())
    err_sq, exact_sq = counters.error.sum((0, 1)).tolist()
    none_mode = mode == "none"
    return {
        "rank_agreement": int(counters.agreed.sum()) / valid if none_mode and valid else None,
        "multiplicity": M.multiplicity_fractions(counters.mult.sum((0, 1)).tolist()),
        "output_rel_error": math.sqrt(err_sq / exact_sq) if none_mode and exact_sq > 0 else None,
    }


def compare(trace: Trace, policies: list[str | Policy], modes: list[str],
            config: ReplayConfig = ReplayConfig()) -> list[Results]:
    """Replay every (mode, policy) on the same trace and placement settings."""
    return [replay(trace, replace(config, policy=p, mode=m)) for m in modes for p in policies]
