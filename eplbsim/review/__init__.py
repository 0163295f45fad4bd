"""`review`: one verdict on a dispatch change before it goes upstream (DESIGN.md §12).

Holds `review` and its `Report` (here), the correctness finding (`invariance`), the balance,
time and rebalance findings (`measures`), the block bootstrap (`evidence`), the rules
(`verdict`) and the page (`page`, Markdown and HTML). Takes in a trace and two `RunSpec`s;
gives out a `Report`. Imports `base`, `placement`, `traces`, `cost`, `dispatch`, `ranks`,
`engines`, `metrics`, `runspec`, `replay` and `plots` (only when the page draws).

Dimensions: `S` steps, `T` tokens, `L` layers, `E` logical experts, `K` top-k, `P` slots,
`G` GPUs.

A review places on the first part of the trace and scores on the rest (`holdout`, the scored
share), candidate beside baseline, in one mode:
- **correctness**: the candidate's claimed rank-invariance class against what it does. In
  "none" a search dispatches small adversarial batches on every rank (one token, odd counts,
  repeated rows, padding rows, then whole steps), each rank with its own view and random stream,
  and keeps the smallest batch on which ranks choose differently; failing that, the first
  step and layer where the scored replay disagreed (as when ranks switch to a rebalance at
  different steps). The toy MoE layer's output error on the scored steps says what it costs.
- **balance**: GPU imbalance (routed pairs, as every balance figure; with the shared experts'
  work too, apart, when the run counts it), replica skew (mean, max, cumulative), idle replicas,
  per layer with the worst named, and the replicas a policy starves (with the share of their
  expert's pairs each row residue class carries, the pattern that starves a replica under `row`).
- **time**: ms a step and tokens/s under the cost model (roofline unless the spec names one),
  and under `measured` too when its extra and a table for the shape are there, which term
  bounds the slowest GPU (weight reads, arithmetic or communication), and with a
  rebalance schedule its stalls or hazard steps and its net benefit (time saved a step x steps
  minus stalls, against the same candidate on the held-out placement without rebalancing).
- **evidence**: every scored step is replayed with `seeds` seeds; the differences in time and
  GPU imbalance get an interval from a paired block bootstrap over those steps and seeds
  (`evidence`), which exists for deterministic policies too. The scored steps are also cut into
  `windows` held-out windows, each placed on every step before it (a rolling origin) and
  scored alone.
- **verdict**: by the rules of `verdict` (stated on the page), against a minimum effect;
  `EXIT` maps each verdict to the command's exit status.

Like for like: an engine algorithm (`sglang:dynamic`) dispatches from its engine's own
candidate lists, whatever view it is given, and any other policy from the view it is given
(`_views`). So that a difference is the change's, not the lists', by default a side that is
not an engine's takes the view equal to the engine side's lists (the candidate's when both are
an engine's): SGLang's per release (`conform.list_view`; a checkout's are the newest
release's), vLLM's `full`. A view the user asks for (`--view`, `view_asked`) overrides, for
every side that is not an engine's. The page's Set-up says which view each side ran on and why;
every step it names (windows, counterexamples) is the log's own (`TraceShape.log_steps`).

By concern: this module runs the replays and assembles the `Report`; `invariance` holds
the correctness finding (the counterexample search), `measures` the balance, time and
rebalance findings with their intervals, `verdict` the rules, `page` the page.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from .. import metrics as M
from ..base.errors import InputError
from ..base.registry import name_of
from ..dispatch import resolve_policy
from ..engines import as_sources, engine_code, is_engine_name
from ..engines.conform import list_view
from ..placement import Placement
from ..replay import (Plan, failed, replay_planned, replay_quiet, routed_loads, schedule_of,
                      shaped, spec_for_trace)
from ..replay.results import Results, model_origin, run_warnings
from ..runspec import RunSpec, default_of
from ..traces import RunTrace
from ..traces.counts import CountsTrace
from ..traces.steps import select, span_words
from .evidence import RESAMPLES, draws
from .invariance import SEARCH_ROWS, invariance_findings
from .measures import (BALANCE_KEYS, STARVED_SHARE, WORST, balance_findings, buffer_findings,
                       percent, rebalance_findings, replica_shares, time_findings)
from .page import html
from .verdict import EXIT, MIN_EFFECT, judge, rests_on_line

WINDOWS = 4  # held-out windows by default
MAX_SEEDS, MAX_WINDOWS, MAX_RESAMPLES = 64, 64, 100_000


@dataclass
class Report:
    """A review's findings (module doc): plain data, JSON-ready (`as_dict`), rendered by
    `report.markdown`, `report.html`; a notebook shows the HTML. `headline` is one line per
    axis (correctness, balance, time); `warnings` what the trace's windows hold that the
    verdict should not rest on (flagged warm-up and outlier steps, a model that does not fit).
    `placement` is the held-out placement the scored steps ran on; a counterexample's `batch`
    (`[T, L, K]` ids, for a search batch of up to 7 rows) reproduces it with
    `checks.rank_invariance` on it at its `scored_step` (its `step` is the log's name of that
    step)."""

    verdict: str
    reasons: list[str]
    candidate: str
    baseline: str
    mode: str
    invariance: dict[str, Any]
    balance: dict[str, Any]
    time: dict[str, Any]
    rebalance: dict[str, Any] | None
    setup: dict[str, Any]
    headline: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict, repr=False)
    placement: Placement | None = field(default=None, repr=False)

    @property
    def exit_status(self) -> int:
        """0 recommend, 1 not recommended, 3 insufficient evidence."""
        return EXIT[self.verdict]

    def as_dict(self) -> dict[str, Any]:
        """Everything but the figure series and the placement, as the JSON the command prints."""
        out = asdict(self)
        out.pop("series"), out.pop("placement")
        return out

    def __repr__(self) -> str:
        return f"Report({self.candidate} vs {self.baseline}, {self.mode}: {self.verdict})"

    def _repr_html_(self) -> str:
        return html(self)


def review(trace: RunTrace, candidate: Any, baseline: Any = None, spec: RunSpec | None = None, *,
           holdout: float = 0.5, seeds: int = 3, windows: int = WINDOWS,
           min_effect: float = MIN_EFFECT, resamples: int = RESAMPLES,
           baseline_sources: Any = None, baseline_solver: Any = None,
           view_asked: bool | None = None,
           progress: Callable[[str], None] | None = None) -> Report:
    """One verdict on a dispatch (or placement) change before it goes upstream (module doc).

    trace:       a token trace (`TokenTrace`: `[N, L, K]` ids in `S` steps); the first part
                 places, the rest is scored
    candidate:   the policy under review: a registry name, an engine algorithm
                 (`ENGINE:ALGORITHM`), `file.py:function` or a callable
    baseline:    the policy it is held against (default SGLang's dispatch for the spec's mode:
                 `row` in "none", `random` in "a2a"; in a placement review, `candidate`)
    spec:        every other setting (default `RunSpec()`; priced by the roofline unless it
                 names a cost model); the trace's steps shaped by it first, as `replay`'s
    holdout:     the scored share of the steps, in (0, 1)
    seeds:       the seeds every scored step is replayed with
    windows:     the held-out windows the scored steps are cut into (a rolling origin)
    min_effect:  the smallest gain worth a pull request, % of the baseline's step time
    resamples:   the block bootstrap's resamples (`evidence`)
    baseline_sources: the engine sources the baseline's engine code runs from, when not the
                 spec's (a branch against main: the candidate from the branch, the baseline
                 from main)
    baseline_solver: when given, a review of a placement change: the spec's solver (the
                 candidate's) against this one, each placing on the placed steps and
                 re-solving on its schedule
    view_asked:  whether the spec's view was asked for: then every side that is not an engine's
                 dispatches from it; else from an engine side's own lists (like for like,
                 module doc). None: asked when it is not the default (`full`)
    progress:    `progress(what)` hears of each replay
    Returns the `Report`: the verdict, its reasons and every finding (`Report.markdown`,
    `Report.html`, `as_json`); `EXIT[report.verdict]` is the command's exit status.
    """
    if isinstance(trace, CountsTrace):
        raise InputError("a review dispatches token rows; a counts-only trace has none")
    _check_options(holdout, seeds, windows, min_effect, resamples)
    trace, asked = shaped(trace, RunSpec() if spec is None else spec)
    trace, spec, failure = failed(trace, asked)  # with fail_ranks: the survivors' run
    if failure is not None and baseline_solver is not None:
        raise InputError("a review of a placement change places on the trace's steps; with "
                         "fail_ranks both sides serve the recovery placement (give the "
                         "recovery to compare instead: run --recovery)")
    if spec.cost.cost is None:
        spec = spec.replace(cost="roofline")
    mode = spec.dispatch.mode
    kind = "dispatch" if baseline_solver is None else "placement"
    if baseline is None:
        baseline = candidate if kind == "placement" else "row" if mode == "none" else "random"
    sources = spec.dispatch.engine_source
    base_sources = sources if baseline_sources is None else dict(as_sources(baseline_sources))
    roles = {"candidate": {"policy": candidate, "engine_source": sources},
             "baseline": {"policy": baseline, "engine_source": base_sources}}
    if view_asked is None:
        view_asked = spec.dispatch.view != default_of("dispatch", "view")
    views, views_why = _views(roles, spec.dispatch.view, view_asked)
    for which, role in roles.items():
        role["view"] = views[which]
    solvers = {"candidate": spec, "baseline": spec if kind == "dispatch" else spec.replace(
        solver=baseline_solver, solver_options={}, affinity_slack=None, lplb_topology=None)}
    names = [_name(r["policy"], r["engine_source"]) for r in roles.values()]
    if kind == "placement":
        names = [f"{s.labels()['solver']} placement, {n}"
                 for s, n in zip(solvers.values(), names)]
    note = progress or (lambda what: None)

    S = trace.num_steps
    scored = max(1, round(S * holdout)) if S > 1 else 0
    placed = S - scored
    if placed < 1 or scored < 1:
        raise InputError(f"the trace has {S} step(s): a review places on some steps and scores "
                         f"on later ones, so it needs at least 2")
    train, test = select(trace, f"0:{placed}"), select(trace, f"{placed}:{S}")
    placements = _placements(train, solvers)
    placement = placements["candidate"]
    rebalancing = spec.schedule.rebalance_every is not None

    runs: dict[str, list[Results]] = {"candidate": [], "baseline": []}
    routed = routed_loads(test)  # counted once; each seed's schedule solved once a solver
    for i in range(seeds):
        specs = {w: _scored(test, solvers[w], placements[w]).replace(seed=spec.dispatch.seed + i)
                 for w in roles}
        plans = _plans(test, specs, routed, solvers)
        for which, role in roles.items():
            note(f"{which} {names[which == 'baseline']}, seed {spec.dispatch.seed + i}")
            runs[which].append(replay_planned(test, specs[which].replace(**role), plans[which]))
    cand, base = runs["candidate"][0], runs["baseline"][0]
    unrebalanced = None
    if rebalancing:
        note(f"candidate {names[0]} without rebalancing")
        unrebalanced = replay_quiet(test, _without_schedule(spec).replace(
            **roles["candidate"], placement=placement))
    cuts = _cuts(placed, S, windows)
    log = trace.log_steps()  # every step named as the log counts it
    windowed = [{**_window(trace, solvers, a, b, roles, note,
                           placements if a == placed else None),
                 "scored_steps": span_words(log, a, b), "placed_steps": span_words(log, 0, a)}
                for a, b in cuts]

    d = draws(seeds, scored, resamples, spec.dispatch.seed)
    invariance = invariance_findings(candidate, names[0], test, placement,
                                     _scoring(spec.replace(**roles["candidate"]), placement),
                                     cand)
    balance = balance_findings(runs, test, placement, d)
    time = time_findings(runs, spec, d, windowed, min_effect, model_origin(trace.meta, asked))
    rebalance = rebalance_findings(cand, unrebalanced, scored,
                                   base if kind == "placement" else None) if rebalancing else None
    buffer = buffer_findings(cand, base)
    verdict, reasons, headline = judge(invariance, balance, time, rebalance, scored, mode,
                                       kind, buffer)
    steps = {"placed_steps": span_words(log, 0, placed), "scored_steps": span_words(log, placed, S)}
    headline.append(rests_on_line(time, trace.num_layers, spec.cost.shape.moe_layers, steps,
                                  None if failure is None else failure.recovery))
    if failure is not None:
        headline.append(f"Scored on the survivors: {failure.words()}.")
    setup = {"kind": kind, "steps": S, "placed_on": [0, placed], "scored_on": [placed, S], **steps,
             "seeds": seeds, "windows": [[a, b] for a, b in cuts], "mode": mode,
             "gpus": spec.topology.gpus, "slots": placement.num_slots,
             "solver": str(spec.labels()["solver"]),
             "baseline_solver": str(solvers["baseline"].labels()["solver"]),
             "cost": str(spec.cost.cost), "model": spec.cost.name,
             "device": spec.cost.device_profile, "engine_source": dict(sources),
             "baseline_engine_source": dict(base_sources),
             "views": {w: name_of(v) for w, v in views.items()}, "views_why": views_why,
             "dispatch_buffer": buffer,
             "failure": None if failure is None else asdict(failure)}
    notes = [f"warning: {w}" for w in run_warnings(trace, spec, asked, [
        (f"the placement window (steps {steps['placed_steps']})", 0, placed),
        (f"the scored window (steps {steps['scored_steps']})", placed, S)])]
    series = {"layer_imbalance": {n: balance["per_layer"][n] for n in ("candidate", "baseline")},
              "step_ms": {n: M.time_series(r).get("moe_ms") for n, r in
                          (("candidate", cand), ("baseline", base))},
              "replica_share": {n: replica_shares(r) for n, r in
                                (("candidate", cand), ("baseline", base))}}
    return Report(verdict, reasons, names[0], names[1], mode, invariance, balance, time,
                  rebalance, setup, headline, notes, series, placement)


def _check_options(holdout: float, seeds: int, windows: int, min_effect: float,
                   resamples: int) -> None:
    """InputError, naming the flag, for an option outside its domain."""
    def whole(value: Any, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least
    if not 0 < holdout < 1:
        raise InputError(f"--holdout must lie in (0, 1), got {holdout}")
    if not whole(seeds, 1) or seeds > MAX_SEEDS:
        raise InputError(f"--seeds must be an integer in [1, {MAX_SEEDS}], got {seeds}")
    if not whole(windows, 1) or windows > MAX_WINDOWS:
        raise InputError(f"--windows must be an integer in [1, {MAX_WINDOWS}], got {windows}")
    if isinstance(min_effect, bool) or not isinstance(min_effect, (int, float)) \
            or not 0 <= min_effect < 100:
        raise InputError(f"--min-effect must be a percentage in [0, 100), got {min_effect}")
    if not whole(resamples, 100) or resamples > MAX_RESAMPLES:
        raise InputError(f"--resamples must be an integer in [100, {MAX_RESAMPLES}], got "
                         f"{resamples}")


def _scoring(spec: RunSpec, placement: Placement) -> RunSpec:
    """`spec` scoring on `placement`: served throughout, or the first placement of its
    rebalance schedule."""
    if spec.schedule.rebalance_every is not None:
        return spec.replace(initial=placement)
    return spec.replace(placement=placement)


def _cuts(placed: int, num_steps: int, windows: int) -> list[tuple[int, int]]:
    """The held-out windows `[a, b)`: the scored steps `[placed, S)` cut into `windows` runs of
    consecutive steps whose lengths differ by at most one (fewer when there are fewer steps)."""
    bounds = np.linspace(placed, num_steps, min(windows, num_steps - placed) + 1).round()
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _name(policy: Any, sources: Any) -> str:
    """A policy's name on the page; an engine algorithm's with the engine code it ran from
    (`engines.label`: `sglang:dynamic (sglang 0.5.23)`, `... (sglang at PATH)` for a
    checkout), so the page says whose code ran."""
    name = resolve_policy(policy, sources)[0]
    code = engine_code([name], sources)
    return f"{name} ({code})" if code else name


def _own_lists(policy: Any, sources: Any) -> str | None:
    """The view equal to the candidate lists engine algorithm `policy` dispatches from,
    whatever view it is given (DESIGN.md §11): SGLang's, per release (`conform.list_view`),
    vLLM's `full` (every replica, ascending); None for any other policy, which dispatches from
    the view it is given."""
    name = resolve_policy(policy, sources)[0]
    if not is_engine_name(name):
        return None
    return list_view(sources) if name.partition(":")[0] == "sglang" else "full"


def _views(roles: dict[str, dict], view: Any, asked: bool) -> tuple[dict[str, Any], str]:
    """The view each role (`roles`: its policy and engine source) dispatches from, and why,
    in words: an engine side from its own lists (`_own_lists`); any other side from `view`
    when `asked`, else from the engine side's lists (the candidate's when both are an
    engine's), so both choose from the same lists, else from `view`."""
    lists = {w: _own_lists(r["policy"], r["engine_source"]) for w, r in roles.items()}
    engines = [w for w in roles if lists[w] is not None]
    shared = view if asked or not engines else lists[engines[0]]
    views = {w: shared if lists[w] is None else lists[w] for w in roles}
    if views["candidate"] != views["baseline"]:
        return views, "; ".join(
            f"the {w} on the {name_of(views[w])} view ("
            f"{'its own lists' if lists[w] is not None else '--view'})" for w in roles) + \
            ": an engine's code chooses from its own lists, whatever view it is given"
    both = f"both sides on the {name_of(views['candidate'])} view"
    if not engines:
        return views, both + (" (--view)" if asked else " (the default; --view sets it)")
    if len(engines) == 2:
        return views, both + ", each engine's own lists"
    return views, both + f", the {engines[0]}'s own lists" + ("" if asked else
                                                             "; --view overrides")


