"""The cost model against its anchors (DESIGN.md §8): the communication model against DeepEP's
published normal and low-latency kernels, the compute models against aiconfigurator-core's
measured H200 MoE kernels.

DeepEP's conditions: H800 GPUs, 8 a node over NVLink, ConnectX-7 400 Gb/s RDMA between nodes;
4096 tokens a rank, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine. Its figure
is the bottleneck link's bandwidth: the bytes the busiest GPU moves over NVLink (one node) or
RDMA (several) divided by the kernel's time. The model's is the same quotient with the
modelled time (`cost.comm`, the `h800` profile). Routing here: each token's 8 experts drawn
uniformly without replacement (seeded), experts spread evenly over the GPUs; tokens are counted
at hidden x dtype bytes (DeepEP's FP8 scales, 4 bytes per 128 values, are left out). The
low-latency kernels are published as times at 128 tokens a rank, EP 8 to 256.

aiconfigurator-core (the `cost` extra): every H200 `moe_perf` row of the current trtllm, sglang
and vllm tables for a shape in `MODELS` (no tensor parallelism; balanced and power-law
routing). `roofline` gets what the measured rank (rank 0, holding experts `[0, E / EP)`) is at
least given: on balanced rows exactly its pairs and distinct experts under aiconfigurator's
balanced routing (token `t` picks experts `(t + j ceil(E / K)) mod E`, `j < K`, spread over the
stride when there are fewer tokens than it); on power-law rows, where the collector makes
rank 0 the most loaded, the mean pairs `num_tokens K / EP` on the fewest experts they fit on
(`ceil(K / EP)`, an expert taking at most one pair a token). So it should never be above the
measured latency. `measured` is evaluated at each balanced row's own token count, for a GPU
reading the weights of the `E / EP` experts the row's rank holds.

    python benchmarks/bench_cost_anchors.py
"""

from __future__ import annotations

import math

import torch

from eplbsim.cost import DEVICES, MODELS
from eplbsim.cost.comm import a2a_crossings, a2a_token_counts, phase_seconds
from eplbsim.placement.topology import Topology

TOKENS, EXPERTS, TOP_K = 4096, 256, 8
ANCHORS = {8: (153, 158), 16: (43, 43), 32: (58, 57), 64: (51, 50)}  # GB/s: dispatch, combine
LL_TOKENS = 128
LL_ANCHORS = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369),
              256: (194, 360)}  # microseconds: dispatch, combine
FRAMEWORKS = ("trtllm", "sglang", "vllm")


def _crossings(ep: int, tokens: int, seed: int) -> torch.Tensor:
    """The busiest GPU's (NVLink, RDMA) token crossings of one dispatch of `tokens` a rank."""
    topology = Topology(ep, min(ep, 8))
    gen = torch.Generator().manual_seed(seed)
    experts = torch.rand(ep * tokens, EXPERTS, generator=gen).argsort(-1)[:, :TOP_K]
    dest = experts // (EXPERTS // ep)  # [T, K] the GPU of each chosen expert
    src = torch.arange(ep).repeat_interleave(tokens)
    return a2a_crossings(*a2a_token_counts(src, dest, topology), topology)  # [2]


def phases(ep: int, tokens: int, seed: int = 0) -> list[tuple[float, float]]:
    """The model's `(seconds, bottleneck bytes)` of dispatch and combine at `ep` ranks (the
    bottleneck DeepEP reports: RDMA across nodes, NVLink within one)."""
    shape, device = MODELS["deepseek-v3"], DEVICES["h800"]
    crossings = _crossings(ep, tokens, seed)
    link = 1 if ep > 8 else 0
    out = []
    for phase in ("dispatch", "combine"):
        token_bytes = shape.hidden * shape.bytes_of(phase)
        out.append((float(phase_seconds(crossings, token_bytes, device)),
                    float(crossings[link]) * token_bytes))
    return out


def deepep() -> None:
    print("DeepEP normal kernels, bottleneck bandwidth (GB/s): model (h800 profile) vs "
          "published, model / published")
    print(f"{'EP':>3s} {'link':>6s} {'dispatch':>9s} {'DeepEP':>7s} {'ratio':>6s} "
          f"{'combine':>8s} {'DeepEP':>7s} {'ratio':>6s}")
    for ep, (dispatch, combine) in ANCHORS.items():
        d, c = (moved / seconds / 1e9 for seconds, moved in phases(ep, TOKENS))
        print(f"{ep:3d} {'NVLink' if ep <= 8 else 'RDMA':>6s} {d:9.1f} {dispatch:7d} "
              f"{d / dispatch:6.2f} {c:8.1f} {combine:7d} {c / combine:6.2f}")
    print(f"\nDeepEP low-latency kernels, {LL_TOKENS} tokens a rank, time (us): model (h800 "
          f"profile) vs published, model / published")
    print(f"{'EP':>3s} {'dispatch':>9s} {'DeepEP':>7s} {'ratio':>6s} {'combine':>8s} "
          f"{'DeepEP':>7s} {'ratio':>6s}")
    for ep, (dispatch, combine) in LL_ANCHORS.items():
        d, c = (seconds * 1e6 for seconds, _ in phases(ep, LL_TOKENS))
        print(f"{ep:3d} {d:9.1f} {dispatch:7d} {d / dispatch:6.2f} {c:8.1f} {combine:7d} "
              f"{c / combine:6.2f}")


