"""replay(trace, config) -> Results: one readable loop from routing trace to metrics.

Dimensions: `S` steps, `T` tokens in a step, `L` layers, `E` logical experts, `K` top-k,
`P` physical slots, `G` GPUs = EP ranks.

Data flows one way: trace -> loads -> (predictor ->) solver -> placement -> per-rank views ->
dispatch per rank -> executed loads -> metrics. By default one placement is solved from the
whole trace's loads; with `rebalance_every` the placement is re-solved on a schedule from
predicted loads (`rebalance.plan`: the first solve after the first window, migration-aware).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from . import metrics as M
from .traces.counts import CountsTrace
from .dispatch.policies import DispatchContext, Policy, resolve_policy
from .errors import InputError
from .moe import make_toy_moe, step_error_terms
from .placement import Placement, View, rank_view
from .schedule.predictors import Predictor
from .ranks import (MODES, drift_before_step, execute_a2a, execute_none, make_rank_generators,
                    rank_groups, token_owners)
from .schedule.plan import DEEPSEEK_V3_EXPERT_BYTES, Segment, plan
from .registry import name_of
from .solvers import Solver
from .timeseries import (Counters, Series, layer_series, migration_rows, migration_summary,
                         placement_epochs, summarize, summarize_ranks, time_series)
from .topology import Topology
from .traces.trace import Trace


@dataclass(frozen=True)
class ReplayConfig:
    """One simulated configuration. `placement`, when given, is used for every step instead
    of solving; `num_groups=None` takes the trace's `num_groups` (else 1).

    Rebalancing (`rebalance.plan`): every `rebalance_every` steps from `predictor`'s forecast
    over `window` steps (default `rebalance_every`; `decay` for `ema`, default `1 - 1/window`),
    starting from `initial` (default trivial), skipping when the placement in service has a
    balancedness above `skip_above`; `migration_aware` lays each new placement out over the one
    in service. `expert_bytes` prices one expert copy (default: a DeepSeek-V3 expert in bf16).
    """

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
    window: int | None = None
    predictor: str | Predictor = "window"
    decay: float | None = None
    initial: Placement | None = None
    skip_above: float | None = None
    migration_aware: bool = True
    expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES
    seed: int = 0
    device: str = "cpu"
    hidden: int = 8
    rank_offset: bool = False
    placement: Placement | None = None


@dataclass(frozen=True)
class Results:
    """What one replay measured.

    metrics:   the DESIGN.md §4 keys (None where undefined), the mean decomposition factors
               (`factor_solver`, `factor_prediction`, `factor_dispatch`) and the migration
               totals (`rebalances`, `moved_slots`, `moved_bytes`)
    slot_load: int64 `[S, L, P]` executed pairs per slot
    true_load: int64 `[S, L, E]` routed pairs per logical expert
    segments:  the schedule's segments in step order (`rebalance.Segment`)
    series:    per-(step, layer) metric components (`timeseries.Series`)
    counters:  the per-(step, layer) rank counts behind the agreement metrics
    """

    config: ReplayConfig
    metrics: dict[str, Any]
    slot_load: torch.Tensor
    true_load: torch.Tensor
    segments: tuple[Segment, ...]
    series: Series
    counters: Counters

    @property
    def epochs(self) -> tuple[tuple[int, Placement], ...]:
        """`(first step, placement)` of every placement used, in step order."""
        return tuple((start, placement) for start, _, placement in
                     placement_epochs(self.segments))

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

    def time_series(self, per_layer: bool = False) -> dict[str, Any]:
        """Every metric per step (or per step and layer): `timeseries.time_series` columns."""
        return time_series(self.series, self.counters, self.segments, self.config.mode,
                           per_layer)

    def migrations(self) -> list[dict[str, Any]]:
        """One row per rebalance point: `timeseries.migration_rows`."""
        return migration_rows(self.segments, self.config.expert_bytes)


def replay(trace: Trace, config: ReplayConfig = ReplayConfig()) -> Results:
    """Replay `trace` under `config`; the same inputs give the same numbers."""
    cfg = config
    policy = resolve_policy(cfg.policy)
    if cfg.mode not in MODES:
        raise InputError(f"unknown mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
    topo = Topology(cfg.num_gpus, cfg.gpus_per_node)
    S, L, E, K, G = trace.num_steps, trace.num_layers, trace.num_experts, trace.top_k, topo.num_gpus
    true_load = trace.counts()  # [S, L, E]
    segments = plan(true_load, cfg, topo, cfg.num_groups or trace.num_groups or 1)
    gens = make_rank_generators(cfg.rng, cfg.seed, G, cfg.device, cfg.drift_p)
    moe = make_toy_moe(L, E, cfg.hidden, cfg.seed, cfg.device) if cfg.mode == "none" else None

    slot_load = torch.zeros(S, L, segments[0].placement.num_slots, dtype=torch.int64)
    counters = Counters.zeros(S, L, G)
    agreed, valid, mult, error, drifted = (counters.agreed, counters.valid, counters.mult,
                                           counters.error, counters.drift)
    for start, stop, placement in placement_epochs(segments):
        views = [rank_view(cfg.view, placement, r).to(cfg.device) for r in range(G)]
        groups = rank_groups(views, policy)
        for s in range(start, stop):
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

    return measured(cfg, slot_load, true_load, segments, counters)


def measured(cfg: ReplayConfig, slot_load: torch.Tensor, true_load: torch.Tensor,
             segments: tuple[Segment, ...], counters: Counters) -> Results:
    """Results from what a run counted: executed `slot_load [S, L, P]`, routed
    `true_load [S, L, E]`, the schedule's segments and the rank counters (the in-process
    replay's, or those gathered from real processes)."""
    series = layer_series(slot_load, true_load, segments, cfg.num_gpus)
    summary = summarize(series, slot_load, segments)
    summary.update(summarize_ranks(counters, cfg.mode))
    summary.update(migration_summary(segments, cfg.expert_bytes))
    metrics = {key: summary[key] for key in M.METRIC_KEYS + M.OVER_TIME_KEYS}
    return Results(cfg, metrics, slot_load, true_load, segments, series, counters)


def promise_only(trace: CountsTrace, config: ReplayConfig = ReplayConfig()) -> dict[str, Any]:
    """A counts-only trace has no token rows, so nothing can be dispatched: the placement's
    even-split promise under `config`'s solver and schedule is all there is to report.
    Returns a table row with `placement_imbalance`, `placement_gap`, the solver and prediction
    factors and the migration totals; every dispatch metric is None, `policy` is
    "(even split)" and `mode` "-"."""
    topo = Topology(config.num_gpus, config.gpus_per_node)
    true_load = torch.from_numpy(trace.counts)  # [S, L, E]
    segments = plan(true_load, config, topo, config.num_groups or trace.num_groups or 1)
    metrics = dict.fromkeys(M.METRIC_KEYS)
    metrics.update(summarize(layer_series(None, true_load, segments, topo.num_gpus), None,
                             segments))
    metrics.update(migration_summary(segments, config.expert_bytes))
    solver = "given" if config.placement is not None else name_of(config.solver)
    return {"policy": "(even split)", "solver": solver, "mode": "-", "view": "-", "rng": "-",
            **metrics}


def compare(trace: Trace, policies: list[str | Policy], modes: list[str],
            config: ReplayConfig = ReplayConfig()) -> list[Results]:
    """Replay every (mode, policy) on the same trace and placement settings."""
    return [replay(trace, replace(config, policy=p, mode=m)) for m in modes for p in policies]
