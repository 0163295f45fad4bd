"""The cost of running an engine's own code beside its twin, DeepSeek-V3's shape (58 MoE layers,
256 experts, top-8, 32 redundant slots) on 8 ranks: seconds per step of dispatch (every rank,
every layer) and the engine's fixed cost (every rank's metadata through `init_by_mapping`).

One placement (the deepseek solver on a seeded skewed step) and one batch of 256 tokens serve
every contender; each is timed over `REPEATS` steps after one warm-up step, in this process.
Run: `python benchmarks/bench_engines.py`.
"""

from __future__ import annotations

import time

import torch

from eplbsim.dispatch import resolve_policy
from eplbsim.dispatch.policies import DispatchContext
from eplbsim.engines import adapter, sglang_infos
from eplbsim.placement import sglang_view
from eplbsim.solvers import solve
from eplbsim.topology import Topology
from eplbsim.traces.synth import synthesize

CONTENDERS = [("none", "sglang:dynamic", "row"), ("none", "sglang:static", "static"),
              ("a2a", "sglang:dynamic", "random"), ("a2a", "sglang:static", "static")]
G, L, E, K, REDUNDANT, TOKENS, REPEATS = 8, 58, 256, 8, 32, 256, 3


def step_seconds(policy: str, mode: str, placement, ids: torch.Tensor) -> float:
    """Seconds for one step: every rank dispatches every layer's ids (the reference path)."""
    _, entry = resolve_policy(policy)
    views = [sglang_view(placement, r, mode) for r in range(G)]
    gens = [torch.Generator().manual_seed(r) for r in range(G)]

    def step() -> None:
        for r in range(G):
            for layer in range(L):
                entry(ids[:, layer], views[r], DispatchContext(layer=layer, rank=r, mode=mode,
                                                               generator=gens[r]))
    step()  # warm: tables, metadata, compiled kernels
    start = time.perf_counter()
    for _ in range(REPEATS):
        step()
    return (time.perf_counter() - start) / REPEATS


def main() -> None:
    trace = synthesize("skewed", steps=1, tokens=TOKENS, layers=L, experts=E, top_k=K, seed=0)
    placement = solve("deepseek", trace.counts()[0].double(), E + REDUNDANT, Topology(G))
    ids = trace.step(0)  # [T, L, K]
    run = adapter("sglang")
    print(f"DeepSeek-V3 shape (L={L}, E={E}, K={K}, P={E + REDUNDANT}), {G} ranks, "
          f"{TOKENS} tokens a step; seconds")
    for mode in ("none", "a2a"):
        start = time.perf_counter()
        for r in range(G):
            sglang_infos(run, placement, "dynamic", mode == "a2a", r)
        print(f"{mode}: engine metadata for {G} ranks (init_by_mapping, once a placement): "
              f"{time.perf_counter() - start:.2f}")
    print(f"{'mode':5s} {'engine':15s} {'s/step':>7s}  {'twin':7s} {'s/step':>7s}  engine/twin")
    for mode, engine, twin in CONTENDERS:
        e, t = step_seconds(engine, mode, placement, ids), step_seconds(twin, mode, placement, ids)
        print(f"{mode:5s} {engine:15s} {e:7.3f}  {twin:7s} {t:7.3f}  {e / t:8.1f}x")


if __name__ == "__main__":
    main()
