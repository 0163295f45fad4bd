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

from .dispatch import DispatchContext, Policy
from .errors import InputError
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
                         device: torch.device | str = "cpu",
                         drift_p: float = 0.05) -> RankGenerators:
    """Generators for `num_ranks` ranks related as `independent` (rank `r` seeded from
    `(seed, r)`), `shared` (all seeded from `seed`) or `drift` (as shared, plus coins)."""
    if relation not in RNG_RELATIONS:
        raise InputError(f"unknown rng relation {relation!r}; choose one of "
                         f"{', '.join(RNG_RELATIONS)}")
    if not 0.0 <= drift_p <= 1.0:
        raise InputError(f"drift_p must lie in [0, 1], got {drift_p}")
    seeds = [_seed(seed, r) if relation == "independent" else _seed(seed)
             for r in range(num_ranks)]
    gens = tuple(torch.Generator(device=device).manual_seed(s) for s in seeds)
    if relation != "drift":
        return RankGenerators(gens)
    coins = tuple(torch.Generator().manual_seed(_seed(seed, r, 1)) for r in range(num_ranks))
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
class LayerOutcome:
    """What the GPUs executed for one (step, layer).

    slot_load:    int64 `[P]` pairs executed on each slot
    multiplicity: int64 `[T, K]` times each pair was executed (0 at padding)
    agreed:       pairs on which every rank chose the same slot (None in "a2a")
    valid:        non-padding pairs
    """

    slot_load: torch.Tensor
    multiplicity: torch.Tensor
    agreed: int | None
    valid: int


def check_choices(phys: torch.Tensor, topk_ids: torch.Tensor, placement: Placement,
                  layer: int, policy: Policy) -> None:
    """InputError unless `phys [T, K]` holds, for every pair, a slot of its routed expert
    (and -1 exactly at padding): a wrong policy must not become a silently wrong number."""
    if phys.shape != topk_ids.shape or phys.dtype not in (torch.int32, torch.int64):
        raise InputError(f"policy {name_of(policy)} returned {phys.dtype} "
                         f"{tuple(phys.shape)}, expected integer slots {tuple(topk_ids.shape)}")
    ids = topk_ids.long()
    valid = ids >= 0
    inside = (phys >= 0) & (phys < placement.num_slots)
    p2l = placement.phy2log[layer].to(phys.device)
    held = p2l[phys.long().clamp(0, placement.num_slots - 1)]
    bad = torch.where(valid, ~inside | (held != ids), phys != -1)
    if bool(bad.any()):
        t, k = bad.nonzero()[0].tolist()
        raise InputError(f"policy {name_of(policy)} sent pair (token {t}, slot {k}) of "
                         f"expert {int(ids[t, k])} in layer {layer} to slot {int(phys[t, k])}, "
                         f"which does not hold that expert")


def dispatch_none(topk_ids: torch.Tensor, views: Sequence[View], policy: Policy,
                  contexts: Sequence[DispatchContext]) -> torch.Tensor:
    """Every rank's choices for the whole batch: int64 `[G, T, K]`."""
    placement = views[0].placement
    out = []
    for view, ctx in zip(views, contexts):
        phys = policy(topk_ids, view, ctx)
        check_choices(phys, topk_ids, placement, ctx.layer, policy)
        out.append(phys.long())
    return torch.stack(out)


def execute_none(choices: torch.Tensor, topk_ids: torch.Tensor,
                 placement: Placement) -> LayerOutcome:
    """Rank `r` executes the pairs of `choices [G, T, K]` that it chose onto its own GPU."""
    G = choices.shape[0]
    valid = topk_ids >= 0
    slot_gpu = placement.slot_gpu.to(choices.device)
    ranks = torch.arange(G, device=choices.device).view(G, 1, 1)
    executed = (slot_gpu[choices.clamp(min=0)] == ranks) & valid  # [G, T, K]
    slot_load = torch.bincount(choices[executed], minlength=placement.num_slots)
    agreed = ((choices == choices[:1]).all(0) & valid).sum()
    return LayerOutcome(slot_load.cpu(), executed.sum(0), int(agreed), int(valid.sum()))


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


def dispatch_a2a(topk_ids: torch.Tensor, owners: torch.Tensor, views: Sequence[View],
                 policy: Policy, contexts: Sequence[DispatchContext]) -> torch.Tensor:
    """Each rank dispatches only its own tokens (rows counted within its share): `[T, K]`."""
    placement = views[0].placement
    phys = torch.full(topk_ids.shape, -1, dtype=torch.int64, device=topk_ids.device)
    owners = owners.to(topk_ids.device)
    for view, ctx in zip(views, contexts):
        rows = (owners == ctx.rank).nonzero().squeeze(1)
        own = topk_ids[rows]
        chosen = policy(own, view, ctx)
        check_choices(chosen, own, placement, ctx.layer, policy)
        phys[rows] = chosen.long()
    return phys


def execute_a2a(phys: torch.Tensor, topk_ids: torch.Tensor,
                placement: Placement) -> LayerOutcome:
    """Every non-padding pair is executed once, on the slot its owner chose."""
    valid = topk_ids >= 0
    slot_load = torch.bincount(phys[valid], minlength=placement.num_slots)
    return LayerOutcome(slot_load.cpu(), valid.long(), None, int(valid.sum()))
