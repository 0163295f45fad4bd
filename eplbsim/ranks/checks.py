"""Checkers for a dispatch policy before it ships: its contract, and its rank invariance.

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts, `P` physical slots,
`G` ranks = GPUs.

A policy written in a notebook is a plain function `(topk_ids [T, K], view, ctx) -> phys
[T, K]` (DESIGN.md §3). `check_policy` runs it as every rank would and raises InputError at the
first broken promise; `rank_invariance` measures whether every rank would choose the same slot
for every pair, which "none" mode needs (DESIGN.md §1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..base.errors import InputError
from ..base.registry import lookup
from ..dispatch import Policy, resolve_policy
from ..dispatch.observe import Probe, probed_groups
from ..placement import Placement, rank_view
from ..placement.topology import Topology
from . import MODES, Epoch, make_ranks, rank_context, rank_groups


def _as_step(topk_ids: torch.Tensor) -> torch.Tensor:
    """`[T, K]` (one layer) or `[T, L, K]` ids as `[T, L, K]`."""
    ids = torch.as_tensor(topk_ids)
    if ids.dim() == 2:
        ids = ids.unsqueeze(1)
    if ids.dim() != 3 or ids.is_floating_point():
        raise InputError(f"topk_ids must be integer [tokens, top_k] or [tokens, layers, top_k], "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    return ids


def _rank_inputs(policy: str | Policy, placement: Placement, view: str, rng: str, seed: int,
                 step: int, mode: str, sources: Any = ()) -> tuple:
    """`(name, entry, ranks, views, contexts)`: every rank of `placement`'s topology with its
    own view and its context at `step`."""
    name, entry = resolve_policy(policy, sources)
    ranks = make_ranks(rng, seed, placement.topology.num_gpus)
    views = tuple(rank_view(view, placement, r.rank, mode) for r in ranks)
    contexts = [rank_context(step, r, mode, seed, None) for r in ranks]
    return name, entry, ranks, views, contexts


def rank_epoch(policy: str | Policy, placement: Placement, view: str, rng: str, seed: int,
               step: int, mode: str, top_k: int, sources: Any = ()) -> Epoch:
    """Every rank of `placement`'s topology, each with its own view and random stream, as one
    epoch keeping every rank's choices; its groups are the ranks that share one computation
    (`ranks.rank_groups`: declared invariant, or an engine's call probed to neither draw nor
    read its rank on equal inputs, at `step` with `top_k` ids a row)."""
    name, entry, ranks, views, contexts = _rank_inputs(policy, placement, view, rng, seed, step,
                                                       mode, sources)
    return Epoch(name=name, policy=entry, placement=placement, ranks=ranks, views=views,
                 groups=rank_groups(views, entry, None, contexts, top_k), num_ranks=len(ranks),
                 mode=mode, seed=seed, keep_choices=True)


def probe_placement(num_experts: int, num_slots: int, topology: Topology,
                    num_layers: int = 1) -> Placement:
    """A placement to observe an engine's calls on (`observed_sharing`): every expert once,
    then experts `0, 1, ...` (mod E) again in the `P - E` redundant slots, in every layer."""
    phy2log = torch.arange(num_slots).remainder(num_experts).expand(num_layers, num_slots)
    return Placement(phy2log.contiguous(), num_experts, topology)


def observed_calls(policy: str | Policy, placement: Placement, view: str, rng: str, seed: int,
                   top_k: int, sources: Any = ()) -> int:
    """The calls that serve `placement`'s ranks in "none": one a group of
    `ranks.rank_groups` (an engine's call shared by ranks of equal inputs when it draws
    nothing)."""
    return len(rank_epoch(policy, placement, view, rng, seed, 0, "none", top_k,
                          sources).groups)


def observed_sharing(policy: str | Policy, placement: Placement, view: str, rng: str,
                     seed: int, top_k: int, sources: Any = ()) -> str:
    """How an engine's calls serve the ranks in "none" (`dispatch.observe`), as the review page
    and `engines list` say it: "draws nothing and reads no rank, N call(s) serve its G ranks
    (one a group of equal inputs)" when ranks share calls, else why they do not ("reads its
    rank through torch.distributed.get_rank (FILE:LINE), one call a rank")."""
    _, entry, _, views, contexts = _rank_inputs(policy, placement, view, rng, seed, 0, "none",
                                                sources)
    G = placement.topology.num_gpus
    if entry.observed is None:
        calls = len(rank_groups(views, entry, None, contexts, top_k))
        seen = Probe()
    else:
        groups, seen = probed_groups(views, contexts, entry, top_k)
        calls = len(groups)
    if calls < G:
        return (f"draws nothing and reads no rank, {calls} call(s) serve its {G} ranks (one a "
                f"group of equal inputs)")
    return f"{seen.says() or 'every rank has inputs of its own'}, one call a rank"