def _window(trace: RunTrace, solvers: dict[str, RunSpec], a: int, b: int, roles: dict[str, dict],
            note: Callable[[str], None],
            placed: dict[str, Placement] | None = None) -> dict[str, Any]:
    """One held-out window: each role placed on steps `[0, a)` by its spec's solver
    (`solvers`; `placed`, when the caller has solved those placements already), candidate and
    baseline (`roles`: the policy and engine source of each) scored on `[a, b)` with the spec's
    seed; their differences in time and GPU imbalance."""
    test = select(trace, f"{a}:{b}")
    if placed is None:
        placed = _placements(select(trace, f"0:{a}"), solvers)
    routed = routed_loads(test)
    note(f"held-out window {a}-{b - 1}")
    specs = {r: _scored(test, solvers[r], placed[r]) for r in roles}
    plans = _plans(test, specs, routed, solvers)
    cand, base = (replay_planned(test, specs[r].replace(**roles[r]), plans[r]).metrics
                  for r in ("candidate", "baseline"))
    return {"placed_on": [0, a], "scored_on": [a, b],
            "difference_ms": cand["moe_ms"] - base["moe_ms"],
            "difference_pct": percent(cand["moe_ms"], base["moe_ms"]),
            "gpu_imbalance_difference": _minus(cand["gpu_imbalance"], base["gpu_imbalance"])}


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _placement(train: RunTrace, spec: RunSpec) -> Placement:
    """The placement the spec's solver makes from the placed steps' loads (or the given one)."""
    segments = schedule_of(train, _without_schedule(spec), routed_loads(train))
    return segments[0].placement


