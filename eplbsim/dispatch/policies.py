"""The reference dispatch policies: which replica serves each (token, top-k slot).

Dimensions: `T` tokens in the batch a rank dispatches, `K` top-k, `L` layers, `E` logical
experts, `R` max candidates of one expert in a view.

A policy is a pure torch function `policy(topk_ids [T, K], view, ctx) -> phys [T, K]` (int64):
for every pair routed to logical expert `e` it returns one of the candidate slots the rank's
`view` lists for `e` in layer `ctx.layer`, and -1 where `topk_ids` is -1 (padding). Policies run
on whatever device `topk_ids` and the view live on. These functions define the semantics and are
the oracle of the fast kernels; `eplbsim.dispatch.POLICIES` registers them with their properties.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import torch

from ..placement import Placement, View
from . import batch_lp
from .streams import Stream, torch_generator

HASH_MULTIPLIER = 2654435769  # Knuth's multiplicative hash constant, floor(2**32 / phi)
RANDOM_RANGE = 65536  # the serving engine's randint(0, 65536) draw
TRTLLM_BLOCK = 1024  # pairs per block of TensorRT-LLM's route kernel
GOLDEN = (5 ** 0.5 - 1) / 2  # 0.6180339887...: the golden-ratio draws of lp-golden
LPLB_MULTIPLIER, LPLB_INCREMENT = 499, 41  # LPLB's permutation k' = (499 k + 41) mod total_e
LPLB_BLOCKS = 132  # thread blocks LPLB's mapping kernel splits a batch over (one per SM, H800)


@dataclass(frozen=True)
class DispatchContext:
    """What a rank knows at dispatch time besides the ids and its view.

    step, layer: shared by every rank.  rank: the dispatching rank.  seed: the scenario seed
    (static's permutation).  stream: the rank's counter-based stream for this step
    (`streams.Stream`: random's draws, and the torch generator of each layer for the policies
    that draw with torch), what the replay gives.  generator: a torch generator to draw from
    instead, advancing call by call as a serving engine's does (random then draws
    `randint(0, 65536)` from it: the engine's own draw, which the conformance checks compare;
    on the policy's device).  mode: "none" or "a2a".  rank_offset: whether policies add the rank to
    their offset: None (the default) for each policy's automatic choice (`ordinal` adds it in
    "a2a", where rank invariance is not needed and it balances best; `trtllm` does not), True
    for both (`trtllm` in every mode), False for neither.
    """

    step: int = 0
    layer: int = 0
    rank: int = 0
    seed: int = 0
    generator: torch.Generator | None = None
    stream: Stream | None = None
    mode: str = "none"
    rank_offset: bool | None = None
    tp: int = 1

    @property
    def draws_streamed(self) -> bool:
        """Whether random draws from the stream (given one and no generator)."""
        return self.stream is not None and self.generator is None


Policy = Callable[[torch.Tensor, View, DispatchContext], torch.Tensor]


def replica_slots(topk_ids: torch.Tensor, view: View, layer: int,
                  replica: torch.Tensor) -> torch.Tensor:
    """Slot of candidate number `replica [T, K]` of each pair's expert; -1 for padding.

    `replica` must lie in `[0, n_e)` where the id is not -1 (values at padding are ignored).
    """
    ids = topk_ids.long()
    valid = ids >= 0
    expert = ids.clamp(min=0)
    log2phy = view.log2phy[layer]  # [E, R]
    phys = log2phy[expert, torch.where(valid, replica, 0)]
    return torch.where(valid, phys, torch.full_like(phys, -1))


def candidate_counts(topk_ids: torch.Tensor, view: View, layer: int) -> torch.Tensor:
    """`n_e` of each pair's expert in the view, int64 `[T, K]` (1 at padding)."""
    return view.logcnt[layer][topk_ids.long().clamp(min=0)]


def _rows(topk_ids: torch.Tensor) -> torch.Tensor:
    """Row index of each pair, int64 `[T, 1]`."""
    return torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)


def row_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`row % n_e`: rank-invariant, but blind to which rows an expert appears on."""
    n = candidate_counts(topk_ids, view, ctx.layer)
    return replica_slots(topk_ids, view, ctx.layer, _rows(topk_ids) % n)


def unmapped_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """The logical id used as the physical slot (a model path that passes no map to top-k:
    sglang #18213, #39580): the right expert while the placement is the trivial one (slot `e`
    holds expert `e`), another expert's slot after a rebalance moves them."""
    return topk_ids.to(torch.int64, copy=True)


