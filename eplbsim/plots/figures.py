"""The paper figures: a named, deterministic set, each rebuilt from seeded scenarios by one
function, in the `FIGURES` registry; `build` writes them as PDF and PNG.

Dimensions: `S` steps, `L` layers, `E` logical experts, `G` GPUs.

Every figure runs small synthetic scenarios with fixed seeds (no files needed, so they rebuild
the same anywhere) on one shared setup, `SETUP`: 64 experts, top-8, 8 GPUs in 2 nodes,
16 redundant slots, the `deepseek` solver. Drawing lives in `plots` (one style, `paper_style`,
Okabe-Ito colours, each policy its own colour and marker); this module only decides what each
figure shows. Each is at most 8 x 6 inches (1600 x 1200 px at `DPI`), to read at 100% on a
laptop screen.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from .. import plots
from ..base.errors import InputError
from ..base.registry import lookup
from ..dispatch import POLICIES as ALL_POLICIES
from ..metrics import placement_gap
from ..replay import compare, replay
from ..runspec import RunSpec
from ..solvers import solve
from ..traces.coactivation import coactivation as coactivation_of
from ..traces.request_synth import synthesize_requests
from ..traces.synth import synthesize
from ..traces.workload import DEFAULT_GRAPH_SIZES, Workload, batch
from . import Figure

SIZES = dict(layers=4, experts=64, top_k=8)
DPI = 200  # of the PNGs `build` writes
SETUP = RunSpec.of(gpus=8, gpus_per_node=4, redundant=16)
POLICIES = ["static", "random", "row", "ordinal"]


def expert_load_heatmap() -> Figure:
    """Which experts are hot: the skewed scenario's load per layer and over time."""
    trace = synthesize("skewed", steps=48, tokens=512, seed=0, **SIZES)
    return plots.expert_load_heatmap(trace.counts(), layer=0)


def policies_by_mode() -> Figure:
    """GPU imbalance and replica skew of the four policies in both modes, on the template
    scenario (packed templated prompts: where `row` leaves replicas idle)."""
    trace = synthesize("template", steps=32, tokens=512, seed=0, **SIZES)
    return plots.policy_mode_bars(compare(trace, POLICIES, ["none", "a2a"], SETUP))


def redundancy_sweep() -> Figure:
    """Rank agreement, multiplicity and output error against 0..64 redundant experts in
    "none" mode: with none, every policy is exact; with any, per-rank choices corrupt."""
    trace = synthesize("skewed", steps=4, tokens=256, seed=0, **SIZES)
    rows = []
    for redundant in (0, 8, 16, 24, 32, 48, 64):
        for result in compare(trace, POLICIES, ["none"], SETUP.replace(redundant=redundant)):
            rows.append({**result.row(), "redundant": redundant})
    return plots.redundancy_curves(rows)


def template_replicas() -> Figure:
    """The balance trap over time: the hottest expert of layer 0 with two replicas on the
    template scenario (prompts of period 2), `row` (one replica does all the work) against
    `ordinal` (even)."""
    trace = synthesize("template", steps=32, tokens=256, seed=0, **SIZES)
    results = compare(trace, ["row", "ordinal"], ["none"], SETUP)
    placement = results[0].epochs[0][2]
    load = trace.counts()[:, 0].sum(0)  # [E]
    twins = (placement.logcnt[0] == 2).nonzero().flatten().tolist()
    if not twins:
        raise InputError("the template placement has no expert with two replicas in layer 0")
    expert = max(twins, key=lambda e: (int(load[e]), -e))
    return plots.replica_loads_pair(results, layer=0, expert=expert)


