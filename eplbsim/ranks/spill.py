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


def none_places(epoch: Epoch, i: int, phys: torch.Tensor) -> torch.Tensor:
    """"none": where held rank `i`'s copy of the step runs each pair of its choices `phys [T,
    L, K]`, int64 `[T, L, K]` (module doc)."""
    P = epoch.placement.num_slots
    counts = slot_counts(phys, P)
    if epoch.policy.spill.local:  # its own share of the batch, times the ranks
        bounds = share_bounds(phys.shape[0], epoch.num_ranks)
        rank = epoch.ranks[i].rank
        counts = slot_counts(phys[int(bounds[rank]):int(bounds[rank + 1])], P) * epoch.num_ranks
    return _moves(epoch, counts).apply(phys, P)


def a2a_places(epoch: Epoch, phys: torch.Tensor, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """"a2a": where each held rank's pairs (`phys [T, L, K]`, its rows `rows[i]`) run, int64
    `[T, L, K]` (module doc)."""
    P, G = epoch.placement.num_slots, epoch.num_ranks
    run = phys.clone()
    own_counts = [slot_counts(phys[own], P) for own in rows]  # [L, P] each
    if epoch.policy.spill.local:
        for own, counts in zip(rows, own_counts):
            run[own] = _moves(epoch, counts).apply(phys[own], P)
        return run
    per_rank = torch.zeros(G, phys.shape[1], P, dtype=torch.int64, device=phys.device)
    for rank, counts in zip(epoch.ranks, own_counts):
        per_rank[rank.rank] = counts
    per_rank = epoch.comm.all_reduce(per_rank)  # every rank's counts: the all-gather
    moves = _moves(epoch, per_rank.sum(0))
    earlier = per_rank.cumsum(0) - per_rank  # [G, L, P] pairs of lower ranks on each slot
    for rank, own in zip(epoch.ranks, rows):
        run[own] = moves.apply(phys[own], P, earlier[rank.rank])
    return run


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
