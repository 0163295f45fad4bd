"""Communication time of one MoE layer (DESIGN.md §8).

Dimensions: `...` any leading dims (steps, layers), `T` tokens, `K` top-k, `G` GPUs, `N` nodes
of `g = G / N` GPUs.

- "a2a" (DeepEP-like): dispatch sends each token once to each distinct destination GPU among
  its top-k choices; a token crosses to another node once per destination node (to the GPU with
  the source's local index there, its proxy) and fans out over NVLink from the proxy; combine
  returns the same volumes. A phase costs `latency_s` plus, over each link class, the slowest
  GPU's bytes (sent or received, whichever is larger) over the class's bandwidth; NVLink and
  RDMA run at once, so the slower class decides.
- "none": an all-reduce of the layer's `[T, H]` output in the combine dtype: a ring over NVLink
  within a node; across nodes, hierarchical (reduce-scatter within the node, a ring of the
  `1/g` shards between nodes over RDMA, all-gather within the node).
"""

from __future__ import annotations

import torch

from ..placement.topology import Topology
from .devices import DeviceProfile
from .shapes import ModelShape


def a2a_token_counts(src: torch.Tensor, dest_gpu: torch.Tensor,
                     topology: Topology) -> tuple[torch.Tensor, torch.Tensor]:
    """`(gpu_tokens [G, G], node_tokens [G, N])`, float64: distinct tokens from source rank
    `s` that have a choice on GPU `d` (on node `n`), of one layer's `src [T]` (each token's
    rank) and `dest_gpu [T, K]` (the GPU of each chosen slot, -1 padding)."""
    G, N = topology.num_gpus, topology.num_nodes
    valid = dest_gpu >= 0
    needs = torch.zeros(dest_gpu.shape[0], G, dtype=torch.float64, device=dest_gpu.device)
    needs = needs.scatter_add(1, dest_gpu.clamp(min=0).long(),
                              valid.to(torch.float64)).clamp(max=1)  # [T, G] 0 or 1
    gpu_tokens = torch.zeros(G, G, dtype=torch.float64, device=needs.device)
    gpu_tokens.index_add_(0, src.long(), needs)
    node_needs = needs.view(-1, N, topology.gpus_per_node).amax(-1)  # [T, N]
    node_tokens = torch.zeros(G, N, dtype=torch.float64, device=needs.device)
    node_tokens.index_add_(0, src.long(), node_needs)
    return gpu_tokens, node_tokens