def solver_gap() -> Figure:
    """Each solver's max GPU load over the lower bound on a skewed load (sigma 1.5), mean over
    layers, as redundancy grows; groups of 16 experts for the hierarchical solvers."""
    trace = synthesize("skewed", steps=16, tokens=512, seed=0, sigma=1.5, **SIZES)
    load = trace.counts().sum(0)  # [L, E]
    topo = SETUP.topology.topology()
    rows = []
    for solver, groups in (("deepseek", 1), ("deepseek", 4), ("lpt", 1), ("lpt-hier", 4)):
        label = solver + (" (groups on nodes)" if solver == "deepseek" and groups > 1 else "")
        for redundant in (0, 8, 16, 32, 64):
            placement = solve(solver, load, SIZES["experts"] + redundant, topo, groups)
            rows.append({"solver": label, "redundant": redundant,
                         "gap": float(placement_gap(placement, load).mean())})
    return plots.solver_gap_lines(rows)


def rebalance_over_time() -> Figure:
    """Imbalance over time across rebalances: the burst scenario (a cold expert hot for steps
    80..159), re-solved every 40 steps from `window`, `ema` and `oracle` forecasts (`ordinal`,
    "a2a")."""
    trace = synthesize("burst", steps=200, tokens=256, seed=0, start=80, length=80, layers=2,
                       experts=64, top_k=8)
    spec = SETUP.replace(policy="ordinal", mode="a2a", rebalance_every=40)
    results = [replay(trace, spec.replace(predictor=p)) for p in ("window", "ema", "oracle")]
    return plots.predictor_time_series(results, highlight=(80, 160))


def time_by_policy() -> Figure:
    """What imbalance costs in time (`roofline` cost model, DeepSeek-V3 shape, H200): MoE time
    per step of `static`, `row` and `ordinal` in both modes on the template scenario at 4096
    tokens a step (compute-bound: the imbalance costs time), compute and communication
    stacked against the balanced reference; and, on the drift scenario at 512 tokens a step
    (weight-bound) re-solved every 16 steps, `row` and `ordinal` ("a2a") per step with each
    rebalance's stall when serving waits for the copies."""
    timed = SETUP.replace(cost="roofline", model="deepseek-v3", device_profile="h200")
    template = synthesize("template", steps=16, tokens=4096, seed=0, **SIZES)
    results = compare(template, ["static", "row", "ordinal"], ["none", "a2a"], timed)
    drift = synthesize("drift", steps=96, tokens=512, seed=0, **SIZES)
    over_time = [replay(drift, timed.replace(policy=p, mode="a2a", rebalance_every=16))
                 for p in ("row", "ordinal")]
    return plots.time_bars_and_stalls(results, over_time)


def switch_hazard() -> Figure:
    """The hazard of async rebalancing: the drift scenario re-solved every 16 steps (`ordinal`),
    copies landing 2 steps after each decision, every rank switching at once (no corruption)
    against ranks switching up to 4 steps apart (seeded per rank and rebalance), in both
    modes."""
    trace = synthesize("drift", steps=96, tokens=512, seed=0, **SIZES)
    spec = SETUP.replace(policy="ordinal", rebalance_every=16, rebalance_mode="async",
                         copy_steps=2)
    return plots.switch_hazard([replay(trace, spec.replace(mode=m, switch_delay=d))
                                for m in ("a2a", "none") for d in (0, 4)])


def workload_batching() -> Figure:
    """The same requests (the requests scenario, 48 of them) batched by 4 DP attention ranks as
    engines do: gathered in the `sum` layout, in the `max` layout, and in the `max` layout under
    CUDA graphs whose padding rows are routed; `row`, `hash` and `ordinal` ("none"), all on the
    one placement solved from the requests' own routing (the `sum` trace's loads), as an
    operator solves it from logged traffic. The heatmap is the routed-padding trace: its
    phantom experts."""
    requests = synthesize_requests("requests", seed=0, num_requests=48, prompt_mean=32.0,
                                   output_mean=48.0, **SIZES)
    batchings = {"sum": Workload(dp=4),
                 "max": Workload(dp=4, dp_layout="max"),
                 "max, graphs\n(routed padding)": Workload(
                     dp=4, dp_layout="max", graph_sizes=DEFAULT_GRAPH_SIZES, padding="routed")}
    traces = {name: batch(requests, w).trace for name, w in batchings.items()}
    topo = SETUP.topology.topology()
    placement = solve("deepseek", traces["sum"].counts().sum(0),
                      SIZES["experts"] + SETUP.topology.redundant, topo)
    rows = []
    for name, trace in traces.items():
        rows += [(name, r) for r in compare(trace, ["row", "hash", "ordinal"], ["none"],
                                            SETUP.replace(placement=placement))]
    routed = traces["max, graphs\n(routed padding)"]
    return plots.workload_batching(rows, routed.counts())


