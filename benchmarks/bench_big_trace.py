"""A trace larger than memory: write a DeepSeek-V3-shaped trace in the directory form, then
replay it in "none" mode for 32 ranks (8 a node, 32 redundant slots) in a child process; report
throughput and the child's peak RSS (issue 5's target: under 2 GB for a trace of at least 8 GB;
issue 14's: also for a run 3x as long, `--repeat 3`: the trace's steps three times over as one
run, `traces.repeated.Repeated`; issue 27's: an hour of DeepSeek-V3 routing, 1e11 pairs, with
`--workers 2`). `peak_rss_mib` is the largest process's peak (the child, or one of its workers).

    python benchmarks/bench_big_trace.py --gigabytes 8 --dir /tmp/big_trace [--keep] [--reuse]
        [--repeat 3] [--policy row] [--gpus 32] [--workers 2 [--executor ray]]

Dimensions: `S` steps, `T` tokens a step, `L = 58` layers, `K = 8`, `E = 256`.
The ids are `--pool` synthesized skewed steps, reused with a per-step random relabelling of the
experts (a permutation drawn from a seeded generator), so writing is limited by the disk, not by
sampling. int16 ids: one step of 4096 tokens is 3.8 MB.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from eplbsim.replay.bench import skewed_ids
from eplbsim.traces.directory import write_steps

L, K, E = 58, 8, 256
CHILD = """
import hashlib, json, sys, time
from dataclasses import fields
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.directory import DirTrace
from eplbsim.traces.repeated import Repeated
from eplbsim.replay.workers import Workers

path, policy, gpus, times = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
workers, executor = int(sys.argv[5]), sys.argv[6]
t0 = time.perf_counter()
trace = DirTrace(path)
opened = time.perf_counter() - t0
trace = trace if times == 1 else Repeated(trace, times)
spec = RunSpec.of(policy=policy, mode="none", gpus=gpus, gpus_per_node=min(gpus, 8),
                  redundant=32)
if workers == 1 and executor == "local":
    res = replay(trace, spec)
else:
    with Workers(trace, workers, executor) as pool:
        res = pool.replay(trace, spec)
metrics = res.metrics
print(json.dumps({"open_seconds": opened, "seconds": time.perf_counter() - t0,
                  "steps": trace.num_steps, "tokens": trace.num_tokens,
                  "gpu_imbalance": metrics["gpu_imbalance"],
                  "rank_agreement": metrics["rank_agreement"],
                  "slot_load_sum": int(res.slot_load.sum()),
                  "slot_load_sha256": hashlib.sha256(res.slot_load.numpy().tobytes()).hexdigest(),
                  "counters_sha256": hashlib.sha256(b"".join(
                      getattr(res.counters, f.name).numpy().tobytes()
                      for f in fields(res.counters))).hexdigest()}))
"""


def write(path: Path, gigabytes: float, tokens: int, pool: int, seed: int) -> dict:
    """Write about `gigabytes` of ids; returns sizes and seconds."""
    step_bytes = tokens * L * K * 2
    steps = max(1, int(gigabytes * 2**30 // step_bytes))
    rng = np.random.default_rng(seed)
    base = [skewed_ids(tokens, L, seed=seed + i).numpy() for i in range(pool)]  # [T, L, K]

    def generate():
        for s in range(steps):
            relabel = rng.permutation(E).astype(np.int16)
            yield relabel[base[s % pool]], None

    t0 = time.perf_counter()
    write_steps(path, generate(), E, {"source": "bench_big_trace", "seed": seed},
                num_layers=L, top_k=K)
    seconds = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"steps": steps, "bytes": size, "write_seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=8.0)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--pool", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/eplbsim_big_trace"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the trace directory")
    parser.add_argument("--reuse", action="store_true",
                        help="replay the trace already in --dir instead of writing one")
    parser.add_argument("--repeat", type=int, default=1,
                        help="replay the trace's steps this many times over as one run")
    parser.add_argument("--policy", default="row")
    parser.add_argument("--workers", type=int, default=1,
                        help="replay on this many worker processes (eplbsim.replay.workers; 1: in the "
                        "child itself)")
    parser.add_argument("--executor", default="local", choices=["local", "ray"])
    parser.add_argument("--gpus", type=int, default=32)
    args = parser.parse_args(argv)
    if args.reuse and args.dir.is_dir():
        written = {"bytes": sum(f.stat().st_size for f in args.dir.iterdir()), "reused": True}
    else:
        if args.dir.exists():
            shutil.rmtree(args.dir)
        written = write(args.dir, args.gigabytes, args.tokens, args.pool, args.seed)
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.dir), args.policy,
                               str(args.gpus), str(args.repeat), str(args.workers),
                               args.executor], check=True,
                              capture_output=True, text=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    child = json.loads(done.stdout)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    pairs = child["tokens"] * L * K
    report = {**written, **child, "policy": args.policy, "gpus": args.gpus,
              "repeat": args.repeat, "workers": args.workers, "executor": args.executor,
              "peak_rss_mib": peak_kib / 1024,
              "trace_pairs_per_second": pairs / child["seconds"]}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
