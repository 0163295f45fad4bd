"""Where each token's shared-expert work runs (DESIGN.md §10, SGLang's Waterfill).

Dimensions: `T` tokens a rank dispatches, `L` layers, `K` top-k, `G` GPUs = EP ranks.

A model's shared experts are always active: a token that routes any pair in a layer also runs
the layer's shared experts once. In "a2a" that work stays on the token's own rank unless the
policy has a shared rule (`DispatchPolicy.shared`) that sends it elsewhere, as SGLang's
Waterfill dispatches the fused shared expert as one more DeepEP slot. In "none" every rank holds
every token and the shared experts run tensor-parallel: each GPU does `1 / G` of every token's
shared work (`even_split`).

A shared rule is `rule(inputs: SharedInputs, ctx) -> int64 [T, L]`: the GPU that runs each of
the dispatching rank's tokens' shared work in each layer, -1 where the token routes no pair in
the layer (padding). Without one, the work stays home (`home`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .kernels import flat_index
from .policies import DispatchContext

WATERFILL = ("SGLang's DeepEP Waterfill (sgl-project/sglang python/sglang/srt/layers/moe/"
             "deepep_waterfill.py _waterfill_expand_kernel and DeepEPWaterfillBalancer "
             "@0389b977; equal to 0.5.23's WaterfillBalancer, eplbsim engines conform; the "
             "routed pairs by row, where 0.5.23 with an a2a backend draws them at random: "
             "sglang:waterfill runs that)")
MIN_BATCH = 64  # a rank with fewer tokens keeps their shared work (MIN_BATCH_FOR_BALANCE)
LOCAL_NUMER, LOCAL_DENOM = 11, 10  # the local rank's preference: others' weights x 10 // 11
SEED_MULTIPLIER = 0x9E3779B9  # token seed = index ^ (source rank x this), mod 2**32
LCG_MULTIPLIER, LCG_INCREMENT = 1664525, 1013904223  # then one step of this LCG, mod 2**32
UINT32 = 1 << 32


@dataclass(frozen=True)
class SharedInputs:
    """What a rank knows when it places its tokens' shared work, every layer of one step.

    gpu:    int64 `[T, L, K]` the GPU of the slot each of its pairs was sent to, -1 at padding
    local:  int64 `[L, G]` its own routed pairs per GPU
    routed: int64 `[L, G]` every rank's routed pairs per GPU (`local` summed over the ranks)
    tokens: int64 `[G]` every rank's tokens (rows, padding included) in the step
    """

    gpu: torch.Tensor
    local: torch.Tensor
    routed: torch.Tensor
    tokens: torch.Tensor


SharedRule = Callable[[SharedInputs, DispatchContext], torch.Tensor]


def has_pairs(gpu: torch.Tensor) -> torch.Tensor:
    """Tokens that route some pair in each layer, bool `[T, L]` of `gpu [T, L, K]`."""
    return (gpu >= 0).any(-1)


def home(gpu: torch.Tensor, rank: int) -> torch.Tensor:
    """Every token's shared work on its own `rank`: int64 `[T, L]` of the GPUs of its pairs
    `gpu [T, L, K]`, -1 at padding."""
    return torch.where(has_pairs(gpu), rank, -1)


def local_rule(inputs: SharedInputs, ctx: DispatchContext) -> torch.Tensor:
    """`home` as a shared rule (it reads nothing of the group)."""
    return home(inputs.gpu, ctx.rank)


def per_gpu(gpu: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Entries of `gpu [T, L, K]` naming each GPU, per layer, int64 `[L, G]` (-1 not counted):
    pairs per GPU of the GPUs of pairs, tokens per GPU of shared destinations `[T, L, 1]`."""
    counts = torch.bincount(flat_index(gpu.clamp(min=0), num_gpus)[gpu >= 0],
                            minlength=gpu.shape[1] * num_gpus)
    return counts.view(-1, num_gpus)