def rank0_workload(tokens: int, experts: int, top_k: int, ep: int,
                   balanced: bool) -> tuple[float, float]:
    """`(pairs, active experts)` rank 0 is at least given in a row (module doc)."""
    if not balanced:
        return tokens * top_k / ep, float(math.ceil(top_k / ep))
    stride = math.ceil(experts / top_k)
    t = torch.arange(tokens, dtype=torch.float64).view(-1, 1)
    j = torch.arange(top_k, dtype=torch.float64).view(1, -1)
    start = t if tokens >= stride else t * stride / tokens
    chosen = ((start + j * stride) % experts).long()  # [T, K]
    local = chosen[chosen < experts // ep]
    return float(local.numel()), float(local.unique().numel())


def aiconfigurator() -> None:
    """Roofline and measured against every H200 row of the shapes in MODELS."""
    import importlib.resources

    import pyarrow.parquet as pq

    from eplbsim.cost.compute import roofline
    from eplbsim.cost.measured import DTYPES, measured, moe_table

    device = DEVICES["h200"]
    shapes: dict[tuple, tuple[str, object]] = {}
    for n, s in MODELS.items():  # models of one shape (deepseek-v3, -r1) share its rows
        key = (s.hidden, s.intermediate, s.experts, s.top_k, DTYPES[s.weight_dtype])
        shapes[key] = (f"{shapes[key][0]}/{n}" if key in shapes else n, s)
    print("\naiconfigurator-core H200 MoE kernels: measured / roofline (>= 1 expected); "
          "measured at the balanced rows' own points")
    print(f"{'framework':>9s} {'version':>10s} {'rows':>5s} {'roof>meas':>9s} "
          f"{'bal>=4096':>9s} {'min':>6s} {'median':>6s} {'max':>6s} {'<=2.5x':>6s} "
          f"{'measured=table':>14s}  shapes")
    for framework in FRAMEWORKS:
        version = moe_table(MODELS["deepseek-v3"], device, 8, framework).version
        path = (importlib.resources.files("aiconfigurator_core") / "systems/data/h200_sxm/moe"
                / framework / version / "moe_perf.parquet")
        rows = [r for r in pq.read_table(path).to_pylist() if r["moe_tp_size"] == 1 and
                (r["hidden_size"], r["inter_size"], r["num_experts"], r["topk"],
                 r["moe_dtype"]) in shapes]
        above, ratios, exact, seen, names, by_ep = [], [], 0, 0, set(), {}
        for r in rows:
            name, shape = shapes[(r["hidden_size"], r["inter_size"], r["num_experts"],
                                  r["topk"], r["moe_dtype"])]
            names.add(name)
            ep, x = r["moe_ep_size"], r["num_tokens"]
            balanced = r["distribution"] == "balanced"
            least = rank0_workload(x, shape.experts, shape.top_k, ep, balanced)
            seconds = r["latency"] * 1e-3
            ratio = seconds / float(roofline(*torch.tensor(least).view(2, 1), shape, device))
            if ratio < 1:
                weights = least[1] * shape.expert_weight_bytes
                above.append((ratio, name, ep, x, r["distribution"], weights / seconds / 1e12))
            if not balanced:
                continue
            if x >= 4096:
                ratios.append(ratio)
                by_ep.setdefault(ep, []).append(ratio)
            table = moe_table(shape, device, ep, framework)
            if r["kernel_source"] == table.kernel and dict(
                    zip(table.tokens.tolist(), table.seconds.tolist())).get(x) == seconds:
                seen += 1  # the row the table keeps for this token count
                pairs = torch.full((1, ep), x * shape.top_k / ep, dtype=torch.float64)
                held = torch.full((1, ep), shape.experts / ep, dtype=torch.float64)
                got = measured(pairs, held, shape, device, framework)
                exact += bool((got == seconds).all())
        ratios.sort()
        within = sum(q <= 2.5 for q in ratios)
        print(f"{framework:>9s} {version:>10s} {len(rows):5d} {len(above):9d} {len(ratios):9d} "
              f"{ratios[0]:6.2f} {ratios[len(ratios) // 2]:6.2f} {ratios[-1]:6.2f} "
              f"{within:6d} {f'{exact}/{seen}':>14s}  {', '.join(sorted(names))}")
        print("    balanced >= 4096 tokens, measured / roofline by EP (min-max, rows <= 2.5x): "
              + "; ".join(f"EP{ep} {min(v):.2f}-{max(v):.2f} ({sum(q <= 2.5 for q in v)}/"
                          f"{len(v)})" for ep, v in sorted(by_ep.items())))
        for ratio, name, ep, x, dist, hbm in sorted(above):
            print(f"    roofline above measured: {name} EP {ep} {x} tokens {dist}: "
                  f"measured / roofline {ratio:.2f}; its weights alone at {hbm:.1f} TB/s")


def main() -> None:
    deepep()
    aiconfigurator()


if __name__ == "__main__":
    main()