def _placements(train: RunTrace, solvers: dict[str, RunSpec]) -> dict[str, Placement]:
    """Each role's placement from the placed steps (`_placement`), solved once when the
    roles share one spec (a dispatch review)."""
    cand = _placement(train, solvers["candidate"])
    return {"candidate": cand, "baseline": cand if _shared(solvers)
            else _placement(train, solvers["baseline"])}


def _shared(solvers: dict[str, RunSpec]) -> bool:
    """Whether the roles place with one spec (a dispatch review), so one solve serves both."""
    return solvers["baseline"] is solvers["candidate"]


def _scored(test: RunTrace, spec: RunSpec, placement: Placement) -> RunSpec:
    """`spec` scoring `test` on `placement` (`_scoring`), fitted to it."""
    return spec_for_trace(test, _scoring(spec, placement))


def _plans(test: RunTrace, specs: dict[str, RunSpec], routed: Any,
           solvers: dict[str, RunSpec]) -> dict[str, Plan]:
    """Each role's `Plan` on `test` (`replay_planned`) for its scoring spec in `specs`: the
    schedule solved once for both when the roles share a spec (`_shared`), once a role in a
    placement review."""
    plans = {"candidate": Plan(routed, schedule_of(test, specs["candidate"], routed))}
    plans["baseline"] = plans["candidate"] if _shared(solvers) else \
        Plan(routed, schedule_of(test, specs["baseline"], routed))
    return plans


SCHEDULE = ("rebalance_every", "window", "predictor", "decay", "initial", "skip_above",
            "rebalance_mode", "copy_steps", "switch_delay", "migration",
            "unmoved", "map_lead")  # what only a schedule reads


def _without_schedule(spec: RunSpec) -> RunSpec:
    """`spec` serving one placement: its schedule's settings at their defaults."""
    return spec.replace(**{name: default_of("schedule", name) for name in SCHEDULE})


def to_json(report: Report) -> str:
    """The report as the JSON `--json` prints and `report.json` holds."""
    return json.dumps(report.as_dict(), indent=2, default=_plain)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


__all__ = ["BALANCE_KEYS", "EXIT", "SEARCH_ROWS", "STARVED_SHARE", "WORST", "Report", "review",
           "to_json"]
