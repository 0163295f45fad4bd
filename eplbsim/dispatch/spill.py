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
from dataclasses import dataclass
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


@jit(**JIT)
def _moonep_step(counts, slot_gpu, node, local, expert, capacities, out):  # pragma: no cover
    """`moonep_step` compiled: every layer's `_moonep_layer` plan of `counts [L, P]` (`local
    [L, G, E]`, `expert [L, P]`, `capacities [L]`) as rows `(layer, slot, start, stop, place)`
    into `out [M, 5]`, each slot's home keeping its first pairs; returns how many."""
    L, P = counts.shape
    G = node.shape[0]
    plan = np.empty((2 * G + P + 1, 3), np.int64)
    rows = 0
    for layer in range(L):
        n = _moonep_layer(counts[layer], slot_gpu, node, local[layer], expert[layer],
                          capacities[layer], plan)
        start = counts[layer].copy()  # each slot's first moved position: what it keeps
        for m in range(n):
            start[plan[m, 0]] -= plan[m, 1]
        for m in range(n):
            slot = plan[m, 0]
            out[rows, 0], out[rows, 1], out[rows, 2] = layer, slot, start[slot]
            out[rows, 3], out[rows, 4] = start[slot] + plan[m, 1], plan[m, 2]
            start[slot] += plan[m, 1]
            rows += 1
    return rows


def moonep_step(counts: np.ndarray, site: Site, slack: float = 0.0) -> np.ndarray:
    """`moonep_moves` for every layer of `counts [L, P]` in one compiled call: the rows
    `(layer, slot, start, stop, place)` of `SpillRule.moves`, int64 `[M, 5]`."""
    counts = np.ascontiguousarray(counts, np.int64)
    L, P = counts.shape
    G = len(site.node)
    capacities = np.array([capacity(int(c), G, slack) for c in counts.sum(1)], np.int64)
    out = np.empty((L * (2 * G + P + 1), 5), np.int64)
    n = _moonep_step(counts, site.slot_gpu, site.node, site.local_slot,
                     np.maximum(site.slot_expert, 0), capacities, out)
    return out[:n]


