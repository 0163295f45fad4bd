"""The engines' own weight movers on a DeepSeek-V3-shaped layer: 256 experts + 32 redundant
slots over 32 ranks in 4 nodes, one MoE layer moved from one `deepseek` placement to another
(skewed loads, the second a different draw), weights in the toy shapes (`migration.SHAPES`).

Contenders, side by side on the same pair of placements:
- **ours**: `migration.migrate`, every rank a thread of this process answering torch.distributed's
  point-to-point calls (`simdist.SimWorld`), SGLang 0.5.23's and vLLM 0.33.0's updaters;
- **real**: `migration.real.migrate_on_processes`, one gloo process a rank (the proof path; its
  time includes starting 32 processes);
- **vLLM async**: `migration.migrate_async`, vLLM's asynchronous path (its async worker a
  thread a rank, one layer a step, the maps checked against the slots before every step); its
  sends are checked equal to the synchronous path's ("equal");
- **model**: eplbsim's own migration model of the same move
  (`schedule.transfers.transfer_kinds` and `cost.rebalance.sync_stall_seconds`'s copy
  counts), for scale: it moves nothing.
Both paths' slots and sends are checked equal. Seconds are the best of `REPEATS` (real: one).
Run: `python benchmarks/bench_migration.py [--layers L] [--no-real]`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from eplbsim.migration import migrate, migrate_async, transfer_totals
from eplbsim.migration.real import migrate_on_processes
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.schedule.transfers import transfer_counts
from eplbsim.solvers import solve

E, P, G, NODES, REPEATS = 256, 288, 32, 4, 3


def placements(layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `deepseek` placements `[L, P]` of skewed loads drawn with seeds 0 and 1."""
    topology = Topology(G, G // NODES)
    out = []
    for seed in (0, 1):
        load = np.random.default_rng(seed).lognormal(9.5, 1.0, (layers, E)).round()
        out.append(solve("deepseek", load.astype(np.int64), P, topology, 8).phy2log)
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--no-real", action="store_true", help="leave the real ranks out")
    args = parser.parse_args()
    topology = Topology(G, G // NODES)
    old, new = placements(args.layers)
    kinds = transfer_counts(Placement(old, E, topology), Placement(new, E, topology)).sum(0)
    print(f"{args.layers} layer(s), E={E}, P={P}, {G} ranks in {NODES} nodes; "
          f"{int((old != new).sum())} slots change; eplbsim's model: same GPU {kinds[0]}, "
          f"same node {kinds[1]}, other node {kinds[2]} copies")
    print(f"{'engine':7s} {'ours s':>8s} {'real s':>8s} {'p2p ops':>8s} {'nvlink B':>9s} "
          f"{'rdma B':>8s} {'equal':>6s}")
    real = {} if args.no_real else dict(zip(("sglang", "vllm"), migrate_on_processes(
        ("sglang", "vllm"), old, new, E, topology)))
    for engine in ("sglang", "vllm"):
        migrate(engine, old, new, E, topology)  # warm: the engine's modules load once
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            moved = migrate(engine, old, new, E, topology)
            times.append(time.perf_counter() - start)
        assert torch.equal(moved.holds, new), f"{engine}: slots wrong after the move"
        summary = transfer_totals(moved.sent, topology)
        equal = "-"
        real_s = "-"
        if engine in real:
            equal = str(torch.equal(real[engine].holds, moved.holds)
                        and sorted(real[engine].sent) == sorted(moved.sent))
        if not args.no_real:
            start = time.perf_counter()
            migrate_on_processes((engine,), old, new, E, topology)
            real_s = f"{time.perf_counter() - start:8.2f}"
        print(f"{engine:7s} {min(times):8.3f} {real_s:>8s} {summary['p2p_ops']:8d} "
              f"{summary['nvlink_bytes']:9d} {summary['rdma_bytes']:8d} {equal:>6s}",
              flush=True)
    migrate_async(old, new, E, topology)  # warm
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        moved, steps = migrate_async(old, new, E, topology)
        times.append(time.perf_counter() - start)
    assert torch.equal(moved.holds, new) and not any(s.mismatch for s in steps), \
        "vLLM async: slots or maps wrong"
    summary = transfer_totals(moved.sent, topology)
    equal = sorted(migrate("vllm", old, new, E, topology).sent) == sorted(moved.sent)
    print(f"{'vllm-as':7s} {min(times):8.3f} {'-':>8s} {summary['p2p_ops']:8d} "
          f"{summary['nvlink_bytes']:9d} {summary['rdma_bytes']:8d} {str(equal):>6s}")


if __name__ == "__main__":
    main()
