"""A spill policy's step (`dispatch.spill`, DESIGN.md §15): from the policy's choices to where
each pair runs, and what the GPUs fetch.

Dimensions: `T` tokens, `L` layers, `K` top-k, `P` physical slots, `G` GPUs = EP ranks, `E`
logical experts.

A pair's place is its slot (`< P`) or `P + g`: GPU `g` runs it with the expert's weights fetched
for the step (`Epoch.place_gpu`). "none": every rank plans from the counts of the whole batch
(the step's global routing, which every rank holds), so ranks with equal choices reach equal
places; the naive port (`SpillRule.local`) plans from the rank's own share of the batch instead.
"a2a": every rank's counts per slot are all-gathered (an all-reduce of `[G, L, P]` here, priced
as the all-gather it stands for, `cost.spill`), and each rank moves its own pairs by their
position among every rank's pairs on the slot; the naive port plans from its own pairs alone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import counting
from ..dispatch.spill import Applied
from .epoch import Epoch
from .traffic import share_bounds


def slot_counts(phys: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Valid pairs of `phys [T, L, K]` on each slot, int64 `[L, P]` (CPU; compiled)."""
    array = np.ascontiguousarray(phys.cpu().numpy(), np.int64)
    return torch.from_numpy(counting.slot_counts(array, num_slots)[0])


def _moves(epoch: Epoch, counts: torch.Tensor):
    """The epoch's spill rule's moves for `counts [L, P]`."""
    rule = epoch.policy.spill
    return rule.moves(counts.cpu().numpy(), epoch.site, slack=epoch.spill_slack)


def none_places(epoch: Epoch, i: int, phys: torch.Tensor, topk_ids: torch.Tensor) -> Applied:
    """"none": where held rank `i`'s copy of the step runs each pair of its choices `phys [T,
    L, K]` for `topk_ids [T, L, K]`, with the pairs at each place and the experts fetched, as
    if every pair ran (`dispatch.spill.Applied`; module doc)."""
    P = epoch.placement.num_slots
    counts = slot_counts(phys, P)
    if not epoch.policy.spill.local:
        return _moves(epoch, counts).apply(phys, topk_ids, epoch.site)
    bounds = share_bounds(phys.shape[0], epoch.num_ranks)  # its own share, times the ranks
    rank = epoch.ranks[i].rank
    own = slot_counts(phys[int(bounds[rank]):int(bounds[rank + 1])], P) * epoch.num_ranks
    return _moves(epoch, own).apply(phys, topk_ids, epoch.site, counts=counts.numpy())


def a2a_places(epoch: Epoch, phys: torch.Tensor, topk_ids: torch.Tensor,
               rows: Sequence[torch.Tensor]) -> Applied:
    """"a2a": where each held rank's pairs (`phys [T, L, K]`, its rows `rows[i]`, of experts
    `topk_ids [T, L, K]`) run, -1 elsewhere, with the held ranks' pairs at each place and the
    experts fetched (`dispatch.spill.Applied`; module doc). Held ranks whose rows follow one
    another in rank order are placed in one pass, as one part counted at the first of them."""
    P, G = epoch.placement.num_slots, epoch.num_ranks
    parts = [_as_slice(own) for own in rows]
    ranks = [rank.rank for rank in epoch.ranks]
    block = None if epoch.policy.spill.local else _one_block(parts, ranks)
    if block is not None:
        parts, ranks = [block], ranks[:1]
    own_counts = [slot_counts(phys[own], P) for own in parts]  # [L, P] each
    if epoch.policy.spill.local:  # each rank's plan is made from its own counts
        moves = [_moves(epoch, counts) for counts in own_counts]
        earlier = [None] * len(parts)
    else:
        per_rank = torch.zeros(G, phys.shape[1], P, dtype=torch.int64, device=phys.device)
        for rank, counts in zip(ranks, own_counts):
            per_rank[rank] = counts
        per_rank = epoch.comm.all_reduce(per_rank)  # every rank's counts: the all-gather
        moves = [_moves(epoch, per_rank.sum(0))] * len(parts)
        every = per_rank.cumsum(0) - per_rank  # [G, L, P] pairs of lower ranks on each slot
        earlier = [every[rank] for rank in ranks]
    if block == slice(0, phys.shape[0]):  # every row: the places are the whole tensor
        return moves[0].apply(phys, topk_ids, epoch.site, earlier[0], own_counts[0].numpy())
    run = torch.full_like(phys, -1)
    counts, marks = None, None
    for own, plan, before, here in zip(parts, moves, earlier, own_counts):
        applied = plan.apply(phys[own], topk_ids[own], epoch.site, before, here.numpy())
        run[own] = applied.run  # a view of `phys` when moved in place: copied here
        counts = applied.counts if counts is None else counts + applied.counts
        marks = applied.marks if marks is None else marks | applied.marks
    return Applied(run, counts, marks)


def _one_block(rows: Sequence[torch.Tensor | slice], ranks: Sequence[int]) -> slice | None:
    """The rows of consecutive `ranks`, each's rows a slice right after the last's, as one
    slice: a pair's position among every rank's pairs on its slot is then its position in
    these rows (plus the earlier ranks'); None otherwise."""
    if not all(isinstance(own, slice) for own in rows):
        return None
    if any(b != a + 1 for a, b in zip(ranks, ranks[1:])) or any(
            nxt.start != own.stop for own, nxt in zip(rows, rows[1:])):
        return None
    return slice(rows[0].start, rows[-1].stop)


def _as_slice(rows: torch.Tensor) -> torch.Tensor | slice:
    """`rows [n]` (ascending indices) as a slice when they are contiguous (a view, no copy)."""
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def fetch_marks(epoch: Epoch, topk_ids: torch.Tensor, run: torch.Tensor,
                executed: torch.Tensor) -> torch.Tensor:
    """The experts each GPU runs with fetched weights, bool `[L, G, E]`, of the pairs
    `topk_ids [T, L, K]` run at `run [T, L, K]` where `executed [T, L, K]`."""
    P, G, E = epoch.placement.num_slots, epoch.num_ranks, epoch.placement.num_experts
    L = run.shape[1]
    fetched = executed & (run >= P)
    _, layer, _ = fetched.nonzero(as_tuple=True)  # the few fetched pairs
    key = (layer * G + run[fetched] - P) * E + topk_ids[fetched].long()
    marks = torch.zeros(L * G * E, dtype=torch.bool, device=run.device)
    marks[key] = True
    return marks.view(L, G, E)


def fetched_counts(epoch: Epoch, marks: torch.Tensor) -> torch.Tensor:
    """Distinct experts each GPU fetched, within its node and across nodes, int64 `[L, G, 2]`,
    from the group's `marks [L, G, E]` (`fetch_marks`, any process's summed): an expert comes
    over NVLink when a GPU of the fetching GPU's node holds a replica, else over RDMA."""
    near = torch.from_numpy(epoch.site.near_node).to(marks.device)  # [L, N, E]
    node = torch.from_numpy(epoch.site.node).to(marks.device)  # [G]
    near_gpu = near[:, node]  # [L, G, E]
    marks = marks > 0
    return torch.stack([(marks & near_gpu).sum(-1), (marks & ~near_gpu).sum(-1)], -1).cpu()


def split_places(counts: torch.Tensor, num_layers: int,
                 num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(slot_load [L, P], spilled [L, G])` of pairs counted per place, `counts [L * (P +
    G)]`: the pairs run on each slot, and with fetched weights on each GPU."""
    places = counts.view(num_layers, -1)
    return places[:, :num_slots], places[:, num_slots:]