def _rank_choices(policy: str | Policy, ids: torch.Tensor, placement: Placement, view: str,
                  rng: str, seed: int, steps: range, mode: str,
                  sources: Any = ()) -> torch.Tensor:
    """Every rank's choices for the same ids dispatched as each step of `steps` in turn, each
    rank with its own view and random stream, through the mode's rank step: int64
    `[len(steps), G, T, L, K]` (-1 outside a rank's own rows in "a2a")."""
    if ids.shape[1] != placement.num_layers:
        raise InputError(f"topk_ids have {ids.shape[1]} layers; the placement has "
                         f"{placement.num_layers}")
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= placement.num_experts):
        raise InputError(f"topk_ids hold ids outside [-1, {placement.num_experts})")
    epoch = rank_epoch(policy, placement, view, rng, seed, steps.start, mode, ids.shape[2],
                       sources)
    step_fn = lookup(MODES, mode, "mode")
    return torch.stack([step_fn(epoch, step, ids).choices for step in steps])


def check_policy(policy: str | Policy, topk_ids: torch.Tensor, placement: Placement, *,
                 view: str = "full", seed: int = 0, steps: int = 2, mode: str = "none") -> None:
    """Run `policy` on `topk_ids` (`[T, K]` for a one-layer placement, or `[T, L, K]`) as every
    rank of `placement`'s topology would, for `steps` consecutive steps, and raise InputError
    at the first broken promise: not an integer `[T, K]` result, a slot that does not hold the
    routed expert, anything but -1 at padding, an exception, or a modified input. Returns None
    when the policy keeps its contract."""
    _rank_choices(policy, _as_step(topk_ids), placement, view, "independent", seed,
                  range(steps), mode)


@dataclass(frozen=True)
class RankInvariance:
    """Whether every rank chose the same slot for every (token, layer, top-k slot) pair.

    agreement: fraction of non-padding pairs on which all ranks agree (1.0 when none exist)
    invariant: agreement == 1
    first:     the first disagreeing pair `(token, layer, k)` and every rank's slot for it, or
               None
    """

    agreement: float
    invariant: bool
    first: tuple[tuple[int, int, int], tuple[int, ...]] | None


def rank_invariance(policy: str | Policy, topk_ids: torch.Tensor, placement: Placement, *,
                    view: str = "full", rng: str = "independent", seed: int = 0,
                    step: int = 0, sources: Any = ()) -> RankInvariance:
    """Dispatch one step of `topk_ids` (`[T, K]` or `[T, L, K]`) on every rank of `placement`'s
    topology, each with its own view (a `VIEWS` name) and random stream (related as `rng`), in
    "none" mode, and compare the choices. A rank-invariant policy agrees everywhere whatever
    the ranks' streams; InputError if it breaks its contract (`check_policy`). `sources`
    names the engine sources an engine policy runs from."""
    ids = _as_step(topk_ids)
    choices = _rank_choices(policy, ids, placement, view, rng, seed, range(step, step + 1),
                            "none", sources)[0]
    valid = ids >= 0
    agree = (choices == choices[0]).all(0) & valid  # [T, L, K]
    total = int(valid.sum())
    agreement = int(agree.sum()) / total if total else 1.0
    wrong = (valid & ~agree).nonzero()
    first = None
    if len(wrong):
        t, lay, k = wrong[0].tolist()
        first = ((t, lay, k), tuple(int(c[t, lay, k]) for c in choices))
    return RankInvariance(agreement, first is None, first)
