"""Token spill (DESIGN.md §15): where a step's surplus pairs run with fetched weights.

Dimensions: `L` layers, `P` physical slots, `G` GPUs, `E` logical experts, `M` moves.

A spill policy first sends every pair where its base rule (`ordinal`) does; its `SpillRule`
then plans, for each layer from the pairs each slot received (`counts [L, P]`), moves of the
surplus: `Moves`, each "the pairs at positions `[start, stop)` of slot `p`'s pairs run at place
`target`". A place is a slot `< P` (a GPU that holds a replica of the expert runs the pairs on
it, reading its own weights) or `P + g`: GPU `g` runs them with the expert's weights fetched for
that step. A slot's pairs are ordered by their position (`Moves.apply`): the source rank, then the
row, then `k`; the home slot keeps the first ones, the moves take the rest in plan order.

Rules (each a function of the counts it is given: given the step's global counts, every rank
reaches the same moves):

- `moonep_moves` (`spill`): MoonEP's planner (Kimi K3's balancer), capacity `C =
  ceil(pairs x (1 + slack) / G)`: donors over `C` are matched with receivers under it, then each
  donor fills its quotas with its hottest slots first.
- `llep_moves` (`llep`): LLEP's least-loaded assignment (arXiv 2601.17111), slots hottest first,
  each GPU kept at `alpha x floor(pairs / G)` by spilling chunks of at least `min_chunk` pairs to
  the least-loaded GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..base.compiled import JIT, jit

MOONEP = ("MoonEP (MoonshotAI/MoonEP moonep/planning.py, read in the forks 0z5a/MoonEP @bf084e79 "
          "and zhumakhan/MoonEP tests/planning_reference.py @4818969e), its planner on the GPUs "
          "of ordinal's choices; where it differs: capacity ceil(pairs x (1 + slack) / G) "
          "instead of exactly S x K, a donor sends only its surplus (MoonEP fills the receiver "
          "and may overshoot), receivers on the donor's node first (MoonEP reads no topology), "
          "a receiver holding a replica runs the pairs on it (MoonEP has no replicas), the home "
          "slot keeps its first pairs (MoonEP hands them out by rank), every expert fetched "
          "(MoonEP's E/R prefetch slots hold all of them at its default)")
LLEP = ("LLEP (SalesforceAIResearch/LeastLoadedEP llep/gpt_oss_llep.py compute_llep_lpt_plan "
        "@11730c80; arXiv 2601.17111), its least-loaded assignment on the slots of ordinal's "
        "choices (each slot as one expert at home); its code's defaults alpha 1.1, "
        "min_tokens_per_gemm 1024, no threshold; where it differs: the helpers re-sorted after "
        "every chunk also when the home GPU has no room (LLEP sorts them once there), the "
        "home slot keeps its first pairs by source rank, then row")
MIN_CHUNK = 1024  # LLEP's min_tokens_per_gemm default
ALPHA = 1.1  # LLEP's max_tokens_factor default


@dataclass(frozen=True)
class Site:
    """What a spill plan reads of one placement.

    slot_gpu:    int64 `[P]` the GPU of each slot
    slot_expert: int64 `[L, P]` the expert each slot holds
    local_slot:  int64 `[L, G, E]` a slot of the expert on the GPU, -1 where it holds none
    node:        int64 `[G]` each GPU's node
    near_node:   bool `[L, N, E]` whether a GPU of the node holds a replica of the expert
    """

    slot_gpu: np.ndarray
    slot_expert: np.ndarray
    local_slot: np.ndarray
    node: np.ndarray
    near_node: np.ndarray

    @classmethod
    def of(cls, placement) -> "Site":
        """The site of a `Placement`."""
        slot_gpu = placement.slot_gpu.numpy().astype(np.int64)
        experts = placement.phy2log.numpy().astype(np.int64)
        L, P = experts.shape
        G, E = placement.topology.num_gpus, placement.num_experts
        local = np.full((L, G, E), -1, np.int64)
        for p in range(P - 1, -1, -1):  # the lowest slot of an expert on a GPU wins
            held = experts[:, p] >= 0
            local[np.nonzero(held)[0], slot_gpu[p], experts[held, p]] = p
        per_node = placement.topology.gpus_per_node
        node = np.arange(G) // per_node
        near = (local >= 0).reshape(L, G // per_node, per_node, E).any(2)
        return cls(slot_gpu, experts, local, node, near)

    @property
    def num_slots(self) -> int:
        return len(self.slot_gpu)

    def place(self, layer: int, slot: int, gpu: int) -> int:
        """Where GPU `gpu` runs pairs of slot `slot`'s expert: its own replica's slot, else
        `P + gpu` (fetched weights)."""
        own = self.local_slot[layer, gpu, self.slot_expert[layer, slot]]
        return int(own) if own >= 0 else self.num_slots + gpu


Move = tuple[int, int, int]  # (slot, pairs, place) of one layer


@jit(**JIT)
def _moonep_layer(counts, slot_gpu, node, local, expert, capacity, out):  # pragma: no cover
    """`moonep_moves` of one layer compiled: `counts [P]`, `slot_gpu [P]`, `node [G]`,
    `local [G, E]` (`Site.local_slot` of the layer), `expert [P]`; writes `(slot, pairs,
    place)` rows into `out [M, 3]` and returns how many."""
    G, P = node.shape[0], counts.shape[0]
    balance = np.zeros(G, np.int64)
    for p in range(P):
        balance[slot_gpu[p]] += counts[p]
    balance -= capacity
    q_donor = np.empty(2 * G + 1, np.int64)  # a quota zeroes its donor's surplus or the room
    q_receiver = np.empty(2 * G + 1, np.int64)
    q_amount = np.empty(2 * G + 1, np.int64)
    quotas = 0
    while True:
        donor = np.argmax(balance)
        if balance[donor] <= 0:
            break
        best = -1
        for g in range(G):
            if balance[g] >= 0:
                continue
            if best < 0:
                best = g
                continue
            far, far_best = node[g] != node[donor], node[best] != node[donor]
            if far < far_best or (far == far_best and balance[g] < balance[best]):
                best = g
        amount = min(balance[donor], -balance[best])
        balance[donor] -= amount
        balance[best] += amount
        q_donor[quotas], q_receiver[quotas], q_amount[quotas] = donor, best, amount
        quotas += 1
    left = counts.copy()
    moves = 0
    for donor in range(G):
        while True:
            quota = -1
            for q in range(quotas):
                if q_donor[q] == donor and q_amount[q] > 0 and (
                        quota < 0 or q_amount[q] > q_amount[quota]
                        or (q_amount[q] == q_amount[quota] and q_receiver[q] < q_receiver[quota])):
                    quota = q
            if quota < 0:
                break
            slot = -1
            for p in range(P):
                if slot_gpu[p] == donor and (slot < 0 or left[p] > left[slot]):
                    slot = p
            n = min(left[slot], q_amount[quota])
            receiver = q_receiver[quota]
            place = local[receiver, expert[slot]]
            out[moves, 0], out[moves, 1] = slot, n
            out[moves, 2] = place if place >= 0 else P + receiver
            moves += 1
            left[slot] -= n
            q_amount[quota] -= n
    return moves


def moonep_moves(counts: np.ndarray, site: Site, layer: int,
                 slack: float = 0.0) -> list[Move]:
    """MoonEP's plan for one layer (module doc) from the pairs each slot received `counts
    [P]`: donors are the GPUs over `C`; repeatedly the most loaded donor (lowest on ties) sends
    `min(its surplus, the room)` to the receiver under `C` on its node, else any, with the most
    room (ties: lowest GPU); then each donor in turn fills its quotas, the largest first (ties:
    lowest receiver), from its slot with the most pairs left (ties: lowest slot)."""
    G, P = len(site.node), len(counts)
    counts = np.ascontiguousarray(counts, np.int64)
    out = np.empty((2 * G + P + 1, 3), np.int64)
    n = _moonep_layer(counts, site.slot_gpu, site.node, site.local_slot[layer],
                      np.maximum(site.slot_expert[layer], 0), capacity(int(counts.sum()), G, slack),
                      out)
    return [tuple(row) for row in out[:n].tolist()]


def llep_moves(counts: np.ndarray, site: Site, layer: int, slack: float = 0.0,
               alpha: float = ALPHA, min_chunk: int = MIN_CHUNK,
               threshold: float | None = None) -> list[Move]:
    """LLEP's least-loaded assignment for one layer (module doc) from `counts [P]`: capacity
    `max(1, int(alpha x (1 + slack) x floor(pairs / G)))`; with `threshold`, no move when the GPUs' max over
    mean load is below it. Slots with pairs, most first (ties: lowest slot): the home GPU keeps
    what fits under capacity counting its slots not yet assigned; the rest goes in chunks to the
    other GPUs by least load (assigned plus pending; ties: lowest GPU), a chunk being the smaller
    of what is left and the GPU's room, taken when at least `min_chunk` or when it finishes the
    slot; what no GPU takes goes to the least-loaded other GPU."""
    G = len(site.node)
    load = np.bincount(site.slot_gpu, weights=counts, minlength=G).astype(np.int64)
    total = int(load.sum())
    if threshold is not None and total and load.max() * G < threshold * total:
        return []
    room = max(1, int(alpha * (1.0 + slack) * (total // G)))
    pending, assigned = load.copy(), np.zeros(G, np.int64)
    moves: list[Move] = []
    order = np.lexsort((np.arange(len(counts)), -counts))
    for slot in order[counts[order] > 0]:
        slot, n = int(slot), int(counts[slot])
        home = int(site.slot_gpu[slot])
        pending[home] -= n
        avail = room - (assigned[home] + pending[home])
        keep = int(min(max(avail, 0), n))
        assigned[home] += keep
        rest = n - keep
        while rest > 0 and G > 1:
            effective = assigned + pending
            helpers = sorted((g for g in range(G) if g != home), key=lambda g: (effective[g], g))
            chosen = None
            for g in helpers:
                chunk = min(rest, room - effective[g])
                if chunk > 0 and (chunk >= min_chunk or chunk == rest):
                    chosen = (g, int(chunk))
                    break
            if chosen is None:  # every GPU is full: the least loaded takes the rest
                chosen = (helpers[0], rest)
            g, chunk = chosen
            moves.append((slot, chunk, site.place(layer, slot, g)))
            assigned[g] += chunk
            rest -= chunk
        assigned[home] += rest  # only with one GPU
    return moves


PlanFn = Callable[[np.ndarray, Site, int], list[Move]]


@dataclass(frozen=True)
class SpillRule:
    """A spill policy's rule: `plan(counts [P], site, layer, slack, **options) -> moves` of one
    layer, `slack` the capacity above the plan's own (`--spill-slack`).

    local:   the naive port: in "none" each rank plans from its own share of the step's tokens
             (its counts times `G`, what it would estimate), in "a2a" from its own pairs alone
             (no all-gather): ranks then disagree in "none" (the seed's bug again)
    options: the plan's keyword options (`slack` for `moonep_moves`)
    """

    plan: PlanFn
    local: bool = False
    options: dict = field(default_factory=dict)

    def moves(self, counts: np.ndarray, site: Site, slack: float = 0.0) -> "Moves":
        """Every layer's moves from `counts [L, P]` (`Moves`): each slot's home keeps its
        first pairs, its moves take the next ones in plan order."""
        parts = []
        for layer in range(counts.shape[0]):
            plan = np.asarray(self.plan(counts[layer], site, layer, slack, **self.options),
                              np.int64).reshape(-1, 3)  # [m, 3] (slot, pairs, place)
            if not len(plan):
                continue
            slot, n = plan[:, 0], plan[:, 1]
            kept = counts[layer].astype(np.int64) - np.bincount(slot, n, len(counts[layer]))
            order = np.argsort(slot, kind="stable")
            before = np.zeros(len(plan), np.int64)  # pairs the slot's earlier moves take
            run = np.cumsum(n[order]) - n[order]
            first = np.searchsorted(slot[order], slot[order])  # each slot's first move
            before[order] = run - run[first]
            start = kept[slot] + before
            parts.append(np.stack([np.full(len(plan), layer), slot, start, start + n,
                                   plan[:, 2]], 1))
        return Moves.of(np.concatenate(parts) if parts else np.empty((0, 5), np.int64))


@dataclass(frozen=True)
class Moves:
    """Planned moves, int64 `[M]` each, sorted by (layer, slot, start): the pairs of `slot`
    in `layer` at positions `[start, stop)` run at `place` (module doc)."""

    layer: np.ndarray
    slot: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    place: np.ndarray

    @classmethod
    def of(cls, rows: np.ndarray) -> "Moves":
        """The moves of `rows [M, 5]`, `(layer, slot, start, stop, place)` each, sorted."""
        array = np.asarray(rows, np.int64).reshape(-1, 5)
        array = array[np.lexsort((array[:, 2], array[:, 1], array[:, 0]))]
        return cls(*(np.ascontiguousarray(array[:, i]) for i in range(5)))

    def __len__(self) -> int:
        return len(self.layer)

    def apply(self, phys: torch.Tensor, num_slots: int,
              earlier: torch.Tensor | None = None) -> torch.Tensor:
        """Where each pair of `phys [T, L, K]` (slots, -1 at padding, kept) runs, int64 `[T, L,
        K]`: a move's place for a pair whose position among its slot's pairs a move covers,
        else its slot. A pair's position counts the pairs before it on its slot in its layer,
        row-major over `[T, K]`, plus `earlier [L, P]` (the pairs earlier ranks sent there).
        Counted on the CPU in one pass; the result is on `phys`'s device."""
        if not len(self) or not phys.numel():
            return phys
        T, L, K = phys.shape
        keys = self.layer * num_slots + self.slot  # [M], ascending
        first = np.searchsorted(keys, np.arange(L * num_slots))  # [L * P]
        last = np.searchsorted(keys, np.arange(L * num_slots), "right")
        seen = (np.zeros(L * num_slots, np.int64) if earlier is None
                else earlier.cpu().numpy().astype(np.int64).reshape(-1))
        flat = np.ascontiguousarray(phys.cpu().numpy(), np.int64).reshape(-1)
        out = np.empty_like(flat)
        _apply(flat, L, K, num_slots, seen, first, last, self.start, self.stop, self.place, out)
        return torch.from_numpy(out.reshape(T, L, K)).to(phys.device)


@jit(**JIT)
def _apply(phys, num_layers, top_k, num_slots, seen, first, last, start, stop, place,
           out):  # pragma: no cover - compiled
    """`Moves.apply` compiled: pairs `phys [N]` (row-major `[T, L, K]`) into `out [N]`,
    `seen [L * P]` each slot's pairs so far (updated), moves `first[key]:last[key]` of each
    (layer, slot) key, their `start`, `stop` and `place`."""
    cursor = first.copy()
    for i in range(phys.shape[0]):
        p = phys[i]
        out[i] = p
        if p < 0:
            continue
        key = (i // top_k) % num_layers * num_slots + p
        position = seen[key]
        seen[key] += 1
        j = cursor[key]
        while j < last[key] and position >= stop[j]:
            j += 1
        cursor[key] = j
        if j < last[key] and position >= start[j]:
            out[i] = place[j]


def capacity(pairs: int, num_gpus: int, slack: float = 0.0) -> int:
    """`spill`'s capacity a GPU of a layer-step with `pairs` valid pairs: `ceil(pairs x (1 +
    slack) / G)`."""
    return math.ceil(pairs * (1.0 + slack) / num_gpus)


SPILL_RULES: dict[str, SpillRule] = {
    "spill": SpillRule(moonep_moves),
    "spill-local": SpillRule(moonep_moves, local=True),
    "llep": SpillRule(llep_moves),
}
