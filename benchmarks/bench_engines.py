"""The engines' own dispatch code at the speed of its twins: seconds per replayed step of a
DeepSeek-V3-shaped trace (4096 tokens, 58 MoE layers, 256 experts, top-8, 32 redundant slots on
32 GPUs in 4 nodes), one process, in "none" and "a2a".

Contenders, side by side in one run on one trace and one placement (the replay's own, from the
trace's counts):
- **ours**: `replay` as `eplbsim run` runs it: an engine's call shared by the ranks whose inputs
  are equal when a probe sees it draw nothing (`dispatch.observe`), vLLM's interpreted map
  kernel launched as one block (`engines.vllm.WholeLaunch`);
- **straightforward**: the same replay with one call a rank (`observed=None`) and vLLM's kernel
  at the block size its own wrapper launches (256): what running the engine's code as it comes
  costs. For `vllm:hash` on the CPU that takes minutes a layer, so it is timed on
  `STRAIGHT_LAYERS` layers and scaled to 58 (stated in the table);
- **row**: eplbsim's own `row` (compiled), the fastest policy, for the ratio the goals name;
- **roofline**: the machine's memory bandwidth moving the step's 12 bytes a pair once
  (`eplbsim.replay.bench.roofline`, best of its copies): no dispatch of the step can beat it.

Every figure is the seconds a step beyond the first (`per_step`: a replay of 1 + `EXTRA` steps
less one of 1 step, each the best of `REPEATS` after a warm-up), so the placement's solve and
the engine's metadata, paid once a placement, are left out. The two paths' metrics are checked
equal on the same trace.

`--device cuda` replays on the GPU (`run --device cuda`): eplbsim's policies run their CUDA
paths and vLLM's map kernel runs compiled for the GPU at vLLM's own block size (both contenders:
the one-block launch is for the interpreter), so its straightforward path is timed in full;
SGLang's dispatch runs on the CPU as its adapter does. `--json PATH` writes the rows.
Run: `python benchmarks/bench_engines.py [--tokens N] [--layers L] [--device D] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from eplbsim.dispatch import resolve_policy
from eplbsim.engines import adapter
from eplbsim.replay import replay
from eplbsim.replay.bench import best_time, make_problem, roofline
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize

G, NODES, E, K, REDUNDANT, REPEATS, STRAIGHT_LAYERS, EXTRA = 32, 4, 256, 8, 32, 2, 2, 2
POLICIES = ("row", "ordinal", "static", "random", "hash", "flat", "sglang:dynamic",
            "sglang:static", "vllm:hash")


def _timed(trace, spec) -> tuple[float, dict]:
    start = time.perf_counter()
    metrics = replay(trace, spec).metrics  # its numbers are on the host: the device is done
    return time.perf_counter() - start, metrics


def per_step(traces, spec, repeats: int = REPEATS) -> tuple[float, dict]:
    """Seconds a step beyond the first, `(t(1 + EXTRA steps) - t(1 step)) / EXTRA`, each the
    best of `repeats` replays after a warm-up one (the placement's solve and the engine's
    metadata are paid once a replay, in both), and the longer replay's metrics."""
    one, more = traces
    _timed(one, spec)  # warm: compiled kernels, the engine's modules
    t1 = min(_timed(one, spec)[0] for _ in range(repeats))
    runs = [_timed(more, spec) for _ in range(repeats)]
    return (min(t for t, _ in runs) - t1) / EXTRA, runs[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"

    def traces(layers: int) -> tuple:
        return tuple(synthesize("skewed", steps=steps, tokens=args.tokens, layers=layers,
                                experts=E, top_k=K, seed=0) for steps in (1, 1 + EXTRA))
    full, small = traces(args.layers), traces(STRAIGHT_LAYERS)
    base = RunSpec.of(gpus=G, gpus_per_node=G // NODES, redundant=REDUNDANT, device=args.device)
    pairs = args.tokens * args.layers * K
    roof = min(best_time(fn, args.device, REPEATS)
               for fn in roofline(make_problem(pairs, args.device)))
    print(f"a step of {args.tokens} tokens x {args.layers} layers, E={E}, K={K}, "
          f"P={E + REDUNDANT}, {G} GPUs in {NODES} nodes: seconds a step beyond the first "
          f"(best of {REPEATS}) on {args.device}; roofline {roof:.4f} s ({pairs:,} pairs at "
          f"12 bytes)")
    print(f"{'mode':5s} {'policy':15s} {'ours':>8s} {'straight':>9s} {'ours/str':>9s} "
          f"{'ours/row':>9s} {'ours/roof':>10s}")
    rows = []
    for mode in ("none", "a2a"):
        spec = base.replace(mode=mode)
        row, _ = per_step(full, spec.replace(policy="row"))
        for name in POLICIES:
            _, policy = resolve_policy(name)
            ours, mine = per_step(full, spec.replace(policy=name))
            straight, scale = None, ""
            if policy.observed is not None:  # an engine's code: the straightforward path too
                shape = small if name == "vllm:hash" and not cuda else full
                want = per_step(small, spec.replace(policy=name), 1)[1] if shape is small \
                    else mine
                adapter("vllm").whole_launch(False)
                straight, theirs = per_step(shape, spec.replace(
                    policy=dataclasses.replace(policy, observed=None)), 1)
                adapter("vllm").whole_launch(True)
                assert theirs == want, f"{name} in {mode}: the two paths' metrics differ"
                if shape is small:
                    straight *= args.layers / STRAIGHT_LAYERS
                    scale = f" (straight: {STRAIGHT_LAYERS} layers, scaled)"
            print(f"{mode:5s} {name:15s} {ours:8.3f} "
                  + (f"{straight:9.2f} {ours / straight:9.3f}" if straight else
                     f"{'-':>9s} {'-':>9s}")
                  + f" {ours / row:9.2f} {ours / roof:10.1f}{scale}", flush=True)
            rows.append({"device": args.device, "mode": mode, "policy": name, "ours_s": ours,
                         "straight_s": straight, "row_s": row, "roof_s": roof,
                         "straight_scaled": bool(scale)})
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
