"""`review`: one verdict on a dispatch change before it goes upstream (DESIGN.md §12).

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
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from . import metrics as M
from .checks import rank_invariance
from .cost.compute import ETA_COMPUTE, ETA_MEMORY, roofline_terms
from .cost.measured import ROOFLINE
from .dispatch import USER, resolve_policy
from .engines import as_sources, is_engine_name, ran
from .errors import InputError
from .evidence import LEVEL, RESAMPLES, Draws, draws, figure, interval, resampled
from .placement import Placement
from .replay import fitted, replay, routed_loads, schedule_of
from .report import html
from .results import Results, model_origin, warnings
from .runspec import RunSpec, default_of
from .traces.counts import CountsTrace
from .traces.steps import select
from .verdict import EXIT, MIN_EFFECT, judge

WINDOWS = 4  # held-out windows by default
MAX_SEEDS, MAX_WINDOWS, MAX_RESAMPLES = 64, 64, 100_000
SEARCH_ROWS = (1, 2, 3, 5, 7)  # the small batches the invariance search tries first
STARVED_SHARE = 0.5  # a replica executing under half its even share of its expert is starved
WORST = 3  # worst layers and starved replicas named


@dataclass
class Report:
    """A review's findings (module doc): plain data, JSON-ready (`as_dict`), rendered by
    `report.markdown`, `report.html`; a notebook shows the HTML. `headline` is one line per
    axis (correctness, balance, time); `warnings` what the trace's windows hold that the
    verdict should not rest on (flagged warm-up and outlier steps, a model that does not fit).
    `placement` is the held-out placement the scored steps ran on; a counterexample's `batch`
    (`[T, L, K]` ids, for a search batch of up to 7 rows) reproduces it with
    `checks.rank_invariance` on it."""

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


def review(trace: Any, candidate: Any, baseline: Any = None, spec: RunSpec | None = None, *,
           holdout: float = 0.5, seeds: int = 3, windows: int = WINDOWS,
           min_effect: float = MIN_EFFECT, resamples: int = RESAMPLES,
           baseline_sources: Any = None, baseline_solver: Any = None,
           progress: Callable[[str], None] | None = None) -> Report:
    """Review `candidate` against `baseline` (default: SGLang's dispatch for the spec's mode,
    `row` in "none", `random` in "a2a") on `trace` under `spec` (module doc). Policies are
    registry names, engine algorithms, `file.py:function` names or callables. `holdout` is the
    scored share of the steps, in (0, 1); `seeds` the seeds every scored step is replayed
    with; `windows` the held-out windows the scored steps are cut into (a rolling origin);
    `min_effect` the smallest gain worth a pull request, in % of the baseline's step time;
    `resamples` the block bootstrap's (`evidence`). `baseline_sources`: the engine sources
    the baseline's engine code runs from, when not the spec's (a branch against main: the
    candidate from the branch, the baseline from main). `baseline_solver`, when given, makes it
    a review of a placement change: the spec's solver (the candidate's) against this one (a
    registry name, an engine's, `file.py:function` or a callable), each placing on the placed
    steps and re-solving on its schedule, with the baseline's policy `candidate` unless
    `baseline` says otherwise. `progress(what)` hears of each replay."""
    if isinstance(trace, CountsTrace):
        raise InputError("a review dispatches token rows; a counts-only trace has none")
    _check_options(holdout, seeds, windows, min_effect, resamples)
    asked = RunSpec() if spec is None else spec
    spec = fitted(trace, asked)
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
    solvers = {"candidate": spec, "baseline": spec if kind == "dispatch" else spec.replace(
        solver=baseline_solver, solver_options={}, affinity_slack=None, lplb_topology=None)}
    names = [_name(r["policy"], r["engine_source"], sources != base_sources)
             for r in roles.values()]
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
            runs[which].append(replay(test, specs[which].replace(**role), planned=plans[which]))
    cand, base = runs["candidate"][0], runs["baseline"][0]
    held = None
    if rebalancing:
        note(f"candidate {names[0]} without rebalancing")
        held = replay(test, _without_schedule(spec).replace(policy=candidate,
                                                            placement=placement))
    cuts = _cuts(placed, S, windows)
    windowed = [_window(trace, solvers, a, b, roles, note,
                        placements if a == placed else None) for a, b in cuts]

    d = draws(seeds, scored, resamples, spec.dispatch.seed)
    invariance = _invariance(candidate, names[0], test, placement,
                             _scoring(spec, placement), cand)
    balance = _balance(runs, test, placement, d)
    time = _time(runs, spec, d, windowed, min_effect, model_origin(trace.meta, asked))
    rebalance = _rebalance(cand, held, scored, base if kind == "placement" else None) \
        if rebalancing else None
    verdict, reasons, headline = judge(invariance, balance, time, rebalance, scored, mode,
                                       kind)
    setup = {"kind": kind, "steps": S, "placed_on": [0, placed], "scored_on": [placed, S],
             "seeds": seeds, "windows": [[a, b] for a, b in cuts], "mode": mode,
             "gpus": spec.topology.gpus, "slots": placement.num_slots,
             "solver": str(spec.labels()["solver"]),
             "baseline_solver": str(solvers["baseline"].labels()["solver"]),
             "cost": str(spec.cost.cost), "model": spec.cost.name,
             "device": spec.cost.device_profile, "engine_source": dict(sources),
             "baseline_engine_source": dict(base_sources)}
    notes = warnings(trace, spec, asked, [
        (f"the placement window (steps 0-{placed - 1})", 0, placed),
        (f"the scored window (steps {placed}-{S - 1})", placed, S)])
    series = {"layer_imbalance": {n: balance["per_layer"][n] for n in ("candidate", "baseline")},
              "step_ms": {n: M.time_series(r).get("moe_ms") for n, r in
                          (("candidate", cand), ("baseline", base))},
              "replica_share": {n: _replica_shares(r) for n, r in
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


def _name(policy: Any, sources: Any, apart: bool) -> str:
    """A policy's name on the page; with the engine code it ran from when the candidate's and
    the baseline's sources are `apart`."""
    name = resolve_policy(policy, sources)[0]
    code = ran([name], sources) if apart else None
    return f"{name} ({code})" if code else name


def _window(trace: Any, solvers: dict[str, RunSpec], a: int, b: int, roles: dict[str, dict],
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
    cand, base = (replay(test, specs[r].replace(**roles[r]), planned=plans[r]).metrics
                  for r in ("candidate", "baseline"))
    return {"placed_on": [0, a], "scored_on": [a, b],
            "difference_ms": cand["moe_ms"] - base["moe_ms"],
            "difference_pct": _percent(cand["moe_ms"], base["moe_ms"]),
            "gpu_imbalance_difference": _minus(cand["gpu_imbalance"], base["gpu_imbalance"])}


def _percent(value: float, reference: float) -> float:
    """`value` over `reference` less 1, in percent (NaN when the reference is 0)."""
    return (value / reference - 1) * 100 if reference else math.nan


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _placement(train: Any, spec: RunSpec) -> Placement:
    """The placement the spec's solver makes from the placed steps' loads (or the given one)."""
    segments = schedule_of(train, _without_schedule(spec), routed_loads(train))
    return segments[0].placement


def _placements(train: Any, solvers: dict[str, RunSpec]) -> dict[str, Placement]:
    """Each role's placement from the placed steps (`_placement`), solved once when the
    roles share one spec (a dispatch review)."""
    cand = _placement(train, solvers["candidate"])
    return {"candidate": cand, "baseline": cand if _shared(solvers)
            else _placement(train, solvers["baseline"])}


def _shared(solvers: dict[str, RunSpec]) -> bool:
    """Whether the roles place with one spec (a dispatch review), so one solve serves both."""
    return solvers["baseline"] is solvers["candidate"]


def _scored(test: Any, spec: RunSpec, placement: Placement) -> RunSpec:
    """`spec` scoring `test` on `placement` (`_scoring`), fitted to it."""
    return fitted(test, _scoring(spec, placement))


def _plans(test: Any, specs: dict[str, RunSpec], routed: Any,
           solvers: dict[str, RunSpec]) -> dict[str, tuple]:
    """Each role's `(routed loads, segments)` on `test` (`replay`'s `planned`) for its scoring
    spec in `specs`: the schedule solved once for both when the roles share a spec
    (`_shared`), once a role in a placement review."""
    plans = {"candidate": (routed, schedule_of(test, specs["candidate"], routed))}
    plans["baseline"] = plans["candidate"] if _shared(solvers) else \
        (routed, schedule_of(test, specs["baseline"], routed))
    return plans


SCHEDULE = ("rebalance_every", "window", "predictor", "decay", "initial", "skip_above",
            "rebalance_mode", "copy_steps", "switch_delay")  # what only a schedule reads


def _without_schedule(spec: RunSpec) -> RunSpec:
    """`spec` serving one placement: its schedule's settings at their defaults."""
    return spec.replace(**{name: default_of("schedule", name) for name in SCHEDULE})


# Correctness ----------------------------------------------------------------------------------

def _claimed(policy: Any, sources: Any) -> str:
    """The rank-invariance class the candidate claims: its registry entry's, else unknown."""
    name, entry = resolve_policy(policy, sources)
    if entry.source.startswith(USER) or is_engine_name(name):
        return "unknown (not registered: nothing is claimed)"
    return entry.invariance()


def _invariance(policy: Any, name: str, test: Any, placement: Placement, spec: RunSpec,
                results: Results) -> dict[str, Any]:
    """Claimed class against observed: in "none" the smallest adversarial batch on which ranks
    choose differently (module doc), and the output error on the scored steps."""
    d = spec.dispatch
    out: dict[str, Any] = {"claimed": _claimed(policy, d.engine_source), "observed": None,
                           "counterexample": None, "searched": 0,
                           "output_rel_error": results.metrics.get("output_rel_error"),
                           "rank_agreement": results.metrics.get("rank_agreement")}
    if d.mode != "none":
        out["observed"] = "not needed in a2a (each token is dispatched once, by its owner)"
        return out
    for step, ids in _search_batches(test):
        out["searched"] += 1
        found = rank_invariance(policy, ids, placement, view=d.view, rng=d.rng, seed=d.seed,
                                step=step, sources=d.engine_source)
        if found.first is not None:
            (t, layer, k), choices = found.first
            out["counterexample"] = {
                "step": step, "layer": layer, "token": t, "expert": int(ids[t, layer, k]),
                "rows": int(ids.shape[0]), "choices": {r: c for r, c in enumerate(choices)},
                "batch": ids.tolist() if ids.shape[0] <= max(SEARCH_ROWS) else None}
            break
    if out["counterexample"] is None:  # the replay may still disagree: across a switch
        out["replay_disagrees"] = _first_disagreement(results, spec)
    agreed = results.metrics.get("rank_agreement")
    corrupt = out["counterexample"] is not None or (agreed is not None and agreed < 1)
    out["observed"] = "variant" if corrupt else "invariant (none found)"
    return out


def _first_disagreement(results: Results, spec: RunSpec) -> dict[str, Any] | None:
    """The first (step, layer) of the scored replay on which ranks disagreed, and whether the
    ranks were then serving different placements (a rebalance they switch to at different
    steps); None when they always agreed."""
    c = results.counters
    split = (c.agreed < c.valid).nonzero()
    if not len(split):
        return None
    step, layer = split[0].tolist()
    switching = any(seg.switch is not None and bool((seg.switch > step).any())
                    and seg.start <= step for seg in results.segments)
    return {"step": step, "layer": layer, "pairs": int(c.valid[step, layer]),
            "agreed": int(c.agreed[step, layer]), "during_switch": switching}


def _search_batches(test: Any) -> list[tuple[int, torch.Tensor]]:
    """`(step, ids [T, L, K])` batches in the order the search tries them: the first rows of the
    first scored step (1, 2, 3, 5, 7), one row repeated, a padding row inside, then every
    scored step whole."""
    first = test.step(0).long()  # [T, L, K]
    valid = first[(first >= 0).any(-1).any(-1)]
    out: list[tuple[int, torch.Tensor]] = []
    for rows in SEARCH_ROWS:
        if rows <= len(valid):
            out.append((0, valid[:rows]))
    if len(valid):
        out.append((0, valid[:1].expand(4, -1, -1).clone()))
        pad = torch.full_like(valid[:1], -1)
        out.append((0, torch.cat([valid[:2], pad, valid[2:3]])))
    out += [(s, test.step(s).long()) for s in range(test.num_steps)]
    return out


# Balance --------------------------------------------------------------------------------------

BALANCE_KEYS = ("gpu_imbalance", "gpu_imbalance_with_shared", "replica_skew_mean",
                "replica_skew_max", "replica_skew_cumulative", "idle_replica_frac",
                "fanout_gpus", "fanout_nodes", "remote_frac")  # each where the run has it


def _balance(runs: dict[str, list[Results]], test: Any, placement: Placement,
             d: Draws) -> dict[str, Any]:
    """Balance and traffic metrics side by side (each where the run has it: the shared
    experts' work when counted, fan-out with the cost model, remote GPUs in "a2a"), the
    difference in GPU imbalance with its interval (`_paired`), per layer, the worst layers and
    the starved replicas."""
    cand, base = runs["candidate"][0], runs["baseline"][0]
    nodes = cand.spec.topology.topology().num_nodes
    keys = [k for k in BALANCE_KEYS if cand.metrics.get(k) is not None
            and not (k == "fanout_nodes" and nodes == 1)]
    layers = {n: _layer_imbalance(r) for n, r in (("candidate", cand), ("baseline", base))}
    worst = np.argsort(-np.nan_to_num(layers["candidate"], nan=-1.0))[:WORST].tolist()
    loaded = placement.logcnt > 1  # [L, E]
    routed = cand.true_load.sum(0)  # [L, E] the test steps' routed pairs
    return {
        "candidate": {k: cand.metrics.get(k) for k in keys},
        "baseline": {k: base.metrics.get(k) for k in keys},
        "difference": _paired(runs, "gpu_imbalance", d),
        "per_layer": {n: [None if math.isnan(v) else float(v) for v in values]
                      for n, values in layers.items()},
        "worst_layers": [{"layer": int(i), "candidate": float(layers["candidate"][i]),
                          "baseline": float(layers["baseline"][i])} for i in worst],
        "replicated_loaded_pairs": int(routed[loaded].sum()),
        "starved": {"candidate": _starved(cand, test), "baseline": _starved(base, test)},
    }


def _layer_imbalance(results: Results) -> np.ndarray:
    """Each layer's `gpu_imbalance` over the steps, `[L]` (NaN for an idle layer): the
    metric's own components, so one layer's figure is the table's."""
    values = results.components["gpu_imbalance"][0]  # [S, L]
    return M.mean(values, dims=(0,)).numpy()


def _step_parts(results: Results, key: str) -> tuple[np.ndarray, np.ndarray]:
    """`(numerator, denominator)` `[S]` of the metric `key` per step (`evidence` module doc):
    a step's time over 1 (`step_time`), or the sum of its defined layers' values over their
    number (`mean`)."""
    values = results.components[key][0].to(torch.float64)  # [S, L]
    if M.METRICS[key].reduce is M.step_time:
        return values.sum(1).numpy(), np.ones(values.shape[0])
    defined = ~values.isnan()
    return values.nan_to_num(0.0).sum(1).numpy(), defined.sum(1).to(torch.float64).numpy()


def _paired(runs: dict[str, list[Results]], key: str, d: Draws,
            relative: bool = False) -> dict[str, Any]:
    """The candidate's `key` less the baseline's over every seed's scored steps, with its
    interval over the resamples `d` (`evidence`); `relative`: also as % of the baseline's."""
    parts = {n: [np.stack(x) for x in zip(*(_step_parts(r, key) for r in rs))]
             for n, rs in runs.items()}  # name -> (num [R, S], den [R, S])
    whole = {n: figure(*parts[n]) for n in parts}
    again = {n: resampled(*parts[n], d) for n in parts}
    out = {"difference": whole["candidate"] - whole["baseline"],
           "interval": list(interval(again["candidate"] - again["baseline"]))}
    if relative:
        with np.errstate(invalid="ignore", divide="ignore"):
            out["difference_pct"] = _percent(whole["candidate"], whole["baseline"])
            out["interval_pct"] = list(interval((again["candidate"] / again["baseline"] - 1)
                                                * 100))
    return out


def _shares(results: Results) -> torch.Tensor:
    """Each slot's executed pairs over its even share over the scored steps, float64 `[L, P]`
    on the first segment's placement; `inf` for a slot whose expert has one replica or no
    load."""
    placement = results.segments[0].placement
    executed = results.slot_load.to(torch.float64).sum(0)  # [L, P]
    even = placement.expected_load(results.true_load.sum(0))  # [L, P]
    replicated = placement.logcnt.gather(1, placement.phy2log) > 1
    return torch.where(replicated & (even > 0), executed / even.clamp(min=1e-12), math.inf)


def _replica_shares(results: Results) -> np.ndarray:
    """The replicated, loaded slots' shares (`_shares`), sorted."""
    share = _shares(results)
    return np.sort(share[torch.isfinite(share)].numpy())


def _starved(results: Results, test: Any) -> list[dict[str, Any]]:
    """The replicas executing under `STARVED_SHARE` of their even share (worst first), each with
    the share of its expert's pairs each row residue class `row % n` carries."""
    placement = results.segments[0].placement
    share = _shares(results)
    out = []
    for flat in torch.argsort(share.flatten())[:WORST].tolist():
        layer, slot = divmod(flat, placement.num_slots)
        if share[layer, slot] >= STARVED_SHARE:
            break
        expert = int(placement.phy2log[layer, slot])
        n = int(placement.logcnt[layer, expert])
        out.append({"layer": layer, "slot": slot, "expert": expert, "replicas": n,
                    "share_of_even": round(float(share[layer, slot]), 4),
                    "row_residues": _residues(test, layer, expert, n)})
    return out


def _residues(test: Any, layer: int, expert: int, n: int) -> list[float]:
    """The share of `expert`'s pairs in `layer` on rows of each residue class `row % n`."""
    counts = torch.zeros(n, dtype=torch.float64)
    for s in range(test.num_steps):
        rows = (test.step(s)[:, layer, :].long() == expert).sum(-1)  # [T]
        counts += torch.bincount(torch.arange(rows.numel()) % n, weights=rows.double(),
                                 minlength=n)
    total = float(counts.sum())
    return [round(float(c) / total, 4) if total else 0.0 for c in counts]


# Time -----------------------------------------------------------------------------------------

def _time(runs: dict[str, list[Results]], spec: RunSpec, d: Draws, windows: list[dict],
          min_effect: float, model_from: str) -> dict[str, Any]:
    """ms a step and tokens/s of both, the difference with its interval over the resampled
    steps and seeds, the spread across seeds, each held-out window's difference, the measured
    tables' prices, which term decides, and where the model came from (`model_from`)."""
    ms = {n: [r.metrics["moe_ms"] for r in rs] for n, rs in runs.items()}
    diff = [c - b for c, b in zip(ms["candidate"], ms["baseline"])]
    cand, base = runs["candidate"][0], runs["baseline"][0]
    paired = _paired(runs, "moe_ms", d, relative=True)
    return {
        "cost": str(spec.cost.cost), "model": spec.cost.name, "model_from": model_from,
        "device": spec.cost.device_profile,
        "candidate": _times(cand.metrics), "baseline": _times(base.metrics),
        "difference_ms": paired["difference"], "interval_ms": paired["interval"],
        "difference_pct": paired["difference_pct"], "interval_pct": paired["interval_pct"],
        "level": LEVEL, "min_effect_pct": float(min_effect),
        "bootstrap": {"resamples": d.resamples, "block_steps": d.block,
                      "seeds": len(diff), "seed": spec.dispatch.seed},
        "difference_per_seed_ms": diff,
        "spread_ms": float(max(diff) - min(diff)),
        "windows": windows,
        "measured": _measured(cand, base),
        "decides": _deciding_term(cand),
    }


def _times(metrics: dict[str, Any]) -> dict[str, Any]:
    return {"ms_per_step": metrics["moe_ms"], "tokens_per_s": metrics["moe_tokens_per_s"],
            "compute_ms": metrics["compute_ms"], "comm_ms": metrics["comm_ms"]}


def _measured(cand: Results, base: Results) -> dict[str, Any]:
    """ms a step of both under the `measured` cost model (aiconfigurator-core's tables), priced
    from the same counted loads, and their difference, when the run's cost model is another and
    the tables have the model and EP size; else why not."""
    if cand.spec.cost.cost == "measured":
        return {"unavailable": "the run's own cost model is measured"}
    try:
        priced = [Results(r.spec.replace(cost="measured", cost_options={}), r.slot_load,
                          r.true_load, r.segments, r.counters).metrics for r in (cand, base)]
    except InputError as exc:  # no extra, or no table for this model, device or EP size
        return {"unavailable": str(exc).removesuffix(f" ({ROOFLINE})")}  # priced so already
    return {"candidate_ms_per_step": priced[0]["moe_ms"],
            "baseline_ms_per_step": priced[1]["moe_ms"],
            "difference_ms": priced[0]["moe_ms"] - priced[1]["moe_ms"],
            "source": priced[0].get("cost_source")}


def _deciding_term(results: Results) -> dict[str, Any]:
    """Which term bounds the candidate's time: the slowest GPU's compute in each (step, layer)
    (its whole work, `metrics.gpu_work`) is bound by its weight (and activation) reads or by
    its arithmetic (the roofline's two terms), beside the communication; the largest share
    decides."""
    spec = results.spec
    shape, device = spec.cost.profiles()
    options = spec.cost.cost_options
    pairs, active = M.gpu_work(results.slot_load, results.counters, spec.topology.gpus,
                               spec.shared_work(), spec.dispatch.mode)  # [S, L, G] each
    arithmetic, reads = roofline_terms(pairs, active, shape, device,
                                       options.get("eta_compute", ETA_COMPUTE),
                                       options.get("eta_memory", ETA_MEMORY))
    slowest = torch.maximum(arithmetic, reads).argmax(-1, keepdim=True)  # [S, L, 1]
    a, r = arithmetic.gather(-1, slowest), reads.gather(-1, slowest)
    bound = torch.maximum(a, r)
    total = float(bound.sum()) or 1.0
    compute_ms = results.metrics["compute_ms"]
    terms = {"weight reads": compute_ms * float(bound[r >= a].sum()) / total,
             "arithmetic": compute_ms * float(bound[r < a].sum()) / total,
             "communication": results.metrics["comm_ms"]}
    return {"ms_per_step": {k: round(v, 6) for k, v in terms.items()},
            "term": max(terms, key=terms.get)}


def _rebalance(cand: Results, held: Results, scored: int,
               base: Results | None = None) -> dict[str, Any]:
    """The schedule's stalls or hazard steps and its net benefit over the scored steps; in a
    placement review (`base`, the baseline's run) also the baseline solver's stalls and
    moves."""
    saved = held.metrics["moe_ms"] - cand.metrics["moe_ms"]
    stall = cand.metrics.get("rebalance_stall_ms") or 0.0
    extra = {} if base is None else {
        "baseline_stall_ms": base.metrics.get("rebalance_stall_ms") or 0.0,
        "baseline_moved_slots": base.metrics.get("moved_slots")}
    return {**extra, "mode": cand.spec.schedule.rebalance_mode,
            "every": cand.spec.schedule.rebalance_every,
            "rebalances": cand.metrics.get("rebalances"),
            "moved_slots": cand.metrics.get("moved_slots"),
            "stall_ms": stall, "hazard_steps": cand.metrics.get("hazard_steps"),
            "ms_per_step_without": held.metrics["moe_ms"], "ms_per_step_with":
            cand.metrics["moe_ms"], "saved_ms_per_step": saved,
            "net_ms": saved * scored - stall}


def to_json(report: Report) -> str:
    """The report as the JSON `--json` prints and `report.json` holds."""
    return json.dumps(report.as_dict(), indent=2, default=_plain)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


__all__ = ["EXIT", "Report", "review", "to_json"]
