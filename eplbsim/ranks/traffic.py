"""What the rank step (`ranks.MODES`) counts of a step beside its slot loads: where each
token's shared-expert work runs (`shared_split` in "none", `shared_sent` in "a2a"), the step's
fan-out (`fanout_counts`: the GPUs and nodes each token's executed choices reach), the busiest
GPU's token crossings of the "a2a" dispatch (`link_crossings`), the pairs sent to a slot
holding another expert's weights (`wrong_pairs`), and which rank owns each token in "a2a"
(`token_owners`, `share_bounds`). Each takes the step's `Epoch` and counts nothing unless the
epoch asks for it. `source_counts` and `source_load` count the pairs each owner sends each
expert, the input of a placement for traffic (`topology-aware`).

Dimensions: `T` tokens, `L` layers, `K` top-k, `G` GPUs = EP ranks, `N` nodes.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from ..cost.comm import a2a_crossings, a2a_token_counts
from ..dispatch import SharedInputs
from ..dispatch.kernels import flat_index
from ..dispatch.shared import even_split, has_pairs, home, per_gpu
from . import fanout
from .epoch import LOCAL, Epoch


def shared_split(epoch: Epoch, topk_ids: torch.Tensor) -> torch.Tensor | None:
    """"none": every GPU's `1 / G` share of the step's tokens per layer, float64 `[L, G]`
    (`dispatch.shared.even_split`), when `epoch.shared`; else None."""
    if not epoch.shared:
        return None
    return even_split(has_pairs(topk_ids).sum(0), epoch.num_ranks).cpu()


def pair_gpus(epoch: Epoch, phys: torch.Tensor) -> torch.Tensor | None:
    """"a2a": the GPU of each pair's chosen slot, int64 `[T, L, K]` of `phys [T, L, K]` (-1 where
    -1), when the step counts shared work or links (what reads it); else None."""
    if not (epoch.shared or epoch.count_links):
        return None
    return epoch.gpu_of(phys)


def shared_sent(epoch: Epoch, step: int, gpu: torch.Tensor | None,
                rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """"a2a": `(tokens per GPU, float64 [L, G] summed over the group; the GPU each held token's
    shared work runs on, int64 [T, L], -1 elsewhere)` when `epoch.shared`, else `(None, None)`.
    Each held rank places its own rows' shared work: at home (`home`), or by the policy's
    shared rule, which knows the GPUs of its pairs (`gpu [T, L, K]`, `pair_gpus`) and the
    group's counts (one all-reduce of them)."""
    if not epoch.shared:
        return None, None
    G, comm, rule = epoch.num_ranks, epoch.comm, epoch.policy.shared
    dest = torch.full(gpu.shape[:2], -1, dtype=torch.int64, device=gpu.device)
    if rule is None:
        for rank, own in zip(epoch.ranks, rows):
            dest[own] = home(gpu[own], rank.rank)
    else:
        local = [per_gpu(gpu[own], G) for own in rows]  # [L, G] each
        tokens = torch.zeros(G, dtype=torch.int64, device=gpu.device)
        for rank, own in zip(epoch.ranks, rows):
            tokens[rank.rank] = len(own)
        routed, tokens = comm.all_reduce(torch.stack(local).sum(0)), comm.all_reduce(tokens)
        for i, own in enumerate(rows):
            inputs = SharedInputs(gpu[own], local[i], routed, tokens)
            dest[own] = rule(inputs, epoch.context(step, i))
    shared = per_gpu(dest.unsqueeze(-1), G).to(torch.float64)
    return comm.all_reduce(shared).cpu(), dest


def fanout_counts(epoch: Epoch, shape: Sequence[int], gpus: Iterable[torch.Tensor],
                  tokens: torch.Tensor, owners: torch.Tensor | None = None) -> torch.Tensor | None:
    """The step's fan-out counts, int64 `[L, 4]` (`fanout.tally`), of the GPUs each pair
    reaches, given as `gpus` (`[T, L, K]` each, -1: nowhere; the step's ids have `shape`),
    their sets united over the group's processes; `tokens [L]`: the group's tokens with a valid
    pair; `owners [T]`: each token's source rank ("a2a"; None in "none"). None (nothing
    counted) unless `count_links`."""
    if not epoch.count_links:
        return None
    sets = fanout.empty(shape[0], shape[1], epoch.num_ranks)
    for gpu in gpus:
        fanout.mark(sets, gpu.cpu().numpy())
    if epoch.comm is not LOCAL:
        sets = epoch.comm.all_reduce(torch.from_numpy(sets).to(epoch.device)).cpu().numpy()
    return torch.from_numpy(fanout.tally(sets, tokens.cpu().numpy(),
                                         epoch.placement.topology.gpus_per_node,
                                         None if owners is None else owners.cpu().numpy()))


def a2a_fanout(epoch: Epoch, src_rank: torch.Tensor | None, gpu: torch.Tensor | None,
               sent: torch.Tensor) -> torch.Tensor | None:
    """"a2a": `fanout_counts` of the held ranks' choices (`gpu [T, L, K]`, `pair_gpus`, -1 where
    not held), `sent [T, L, K]` the valid pairs they sent, tokens owned as `token_owners`
    says."""
    if not epoch.count_links:
        return None
    tokens = epoch.comm.all_reduce(sent.any(-1).sum(0))
    owners = token_owners(gpu.shape[0], epoch.num_ranks, src_rank)
    return fanout_counts(epoch, gpu.shape, [gpu], tokens, owners)


