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
- **balance**: GPU imbalance, replica skew (mean, max, cumulative), idle replicas, per layer
  with the worst named, and the replicas a policy starves (with the share of their expert's
  pairs each row residue class carries, the pattern that starves a replica under `row`).
- **time**: ms a step and tokens/s under the cost model (roofline unless the spec names one),
  and under `measured` too when its extra and a table for the shape are there, which term
  bounds the slowest GPU (weight reads, arithmetic or communication), and with a
  rebalance schedule its stalls or hazard steps and its net benefit (time saved a step x steps
  minus stalls, against the same candidate on the held-out placement without rebalancing).
- **verdict**: `not recommended` when the candidate corrupts "none" mode, or when its
  rebalancing loses more than it saves, or when it is slower; `insufficient evidence` when the
  scored steps are too few, no replicated expert carries load, or the difference in time lies
  within the spread of the difference across seeds; else `recommend`. `EXIT` maps each to the
  command's exit status.
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
from .cost import DEVICES, MODELS
from .cost.compute import ETA_COMPUTE, ETA_MEMORY
from .dispatch import USER, resolve_policy
from .engines import is_engine_name
from .errors import InputError
from .placement import Placement
from .registry import lookup
from .replay import fitted, replay, routed_loads, schedule_of
from .report import html, number
from .results import Results
from .spec import RunSpec, default_of
from .traces.counts import CountsTrace
from .traces.steps import select

EXIT = {"recommend": 0, "not recommended": 1, "insufficient evidence": 3}
MIN_SCORED_STEPS = 4  # fewer scored steps than this is too little to judge
SEARCH_ROWS = (1, 2, 3, 5, 7)  # the small batches the invariance search tries first
STARVED_SHARE = 0.5  # a replica executing under half its even share of its expert is starved
WORST = 3  # worst layers and starved replicas named


