"""A review's balance, time and rebalance findings (`review` module doc), candidate beside
baseline, each difference with its interval from a paired block bootstrap over the scored steps
and seeds (`evidence`): GPU imbalance and replica skew per layer with the worst named and the
replicas a policy starves (with the share of their expert's pairs each row residue class
carries); ms a step under the run's cost model and under `measured` when it can price the
shape, and which term bounds the slowest GPU; a rebalance schedule's stalls and net benefit.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` slots, `G` GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import metrics as M
from ..base.errors import InputError
from ..cost.compute import ETA_COMPUTE, ETA_MEMORY, roofline_terms
from ..cost.measured import ROOFLINE
from ..placement import Placement
from ..replay.results import Results
from ..runspec import RunSpec
from ..traces import RunTrace
from .evidence import LEVEL, Draws, bounds, figure, resampled

STARVED_SHARE = 0.5  # a replica executing under half its even share of its expert is starved
WORST = 3  # worst layers and starved replicas named


BALANCE_KEYS = ("gpu_imbalance", "gpu_imbalance_with_shared", "replica_skew_mean",
                "replica_skew_max", "replica_skew_cumulative", "idle_replica_frac",
                "fanout_gpus", "fanout_nodes", "remote_frac")  # each where the run has it


def balance_findings(runs: dict[str, list[Results]], test: RunTrace, placement: Placement,
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
    interval over the resamples `d` (`evidence.bounds`: None for one scored step, which no
    resample of steps can bound); `relative`: also as % of the baseline's."""
    parts = {n: [np.stack(x) for x in zip(*(_step_parts(r, key) for r in rs))]
             for n, rs in runs.items()}  # name -> (num [R, S], den [R, S])
    steps = parts["candidate"][0].shape[1]
    whole = {n: figure(*parts[n]) for n in parts}
    again = {n: resampled(*parts[n], d) for n in parts}
    out = {"difference": whole["candidate"] - whole["baseline"],
           "interval": bounds(again["candidate"] - again["baseline"], steps)}
    if relative:
        with np.errstate(invalid="ignore", divide="ignore"):
            out["difference_pct"] = percent(whole["candidate"], whole["baseline"])
            out["interval_pct"] = bounds((again["candidate"] / again["baseline"] - 1) * 100,
                                         steps)
    return out


def _shares(results: Results) -> torch.Tensor:
    """Each slot's executed pairs over its even share over the scored steps, float64 `[L, P]`
    on the first segment's placement; `inf` for a slot whose expert has one replica or no
    load, and for an empty slot (-1)."""
    placement = results.segments[0].placement
    executed = results.slot_load.to(torch.float64).sum(0)  # [L, P]
    even = placement.expected_load(results.true_load.sum(0))  # [L, P]
    replicated = placement.filled & (placement.logcnt.gather(
        1, placement.phy2log.clamp(min=0)) > 1)
    return torch.where(replicated & (even > 0), executed / even.clamp(min=1e-12), math.inf)


def replica_shares(results: Results) -> np.ndarray:
    """The replicated, loaded slots' shares (`_shares`), sorted."""
    share = _shares(results)
    return np.sort(share[torch.isfinite(share)].numpy())


def _starved(results: Results, test: RunTrace) -> list[dict[str, Any]]:
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


def _residues(test: RunTrace, layer: int, expert: int, n: int) -> list[float]:
    """The share of `expert`'s pairs in `layer` on rows of each residue class `row % n`."""
    counts = torch.zeros(n, dtype=torch.float64)
    for s in range(test.num_steps):
        rows = (test.step(s)[:, layer, :].long() == expert).sum(-1)  # [T]
        counts += torch.bincount(torch.arange(rows.numel()) % n, weights=rows.double(),
                                 minlength=n)
    total = float(counts.sum())
    return [round(float(c) / total, 4) if total else 0.0 for c in counts]


def time_findings(runs: dict[str, list[Results]], spec: RunSpec, d: Draws, windows: list[dict],
                  min_effect: float, model_from: str) -> dict[str, Any]:
    """ms a step and tokens/s of both, the difference with its interval over the resampled
    steps and seeds, the spread across seeds, each held-out window's difference, the measured
    tables' prices, which term decides, and where the model came from (`model_from`)."""
    ms = {n: [r.metrics["moe_ms"] for r in rs] for n, rs in runs.items()}
    diff = [c - b for c, b in zip(ms["candidate"], ms["baseline"])]
    cand, base = runs["candidate"][0], runs["baseline"][0]
    paired = _paired(runs, "moe_ms", d, relative=True)
    slow = {"candidate": Slowest.of(cand), "baseline": Slowest.of(base)}
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
        "decides": _deciding_term(cand, slow["candidate"]),
        "mechanism": _mechanism(cand, base, slow),
    }


