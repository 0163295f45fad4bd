"""The rank model: how `G` EP ranks dispatch a batch, and what each GPU then executes.

Dimensions: `T` tokens, `K` top-k, `P` physical slots, `G` GPUs = EP ranks.

- "none" mode: every rank dispatches all `T` tokens with its own view and context; rank `r`
  executes the pairs whose chosen slot lives on GPU `r`. Pair `(t, k)` is executed
  `c = #{r : gpu(choice_r) == r}` times; the output is right only if `c == 1` everywhere.
- "a2a" mode: each token belongs to one source rank, which alone dispatches it; `c == 1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .dispatch.policies import RANK_INDEPENDENT, DispatchContext, Policy
from .errors import InputError
from .dispatch.kernels import dispatch_step
from .placement import Placement, View
from .registry import name_of

MODES = ("none", "a2a")
RNG_RELATIONS = ("independent", "shared", "drift")


@dataclass(frozen=True)
class RankGenerators:
    """Each rank's random generator, and for "drift" the separate coin that decides, before
    each step, whether the rank consumes one extra batch of draws."""

    generators: tuple[torch.Generator, ...]
    coins: tuple[torch.Generator, ...] | None = None
    drift_p: float = 0.0


def _seed(*parts: int) -> int:
    """A 32-bit seed derived from integers (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def make_rank_generators(relation: str, seed: int, num_ranks: int,
                         device: torch.device | str = "cpu", drift_p: float = 0.05,
                         ranks: Sequence[int] | None = None) -> RankGenerators:
    """Generators for `num_ranks` ranks related as `independent` (rank `r` seeded from
    `(seed, r)`), `shared` (all seeded from `seed`) or `drift` (as shared, plus coins).
    `ranks` (default all) picks whose to make: a real rank makes only its own, and gets the
    same generator as the simulation's rank of that id."""
    if relation not in RNG_RELATIONS:
        raise InputError(f"unknown rng relation {relation!r}; choose one of "
                         f"{', '.join(RNG_RELATIONS)}")
    if not 0.0 <= drift_p <= 1.0:
        raise InputError(f"drift_p must lie in [0, 1], got {drift_p}")
    ranks = range(num_ranks) if ranks is None else ranks
    seeds = [_seed(seed, r) if relation == "independent" else _seed(seed) for r in ranks]
    gens = tuple(torch.Generator(device=device).manual_seed(s) for s in seeds)
    if relation != "drift":
        return RankGenerators(gens)
    coins = tuple(torch.Generator().manual_seed(_seed(seed, r, 1)) for r in ranks)
    return RankGenerators(gens, coins, drift_p)


def drift_before_step(gens: RankGenerators, draws_per_rank: Sequence[int]) -> list[bool]:
    """For "drift": each rank flips its coin and, on heads, consumes `draws_per_rank[r]` extra
    draws (one batch), as when only some ranks sample. Returns which ranks drifted."""
    if gens.coins is None:
        return [False] * len(gens.generators)
    drifted = []
    for gen, coin, n in zip(gens.generators, gens.coins, draws_per_rank):
        hit = bool(torch.rand(1, generator=coin) < gens.drift_p)
        if hit:
            torch.randint(0, 65536, (n,), generator=gen, device=gen.device)
        drifted.append(hit)
    return drifted


@dataclass(frozen=True)
class StepOutcome:
    """What the GPUs executed for one step, every layer.

    slot_load:    int64 `[L, P]` pairs executed on each slot
    multiplicity: int64 `[T, L, K]` times each pair was executed (0 at padding)
    agreed:       int64 `[L]` pairs on which every rank chose the same slot (None in "a2a")
    valid:        int64 `[L]` non-padding pairs
    """

    slot_load: torch.Tensor
    multiplicity: torch.Tensor
    agreed: torch.Tensor | None
    valid: torch.Tensor


def check_choices(phys: torch.Tensor, topk_ids: torch.Tensor, placement: Placement,
                  policy: Policy) -> None:
    """InputError unless `phys [T, L, K]` holds, for every pair, a slot of its routed expert
    (and -1 exactly at padding): a wrong policy must not become a silently wrong number."""
    if phys.shape != topk_ids.shape or phys.dtype not in (torch.int32, torch.int64):
        raise InputError(f"policy {name_of(policy)} returned {phys.dtype} "
                         f"{tuple(phys.shape)}, expected integer slots {tuple(topk_ids.shape)}")
    ids = topk_ids.long()
    valid = ids >= 0
    P = placement.num_slots
    inside = (phys >= 0) & (phys < P)
    layer = torch.arange(ids.shape[1], device=ids.device).view(1, -1, 1)
    p2l = placement.phy2log.to(phys.device).reshape(-1)  # [L*P]
    held = p2l[layer * P + phys.long().clamp(0, P - 1)]
    bad = torch.where(valid, ~inside | (held != ids), phys != -1)
    if bool(bad.any()):
        t, lay, k = bad.nonzero()[0].tolist()
        raise InputError(f"policy {name_of(policy)} sent pair (token {t}, slot {k}) of "
                         f"expert {int(ids[t, lay, k])} in layer {lay} to slot "
                         f"{int(phys[t, lay, k])}, which does not hold that expert")


def rank_groups(views: Sequence[View], policy: Policy) -> list[list[int]]:
    """Ranks whose choices are provably identical, in rank order: for a policy in
    `RANK_INDEPENDENT` (its choice reads only the ids, the view, step and layer), ranks with
    equal views; every other policy (rank-variant, or an unknown callable) one rank a group."""
    if policy not in RANK_INDEPENDENT:
        return [[r] for r in range(len(views))]
    groups: list[list[int]] = []
    for r, view in enumerate(views):
        for group in groups:
            first = views[group[0]]
            if torch.equal(first.log2phy, view.log2phy) and torch.equal(first.logcnt,
                                                                        view.logcnt):
                group.append(r)
                break
        else:
            groups.append([r])
    return groups


def flat_index(index: torch.Tensor, width: int) -> torch.Tensor:
    """`layer * width + index` of every pair of `index [T, L, K]` (a slot, width `P`, or an
    expert, width `E`): one bincount then counts every layer at once."""
    layer = torch.arange(index.shape[1], device=index.device).view(1, -1, 1)
    return layer * width + index.long()


def execute_none(topk_ids: torch.Tensor, views: Sequence[View], policy: Policy,
                 contexts: Sequence[DispatchContext],
                 groups: Sequence[Sequence[int]]) -> StepOutcome:
    """"none" mode for one step `topk_ids [T, L, K]`: every rank dispatches every token with its
    own view and context, and rank `r` executes the pairs it chose onto GPU `r`.

    One computation serves each group of `groups` (ranks with provably identical choices);
    every rank of the group still counts on its own: a pair is executed by each member whose
    GPU holds the group's choice, and agreement compares every group's choices with rank 0's.
    """
    placement = views[0].placement
    G, P, L = len(views), placement.num_slots, topk_ids.shape[1]
    device = topk_ids.device
    valid = topk_ids >= 0
    slot_gpu = placement.slot_gpu.to(device)
    multiplicity = torch.zeros(topk_ids.shape, dtype=torch.int64, device=device)
    slot_load = torch.zeros(L * P, dtype=torch.int64, device=device)
    agree = valid.clone()
    first = None
    for group in groups:
        phys = dispatch_step(policy, topk_ids, views[group[0]], contexts[group[0]])
        check_choices(phys, topk_ids, placement, policy)
        member = torch.zeros(G, dtype=torch.bool, device=device)
        member[list(group)] = True
        executed = member[slot_gpu[phys.clamp(min=0)]] & valid  # [T, L, K]
        multiplicity += executed
        slot_load += torch.bincount(flat_index(phys, P)[executed], minlength=L * P)
        if first is None:
            first = phys
        else:
            agree &= phys == first
    return StepOutcome(slot_load.view(L, P).cpu(), multiplicity, agree.sum((0, 2)).cpu(),
                       valid.sum((0, 2)).cpu())


def token_owners(num_tokens: int, num_ranks: int,
                 src_rank: torch.Tensor | None = None) -> torch.Tensor:
    """Source rank of each token in "a2a", int64 `[T]`: the trace's `src_rank` when given, else
    contiguous shares differing by at most one, the first `T % G` ranks taking one more."""
    if src_rank is not None:
        if src_rank.numel() and int(src_rank.max()) >= num_ranks:
            raise InputError(f"the trace's src_rank names rank {int(src_rank.max())}, but there "
                             f"are only {num_ranks} GPUs")
        return src_rank.long()
    base, extra = divmod(num_tokens, num_ranks)
    sizes = torch.full((num_ranks,), base, dtype=torch.int64)
    sizes[:extra] += 1
    return torch.repeat_interleave(torch.arange(num_ranks), sizes)


def execute_a2a(topk_ids: torch.Tensor, owners: torch.Tensor, views: Sequence[View],
                policy: Policy, contexts: Sequence[DispatchContext]) -> StepOutcome:
    """"a2a" mode for one step `topk_ids [T, L, K]`: each rank dispatches only its own tokens
    (rows counted within its share); every non-padding pair is executed once."""
    placement = views[0].placement
    P, L = placement.num_slots, topk_ids.shape[1]
    phys = torch.full(topk_ids.shape, -1, dtype=torch.int64, device=topk_ids.device)
    owners = owners.to(topk_ids.device)
    for view, ctx in zip(views, contexts):
        rows = (owners == ctx.rank).nonzero().squeeze(1)
        own = topk_ids[rows]
        chosen = dispatch_step(policy, own, view, ctx)
        check_choices(chosen, own, placement, policy)
        phys[rows] = chosen.long()
    valid = topk_ids >= 0
    slot_load = torch.bincount(flat_index(phys, P)[valid], minlength=L * P)
    return StepOutcome(slot_load.view(L, P).cpu(), valid.long(), None,
                       valid.sum((0, 2)).cpu())
