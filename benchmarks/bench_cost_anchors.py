"""The communication model against DeepEP's published normal-kernel bandwidths (DESIGN.md §8).

DeepEP's conditions: H800 GPUs, 8 a node over NVLink, ConnectX-7 400 Gb/s RDMA between nodes;
4096 tokens a rank, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine. Its figure
is the bottleneck link's bandwidth: the bytes the busiest GPU moves over NVLink (one node) or
RDMA (several) divided by the kernel's time. The model's is the same quotient with the
modelled time (`cost.comm`, the `h800` profile). Routing here: each token's 8 experts drawn
uniformly without replacement (seeded), experts spread evenly over the GPUs; tokens are counted
at hidden x dtype bytes (DeepEP's FP8 scales, 4 bytes per 128 values, are left out).

    python benchmarks/bench_cost_anchors.py
"""

from __future__ import annotations

import torch

from eplbsim.cost import DEVICES, MODELS
from eplbsim.cost.comm import a2a_crossings, a2a_token_counts, phase_seconds
from eplbsim.topology import Topology

TOKENS, EXPERTS, TOP_K = 4096, 256, 8
ANCHORS = {8: (153, 158), 16: (43, 43), 32: (58, 57), 64: (51, 50)}  # GB/s: dispatch, combine


def bottleneck_gbps(ep: int, seed: int = 0) -> tuple[float, float]:
    """The model's (dispatch, combine) bottleneck bandwidth at `ep` ranks, GB/s."""
    shape, device = MODELS["deepseek-v3"], DEVICES["h800"]
    topology = Topology(ep, min(ep, 8))
    gen = torch.Generator().manual_seed(seed)
    experts = torch.rand(ep * TOKENS, EXPERTS, generator=gen).argsort(-1)[:, :TOP_K]
    dest = experts // (EXPERTS // ep)  # [T, K] the GPU of each chosen expert
    src = torch.arange(ep).repeat_interleave(TOKENS)
    crossings = a2a_crossings(*a2a_token_counts(src, dest, topology), topology)  # [2]
    link = 1 if topology.num_nodes > 1 else 0  # the bottleneck DeepEP reports: RDMA or NVLink
    out = []
    for phase in ("dispatch", "combine"):
        token_bytes = shape.hidden * shape.bytes_of(phase)
        seconds = float(phase_seconds(crossings, token_bytes, device))
        out.append(float(crossings[link]) * token_bytes / seconds / 1e9)
    return out[0], out[1]


def main() -> None:
    print("DeepEP normal kernels, bottleneck bandwidth (GB/s): model (h800 profile) vs "
          "published, model / published")
    print(f"{'EP':>3s} {'link':>6s} {'dispatch':>9s} {'DeepEP':>7s} {'ratio':>6s} "
          f"{'combine':>8s} {'DeepEP':>7s} {'ratio':>6s}")
    for ep, (dispatch, combine) in ANCHORS.items():
        d, c = bottleneck_gbps(ep)
        print(f"{ep:3d} {'NVLink' if ep <= 8 else 'RDMA':>6s} {d:9.1f} {dispatch:7d} "
              f"{d / dispatch:6.2f} {c:8.1f} {combine:7d} {c / combine:6.2f}")


if __name__ == "__main__":
    main()