@dataclass(frozen=True)
class Slowest:
    """A run's GPU work under the roofline's terms (`metrics.gpu_work`,
    `cost.compute.roofline_terms`), float64 `[S, L, G]` each, and the slowest GPU of every
    (step, layer), int64 `[S, L, 1]`."""

    pairs: torch.Tensor
    active: torch.Tensor
    arithmetic: torch.Tensor
    reads: torch.Tensor
    gpu: torch.Tensor

    @classmethod
    def of(cls, results: Results) -> "Slowest":
        spec = results.spec
        shape, device = spec.cost.profiles()
        options = spec.cost.cost_options
        pairs, active = M.gpu_work(results.slot_load, results.counters, spec.topology.gpus,
                                   spec.shared_work(), spec.dispatch.mode)
        arithmetic, reads = roofline_terms(pairs, active, shape, device,
                                           options.get("eta_compute", ETA_COMPUTE),
                                           options.get("eta_memory", ETA_MEMORY))
        return cls(pairs, active, arithmetic, reads,
                   torch.maximum(arithmetic, reads).argmax(-1, keepdim=True))

    def at(self, values: torch.Tensor) -> torch.Tensor:
        """`values [S, L, G]` at the slowest GPU of each (step, layer), `[S, L, 1]`."""
        return values.gather(-1, self.gpu)


def _slowest_gpu(results: Results, slow: Slowest) -> dict[str, float]:
    """The slowest GPU of every (step, layer) of `results` (`slow`), averaged over them: the
    experts whose weights it reads (`active`), the pairs it computes, its share of its layer's
    pairs (over the even share, 1 = even), and the compute and communication ms a step of the
    run."""
    share = slow.at(slow.pairs).squeeze(-1) / slow.pairs.mean(-1).clamp(min=1e-12)
    return {"active": float(slow.at(slow.active).mean()),
            "pairs": float(slow.at(slow.pairs).mean()),
            "share": float(share.mean()),
            "compute_ms": results.metrics["compute_ms"], "comm_ms": results.metrics["comm_ms"]}


def _mechanism(cand: Results, base: Results, slow: dict[str, Slowest]) -> dict[str, Any]:
    """What moves the time, from the cost model's own terms: the compute and communication
    differences a step (candidate minus baseline) and, for compute, the slowest GPU's weight
    reads (experts it runs) and pairs, each run's (`_slowest_gpu`, from `slow`: each role's);
    `moved`: the larger of the two differences ("compute" or "communication")."""
    c, b = _slowest_gpu(cand, slow["candidate"]), _slowest_gpu(base, slow["baseline"])
    compute, comm = c["compute_ms"] - b["compute_ms"], c["comm_ms"] - b["comm_ms"]
    return {"candidate": c, "baseline": b, "compute_ms": compute, "comm_ms": comm,
            "moved": "compute" if abs(compute) >= abs(comm) else "communication"}


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


def _deciding_term(results: Results, slow: Slowest) -> dict[str, Any]:
    """Which term bounds the candidate's time: the slowest GPU's compute in each (step, layer)
    (its whole work, `slow`) is bound by its weight (and activation) reads or by its arithmetic
    (the roofline's two terms), beside the communication; the largest share decides."""
    a, r = slow.at(slow.arithmetic), slow.at(slow.reads)
    bound = torch.maximum(a, r)
    total = float(bound.sum()) or 1.0
    compute_ms = results.metrics["compute_ms"]
    terms = {"weight reads": compute_ms * float(bound[r >= a].sum()) / total,
             "arithmetic": compute_ms * float(bound[r < a].sum()) / total,
             "communication": results.metrics["comm_ms"]}
    return {"ms_per_step": {k: round(v, 6) for k, v in terms.items()},
            "term": max(terms, key=terms.get)}


def rebalance_findings(cand: Results, held: Results, scored: int,
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


def percent(value: float, reference: float) -> float:
    """`value` over `reference` less 1, in percent (NaN when the reference is 0)."""
    return (value / reference - 1) * 100 if reference else math.nan


def buffer_findings(cand: Results, base: Results) -> dict[str, Any] | None:
    """Each side's dispatch buffer in the scored steps ("a2a", when the run names a cap:
    `--dispatch-buffer-gib` or `--dispatch-cap`): its cap (from its own physical slots), its
    busiest rank's most tokens in a step, and the steps that overflow the cap; None without a
    cap."""
    sides = {}
    for which, r in (("candidate", cand), ("baseline", base)):
        m = r.metrics
        if m["buffer_overflow_steps"] is None:
            return None
        sides[which] = {"cap": m["dispatch_cap_tokens"], "peak_tokens": m["dispatch_peak_tokens"],
                        "overflow_steps": m["buffer_overflow_steps"],
                        "slots": r.segments[0].placement.num_slots}
    return {**sides, "steps": cand.true_load.shape[0]}