def a2a_link_bytes(gpu_tokens: torch.Tensor, node_tokens: torch.Tensor, topology: Topology,
                   token_bytes: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(nvlink, rdma)`, float64 `[..., G]`: each GPU's larger of sent and received bytes over
    each link class in one dispatch (or combine: the same volumes reversed) of tokens of
    `token_bytes`, from `gpu_tokens [..., G, G]` and `node_tokens [..., G, N]`."""
    G, g = topology.num_gpus, topology.gpus_per_node
    ranks = torch.arange(G, device=gpu_tokens.device)
    node, local = ranks // g, ranks % g
    same = node.view(G, 1) == node.view(1, G)  # [s, d]
    direct = gpu_tokens * (same & (ranks.view(G, 1) != ranks.view(1, G)))  # over NVLink
    remote = gpu_tokens * ~same
    proxy_of = torch.arange(topology.num_nodes, device=ranks.device).view(1, -1) * g \
        + local.view(G, 1)  # [s, n] the GPU a token of s lands on in node n
    crossing = node_tokens * (node.view(G, 1) != proxy_of // g)  # [s, n] not the own node
    proxy = proxy_of[:, node]  # [s, d] the proxy that forwards s's tokens to d
    fanned = remote * (proxy != ranks.view(1, G))  # from the proxy to d over NVLink
    lead = gpu_tokens.shape[:-2]
    flat = fanned.reshape(-1, G * G)
    nvl_send = direct.sum(-1) + torch.zeros(flat.shape[0], G, dtype=torch.float64,
                                            device=flat.device).index_add_(
        1, proxy.reshape(-1), flat).view(*lead, G)
    nvl_recv = direct.sum(-2) + fanned.sum(-2)
    rdma_send = crossing.sum(-1)
    rdma_recv = torch.zeros(flat.shape[0], G, dtype=torch.float64,
                            device=flat.device).index_add_(
        1, proxy_of.reshape(-1), crossing.reshape(-1, proxy_of.numel())).view(*lead, G)
    return (torch.maximum(nvl_send, nvl_recv) * token_bytes,
            torch.maximum(rdma_send, rdma_recv) * token_bytes)


def a2a_crossings(gpu_tokens: torch.Tensor, node_tokens: torch.Tensor,
                  topology: Topology) -> torch.Tensor:
    """The busiest GPU's token crossings of one dispatch, float64 `[..., 2]`: over NVLink and
    over RDMA (each the larger of sent and received), from the counts of `a2a_token_counts`.
    Bytes are these times a token's bytes, so one count serves any model shape and dtype."""
    nvl, rdma = a2a_link_bytes(gpu_tokens, node_tokens, topology, 1.0)
    return torch.stack([nvl.amax(-1), rdma.amax(-1)], -1)


def a2a_seconds(crossings: torch.Tensor, shape: ModelShape,
                device: DeviceProfile) -> torch.Tensor:
    """Dispatch plus combine of one layer, seconds `[...]`, from its `a2a_crossings
    [..., 2]` (`phase_seconds` of each, in its dtype)."""
    return sum(phase_seconds(crossings, shape.hidden * shape.bytes_of(phase), device)
               for phase in ("dispatch", "combine"))


def phase_seconds(crossings: torch.Tensor, token_bytes: float,
                  device: DeviceProfile) -> torch.Tensor:
    """One dispatch (or combine) of tokens of `token_bytes`, seconds `[...]`, from the busiest
    GPU's `crossings [..., 2]`: `latency_s` plus the slower link class's bytes over its
    bandwidth."""
    size = crossings.to(torch.float64) * token_bytes
    return device.latency_s + torch.maximum(size[..., 0] / device.nvlink,
                                            size[..., 1] / device.rdma)


def allreduce_seconds(tokens: torch.Tensor, topology: Topology, shape: ModelShape,
                      device: DeviceProfile) -> torch.Tensor:
    """The "none" all-reduce of one layer's `[T, H]` output, seconds, for `tokens [...]` (0
    on one GPU)."""
    size = tokens.to(torch.float64) * shape.hidden * shape.bytes_of("combine")
    G, g, N = topology.num_gpus, topology.gpus_per_node, topology.num_nodes
    if G == 1:
        return torch.zeros_like(size)
    within = 2 * (g - 1) / g * size / device.nvlink
    between = 2 * (N - 1) / N * (size / g) / device.rdma
    return device.latency_s + within + between


def layer_comm_seconds(mode: str, tokens: torch.Tensor, crossings: torch.Tensor,
                       topology: Topology, shape: ModelShape,
                       device: DeviceProfile) -> torch.Tensor:
    """Communication of every layer, seconds `[S, L]`, of steps of `tokens [S]` tokens with
    the busiest GPU's `crossings [S, L, 2]` ("a2a"; `Counters.crossings`): the "none"
    all-reduce or the "a2a" dispatch and combine."""
    if mode == "a2a":
        return a2a_seconds(crossings, shape, device)
    return allreduce_seconds(tokens, topology, shape, device).unsqueeze(1).expand(
        crossings.shape[:2])


def spill_seconds(fetched: torch.Tensor, expert_bytes: int, gathers: bool, num_slots: int,
                  topology: Topology, device: DeviceProfile) -> torch.Tensor:
    """A spill policy's time in every layer, seconds `[...]`, from the distinct experts each
    GPU fetched within its node and across nodes, `fetched [..., G, 2]` (`[..., 0, 2]`: no
    spill policy, 0 s): the busiest GPU's fetch (`latency_s` plus the slower link class's bytes,
    `expert_bytes` an expert, over its bandwidth; a layer with no fetch costs nothing) and,
    when the ranks `gathers` their counts ("a2a"), one all-gather of every slot's count
    (int32) a layer."""
    if not fetched.shape[-2]:
        return torch.zeros(fetched.shape[:-2], dtype=torch.float64)
    size = fetched.to(torch.float64) * expert_bytes
    busiest = torch.maximum(size[..., 0] / device.nvlink, size[..., 1] / device.rdma).amax(-1)
    seconds = torch.where(fetched.sum((-2, -1)) > 0, device.latency_s + busiest, 0.0)
    if gathers:
        g, G = topology.gpus_per_node, topology.num_gpus
        count_bytes = num_slots * 4
        seconds = seconds + device.latency_s + max((g - 1) * count_bytes / device.nvlink,
                                                   (G - g) * count_bytes / device.rdma)
    return seconds