def field_policies() -> Figure:
    """Every registered policy, the field's as published and eplbsim's, in small multiples: a
    row per policy, in its own colour and marker, and a panel per metric (GPU imbalance, replica
    skew, agreement and multiplicity in "none"): the template scenario at 256 tokens a step.
    Waterfill places the shared expert, so every mark counts the model's one shared expert
    (DeepSeek-V3's: one pair a token and layer); Waterfill runs in "a2a" only."""
    trace = synthesize("template", steps=8, tokens=256, seed=0, **SIZES)
    return plots.policy_comparison(compare(trace, list(ALL_POLICIES), ["none", "a2a"], SETUP))


def coactivation() -> Figure:
    """Which experts tokens choose together: the clustered scenario's co-activation of layer
    0 in expert order and grouped (its hidden groups as blocks)."""
    trace = synthesize("clustered", steps=8, tokens=512, seed=0, **SIZES)
    return plots.coactivation_heatmap(coactivation_of(trace), layer=0)


@lru_cache(maxsize=1)
def _traffic() -> dict[str, list]:
    """deepseek, affinity and flashlb (`ordinal`, "a2a", roofline, DeepSeek-V3 shape) on the
    skewed and the clustered scenarios: the traffic figures' runs."""
    spec = SETUP.replace(mode="a2a", policy="ordinal", cost="roofline", model="deepseek-v3")
    out = {}
    for name in ("skewed", "clustered"):
        trace = synthesize(name, steps=8, tokens=1024, seed=0, **SIZES)
        out[name] = [replay(trace, spec.replace(solver=s))
                     for s in ("deepseek", "affinity", "flashlb")]
    return out


def balance_traffic() -> Figure:
    """Balance against traffic: each solver's fan-out against its GPU imbalance on the skewed
    (no co-activation structure) and the clustered scenarios, 8 GPUs in 2 nodes."""
    return plots.balance_against_traffic(_traffic())


def traffic_time() -> Figure:
    """What fan-out costs in time: each solver's communication and MoE time a step on the
    skewed and the clustered scenarios."""
    return plots.communication_and_time(_traffic())


FIGURES: dict[str, Callable[[], Figure]] = {
    "expert_load_heatmap": expert_load_heatmap,
    "policies_by_mode": policies_by_mode,
    "redundancy_sweep": redundancy_sweep,
    "template_replicas": template_replicas,
    "solver_gap": solver_gap,
    "rebalance_over_time": rebalance_over_time,
    "time_by_policy": time_by_policy,
    "switch_hazard": switch_hazard,
    "workload_batching": workload_batching,
    "field_policies": field_policies,
    "coactivation": coactivation,
    "balance_traffic": balance_traffic,
    "traffic_time": traffic_time,
}


def build(out_dir: str | Path = "figures", names: Sequence[str] | None = None,
          dpi: int = DPI) -> list[Path]:
    """Rebuild the named figures (default all, in `FIGURES` order) into `out_dir` as
    `NAME.pdf` and `NAME.png`, in the paper style; returns the paths written. The same call
    writes the same files. InputError on an unknown name."""
    chosen = list(FIGURES) if names is None else list(names)
    for name in chosen:
        lookup(FIGURES, name, "figure")
    if not chosen:
        raise InputError("no figure named")
    written: list[Path] = []
    for name in chosen:
        with plots.paper_style():
            fig = FIGURES[name]()
            written += plots.save_figure(fig, Path(out_dir) / f"{name}.pdf", dpi=dpi)
    return written
