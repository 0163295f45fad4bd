"""Token spill (DESIGN.md §15): where a step's surplus pairs run with fetched weights.

Dimensions: `L` layers, `P` physical slots, `G` GPUs, `E` logical experts, `M` moves.

A spill policy first sends every pair where its base rule (`ordinal`) does; its `SpillRule`
then plans, for each layer from the pairs each slot received (`counts [L, P]`), moves of the
surplus: `Moves`, each "the pairs at positions `[start, stop)` of slot `p`'s pairs run at place
`target`". A place is a slot `< P` (a GPU that holds a replica of the expert runs the pairs on
it, reading its own weights) or `P + g`: GPU `g` runs them with the expert's weights fetched for
that step. A slot's pairs are ordered by their position (`positions`): the source rank, then the
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


def moonep_moves(counts: np.ndarray, site: Site, layer: int,
                 slack: float = 0.0) -> list[Move]:
    """MoonEP's plan for one layer (module doc) from the pairs each slot received `counts
    [P]`: donors are the GPUs over `C`; repeatedly the most loaded donor sends
    `min(its surplus, the room)` to the receiver under `C` with the most room, on the donor's
    node first (ties: lowest GPU); then each donor fills its quotas, the largest first, from
    its slots with the most pairs left (ties: lowest slot)."""
    G = len(site.node)
    load = np.bincount(site.slot_gpu, weights=counts, minlength=G).astype(np.int64)
    balance = load - capacity(int(load.sum()), G, slack)
    quotas: dict[int, list[list[int]]] = {}
    while balance.max() > 0:
        donor = int(np.argmax(balance))
        room = np.nonzero(balance < 0)[0]
        receiver = int(min(room, key=lambda g: (site.node[g] != site.node[donor], balance[g], g)))
        amount = int(min(balance[donor], -balance[receiver]))
        balance[donor] -= amount
        balance[receiver] += amount
        quotas.setdefault(donor, []).append([receiver, amount])
    moves: list[Move] = []
    left = counts.astype(np.int64).copy()
    for donor, owed in sorted(quotas.items()):
        slots = np.nonzero(site.slot_gpu == donor)[0]
        while owed:
            quota = max(owed, key=lambda q: (q[1], -q[0]))
            slot = int(slots[np.lexsort((slots, -left[slots]))[0]])
            n = int(min(left[slot], quota[1]))
            moves.append((slot, n, site.place(layer, slot, quota[0])))
            left[slot] -= n
            quota[1] -= n
            if quota[1] == 0:
                owed.remove(quota)
    return moves


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
        """Every layer's moves from `counts [L, P]` (`Moves`)."""
        rows = []
        for layer in range(counts.shape[0]):
            layer_counts = counts[layer]
            kept = layer_counts.astype(np.int64).copy()
            planned = self.plan(layer_counts, site, layer, slack, **self.options)
            for slot, n, _ in planned:
                kept[slot] -= n
            start = kept.copy()
            for slot, n, place in planned:
                rows.append((layer, slot, start[slot], start[slot] + n, place))
                start[slot] += n
        return Moves.of(rows)


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
    def of(cls, rows: list[tuple[int, int, int, int, int]]) -> "Moves":
        array = np.asarray(rows, np.int64).reshape(-1, 5)
        array = array[np.lexsort((array[:, 2], array[:, 1], array[:, 0]))]
        return cls(*(np.ascontiguousarray(array[:, i]) for i in range(5)))

    def __len__(self) -> int:
        return len(self.layer)

    def apply(self, phys: torch.Tensor, position: torch.Tensor, num_slots: int) -> torch.Tensor:
        """Where each pair runs, int64 `[T, L, K]`: the move's place for a pair of `phys [T, L,
        K]` (-1 at padding, kept) whose `position [T, L, K]` on its slot a move covers, else its
        slot."""
        if not len(self) or not phys.numel():
            return phys
        device = phys.device
        span = int(max(int(self.stop.max()), int(position.max()) + 1))
        layers = torch.arange(phys.shape[1], device=device).view(1, -1, 1)
        key = (layers * num_slots + phys.clamp(min=0)) * span + position
        starts = torch.from_numpy((self.layer * num_slots + self.slot) * span + self.start)
        stops = torch.from_numpy((self.layer * num_slots + self.slot) * span + self.stop)
        starts, stops = starts.to(device), stops.to(device)
        i = torch.searchsorted(starts, key.reshape(-1), right=True).view(key.shape) - 1
        hit = (phys >= 0) & (i >= 0) & (key < stops[i.clamp(min=0)])
        places = torch.from_numpy(self.place).to(device)
        return torch.where(hit, places[i.clamp(min=0)], phys)


def positions(phys: torch.Tensor, num_slots: int, offset: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Each pair's position among its slot's pairs, int64 `[T, L, K]` of `phys [T, L, K]`: the
    pairs before it on the same slot of its layer, row-major over `[T, K]`, plus `offset [L,
    P]` (the pairs earlier ranks sent to the slot); padding gets 0."""
    L = phys.shape[1]
    layers = torch.arange(L, device=phys.device).view(1, -1, 1)
    flat = torch.where(phys >= 0, layers * num_slots + phys, -1).reshape(-1)  # row-major
    sorted_keys, order = torch.sort(flat, stable=True)
    n = sorted_keys.numel()
    index = torch.arange(n, device=phys.device)
    first = torch.ones(n, dtype=torch.bool, device=phys.device)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    run_start = torch.cummax(torch.where(first, index, 0), 0).values
    out = torch.empty(n, dtype=torch.int64, device=phys.device)
    out[order] = index - run_start
    out = out.view(phys.shape)
    if offset is not None:
        base = offset.to(phys.device).reshape(-1)[(layers * num_slots + phys.clamp(min=0))]
        out = out + base
    return torch.where(phys >= 0, out, 0)


def capacity(pairs: int, num_gpus: int, slack: float = 0.0) -> int:
    """`spill`'s capacity a GPU of a layer-step with `pairs` valid pairs: `ceil(pairs x (1 +
    slack) / G)`."""
    return math.ceil(pairs * (1.0 + slack) / num_gpus)


SPILL_RULES: dict[str, SpillRule] = {
    "spill": SpillRule(moonep_moves),
    "spill-local": SpillRule(moonep_moves, local=True),
    "llep": SpillRule(llep_moves),
}