def even_split(valid_tokens: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """"none": every token's shared work split over the GPUs, float64 `[L, G]` of the valid
    tokens per layer `[L]`."""
    share = valid_tokens.to(torch.float64) / num_gpus
    return share.unsqueeze(1).expand(-1, num_gpus).contiguous()


def waterfill_static(inputs: SharedInputs, ctx: DispatchContext) -> torch.Tensor:
    """Waterfill's static mode (SGLang's default with an EPLB placement: no collective): the
    loads are the rank's own routed pairs per GPU, the fill level
    `ceil((sum + sum // K) / G)`, and every GPU is a candidate."""
    load = inputs.local
    total = load.sum(-1)
    G, K = load.shape[1], inputs.gpu.shape[2]
    target = (total + total // K + G - 1) // G
    return _waterfill(inputs, ctx, load, target, torch.ones_like(target, dtype=torch.bool))


def waterfill_dynamic(inputs: SharedInputs, ctx: DispatchContext) -> torch.Tensor:
    """Waterfill's dynamic mode (one all-reduce of the counts per layer): the loads are every
    rank's routed pairs per GPU plus its tokens, the fill level
    `ceil((sum of loads + routed // K) / G)`; every GPU is a candidate when no load exceeds
    it, else only the GPUs the token already routes to and its own."""
    load = inputs.routed + inputs.tokens.unsqueeze(0)  # [L, G]
    G, K = load.shape[1], inputs.gpu.shape[2]
    target = (load.sum(-1) + inputs.routed.sum(-1) // K + G - 1) // G
    return _waterfill(inputs, ctx, load, target, load.amax(-1) <= target)


def _waterfill(inputs: SharedInputs, ctx: DispatchContext, load: torch.Tensor,
               target: torch.Tensor, allow_all: torch.Tensor) -> torch.Tensor:
    """The fused kernel's choice for every token and layer, int64 `[T, L]` (-1 at padding), from
    the loads `[L, G]`, the fill level `[L]` and whether every GPU is a candidate `[L]`.

    A candidate GPU's weight is its room below the fill level, `max(target - load, 0)`, cut to
    `w x 10 // 11` unless it is the token's own; a token draws `u = seed mod (sum of its
    candidates' weights)` with `seed = LCG(index ^ (rank x 0x9E3779B9))` and takes the GPU whose
    cumulative weight interval holds `u`. When its weights sum to 0 it takes the first GPU, in
    scan order, more than 10% less loaded than the best so far, starting from its own. A rank
    with fewer than `MIN_BATCH` tokens keeps every token's shared work."""
    gpu = inputs.gpu
    T, L, K = gpu.shape
    G, s = load.shape[1], ctx.rank
    if T < MIN_BATCH:
        return home(gpu, s)
    device = gpu.device
    load, target, allow_all = load.to(device), target.to(device), allow_all.to(device)
    ranks = torch.arange(G, device=device)
    routed_to = torch.zeros(T, L, G, dtype=torch.bool, device=device)
    routed_to.scatter_(2, gpu.clamp(min=0), gpu >= 0)  # padding writes False to GPU 0: no-op
    candidate = routed_to | (ranks == s) | allow_all.view(1, L, 1)  # [T, L, G]
    room = (target.unsqueeze(1) - load).clamp(min=0)  # [L, G]
    weight = torch.where(ranks == s, room, room * LOCAL_DENOM // LOCAL_NUMER)
    cum = torch.where(candidate, weight.unsqueeze(0), 0).cumsum(-1)  # [T, L, G]
    total = cum[..., -1]  # [T, L]
    index = torch.arange(T, device=device, dtype=torch.int64)
    seed = (index ^ (s * SEED_MULTIPLIER % UINT32)) * LCG_MULTIPLIER + LCG_INCREMENT
    u = (seed % UINT32).unsqueeze(1) % total.clamp(min=1)  # [T, L]
    dest = (cum <= u.unsqueeze(-1)).sum(-1)
    if (total == 0).any():  # rare: no candidate has room
        dest = torch.where(total > 0, dest, _least_loaded(gpu, load, s, allow_all))
    return torch.where(has_pairs(gpu), dest, -1)


def _least_loaded(gpu: torch.Tensor, load: torch.Tensor, source: int,
                  allow_all: torch.Tensor) -> torch.Tensor:
    """The kernel's fallback, int64 `[T, L]`: from the own GPU, scan the candidates (every GPU
    in order where `allow_all [L]`, else the token's pairs in top-k order) and move to one whose
    load x 11 is below the best load so far x 10."""
    T, L, _ = gpu.shape
    every = torch.arange(load.shape[1], device=gpu.device).expand(T, L, -1)
    if bool(allow_all.all()):
        return _scan(every, load, source)
    if not bool(allow_all.any()):
        return _scan(gpu, load, source)
    return torch.where(allow_all.unsqueeze(0), _scan(every, load, source),
                       _scan(gpu, load, source))


def _scan(candidates: torch.Tensor, load: torch.Tensor, source: int) -> torch.Tensor:
    """`_least_loaded`'s scan over `candidates [T, L, C]` (GPUs, -1 skipped) in order,
    int64 `[T, L]`."""
    T, L, C = candidates.shape
    layers = torch.arange(L, device=candidates.device).unsqueeze(0)
    best = torch.full((T, L), source, dtype=torch.int64, device=candidates.device)
    best_load = load[:, source].unsqueeze(0).expand(T, L)
    for c in range(C):
        g = candidates[:, :, c]
        count = load[layers, g.clamp(min=0)]  # [T, L]
        better = (g >= 0) & (count * LOCAL_NUMER < best_load * LOCAL_DENOM)
        best, best_load = torch.where(better, g, best), torch.where(better, count, best_load)
    return best