def unmapped_table(view: View, ctx: DispatchContext) -> torch.Tensor:
    """`unmapped`'s choice as a table: expert `e` to slot `e`, int64 `[L, E]`."""
    L, E = view.logcnt.shape
    return torch.arange(E, device=view.logcnt.device).expand(L, E).clone()


def flat_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`(row * K + k) % n_e`: the flat pair position; ties the replica to the top-k slot."""
    n = candidate_counts(topk_ids, view, ctx.layer)
    K = topk_ids.shape[1]
    k = torch.arange(K, device=topk_ids.device).unsqueeze(0)
    return replica_slots(topk_ids, view, ctx.layer, (_rows(topk_ids) * K + k) % n)


def hash_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`((row * 2654435769) mod 2**32) % n_e`: equals `row % n_e` for n_e in {2, 4, 8}."""
    n = candidate_counts(topk_ids, view, ctx.layer)
    hashed = (_rows(topk_ids) * HASH_MULTIPLIER) % (1 << 32)
    return replica_slots(topk_ids, view, ctx.layer, hashed % n)


def layer_draws(ctx: DispatchContext, num_pairs: int, num_layers: int,
                device: torch.device | str) -> torch.Tensor:
    """random's draws for layers `ctx.layer .. ctx.layer + num_layers - 1` of a step, int64
    `[num_layers, T*K]` in `[0, 65536)`, one per pair of each layer's batch: the stream's
    (`Stream.draws`), else one `randint(0, 65536)` batch a layer from `ctx.generator`, in layer
    order."""
    if ctx.draws_streamed:
        return ctx.stream.draws(num_pairs, ctx.layer, device, num_layers)
    generator = torch_generator(ctx.generator, None, ctx.layer, device, "random")
    out = torch.empty(num_layers, num_pairs, dtype=torch.int64, device=device)
    for layer in range(num_layers):
        out[layer] = torch.randint(0, RANDOM_RANGE, (num_pairs,), generator=generator,
                                   device=device)
    return out


