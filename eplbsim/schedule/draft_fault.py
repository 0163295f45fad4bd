"""A draft's (MTP) own placement beside its target's, the fault of mixing them (SGLang #16044),
and the EP sizes both admit (DESIGN.md §16).

Dimensions: `S` steps, `T` tokens of a step, `L`/`Ld` target/draft MoE layers, `E`/`Ed`
target/draft experts, `K`/`Kd` top-k, `P`/`Pd` target/draft physical slots, `G` GPUs.

**EP sizes.** A draft's layers are placed over the same `G` EP ranks with the same redundant
slots `R` (SGLang's `ep_num_redundant_experts` is one setting for both), so both `E + R` and
`Ed + R` must be multiples of `G`: with a 288-expert target and a 256-expert draft, EP 72 and
144 admit the target alone (sgl-project/sglang #7893; pull request #19187 computes the draft's
dispatch sizes from its own expert count). Both admit `G` exactly when `G` divides `E - Ed`,
and then `R = (-E) mod G + m G`.

**The fault** (`draft_fault`, SGLang #16044, `traces.draft`): the target's placement is solved
from what its recorder counted, the draft's pairs written into the target's positions
(`traces.draft.misrecorded_loads`); the draft's weights stay in the draft's own placement
(solved from its own loads), but its pairs are dispatched through the target's map of layer
`into[j]`. A pair goes to replica `row % n_e` of its expert in the map it reads (the row-based
choice every rank makes alike, `row`); it is **wrong** when that slot holds another expert's
weights in the draft, lies beyond the draft's slots, or the target's map has no replica of
its expert (`e >= E`). Through its own map a draft pair is never wrong: the check of the
healthy path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..base.errors import InputError
from ..placement import Placement
from ..placement.loads import gpu_imbalance, gpu_loads
from ..placement.topology import Topology
from ..solvers import solve
from ..traces.draft import Drafted, draft_positions, misrecorded_loads


def shared_redundancy(experts: int, draft_experts: int, gpus: int) -> int | None:
    """The fewest redundant slots `R >= 0` with `E + R` and `Ed + R` both multiples of `gpus`
    (module doc), or None when no `R` gives both."""
    for name, value in (("experts", experts), ("draft_experts", draft_experts), ("gpus", gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    if (experts - draft_experts) % gpus:
        return None
    return -experts % gpus


def check_shared(experts: int, draft_experts: int, redundant: int, gpus: int) -> None:
    """InputError unless `redundant` slots beside both the target's `experts` and the
    draft's `draft_experts` divide over `gpus` (module doc), naming the fewest that would."""
    if (experts + redundant) % gpus or (draft_experts + redundant) % gpus:
        fewest = shared_redundancy(experts, draft_experts, gpus)
        raise InputError(f"{experts} target and {draft_experts} draft experts + {redundant} "
                         f"redundant slots do not both divide over {gpus} GPUs (one redundancy "
                         f"serves both, as SGLang's ep_num_redundant_experts); "
                         + (f"redundant {fewest} (+ a multiple of {gpus}) would"
                            if fewest is not None else
                            f"no redundancy does ({gpus} does not divide {experts} - "
                            f"{draft_experts})"))


