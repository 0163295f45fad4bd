"""Placement solvers side by side: quality (mean placement_gap, against the lower bound) and
time, on (1) the DeepSeek-V3 shape, (2) 64 GPUs and 320 slots, (3) the real OLMoE/Mixtral counts
in ../shared/data/olmoe-routing-counts/ (8 GPUs, 8 redundant slots; skipped when absent).

    python benchmarks/bench_solvers.py [--json] [--repeats 3] [--layers 58] [--solvers ...]

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs, `N` nodes.
Each solver is run once to warm up (numba compiles there), then timed as the best of
`--repeats` runs. `gap` is the mean over layers of the max GPU load (even split) over the global
lower bound; `hier gap` the same over the hierarchical bound (groups stay on their node).
`exact` runs only where its model is small enough (it says so otherwise). `deepseek` runs both
globally (1 group) and hierarchically (the case's groups); `lpt-hier` with the case's groups.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eplbsim.base.errors import InputError
from eplbsim.metrics import gpu_loads
from eplbsim.placement.topology import Topology
from eplbsim.solvers import SOLVERS, solve, solve_with_info, solver_options
from eplbsim.solvers.bounds import hierarchical_lower_bound, lower_bound
from eplbsim.traces.counts import load_counts_csv

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "olmoe-routing-counts" \
    / "expert_counts.csv"


def lognormal_loads(layers: int, experts: int, seed: int = 0) -> np.ndarray:
    """`[L, E]` log-normal(sigma=1) expert loads, seeded."""
    return np.exp(np.random.default_rng(seed).standard_normal((layers, experts)))


def cases(layers: int) -> list[dict]:
    """The benchmark instances: name, load `[L, E]`, slots, topology, groups."""
    out = [
        dict(case="(1) DeepSeek-V3: 256 experts, 288 slots, 32 GPUs / 4 nodes, 8 groups",
             load=lognormal_loads(layers, 256), slots=288, topology=Topology(32, 8), groups=8),
        dict(case="(2) 256 experts, 320 slots, 64 GPUs / 8 nodes, 8 groups",
             load=lognormal_loads(layers, 256), slots=320, topology=Topology(64, 8), groups=8),
    ]
    if REAL.exists():
        for model, domain in (("olmoe", "arxiv"), ("olmoe", "github"), ("mistral", "c4")):
            counts = load_counts_csv(REAL, {"model": model, "domain": domain})
            E = counts.load.shape[1]
            out.append(dict(case=f"(3) real {model}/{domain}: {E} experts, {E + 8} slots, "
                                 f"8 GPUs", load=counts.load, slots=E + 8,
                            topology=Topology(8), groups=1))
    return out


# Solvers whose result depends on the expert groups: run both global (1 group) and grouped.
GROUPED = {"deepseek": (1, None), "lpt-hier": (None,)}  # None = the case's groups


def variants(name: str, case_groups: int) -> list[int]:
    """The group counts to run `name` with on a case with `case_groups` groups."""
    wanted = GROUPED.get(name, (1,))
    return list(dict.fromkeys(case_groups if g is None else g for g in wanted))


def measure(name: str, case: dict, groups: int, repeats: int, time_limit: float) -> dict:
    """Solve `case` with `name` and `groups`: time (s) and mean gaps, or why it cannot.
    A time-limited solver (exact) runs once, with `time_limit` seconds per layer, and reports
    the fraction of layers it proved optimal; the others are timed as the best of `repeats`
    runs after one untimed run (numba compiles there)."""
    load, slots, topo = case["load"], case["slots"], case["topology"]
    row = {"case": case["case"], "solver": name, "groups": groups}
    timed = "time_limit" in solver_options(SOLVERS[name])
    options = {"time_limit": time_limit} if timed else {}
    try:
        t0 = time.perf_counter()
        placement, info = solve_with_info(name, load, slots, topo, groups, **options)
        seconds = time.perf_counter() - t0
    except InputError as exc:
        return {**row, "skipped": str(exc)}
    if timed:
        row["proven_optimal"] = float(np.mean(info.get("optimal", [False])))
    else:
        seconds = _best_of(name, load, slots, topo, groups, repeats)
    peak = gpu_loads(placement.expected_load(torch.from_numpy(load)), topo.num_gpus).amax(-1)
    bound = lower_bound(load, slots, topo.num_gpus)
    hier = hierarchical_lower_bound(load, slots, topo, case["groups"])
    return {**row, "seconds": seconds, "gap": float((peak.numpy() / bound).mean()),
            "hier_gap": float((peak.numpy() / hier).mean()),
            "hier_bound_over_bound": float((hier / bound).mean())}


def _best_of(name: str, load: np.ndarray, slots: int, topo: Topology, groups: int,
             repeats: int) -> float:
    """Best wall time of `repeats` solves (after the warm-up the caller did)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        solve(name, load, slots, topo, groups)
        times.append(time.perf_counter() - t0)
    return min(times)


def format_rows(rows: list[dict]) -> str:
    lines, case = [], None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            bound = next((x["hier_bound_over_bound"] for x in rows
                          if x["case"] == case and "gap" in x), None)
            lines += ["", case + (f"  (hierarchical bound / global bound = {bound:.4f})"
                                  if bound is not None else ""),
                      f"  {'solver':10s} {'groups':>6s} {'gap':>8s} {'hier gap':>9s} {'ms':>9s}"]
        head = f"  {r['solver']:10s} {r['groups']:6d}"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']}")
        else:
            proven = (f"  (proven optimal in {r['proven_optimal']:.0%} of layers)"
                      if "proven_optimal" in r else "")
            lines.append(f"{head} {r['gap']:8.4f} {r['hier_gap']:9.4f} "
                         f"{r['seconds'] * 1e3:9.1f}{proven}")
    return "\n".join(lines).lstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solvers", default=",".join(SOLVERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=58, help="layers of cases (1) and (2)")
    parser.add_argument("--time-limit", type=float, default=10.0,
                        help="seconds per layer for exact (default 10)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [measure(name, case, groups, args.repeats, args.time_limit) for case in cases(args.layers)
            for name in args.solvers.split(",") for groups in variants(name, case["groups"])]
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
