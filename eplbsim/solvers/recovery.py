"""Dead ranks (DESIGN.md §16): the survivors' placement after EP ranks fail, as vLLM's
proposals build it, against a full re-solve on the survivors; the pairs of experts left with
no replica; the copies the repair makes.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs = EP ranks.

A map here is a raw `phy2log [L, P]` (int64, -1: an empty or dead slot), not a `Placement`:
after a failure an expert may have no replica at all, a state to count, not an input error
(vLLM's `tests/distributed/test_eplb_coverage.py`, commit
81b102001fbcb635e0a112baa182c570e0cb9c36, expects uncovered experts when the survivors hold
fewer slots than experts). Neither proposal's code is in a vLLM release (0.34.0 has none), so
each recovery here is a twin named for the pull request it follows:

- `recover-38862` (vLLM #38862, closed: `ElasticEPScalingExecutor.reassign_missing_experts`
  on its `feat/ep-fault-tolerance` branch): the dead ranks' slots are stripped, the survivors
  compacted to ranks `0..G'-1`; per layer, the missing experts (ascending) take the slots of
  the most-replicated donors, candidates `(donor replicas, slot)` sorted descending, never
  taking a donor below one replica. "Not load-balanced": it only restores coverage.
- `recover-46370` (vLLM #46370, open: fault-tolerant EP by scale-down): the dead slots stay
  in the map as -1 (its shape constant); missing experts take slots of over-replicated donors
  "interleaving across EP ranks": here the survivors' donor slots, each rank's ordered as
  above, are taken round-robin over the surviving ranks in rank order. The interleaving is
  written from the pull request's description; its code is not in the stored index.

Where donors run out, the engines raise (`RuntimeError`); here the experts left are counted
as lost (`lost_pairs`), their pairs unserved.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..base.errors import InputError
from ..placement.topology import Topology


def _dead_set(dead: Sequence[int], num_gpus: int) -> list[int]:
    ranks = sorted(set(int(r) for r in dead))
    if not ranks or ranks[0] < 0 or ranks[-1] >= num_gpus:
        raise InputError(f"dead ranks must be some of the ranks 0..{num_gpus - 1}, got "
                         f"{list(dead)}")
    if len(ranks) == num_gpus:
        raise InputError("every rank is dead: no survivor holds a slot")
    return ranks


def mark_dead(phy2log: torch.Tensor, dead: Sequence[int], num_gpus: int) -> torch.Tensor:
    """`phy2log [L, P]` with the slots of the `dead` ranks (of `num_gpus`, `P / G` slots each)
    set to -1, a new tensor."""
    out = phy2log.clone().long()
    per = out.shape[1] // num_gpus
    for rank in _dead_set(dead, num_gpus):
        out[:, rank * per:(rank + 1) * per] = -1
    return out


def strip_dead(phy2log: torch.Tensor, dead: Sequence[int], num_gpus: int) -> torch.Tensor:
    """The survivors' slots of `phy2log [L, P]`, `[L, P - |dead| P / G]`: the dead ranks'
    columns removed, the survivors compacted in rank order."""
    per = phy2log.shape[1] // num_gpus
    gone = set(_dead_set(dead, num_gpus))
    keep = [p for p in range(phy2log.shape[1]) if p // per not in gone]
    return phy2log[:, keep].clone().long()


def _donors(layer: torch.Tensor, counts: dict[int, int], slots: Sequence[int]) -> list[int]:
    """Slots among `slots` whose expert has more than one replica (`counts`), most-replicated
    first, ties by the higher slot (vLLM #38862's descending sort of `(replicas, slot)`)."""
    ranked = [(counts[int(layer[p])], p) for p in slots if layer[p] >= 0
              and counts[int(layer[p])] > 1]
    return [p for _, p in sorted(ranked, reverse=True)]


def _reassign(phy2log: torch.Tensor, num_experts: int,
              order: Callable[[torch.Tensor, dict[int, int]], list[int]]) -> torch.Tensor:
    """Per layer, each missing expert (ascending) takes the next slot of `order(layer, counts)`
    whose donor still has more than one replica; experts left when the slots run out stay
    missing. A new tensor."""
    out = phy2log.clone()
    for layer in out:
        counts = dict.fromkeys(range(num_experts), 0)
        for e in layer.tolist():
            if e >= 0:
                counts[e] += 1
        slots = iter(order(layer, counts))
        for expert in [e for e, n in counts.items() if n == 0]:
            for p in slots:
                donor = int(layer[p])
                if counts[donor] > 1:
                    layer[p], counts[donor] = expert, counts[donor] - 1
                    counts[expert] += 1
                    break
    return out


def recover_38862(phy2log: torch.Tensor, dead: Sequence[int], num_gpus: int,
                  num_experts: int) -> torch.Tensor:
    """vLLM #38862's recovery (module doc): the survivors' compacted map `[L, P']`."""
    return _reassign(strip_dead(phy2log, dead, num_gpus), num_experts,
                     lambda layer, counts: _donors(layer, counts, range(layer.shape[0])))


def recover_46370(phy2log: torch.Tensor, dead: Sequence[int], num_gpus: int,
                  num_experts: int) -> torch.Tensor:
    """vLLM #46370's recovery (module doc): the map `[L, P]`, dead slots -1, missing experts on
    donor slots taken round-robin over the surviving ranks."""
    per = phy2log.shape[1] // num_gpus
    alive = [r for r in range(num_gpus) if r not in set(_dead_set(dead, num_gpus))]

    def interleaved(layer: torch.Tensor, counts: dict[int, int]) -> list[int]:
        queues = [_donors(layer, counts, range(r * per, (r + 1) * per)) for r in alive]
        return [q[i] for i in range(max(map(len, queues), default=0))
                for q in queues if i < len(q)]
    return _reassign(mark_dead(phy2log, dead, num_gpus), num_experts, interleaved)


def resolve_survivors(place: Callable[[torch.Tensor, int, Topology], Any], load: torch.Tensor,
                      num_slots: int, survivors: int,
                      gpus_per_node: int | None = None) -> torch.Tensor:
    """A full re-solve on the survivors: `place(load, num_slots, topology)` (a solver bound by
    its caller, e.g. `lambda *a: solvers.solve("deepseek", *a).phy2log`) places `load [L, E]` on
    `num_slots` slots over `survivors` GPUs, `[L, P']`. With fewer slots than experts, each
    layer places its `P'` heaviest experts (ties by id) one replica each, the rest left with
    none, as vLLM's coverage tests expect of its rebalance."""
    L, E = load.shape
    topo = Topology(survivors, gpus_per_node if gpus_per_node and survivors % gpus_per_node == 0
                    else None)
    if num_slots >= E:
        return torch.as_tensor(place(load, num_slots, topo)).long()
    out = torch.full((L, num_slots), -1, dtype=torch.int64)
    for layer in range(L):
        kept = sorted(sorted(range(E), key=lambda e: (-float(load[layer, e]), e))[:num_slots])
        sub = torch.as_tensor(place(load[layer:layer + 1, kept], num_slots, topo))[0]
        out[layer] = torch.tensor(kept)[sub.long()]
    return out


def replica_counts(phy2log: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Replicas of each expert, int64 `[L, E]` (0: lost), of a map `[L, P]` (-1 counts
    nowhere)."""
    counts = torch.zeros(phy2log.shape[0], num_experts + 1, dtype=torch.int64)
    counts.scatter_add_(1, phy2log.long().clamp(min=-1) % (num_experts + 1),
                        torch.ones_like(phy2log, dtype=torch.int64))
    return counts[:, :num_experts]


def lost_pairs(load: torch.Tensor, phy2log: torch.Tensor) -> tuple[float, float]:
    """`(lost pairs, their share of all pairs)` of `load [..., L, E]` (pairs per expert, any
    leading dims summed) under a map `[L, P]`: the pairs of experts with no replica, unserved.
    The share is 0 when there are no pairs."""
    E = load.shape[-1]
    lost = (replica_counts(phy2log, E) == 0)  # [L, E]
    total = float(load.sum())
    pairs = float((load * lost).sum())
    return pairs, pairs / total if total else 0.0


def repair_slots(old: torch.Tensor, after: torch.Tensor,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(changed, from_disk)`, bool `[L, P']` each: the survivors' slots whose expert changed
    from `old [L, P']` (what each held before) to `after [L, P']`, and of these those whose
    new expert no surviving slot held before (no peer has its weights: vLLM #38862's disk
    reload)."""
    changed = (after >= 0) & (after != old)
    survived = replica_counts(old, num_experts) > 0  # [L, E]
    rows = torch.arange(after.shape[0]).unsqueeze(1).expand_as(after)
    return changed, changed & ~survived[rows, after.clamp(min=0)]


def repair_copies(before: torch.Tensor, after: torch.Tensor, slot_of: Sequence[int],
                  num_experts: int) -> dict[str, int]:
    """What a recovery copies: of the survivors' slots (`slot_of[q]`: the old slot of new slot
    `q` of `after [L, P']`, in `before [L, P]`), those whose expert changed (`copies`), and
    of these the experts no surviving slot held before (`from_disk`, `repair_slots`)."""
    changed, unheld = repair_slots(before.long()[:, list(slot_of)], after, num_experts)
    return {"copies": int(changed.sum()), "from_disk": int(unheld.sum())}


def survivor_slots(num_slots: int, dead: Sequence[int], num_gpus: int) -> list[int]:
    """The old slot of each survivor slot, in rank order (`strip_dead`'s columns)."""
    per = num_slots // num_gpus
    gone = set(_dead_set(dead, num_gpus))
    return [p for p in range(num_slots) if p // per not in gone]


RECOVERIES: dict[str, Callable[..., torch.Tensor]] = {
    "recover-38862": recover_38862,
    "recover-46370": recover_46370,
}

# what a run's `recovery` names: the twins, then "resolve" (`resolve_survivors`), the default
# first (the open proposal)
RECOVERY_NAMES = ("recover-46370", "recover-38862", "resolve")