def ep_sizes(experts: int, draft_experts: int, gpus: Sequence[int]) -> list[dict[str, Any]]:
    """For each EP size in `gpus`: `gpus`, `target_redundant` (the fewest redundant slots the
    target alone admits), `shared_redundant` (the fewest both admit, None when none does), and
    the slots a GPU of each at that redundancy (`target_slots_per_gpu`,
    `draft_slots_per_gpu`, None with it)."""
    rows = []
    for G in gpus:
        shared = shared_redundancy(experts, draft_experts, G)
        rows.append({"gpus": G, "target_redundant": -experts % G, "shared_redundant": shared,
                     "target_slots_per_gpu": None if shared is None else (experts + shared) // G,
                     "draft_slots_per_gpu": None if shared is None else
                     (draft_experts + shared) // G})
    return rows


def route_slots(ids: torch.Tensor, placement: Placement, layer: int) -> torch.Tensor:
    """The slot each pair of `ids [T, K]` (logical ids, -1 padding) goes to through
    `placement`'s map of `layer`: replica `row % n_e` (module doc), int64 `[T, K]`; -1 for
    padding and for an expert the map does not have (`>= E` or no replica)."""
    T = ids.shape[0]
    E = placement.num_experts
    known = (ids >= 0) & (ids < E)
    e = torch.where(known, ids, 0).to(torch.int64)
    count = placement.logcnt[layer][e]  # [T, K]
    known &= count > 0
    replica = torch.arange(T).view(T, 1) % count.clamp(min=1)
    slots = placement.log2phy[layer][e, replica]  # [T, K]
    return torch.where(known, slots, -1)


@dataclass(frozen=True)
class DraftFault:
    """The damage of SGLang #16044's two mistakes on a drafted run (module doc).

    pairs:            the draft's routed pairs (padding not counted)
    wrong_pairs:      draft pairs sent through the target's map to a slot that, in the draft,
                      holds another expert's weights or does not exist, or with no slot there
    own_wrong_pairs:  the same through the draft's own map (0: the healthy path)
    misrecorded:      draft pairs the recorder counted into the target's positions
    dropped:          draft pairs of experts the target's positions lack (`>= E`)
    promise:          the target's placement solved from its own pairs: its even-split GPU
                      imbalance on them, mean over layers
    recorded_promise: the same for the placement solved from the recorded statistics
    """

    pairs: int
    wrong_pairs: int
    own_wrong_pairs: int
    misrecorded: int
    dropped: int
    promise: float
    recorded_promise: float

    @property
    def wrong_frac(self) -> float:
        """`wrong_pairs / pairs` (0 for no pairs)."""
        return self.wrong_pairs / self.pairs if self.pairs else 0.0

    def row(self) -> dict[str, Any]:
        """Every field and `wrong_frac`, as one table or JSON row."""
        return {**self.__dict__, "wrong_frac": self.wrong_frac}


def _promise(placement: Placement, load: torch.Tensor, gpus: int) -> float:
    """Mean over layers of `placement`'s even-split GPU imbalance on `load [L, E]`."""
    return float(gpu_imbalance(gpu_loads(placement.expected_load(load), gpus)).nanmean())


def _wrong_pairs(ids: torch.Tensor, read: Placement, layer: int, held: Placement,
                 held_layer: int) -> int:
    """Pairs of `ids [T, K]` routed through `read`'s map of `layer` (`route_slots`) whose slot
    does not hold their expert in `held`'s layer `held_layer` (the weights that are there), or
    does not exist there, or whose expert the map lacks."""
    slots = route_slots(ids, read, layer)
    P = held.num_slots
    there = torch.where((slots >= 0) & (slots < P), held.phy2log[held_layer][slots.clamp(0, P - 1)],
                        -1)
    return int(((ids >= 0) & (there != ids)).sum())


def draft_fault(drafted: Drafted, topology: Topology, redundant: int, solver: Any = "deepseek",
                into: Sequence[int] | None = None) -> DraftFault:
    """The fault of SGLang #16044 on `drafted` (module doc), each placement solved by `solver`
    on `topology` with `redundant` slots beside each model's experts. `into [Ld]`: the target
    layer each draft layer records into and reads the map of (`traces.draft.draft_positions`).
    InputError when the target and the draft do not both admit `redundant` on the topology's
    GPUs (`shared_redundancy` names the fewest that would)."""
    target, draft = drafted.target, drafted.draft
    E, Ed, G = target.num_experts, draft.num_experts, topology.num_gpus
    check_shared(E, Ed, redundant, G)
    into = draft_positions(draft.num_layers, target.num_layers, into)
    counts, draft_counts = target.counts(), draft.counts()  # [S, L, E], [S, Ld, Ed]
    recorded = misrecorded_loads(counts, draft_counts, into)
    true_load = counts.sum(0).to(torch.float64)  # [L, E]
    clean = solve(solver, true_load, E + redundant, topology)
    served = solve(solver, recorded.recorded.sum(0).to(torch.float64), E + redundant, topology)
    own = solve(solver, draft_counts.sum(0).to(torch.float64), Ed + redundant, topology)
    pairs = wrong = own_wrong = 0
    for s in range(draft.num_steps):
        ids = draft.step(s)  # [T, Ld, Kd]
        for j, layer in enumerate(into):
            pairs += int((ids[:, j] >= 0).sum())
            wrong += _wrong_pairs(ids[:, j], served, layer, own, j)
            own_wrong += _wrong_pairs(ids[:, j], own, j, own, j)
    return DraftFault(pairs, wrong, own_wrong, recorded.pairs, recorded.dropped,
                      _promise(clean, true_load, G), _promise(served, true_load, G))


EP_CANDIDATES = tuple(range(8, 257, 8))  # EP sizes of one to 32 eight-GPU nodes


def ep_words(experts: int, draft_experts: int, gpus: Sequence[int] = EP_CANDIDATES) -> str:
    """"the EP sizes both admit: 8 (R 0), 16 (R 0), ...": which of `gpus` a target of
    `experts` and a draft of `draft_experts` both admit, each with the fewest redundant slots
    (`ep_sizes`), and how many of `gpus` the target alone admits that the draft does not."""
    rows = ep_sizes(experts, draft_experts, gpus)
    both = [f"{r['gpus']} (R {r['shared_redundant']})" for r in rows
            if r["shared_redundant"] is not None]
    alone = [str(r["gpus"]) for r in rows if r["shared_redundant"] is None]
    return (f"the EP sizes both admit: {', '.join(both) or 'none'}"
            + (f"; the target alone: {', '.join(alone)}" if alone else ""))