@dataclass
class Report:
    """A review's findings (module doc): plain data, JSON-ready (`as_dict`), rendered by
    `report.markdown`, `report.html`; a notebook shows the HTML. `placement` is the held-out
    placement the scored steps ran on; a counterexample's `batch` (`[T, L, K]` ids, for a
    search batch of up to 7 rows) reproduces it with `checks.rank_invariance` on it."""

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
           holdout: float = 0.5, seeds: int = 3,
           progress: Callable[[str], None] | None = None) -> Report:
    """Review `candidate` against `baseline` (default: SGLang's dispatch for the spec's mode,
    `row` in "none", `random` in "a2a") on `trace` under `spec` (module doc). Policies are
    registry names, engine algorithms, `file.py:function` names or callables. `holdout` is the
    scored share of the steps, in (0, 1); `seeds` the number of seeds the time difference's
    spread is measured over. `progress(what)` hears of each replay."""
    if isinstance(trace, CountsTrace):
        raise InputError("a review dispatches token rows; a counts-only trace has none")
    if not 0 < holdout < 1:
        raise InputError(f"--holdout must lie in (0, 1), got {holdout}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 2:
        raise InputError(f"--seeds must be an integer >= 2 (a spread needs two), got {seeds}")
    spec = fitted(trace, RunSpec() if spec is None else spec)
    if spec.cost.cost is None:
        spec = spec.replace(cost="roofline")
    mode = spec.dispatch.mode
    baseline = ("row" if mode == "none" else "random") if baseline is None else baseline
    sources = spec.dispatch.engine_source
    names = [resolve_policy(p, sources)[0] for p in (candidate, baseline)]
    note = progress or (lambda what: None)

    S = trace.num_steps
    scored = max(1, round(S * holdout)) if S > 1 else 0
    placed = S - scored
    if placed < 1 or scored < 1:
        raise InputError(f"the trace has {S} step(s): a review places on some steps and scores "
                         f"on later ones, so it needs at least 2")
    train, test = select(trace, f"0:{placed}"), select(trace, f"{placed}:{S}")
    placement = _placement(train, spec)
    rebalancing = spec.schedule.rebalance_every is not None
    scoring = (spec.replace(initial=placement) if rebalancing
               else spec.replace(placement=placement))

    runs: dict[str, list[Results]] = {"candidate": [], "baseline": []}
    routed = routed_loads(test)  # counted once; each seed's schedule solved once for both
    for i in range(seeds):
        seeded = fitted(test, scoring.replace(seed=spec.dispatch.seed + i))
        planned = routed, schedule_of(test, seeded, routed)
        for which, policy in (("candidate", candidate), ("baseline", baseline)):
            note(f"{which} {names[which == 'baseline']}, seed {spec.dispatch.seed + i}")
            runs[which].append(replay(test, seeded.replace(policy=policy), planned=planned))
    cand, base = runs["candidate"][0], runs["baseline"][0]
    held = None
    if rebalancing:
        note(f"candidate {names[0]} without rebalancing")
        held = replay(test, _without_schedule(spec).replace(policy=candidate,
                                                            placement=placement))

    invariance = _invariance(candidate, names[0], test, placement, scoring, cand)
    balance = _balance(cand, base, test, placement)
    time = _time(runs, spec)
    rebalance = _rebalance(cand, held, scored) if rebalancing else None
    verdict, reasons = _verdict(invariance, balance, time, rebalance, scored, mode)
    setup = {"steps": S, "placed_on": [0, placed], "scored_on": [placed, S], "seeds": seeds,
             "mode": mode, "gpus": spec.topology.gpus, "slots": placement.num_slots,
             "solver": str(spec.solver.solver), "cost": str(spec.cost.cost),
             "model": spec.cost.model, "device": spec.cost.device_profile,
             "engine_source": dict(sources)}
    series = {"layer_imbalance": {n: _layer_imbalance(r) for n, r in
                                  (("candidate", cand), ("baseline", base))},
              "step_ms": {n: M.time_series(r).get("moe_ms") for n, r in
                          (("candidate", cand), ("baseline", base))},
              "replica_share": {n: _replica_shares(r) for n, r in
                                (("candidate", cand), ("baseline", base))}}
    return Report(verdict, reasons, names[0], names[1], mode, invariance, balance, time,
                  rebalance, setup, series, placement)


def _placement(train: Any, spec: RunSpec) -> Placement:
    """The placement the spec's solver makes from the placed steps' loads (or the given one)."""
    segments = schedule_of(train, _without_schedule(spec), routed_loads(train))
    return segments[0].placement


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

BALANCE_KEYS = ("gpu_imbalance", "replica_skew_mean", "replica_skew_max",
                "replica_skew_cumulative", "idle_replica_frac")


def _balance(cand: Results, base: Results, test: Any, placement: Placement) -> dict[str, Any]:
    """Balance metrics side by side, per layer, the worst layers and the starved replicas."""
    layers = {n: _layer_imbalance(r) for n, r in (("candidate", cand), ("baseline", base))}
    worst = np.argsort(-np.nan_to_num(layers["candidate"], nan=-1.0))[:WORST].tolist()
    loaded = placement.logcnt > 1  # [L, E]
    routed = cand.true_load.sum(0)  # [L, E] the test steps' routed pairs
    return {
        "candidate": {k: cand.metrics.get(k) for k in BALANCE_KEYS},
        "baseline": {k: base.metrics.get(k) for k in BALANCE_KEYS},
        "per_layer": {n: [None if math.isnan(v) else round(float(v), 4) for v in values]
                      for n, values in layers.items()},
        "worst_layers": [{"layer": int(i), "candidate": float(layers["candidate"][i]),
                          "baseline": float(layers["baseline"][i])} for i in worst],
        "replicated_loaded_pairs": int(routed[loaded].sum()),
        "starved": {"candidate": _starved(cand, test), "baseline": _starved(base, test)},
    }


def _layer_imbalance(results: Results) -> np.ndarray:
    """Mean over steps of each layer's max / mean GPU load, `[L]` (NaN for an idle layer)."""
    gpu = M.gpu_loads(results.slot_load, results.spec.topology.gpus)  # [S, L, G]
    return torch.nanmean(M.max_over_mean(gpu), 0).numpy()


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

def _time(runs: dict[str, list[Results]], spec: RunSpec) -> dict[str, Any]:
    """ms a step, tokens/s and the spread over seeds of the difference; which term decides."""
    ms = {n: [r.metrics["moe_ms"] for r in rs] for n, rs in runs.items()}
    diff = [c - b for c, b in zip(ms["candidate"], ms["baseline"])]
    cand, base = runs["candidate"][0].metrics, runs["baseline"][0].metrics
    return {
        "measured": _measured(runs["candidate"][0], runs["baseline"][0]),
        "cost": str(spec.cost.cost), "model": spec.cost.model, "device": spec.cost.device_profile,
        "candidate": {"ms_per_step": cand["moe_ms"], "tokens_per_s": cand["moe_tokens_per_s"],
                      "compute_ms": cand["compute_ms"], "comm_ms": cand["comm_ms"]},
        "baseline": {"ms_per_step": base["moe_ms"], "tokens_per_s": base["moe_tokens_per_s"],
                     "compute_ms": base["compute_ms"], "comm_ms": base["comm_ms"]},
        "difference_ms": float(np.mean(diff)),
        "difference_per_seed_ms": diff,
        "spread_ms": float(max(diff) - min(diff)),
        "decides": _deciding_term(runs["candidate"][0], spec),
    }


def _measured(cand: Results, base: Results) -> dict[str, Any]:
    """ms a step of both under the `measured` cost model (aiconfigurator-core's tables), priced
    from the same counted loads, when the run's cost model is another and the tables have the
    model and EP size; else why not."""
    if cand.spec.cost.cost == "measured":
        return {"unavailable": "the run's own cost model is measured"}
    try:
        priced = [Results(r.spec.replace(cost="measured", cost_options={}), r.slot_load,
                          r.true_load, r.segments, r.counters) for r in (cand, base)]
        return {"candidate_ms_per_step": priced[0].metrics["moe_ms"],
                "baseline_ms_per_step": priced[1].metrics["moe_ms"],
                "source": priced[0].metrics.get("cost_source")}
    except InputError as exc:  # no extra, or no table for this model, device or EP size
        return {"unavailable": str(exc)}


def _deciding_term(results: Results, spec: RunSpec) -> dict[str, Any]:
    """Which term bounds the candidate's time: the slowest GPU's compute in each (step, layer)
    is bound by its weight (and activation) reads or by its arithmetic (the roofline's two
    terms), beside the communication; the largest share decides."""
    shape = lookup(MODELS, spec.cost.model, "model")
    device = lookup(DEVICES, spec.cost.device_profile, "device profile")
    options = spec.cost.cost_options
    G = spec.topology.gpus
    pairs = M.gpu_loads(results.slot_load, G)  # [S, L, G]
    active = M.gpu_loads((results.slot_load > 0).to(torch.int64), G)
    arithmetic = pairs * shape.flops_per_pair / (device.peak_flops(shape.weight_dtype)
                                                  * options.get("eta_compute", ETA_COMPUTE))
    reads = (active * shape.expert_weight_bytes + pairs * 2 * shape.hidden
             * shape.bytes_of("act")) / (device.hbm * options.get("eta_memory", ETA_MEMORY))
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


def _rebalance(cand: Results, held: Results, scored: int) -> dict[str, Any]:
    """The schedule's stalls or hazard steps and its net benefit over the scored steps."""
    saved = held.metrics["moe_ms"] - cand.metrics["moe_ms"]
    stall = cand.metrics.get("rebalance_stall_ms") or 0.0
    return {"mode": cand.spec.schedule.rebalance_mode,
            "every": cand.spec.schedule.rebalance_every,
            "rebalances": cand.metrics.get("rebalances"),
            "moved_slots": cand.metrics.get("moved_slots"),
            "stall_ms": stall, "hazard_steps": cand.metrics.get("hazard_steps"),
            "ms_per_step_without": held.metrics["moe_ms"], "ms_per_step_with":
            cand.metrics["moe_ms"], "saved_ms_per_step": saved,
            "net_ms": saved * scored - stall}


# Verdict --------------------------------------------------------------------------------------

def _verdict(invariance: dict, balance: dict, time: dict, rebalance: dict | None,
             scored: int, mode: str) -> tuple[str, list[str]]:
    """The verdict and its reasons, each with the numbers behind it (module doc)."""
    ce = invariance["counterexample"]
    if mode == "none" and invariance["observed"] == "variant":
        late = invariance.get("replay_disagrees")
        where = (f"step {ce['step']}, layer {ce['layer']}, token {ce['token']}, expert "
                 f"{ce['expert']} of a {ce['rows']}-row batch: ranks chose "
                 f"{sorted(set(ce['choices'].values()))}" if ce else
                 f"from scored step {late['step']}, layer {late['layer']} of the replay"
                 + (", while ranks switched placements at different steps"
                    if late["during_switch"] else "") if late else "the replay")
        return "not recommended", [
            f"ranks choose different replicas in \"none\" mode ({where}); output error "
            f"{number(invariance['output_rel_error'])}, rank agreement "
            f"{number(invariance['rank_agreement'])}: it corrupts the layer's output"]
    reasons = []
    if scored < MIN_SCORED_STEPS:
        reasons.append(f"only {scored} scored step(s); at least {MIN_SCORED_STEPS} are needed")
    if balance["replicated_loaded_pairs"] == 0:
        reasons.append("no replicated expert carries load in the scored steps: the dispatch "
                       "choice cannot matter")
    if reasons:
        return "insufficient evidence", reasons
    if rebalance is not None and rebalance["net_ms"] < 0:
        return "not recommended", [
            f"rebalancing every {rebalance['every']} steps ({rebalance['mode']}) saves "
            f"{number(rebalance['saved_ms_per_step'])} ms a step over {scored} steps but stalls "
            f"{number(rebalance['stall_ms'])} ms: net {number(rebalance['net_ms'])} ms"]
    d, spread = time["difference_ms"], time["spread_ms"]
    term = time["decides"]["term"]
    base_ms = time["baseline"]["ms_per_step"]
    if d == 0 or abs(d) <= spread:
        return "insufficient evidence", [
            f"the difference in time, {number(d)} ms a step, lies within its spread across "
            f"seeds, {number(spread)} ms"]
    share = f"{number(abs(d) / base_ms * 100)}% of its {number(base_ms)} ms; spread across " \
        f"seeds {number(spread)} ms"
    if d < 0:
        return "recommend", [f"{number(-d)} ms a step faster than the baseline ({share}); "
                             f"{term} decide the time"]
    return "not recommended", [f"{number(d)} ms a step slower than the baseline ({share}); "
                               f"{term} decide the time"]


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