def llep_moves(counts: np.ndarray, site: Site, layer: int, slack: float = 0.0,
               alpha: float = ALPHA, min_chunk: int = MIN_CHUNK,
               threshold: float | None = None) -> list[Move]:
    """LLEP's least-loaded assignment for one layer (module doc) from `counts [P]`: capacity
    `max(1, int(alpha x (1 + slack) x floor(pairs / G)))`; with `threshold`, no move when the
    GPUs' max over mean load is below it. Slots with pairs, most first (ties: lowest slot): the
    home GPU keeps what fits under capacity counting its slots not yet assigned; the rest goes in
    chunks to the other GPUs by least load (assigned plus pending; ties: lowest GPU), a chunk
    being the smaller of what is left and the GPU's room, taken when at least `min_chunk` or
    when it finishes the slot; what no GPU takes goes to the least-loaded other GPU."""
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
    """A spill policy's rule: `plan(counts [P], site, layer, slack) -> moves` of one
    layer, `slack` the capacity above the plan's own (`--spill-slack`).

    step:    the same plan for every layer of a step at once, `(counts [L, P], site, slack) ->
             rows [M, 5]` as `moves` makes them (a compiled rule's fast path); None: layer by
             layer
    local:   the naive port: in "none" each rank plans from its own share of the step's tokens
             (its counts times `G`, what it would estimate), in "a2a" from its own pairs alone
             (no all-gather): ranks then disagree in "none" (the seed's bug again)
    """

    plan: PlanFn
    step: Callable[[np.ndarray, Site, float], np.ndarray] | None = None
    local: bool = False

    def moves(self, counts: np.ndarray, site: Site, slack: float = 0.0) -> "Moves":
        """Every layer's moves from `counts [L, P]` (`Moves`): each slot's home keeps its
        first pairs, its moves take the next ones in plan order."""
        if self.step is not None:
            return Moves.of(self.step(counts, site, slack), counts)
        parts = []
        for layer in range(counts.shape[0]):
            plan = np.asarray(self.plan(counts[layer], site, layer, slack),
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
        return Moves.of(np.concatenate(parts) if parts else np.empty((0, 5), np.int64), counts)


@dataclass(frozen=True)
class Moves:
    """Planned moves, int64 `[M]` each, sorted by (layer, slot, start): the pairs of `slot`
    in `layer` at positions `[start, stop)` run at `place` (module doc); `counts [L, P]` the
    pairs each slot received, which the plan was made from; `first`, `last` int64 `[L * P]`:
    each (layer, slot)'s moves are `first[key]:last[key]`, `key = layer x P + slot`."""

    layer: np.ndarray
    slot: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    place: np.ndarray
    counts: np.ndarray
    first: np.ndarray
    last: np.ndarray

    @classmethod
    def of(cls, rows: np.ndarray, counts: np.ndarray) -> "Moves":
        """The moves of `rows [M, 5]`, `(layer, slot, start, stop, place)` each, planned from
        `counts [L, P]`, sorted and indexed by (layer, slot)."""
        array = np.asarray(rows, np.int64).reshape(-1, 5)
        array = array[np.lexsort((array[:, 2], array[:, 1], array[:, 0]))]
        layer, slot, start, stop, place = (np.ascontiguousarray(array[:, i]) for i in range(5))
        keys, every = layer * counts.shape[1] + slot, np.arange(counts.size)
        return cls(layer, slot, start, stop, place, np.asarray(counts, np.int64),
                   np.searchsorted(keys, every), np.searchsorted(keys, every, "right"))

    def __len__(self) -> int:
        return len(self.layer)

    def apply(self, phys: torch.Tensor, ids: torch.Tensor, site: Site,
              earlier: torch.Tensor | None = None, counts: np.ndarray | None = None
              ) -> "Applied":
        """Where each pair of `phys [T, L, K]` (slots, -1 at padding, kept) of experts `ids [T,
        L, K]` runs: a move's place for a pair whose position among its slot's pairs a move
        covers, else its slot. A pair's position counts the pairs before it on its slot in its
        layer, row-major over `[T, K]`, plus `earlier [L, P]` (the pairs earlier ranks sent
        there). One compiled pass on the CPU over the pairs, which also moves the pairs at each
        place from `counts [L, P]` (the pairs of `phys` on each slot; default the plan's) and
        marks the experts fetched (`Applied`); the places are on `phys`'s device. A contiguous
        int64 CPU `phys` is moved in place (`Applied.run` is its memory): the caller's choices
        become the places."""
        T, L, K = phys.shape
        P, G, E = site.num_slots, len(site.node), site.local_slot.shape[2]
        seen = (np.zeros(L * P, np.int64) if earlier is None
                else earlier.cpu().numpy().astype(np.int64).reshape(-1))
        out = np.ascontiguousarray(phys.cpu().numpy(), np.int64).reshape(-1)
        experts = np.ascontiguousarray(ids.cpu().numpy(), np.int64).reshape(-1)
        places = np.zeros((L, P + G), np.int64)
        places[:, :P] = self.counts if counts is None else counts
        marks = np.zeros(L * G * E, np.bool_)
        active = (self.last > self.first).astype(np.uint8)  # [L * P] slots with a move left
        _apply(out, experts, L, K, P, G, E, seen, active, self.first, self.last, self.start,
               self.stop, self.place, places.reshape(-1), marks)
        return Applied(torch.from_numpy(out.reshape(T, L, K)).to(phys.device),
                       torch.from_numpy(places), torch.from_numpy(marks.reshape(L, G, E)))


@dataclass(frozen=True)
class Applied:
    """What `Moves.apply` gives: `run` int64 `[T, L, K]` the place of every pair (-1 at
    padding); `counts` int64 `[L, P + G]` the pairs at each place (CPU); `marks` bool `[L, G,
    E]` the experts each GPU runs with fetched weights (CPU)."""

    run: torch.Tensor
    counts: torch.Tensor
    marks: torch.Tensor


@jit(**JIT)
def _apply(phys, ids, num_layers, top_k, num_slots, num_gpus, num_experts, seen, active, first,
           last, start, stop, place, counts, marks):  # pragma: no cover - compiled
    """`Moves.apply` compiled: moves in place each pair of `phys [N]` (experts `ids [N]`,
    row-major `[T, L, K]`) a move covers; `seen [L * P]` each slot's pairs so far (updated),
    `active [L * P]` whether a slot has a move left (updated: a byte a slot, what most pairs
    read), moves `first[key]:last[key]` of each (layer, slot) key, their `start`, `stop` and
    `place`; shifts each moved pair in `counts [L * (P + G)]` from its slot to its place and
    marks `marks [L * G * E]` where a GPU runs an expert with fetched weights. A slot with no
    move left keeps its pairs, uncounted in `seen`."""
    cursor = first.copy()
    width = num_slots + num_gpus
    i = 0
    for _ in range(phys.shape[0] // max(num_layers * top_k, 1)):
        for layer in range(num_layers):
            base = layer * num_slots
            for _ in range(top_k):
                p = phys[i]
                i += 1
                if p < 0:
                    continue
                key = base + p
                if not active[key]:
                    continue
                j = cursor[key]
                position = seen[key]
                seen[key] += 1
                while j < last[key] and position >= stop[j]:
                    j += 1
                cursor[key] = j
                if j == last[key]:
                    active[key] = 0
                if j < last[key] and position >= start[j]:
                    to = place[j]
                    phys[i - 1] = to
                    counts[layer * width + p] -= 1
                    counts[layer * width + to] += 1
                    if to >= num_slots:
                        marks[(layer * num_gpus + to - num_slots) * num_experts
                              + ids[i - 1]] = True


def capacity(pairs: int, num_gpus: int, slack: float = 0.0) -> int:
    """`spill`'s capacity a GPU of a layer-step with `pairs` valid pairs: `ceil(pairs x (1 +
    slack) / G)`."""
    return math.ceil(pairs * (1.0 + slack) / num_gpus)


SPILL_RULES: dict[str, SpillRule] = {
    "spill": SpillRule(moonep_moves, moonep_step),
    "spill-local": SpillRule(moonep_moves, moonep_step, local=True),
    "llep": SpillRule(llep_moves),
}
