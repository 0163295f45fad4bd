"""Token spill and the per-layer budget, timed beside what they replace (issue 51).

On a DeepSeek-V3-shaped trace (E=256, top-8, 58 layers; `--tokens` a step, skewed), one run:
- the replay per step of `spill` and `llep` beside `ordinal` (the speed goal:
  `spill` within 2x `ordinal` a step), in "none" and "a2a", on 32 GPUs of 8 a node with 32
  redundant slots; `spill`'s plan alone (its moves, `SpillRule.moves`) per step;
- the `budget` solver beside `deepseek` and `lpt` on the trace's loads, with each one's summed
  max GPU load (the promise the budget minimises).

Prints a table; `--json` writes the figures. Run: `python benchmarks/bench_spill.py`.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from eplbsim import RunSpec, replay, synthesize
from eplbsim.dispatch import POLICIES, DispatchContext
from eplbsim.dispatch.kernels import dispatch_step
from eplbsim.dispatch.spill import Site
from eplbsim.placement import full_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks.spill import slot_counts
from eplbsim.replay.bench import best_time
from eplbsim.solvers import solve
from eplbsim.solvers.budget import peak_loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    trace = synthesize("skewed", steps=args.steps, tokens=args.tokens, layers=58, experts=256,
                       top_k=8, seed=0)
    spec = RunSpec.of(gpus=32, gpus_per_node=8, redundant=32)
    out: dict = {"shape": f"{args.steps} steps x {args.tokens} tokens x 58 layers, E=256, K=8, "
                          "32 GPUs (8 a node), 32 redundant slots"}
    rows = []
    for mode in ("none", "a2a"):
        for policy in ("ordinal", "spill", "llep"):
            run = spec.replace(policy=policy, mode=mode)
            seconds = best_time(lambda: replay(trace, run), "cpu", args.repeats, warmup=1) / args.steps
            rows.append((f"replay {mode} {policy}", seconds * 1e3))
            out[f"{mode}_{policy}_ms_per_step"] = seconds * 1e3
        out[f"{mode}_spill_over_ordinal"] = (out[f"{mode}_spill_ms_per_step"]
                                             / out[f"{mode}_ordinal_ms_per_step"])
    placement = replay(trace, spec).segments[0].placement
    site = Site.of(placement)
    ids = trace.step(0).to(torch.int32)
    phys = dispatch_step(POLICIES["ordinal"], ids, full_view(placement), DispatchContext(),
                         "ordinal")
    counts = slot_counts(phys, placement.num_slots).numpy()
    plan = best_time(lambda: POLICIES["spill"].spill.moves(counts, site), "cpu", args.repeats,
                     warmup=1)
    rows.append(("spill plan alone (one step)", plan * 1e3))
    out["spill_plan_ms_per_step"] = plan * 1e3
    load = np.zeros((58, 256))  # [L, E] the trace's routed pairs
    for s in range(trace.num_steps):
        step = trace.step(s).numpy()
        for layer in range(58):
            v = step[:, layer].ravel()
            load[layer] += np.bincount(v[v >= 0], minlength=256)
    topo = Topology(32, 8)
    for solver in ("deepseek", "lpt", "budget"):
        seconds = best_time(lambda: solve(solver, load, 256 + 32, topo), "cpu", args.repeats,
                            warmup=1)
        phy2log = solve(solver, load, 256 + 32, topo).phy2log.numpy()
        total = float(peak_loads(phy2log, load[None], 32).sum())
        rows.append((f"solve {solver} (summed max GPU load {total:.0f})", seconds * 1e3))
        out[f"solve_{solver}_ms"] = seconds * 1e3
        out[f"solve_{solver}_summed_max"] = total
    out["budget_over_deepseek"] = out["solve_budget_ms"] / out["solve_deepseek_ms"]
    print(out["shape"])
    for name, ms in rows:
        print(f"{name:<48} {ms:10.1f} ms")
    print(f"spill / ordinal a step: none {out['none_spill_over_ordinal']:.2f}x, "
          f"a2a {out['a2a_spill_over_ordinal']:.2f}x (goal: within 2x)")
    print(f"budget / deepseek solve time: {out['budget_over_deepseek']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