def link_crossings(epoch: Epoch, src_rank: torch.Tensor | None, gpu: torch.Tensor | None,
                   shared: torch.Tensor | None = None) -> torch.Tensor | None:
    """The busiest GPU's token crossings of every layer's dispatch, int64 `[L, 2]` (NVLink,
    RDMA), the group's processes' counts summed, from the GPUs of the held ranks' choices
    (`gpu [T, L, K]`, `pair_gpus`: -1 where not held or padding) and the GPUs their shared work
    runs on (`shared [T, L]`, one more destination of the token; None: none) of tokens owned as
    `token_owners` says; None unless `count_links`."""
    if not epoch.count_links:
        return None
    topo = epoch.placement.topology
    owners = token_owners(gpu.shape[0], epoch.num_ranks, src_rank).to(gpu.device)
    dest = gpu if shared is None else torch.cat([gpu, shared.unsqueeze(-1)], -1)  # [T, L, K+]
    counts = [a2a_token_counts(owners, dest[:, layer], topo) for layer in range(gpu.shape[1])]
    gpu_tokens = epoch.comm.all_reduce(torch.stack([g for g, _ in counts]))  # [L, G, G]
    node_tokens = epoch.comm.all_reduce(torch.stack([n for _, n in counts]))  # [L, G, N]
    return a2a_crossings(gpu_tokens, node_tokens, topo).round().long().cpu()


def wrong_pairs(epoch: Epoch, topk_ids: torch.Tensor, phys: torch.Tensor,
                all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Pairs of `topk_ids [T, L, K]` sent (`phys [T, L, K]`, -1 where not sent) to a slot
    whose weights are another expert's (`Epoch.slot_experts`), int64 `[L]` summed over the
    group; None when `slot_experts` is not set."""
    if epoch.slot_experts is None:
        return None
    wrong = (phys >= 0) & (held_experts(epoch.slot_experts, phys, topk_ids) != topk_ids)
    return all_reduce(wrong.sum((0, 2))).cpu()


def held_experts(slot_experts: torch.Tensor, phys: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """The expert whose weights run each pair of `topk_ids [T, L, K]` at `phys [T, L, K]`,
    int64 `[T, L, K]`: what its slot holds (`slot_experts [L, P]`), the pair's own at a place
    past the slots (weights fetched for it, `dispatch.spill`)."""
    P = slot_experts.shape[1]
    index = flat_index(phys.clamp(min=0, max=P - 1), P)
    holds = slot_experts.to(phys.device).flatten()[index]
    return torch.where(phys >= P, topk_ids.long(), holds)


def token_owners(num_tokens: int, num_ranks: int,
                 src_rank: torch.Tensor | None = None) -> torch.Tensor:
    """Source rank of each token in "a2a", int64 `[T]`: the trace's `src_rank` when given, else
    contiguous shares differing by at most one, the first `T % G` ranks taking one more."""
    if src_rank is not None:
        if src_rank.numel() and int(src_rank.max()) >= num_ranks:
            raise InputError(f"the trace's src_rank names rank {int(src_rank.max())}, but there "
                             f"are only {num_ranks} GPUs")
        return src_rank.long()
    return torch.repeat_interleave(torch.arange(num_ranks),
                                   torch.from_numpy(np.diff(share_bounds(num_tokens, num_ranks))))


def share_bounds(num_tokens: int, num_ranks: int) -> np.ndarray:
    """Where the contiguous shares of `token_owners` start, int64 `[G + 1]`: rank `r` owns
    rows `bounds[r]:bounds[r + 1]`."""
    base, extra = divmod(num_tokens, num_ranks)
    sizes = np.full(num_ranks, base, np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def source_counts(ids: torch.Tensor, owners: torch.Tensor, num_ranks: int,
                  num_experts: int) -> torch.Tensor:
    """Routed pairs each source rank sends each expert in one step: int64 `[L, G, E]` of
    `ids [T, L, K]` (padding, -1, counts nowhere) and each token's rank `owners [T]`."""
    L = ids.shape[1]
    index = flat_index(ids, num_experts) + (owners.view(-1, 1, 1).to(ids.device) * L
                                            * num_experts)  # [T, L, K] (owner, layer, expert)
    counts = torch.bincount(index[ids >= 0], minlength=num_ranks * L * num_experts)
    return counts.view(num_ranks, L, num_experts).transpose(0, 1)


def source_load(trace: object, num_ranks: int, steps: Iterable[int]) -> np.ndarray:
    """The pairs each source rank sends each expert over `steps` of a token trace, float64
    `[L, G, E]`: tokens owned as "a2a" owns them (`token_owners`: the trace's `src_rank`, else
    contiguous shares of each step)."""
    out = np.zeros((trace.num_layers, num_ranks, trace.num_experts))
    for s in steps:
        ids = trace.step(s)  # [T, L, K]
        owners = token_owners(ids.shape[0], num_ranks, trace.step_src_rank(s))
        out += source_counts(ids, owners, num_ranks, trace.num_experts).numpy()
    return out
