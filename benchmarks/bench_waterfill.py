"""SGLang's Waterfill beside keeping the shared expert home: GPU imbalance and MoE time in "a2a".

DeepSeek-V3's shape (256 experts, top-8, one shared expert of a routed one's size), the
`deepseek` solver's placement from the whole trace with 32 redundant slots, 8 steps of 4 layers,
the roofline cost model on the H200 profile. Every row counts the shared expert; `row` keeps it
on the token's rank, `waterfill` and `waterfill-dynamic` place it (their routed pairs are
`row`'s). Below 64 tokens a rank Waterfill keeps every token's shared work, so the smallest
batch is the control.

    python benchmarks/bench_waterfill.py [--scenarios skewed,burst,template]
"""

from __future__ import annotations

import argparse

from eplbsim import RunSpec, compare, synthesize

POLICIES = ["row", "waterfill", "waterfill-dynamic"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="skewed,burst,template")
    parser.add_argument("--gpus", default="8,16,32")
    parser.add_argument("--per-rank", default="32,128,512", help="tokens a rank a step")
    args = parser.parse_args()
    print("per policy: max / mean GPU load (shared work included), compute ms and communication "
          "ms a step; last: the better Waterfill's moe_ms over row's")
    print(f"{'scenario':9s} {'EP':>3s} {'tok/rank':>8s} " + " ".join(
        f"{p + ' imb':>22s} {'comp':>6s} {'comm':>6s}" for p in POLICIES) + f" {'ms/row':>7s}")
    for scenario in args.scenarios.split(","):
        for gpus in map(int, args.gpus.split(",")):
            for per_rank in map(int, args.per_rank.split(",")):
                trace = synthesize(scenario, steps=8, tokens=gpus * per_rank, layers=4,
                                   experts=256, top_k=8, seed=0)
                spec = RunSpec.of(gpus=gpus, gpus_per_node=8, redundant=32, mode="a2a",
                                  cost="roofline")
                rows = [r.metrics for r in compare(trace, POLICIES, ["a2a"], spec)]
                cells = " ".join(f"{m['gpu_imbalance']:22.4f} {m['compute_ms']:6.3f} "
                                 f"{m['comm_ms']:6.3f}" for m in rows)
                best = min(m["moe_ms"] for m in rows[1:])
                print(f"{scenario:9s} {gpus:3d} {per_rank:8d} {cells} "
                      f"{best / rows[0]['moe_ms']:7.4f}")


if __name__ == "__main__":
    main()