def random_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`draw % n_e`, one draw in `[0, 65536)` per pair of `[T, K]` (`layer_draws`).

    Draws are taken for the whole flattened batch, padding and single-replica experts included,
    as the serving engine does (with a generator, it advances by `T * K` draws per call).
    """
    draws = layer_draws(ctx, topk_ids.numel(), 1, topk_ids.device).view(topk_ids.shape)
    n = candidate_counts(topk_ids, view, ctx.layer)
    return replica_slots(topk_ids, view, ctx.layer, draws % n)


def trtllm_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """TensorRT-LLM's route kernel: the flattened pairs (row-major over `[T, K]`) in blocks of
    `TRTLLM_BLOCK`; a pair's replica is `(ord + block index + offset) % n_e`, `ord` the earlier
    pairs of its expert within its block, `offset` the rank when `ctx.rank_offset` is True (the
    kernel's `offset_by_ep_rank`, on under attention DP) in either mode, else 0."""
    T, K = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    block = torch.arange(flat.numel(), device=flat.device) // TRTLLM_BLOCK
    keyed = torch.where(flat >= 0, block * view.logcnt.shape[1] + flat, -1)
    ordinal = occurrence_index(keyed.view(T, K))
    offset = ctx.rank if ctx.rank_offset is True else 0
    n = candidate_counts(topk_ids, view, ctx.layer)
    return replica_slots(topk_ids, view, ctx.layer, (ordinal + block.view(T, K) + offset) % n)


def ascend_replicas(logcnt: torch.Tensor, ctx: DispatchContext, fixed: bool) -> torch.Tensor:
    """vllm-ascend's replica of every expert for the rank, int64 like `logcnt [..., E]` (each
    expert's candidates): `ep_rank % n_e`, or with `fixed` and `ctx.tp > 1` (their fix, applied
    only then) `(tp_rank + dp_rank + e) % n_e` with `tp_rank = r % tp`, `dp_rank = r // tp`."""
    r = ctx.rank
    if fixed and ctx.tp > 1:
        expert = torch.arange(logcnt.shape[-1], device=logcnt.device)
        return torch.remainder(r % ctx.tp + r // ctx.tp + expert, logcnt)
    return torch.remainder(torch.full_like(logcnt, r), logcnt)


def _ascend(topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
            fixed: bool) -> torch.Tensor:
    """Every pair of `topk_ids [T, K]` to its expert's `ascend_replicas` replica."""
    replica = ascend_replicas(view.logcnt[ctx.layer], ctx, fixed)[topk_ids.long().clamp(min=0)]
    return replica_slots(topk_ids, view, ctx.layer, replica)


def ascend_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """vllm-ascend's static choice: every pair of expert `e` goes to replica `ep_rank % n_e`
    (rank-variant in "none" mode: each rank sends an expert's pairs to its own replica)."""
    return _ascend(topk_ids, view, ctx, False)


def ascend_fixed_policy(topk_ids: torch.Tensor, view: View,
                        ctx: DispatchContext) -> torch.Tensor:
    """vllm-ascend's fix: with attention TP (`ctx.tp > 1`) every pair of expert `e` goes to
    replica `(tp_rank + dp_rank + e) % n_e`, spreading one rank's experts over their replicas;
    at TP 1 the old `ep_rank % n_e`. Rank-variant in "none" mode either way."""
    return _ascend(topk_ids, view, ctx, True)


def occurrence_index(topk_ids: torch.Tensor) -> torch.Tensor:
    """How many earlier pairs (row-major over `[T, K]`) carry the same id, int64 `[T, K]`."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    ordered = flat[order]
    n = flat.numel()
    position = torch.arange(n, device=flat.device)
    new_run = torch.ones(n, dtype=torch.bool, device=flat.device)
    new_run[1:] = ordered[1:] != ordered[:-1]
    run_start = torch.cummax(torch.where(new_run, position, 0), 0).values
    occ = torch.empty_like(flat)
    occ[order] = position - run_start
    return occ.view(topk_ids.shape)


def ordinal_offset(ctx: DispatchContext) -> int:
    """Start offset of ordinal: step + layer, so leftover pairs rotate over the replicas from
    step to step; plus the rank in "a2a" mode unless `ctx.rank_offset` is False (each rank's
    share then starts where the others' do not, which on small per-rank batches balances
    better: benchmarks/history/2026-12.md)."""
    offset = ctx.step + ctx.layer
    if ctx.mode == "a2a" and ctx.rank_offset is not False:
        offset += ctx.rank
    return offset


def layer_offsets(ctx: DispatchContext, num_layers: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """ordinal's offset of every layer of a step, int64 `[L]` on `device`: the offset of layer
    `ctx.layer` plus each layer's distance from it (made there, not copied from the host)."""
    first = ordinal_offset(ctx)
    return torch.arange(first, first + num_layers, dtype=torch.int64, device=device)


def ordinal_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`(occurrence index of e in the batch + offset) % n_e`: each expert's pairs split over its
    replicas to within one pair per batch, identically on every rank that sees the batch."""
    n = candidate_counts(topk_ids, view, ctx.layer)
    replica = (occurrence_index(topk_ids) + ordinal_offset(ctx)) % n
    return replica_slots(topk_ids, view, ctx.layer, replica)


def colocate_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """Locality without rank variance: each pair takes, among its expert's candidates, the
    first one on a GPU the token already sends an earlier top-k pair to (earlier pairs in
    slot order), else the candidate `ordinal` would take. A pure function of the token's own
    ids, the view and the batch, so ranks with equal views choose alike: what SGLang's
    per-rank narrowing to a local replica aims at (fewer destinations a token), the
    rank-invariant way (DESIGN.md §13)."""
    slots = ordinal_policy(topk_ids, view, ctx)  # [T, K] the fallback
    T, K = topk_ids.shape
    if K < 2 or T == 0:
        return slots
    slot_gpu = view.placement.slot_gpu.to(topk_ids.device)  # [P]
    cands = view.log2phy[ctx.layer][topk_ids.long().clamp(min=0)]  # [T, K, R], -1 padded
    cand_gpu = torch.where(cands >= 0, slot_gpu[cands.clamp(min=0)], -1)  # [T, K, R]
    valid = topk_ids >= 0
    for k in range(1, K):
        gpu = torch.where(valid[:, :k], slot_gpu[slots[:, :k].clamp(min=0)], -2)  # [T, k]
        hit = cand_gpu[:, k, None, :] == gpu[:, :, None]  # [T, k, R]: earlier pair j, candidate r
        found = hit.any(-1)  # [T, k]
        first_j = torch.argmax(found.to(torch.int8), dim=1)  # [T] the earliest pair matched
        row = hit[torch.arange(T, device=hit.device), first_j]  # [T, R]
        pick = cands[:, k].gather(1, torch.argmax(row.to(torch.int8), dim=1, keepdim=True))
        take = found.any(1) & valid[:, k]
        slots[:, k] = torch.where(take, pick.squeeze(1), slots[:, k])
    return slots


STATIC_SEED = 42  # SGLang seeds its tables' random.Random with 42


@lru_cache(maxsize=64)
def _static_tables(log2phy: torch.Tensor, placement: Placement, seed: int) -> np.ndarray:
    """Every rank's `static` table built from one view's candidate lists `log2phy [L, E, R]`
    (in the view's order, -1 padded), int64 `[G, L, E]` (keyed by the view's tensor: ranks
    sharing a view share the work). SGLang's construction: per (layer, expert) in order, each
    rank takes its nearest candidate (the only one; else the first on its GPU; else the first
    on its node when the node holds some but not all candidates); the ranks left over, in rank
    order, take `fair_choices` of the candidates from one `random.Random(42 + seed)` that runs
    through all layers and experts."""
    cands = log2phy.cpu().long().numpy()
    valid = cands >= 0
    safe = np.where(valid, cands, 0)
    G = placement.topology.num_gpus
    gpu = placement.slot_gpu.numpy()[safe]  # [L, E, R]
    node = placement.slot_node.numpy()[safe]
    ranks = np.arange(G)
    rank_node = np.array([placement.topology.node_of_gpu(r) for r in ranks])
    cnt = valid.sum(-1)  # [L, E]
    on_gpu = valid[..., None] & (gpu[..., None] == ranks)  # [L, E, R, G]
    on_node = valid[..., None] & (node[..., None] == rank_node)
    same_node = on_node.sum(2)  # [L, E, G]
    gpu_first = _first(cands, on_gpu)  # [L, E, G], -1 where none
    node_first = np.where((same_node > 0) & (same_node < cnt[..., None]),
                          _first(cands, on_node), -1)
    table = np.where(gpu_first >= 0, gpu_first, node_first)
    table = np.where((cnt == 1)[..., None], cands[..., :1], table)  # [L, E, G]
    draw = random.Random(STATIC_SEED + seed)
    for layer, e in zip(*np.nonzero((table < 0).any(-1) & (cnt > 0))):  # a lost expert: -1
        left = np.nonzero(table[layer, e] < 0)[0]
        table[layer, e, left] = fair_choices(cands[layer, e, :cnt[layer, e]].tolist(),
                                             len(left), draw)
    return np.ascontiguousarray(table.transpose(2, 0, 1))


def _first(cands: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The first candidate of `cands [L, E, R]` where `mask [L, E, R, G]`, -1 where none:
    `[L, E, G]`."""
    first = np.take_along_axis(cands[..., None], mask.argmax(2)[:, :, None, :], 2)[:, :, 0, :]
    return np.where(mask.any(2), first, -1)


def fair_choices(candidates: list[int], k: int, draw: random.Random) -> list[int]:
    """`k` picks from `candidates`, each taken `k // n` times plus a sample without
    replacement for the rest, shuffled by `draw` (the picks differ in count by at most one)."""
    whole, rest = divmod(k, len(candidates))
    picks = candidates * whole + draw.sample(candidates, k=rest)
    draw.shuffle(picks)
    return picks


def static_table(view: View, rank: int, seed: int) -> torch.Tensor:
    """The fixed expert -> slot table of `rank`, int64 `[L, E]`, built from its view as SGLang
    builds it (`_static_tables`; equal to SGLang 0.5.23's at seed 0, `eplbsim engines
    conform`)."""
    return _static_tables_on(view.log2phy, view.placement, seed)[rank]


@lru_cache(maxsize=64)
def _static_tables_on(log2phy: torch.Tensor, placement: Placement, seed: int) -> torch.Tensor:
    """`_static_tables` as int64 `[G, L, E]` on `log2phy`'s device, copied there once per
    view (a copy a call would cost more than the gather it serves)."""
    return torch.from_numpy(_static_tables(log2phy, placement, seed)).to(log2phy.device)


def static_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """Each rank's own fixed table expert -> one replica (rank-variant by construction)."""
    table = static_table(view, ctx.rank, ctx.seed)[ctx.layer]  # [E]
    ids = topk_ids.long()
    return torch.where(ids >= 0, table[ids.clamp(min=0)], -1)


def batch_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert in the batch, int64 `[E]` on the CPU (padding not counted):
    what every rank knows after an all-reduce of its counts in "none" mode."""
    ids = topk_ids.reshape(-1).long()
    return torch.bincount(ids[ids >= 0], minlength=num_experts).cpu()


def _lp_inputs(topk_ids: torch.Tensor, view: View, layer: int) -> tuple:
    """`(counts [E], log2phy [E, R], logcnt [E], slot_gpu [P], G)` of one layer, on the CPU."""
    placement = view.placement
    return (batch_counts(topk_ids, view.logcnt.shape[1]), view.log2phy[layer].cpu(),
            view.logcnt[layer].cpu(), placement.slot_gpu, placement.topology.num_gpus)


def lp_fractions(topk_ids: torch.Tensor, view: View, layer: int) -> torch.Tensor:
    """The batch's LP-optimal replica fractions of every expert, float64 `[E, R]` on the ids'
    device (`batch_lp.optimal_fractions`, solved on the CPU from the batch's counts)."""
    return batch_lp.optimal_fractions(*_lp_inputs(topk_ids, view, layer)).to(topk_ids.device)


def lp_quotas(topk_ids: torch.Tensor, view: View, layer: int) -> torch.Tensor:
    """The batch's optimal integer quotas per replica, int64 `[E, R]` on the ids' device
    (`batch_lp.optimal_quotas`: max GPU load = ceil of the LP optimum, the best possible)."""
    return batch_lp.optimal_quotas(*_lp_inputs(topk_ids, view, layer)).to(topk_ids.device)


def lp_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """Sample each pair's replica from the batch's LP-optimal fractions (`lp_fractions`) with
    the rank's generator: one `torch.rand` float64 draw per pair of the flattened `[T, K]`
    batch, padding included, so the generator advances by `T * K` draws per call.

    The pair takes candidate `j` with probability `fractions[e, j]` (candidates with fraction 0
    never). The expected split is load-optimal for the batch; the draws are the rank's own, so
    with independent generators ranks disagree (rank-variant, like the serving engine's).
    """
    generator = torch_generator(ctx.generator, ctx.stream, ctx.layer, topk_ids.device, "lp")
    u = torch.rand(topk_ids.numel(), generator=generator, device=topk_ids.device,
                   dtype=torch.float64).view(topk_ids.shape)
    return _lp_pick(topk_ids, view, ctx.layer, u)


def lp_golden_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """`lp_policy` with the draw of pair `i` (its flat position `row K + k` in the batch) taken
    as `frac(i x 0.6180339887...)` (the golden-ratio sequence) instead of the rank's generator:
    the same fractions and the same draws on every rank that sees the batch (rank-invariant),
    and the draws spread evenly over [0, 1)."""
    i = torch.arange(topk_ids.numel(), device=topk_ids.device, dtype=torch.float64)
    u = torch.remainder(i * GOLDEN, 1.0).view(topk_ids.shape)
    return _lp_pick(topk_ids, view, ctx.layer, u)


def _lp_pick(topk_ids: torch.Tensor, view: View, layer: int, u: torch.Tensor) -> torch.Tensor:
    """Each pair's candidate from the batch's LP fractions and its draw `u [T, K]` in [0, 1):
    the first candidate whose cumulative fraction exceeds `u`."""
    frac = lp_fractions(topk_ids, view, layer)  # [E, R]
    R = frac.shape[1]
    cum = frac.cumsum(-1)
    index = torch.arange(R, device=frac.device)
    # the last candidate with a positive fraction closes the interval at 1 (float cumsums may
    # stop just short of it)
    last = R - 1 - torch.argmax(torch.flip(frac > 0, [-1]).to(torch.int8), -1, keepdim=True)
    cum = torch.where(index >= last, 2.0, cum)
    expert = topk_ids.long().clamp(min=0)
    replica = (u.unsqueeze(-1) >= cum[expert]).sum(-1)  # [T, K]
    return replica_slots(topk_ids, view, layer, replica)


def lplb_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """DeepSeek LPLB's mapping, deterministic: the batch's LP fractions (`lp_fractions`; LPLB
    solves the same min-max LP per redundancy group) and, for the `k`-th occurrence of expert
    `e` (`occurrence_index`, flattened order) among its `total_e` pairs, the permuted position
    `k' = (499 k + 41) mod total_e`: candidate `j` takes the `k'` in
    `[floor(F_{j-1} total_e), floor(F_j total_e))`, `F_j` the cumulative fraction (the last
    candidate everything left). Rank-invariant: every rank with the batch counts alike."""
    return _lplb_map(topk_ids, view, ctx.layer, occurrence_index(topk_ids))


def lplb_atomic_policy(topk_ids: torch.Tensor, view: View,
                       ctx: DispatchContext) -> torch.Tensor:
    """`lplb_policy` with `k` as LPLB's reference kernel takes it: the rank's flattened batch is
    cut into `LPLB_BLOCKS` contiguous blocks, and within a block an atomic counter hands out the
    occurrences of an expert in an order the hardware picks, modelled by a permutation of each
    block's pairs from one float64 draw per pair of the rank's generator (rank-variant in
    "none" mode)."""
    generator = torch_generator(ctx.generator, ctx.stream, ctx.layer, topk_ids.device,
                                "lplb-atomic")
    T, K = topk_ids.shape
    n = topk_ids.numel()
    block = torch.arange(n, device=topk_ids.device) * LPLB_BLOCKS // max(n, 1)
    # block + a draw in [0, 1): sorting keeps the blocks in order and shuffles each one
    draw = torch.rand(n, generator=generator, device=topk_ids.device, dtype=torch.float64)
    order = torch.argsort(block + draw)  # the pairs in the order the counters serve them
    k = torch.empty(n, dtype=torch.int64, device=topk_ids.device)
    k[order] = occurrence_index(topk_ids.reshape(1, n)[:, order]).view(n)
    return _lplb_map(topk_ids, view, ctx.layer, k.view(T, K))


def _lplb_map(topk_ids: torch.Tensor, view: View, layer: int,
              k: torch.Tensor) -> torch.Tensor:
    """LPLB's permuted-ordinal choice (`lplb_policy`) given each pair's occurrence `k [T, K]`."""
    frac = lp_fractions(topk_ids, view, layer)  # [E, R]
    expert = topk_ids.long().clamp(min=0)
    total = torch.bincount(expert[topk_ids >= 0], minlength=frac.shape[0])  # [E]
    tot = total[expert].clamp(min=1)  # [T, K]
    permuted = (LPLB_MULTIPLIER * k + LPLB_INCREMENT) % tot
    bounds = torch.floor(frac.cumsum(-1)[expert] * tot.unsqueeze(-1))  # [T, K, R]
    n = candidate_counts(topk_ids, view, layer)
    replica = torch.minimum((permuted.unsqueeze(-1) >= bounds).sum(-1), n - 1)
    return replica_slots(topk_ids, view, layer, replica)


def quota_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """The batch's optimal integer quotas (`lp_quotas`) filled in occurrence order: the i-th
    occurrence of expert `e` (row-major over `[T, K]`, `occurrence_index`) goes to the
    candidate whose cumulative quota range `[q_0 + .. + q_{j-1}, q_0 + .. + q_j)` holds `i`.

    Load-optimal for the batch (max GPU load = ceil of the LP optimum) and rank-invariant: it
    reads the ids, the view (candidates, and its placement's slot -> GPU map) and `ctx.layer`,
    nothing of the rank, and the LP is deterministic.
    """
    quotas = lp_quotas(topk_ids, view, ctx.layer)  # [E, R]
    cum = quotas.cumsum(-1)
    expert = topk_ids.long().clamp(min=0)
    replica = (occurrence_index(topk_ids).unsqueeze(-1) >= cum[expert]).sum(-1)  # [T, K]
    return replica_slots(topk_ids, view, ctx.layer, replica)
