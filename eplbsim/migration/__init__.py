"""A rebalance's weights moved by the engine's own updater, on ranks whose weights say whose
they are, and checked slot by slot (DESIGN.md §14).

Holds `migrate` (here), the weights that say whose they are (`weights`), simulated
and real ranks (`simdist`, `real`) and a run's rebalances moved by the engine (`replayed`).
Takes in two placements and an engine; gives out what every slot holds after the move. Imports
`base`, `placement`, `cost`, `dispatch`, `engines`, `metrics` and `schedule`.

Dimensions: `G` ranks, `L` layers, `E` logical experts, `P` physical slots, `W` tensors a
layer.

`migrate(engine, old, new, ...)` builds every rank's weights for the old placement
(`weights.rank_weights`), hands each rank's list to the engine's updater (`MIGRATIONS`: SGLang's
`expert_location_updater`, vLLM's `rearrange_expert_weights_inplace`), runs the ranks in one
process (`simdist.SimWorld`, threads answering torch.distributed's point-to-point calls) and
reads back what every slot holds (`weights.slot_experts`). `drop` leaves tensors out of the list the
engine is given while they stay in the weights (a tensor the updater is not told of: vLLM
#47588's shape). The result says:
- `holds [L, P]`: the expert each slot holds after the move (-1: nothing valid);
- `mismatch [L]`: slots not holding the expert the new map names (`slot_mismatch`);
- `lost`: `(layer, expert)` no slot holds;
- `sent`: the engine's point-to-point transfers `(source rank, destination rank, bytes)`,
  summed by `plan` into bytes by link class (same node over NVLink, across nodes over RDMA),
  operations, and the slowest rank's received bytes;
- `maps`: the engine's own maps after the commit (SGLang: every rank's updated
  `ExpertLocationMetadata`; vLLM: `compute_logical_maps` of the new placement), and
  `map_mismatch`, the SGLang ranks whose committed maps differ from those built for the new
  placement.
`prepare` is what both this path and the real processes (`migration.real`) run per rank.

`migrate_async` runs vLLM's asynchronous rebalance instead (`engines.vllm_async`): one layer
a step lands in every rank's weights and switches that layer's maps, and before every step it
checks the maps the dispatch reads against what the slots hold (`AsyncStep`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from ..base.errors import InputError
from ..placement import refuse_empty_slots
from ..placement.topology import Topology
from .simdist import WAIT_S, SimWorld, simulated
from .weights import (SHAPES, given_to_engine, lost_experts, rank_weights, slot_experts,
                      slot_mismatch)

MIGRATIONS = {  # --migration: who moves the weights at a rebalance
    "eplbsim": "eplbsim's own migration model (moved slots priced by the cost model)",
    "sglang": "SGLang's expert_location_updater, then ExpertLocationMetadata.update",
    "vllm": "vLLM's rearrange_expert_weights_inplace over its torch.distributed communicator",
}


@dataclass
class Moved:
    """What one engine's move did (module doc); `map_mismatch` counts the ranks whose committed
    SGLang map differs from the one built for the new placement (what the dispatch reads next;
    always 0 for vLLM, whose maps are `compute_logical_maps` of the new placement)."""

    holds: torch.Tensor  # int64 [L, P]
    mismatch: torch.Tensor  # int64 [L]
    lost: list[tuple[int, int]]
    sent: list[tuple[int, int, int]]
    maps: Any = None
    weights: list = field(default_factory=list, repr=False)  # [G][L][W] after the move
    map_mismatch: int = 0

    @classmethod
    def read(cls, weights: list, new: torch.Tensor, num_experts: int, sent: list,
             maps: Any = None, map_mismatch: int = 0) -> "Moved":
        """What the ranks' weights `[G][L][W]` hold after a move to `new [L, P]`."""
        holds = slot_experts(weights, num_experts)
        return cls(holds, slot_mismatch(holds, new), lost_experts(holds, num_experts),
                   list(sent), maps, weights, map_mismatch)


@dataclass
class Mover:
    """One engine's move from `old` to `new`, prepared for some ranks (`prepare`): `owners`,
    the engine modules whose names imported from torch.distributed a world replaces;
    `move(rank, given, group)`, that rank's part (its weights `[L][W]` as the engine is given
    them, its EP group); `maps`, what the ranks committed (SGLang: each rank's updated
    metadata; vLLM: none); `fresh`, the maps built for the new placement beside them."""

    owners: list
    move: Callable[[int, list, Any], None]
    maps: Any = None
    fresh: Any = None


def prepare(engine: str, run: Any, old: torch.Tensor, new: torch.Tensor, num_experts: int,
            topology: Topology, ranks: Sequence[int],
            chunks: Sequence[Sequence[int]] | None = None,
            rank_mapping: dict[int, int] | None = None) -> Mover:
    """`engine`'s move of `old [L, P]` to `new [L, P]` for `ranks` of `topology`, from the
    adapter `run`: SGLang's metadata built for each rank (`init_by_mapping` of both
    placements), `chunks` the layer ids each update takes in turn (default: all at once);
    vLLM's rebalance and communicator modules loaded, `rank_mapping` handed to it (`elastic`).
    Everything is loaded here, so ranks in threads import nothing. InputError when either
    placement has an empty slot (-1): the engine's code takes none (`refuse_empty_slots`)."""
    _refuse_empty(engine, old, new)
    L, P = old.shape
    if engine == "sglang":
        from ..engines.sglang import Layout
        from ..engines.sglang_updater import metadata, move_rank
        run.need("updater")
        layout = Layout(L, num_experts, P, topology.num_gpus, topology.num_nodes)
        olds = dict(zip(ranks, metadata(run, layout, old, ranks)))
        news = dict(zip(ranks, metadata(run, layout, new, ranks)))
        layers = [list(range(L))] if chunks is None else chunks
        return Mover([run.role("updater")], lambda rank, given, group: move_rank(
            run, layout, olds[rank], news[rank], given, layers, rank), olds, news)
    from ..engines.vllm_rearrange import modules, move_rank
    loaded = modules(run)
    return Mover(list(loaded), lambda rank, given, group: move_rank(
        run, loaded, old, new, given, group, rank_mapping))


def committed_apart(mover: Mover) -> int:
    """Ranks whose committed maps differ from those built for the new placement (`Mover`)."""
    from ..dispatch.observe import inputs_equal
    if mover.maps is None:
        return 0
    names = ("physical_to_logical_map", "logical_to_all_physical_map",
             "logical_to_all_physical_map_num_valid", "logical_to_rank_dispatch_physical_map")

    def maps(meta: Any) -> list:
        return [getattr(meta, n) for n in names if getattr(meta, n, None) is not None]
    return sum(not inputs_equal(maps(mover.maps[r]), maps(mover.fresh[r])) for r in mover.maps)


def migrate(engine: str, old: torch.Tensor, new: torch.Tensor, num_experts: int,
            topology: Topology, sources: Any = (), shapes: Sequence[Sequence[int]] = SHAPES,
            chunks: Sequence[Sequence[int]] | None = None, drop: Sequence[int] = (),
            weights: list | None = None, rank_mapping: dict[int, int] | None = None) -> Moved:
    """Move a rebalance's weights with an engine's own updater, every rank simulated here.

    engine:       "sglang" (its `expert_location_updater`) or "vllm" (its
                  `rearrange_expert_weights_inplace`), run from `sources` (default pinned)
    old, new:     int `[L, P]` the placements before and after (`phy2log`)
    num_experts:  `E`
    topology:     the EP group that runs the move (`G` ranks)
    shapes:       the shape of each of an expert's `W` tensors, one slot's
    chunks:       SGLang: the layer ids each update call takes in turn (default all at once)
    drop:         indices of tensors left out of what the engine is given (they stay in the
                  weights: a tensor the updater is not told of)
    weights:      the ranks' weights `[G][L][W]` to move in place (default fresh ones holding
                  `old`, `weights.rank_weights`)
    rank_mapping: vLLM's elastic EP (`elastic`): old rank -> new rank, -1 for one that leaves
    Returns `Moved`: what every slot holds after (`holds [L, P]`), the slots that hold another
    expert than `new` names (`mismatch [L]`), experts lost, the sends `(src, dst, bytes)` and
    the maps each rank committed; in `topology`'s slots. InputError in one line when `old` or
    `new` has an empty slot (-1): the engines' updaters take none.
    """
    from ..engines import adapter
    if engine not in ("sglang", "vllm"):
        raise InputError(f"unknown migration {engine!r}; the engines' own: sglang, vllm")
    if rank_mapping is not None and engine != "vllm":
        raise InputError("a rank mapping (elastic EP) is vLLM's: SGLang's updater takes none")
    _refuse_empty(engine, old, new)  # before the engine's code loads
    G = topology.num_gpus
    if rank_mapping is None:
        old, new = _placements(old, new)
        start, want = old, new
    else:
        old, new = old.long(), new.long()
        start, want = elastic(old, new, rank_mapping, G)
    if weights is None:
        weights = rank_weights(start, num_experts, G, shapes)
    given = [given_to_engine(rank, drop) for rank in weights]
    run = adapter(engine, sources)
    mover = prepare(engine, run, old, new, num_experts, topology, range(G), chunks,
                    rank_mapping)
    world, group = _world(G)
    with run.modules.active(), simulated(world, mover.owners):
        world.run(lambda r: mover.move(r, given[r], group))
    maps = list(mover.maps.values()) if mover.maps is not None else \
        run.logical_maps(new, num_experts)
    return Moved.read(weights, want, num_experts, world.sent, maps, committed_apart(mover))


def _refuse_empty(engine: str, old: torch.Tensor, new: torch.Tensor) -> None:
    """InputError in one line when `old` or `new` `[L, P]` has an empty slot (-1), which the
    engine's updater (`MIGRATIONS[engine]`) cannot take."""
    for which, phy2log in (("the old placement", old), ("the new placement", new)):
        refuse_empty_slots(phy2log, f"--migration {engine} ({MIGRATIONS[engine]})", which)


def _placements(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`old` and `new` as int64; InputError when their shapes differ."""
    if old.shape != new.shape:
        raise InputError(f"old and new placements differ in shape: {tuple(old.shape)} and "
                         f"{tuple(new.shape)}")
    return old.long(), new.long()


def _world(G: int, wait_s: float = WAIT_S) -> tuple[SimWorld, Any]:
    """A simulated world of `G` ranks and the EP group its ranks see (`size()`, `rank()`)."""
    world = SimWorld(G, wait_s)
    return world, SimpleNamespace(size=lambda: G, rank=world.get_rank)


def elastic(old: torch.Tensor, new: torch.Tensor, rank_mapping: dict[int, int], world: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """An elastic EP move (vLLM's `rank_mapping`, old rank -> new rank, -1: leaves) in the
    slots of the group of `world` ranks that runs it: `(start, want)`, both `[L, world x S]`,
    S slots a rank. Scale-down (`world` = the old group, every old rank mapped): `start` is
    `old [L, P_old]`, `want` each kept rank's new slots (`new [L, P_new]` under its new rank)
    and -1 (anything) on the ranks that leave. Scale-up (`world` = the new group, the mapping
    the old ranks'): `start` each old rank's slots under its new rank and -1 (nothing) on the
    ranks that join, `want` is `new`. InputError for a mapping that fits neither."""
    ranks = sorted(rank_mapping)
    targets = [rank_mapping[r] for r in ranks]
    kept = [t for t in targets if t >= 0]
    down = len(ranks) == world
    size = len(kept) if down else world
    if (ranks != list(range(len(ranks))) or len(set(kept)) != len(kept)
            or any(t < -1 or t >= size for t in targets) or not kept
            or (not down and len(ranks) > world)):
        raise InputError(f"rank mapping {rank_mapping}: give every old rank 0..n-1 a distinct "
                         f"new rank below the new group's size, or -1 where it leaves")
    S = (old.shape[1] // len(ranks)) if len(ranks) else 0
    if old.shape[1] != len(ranks) * S or new.shape[1] != size * S or old.shape[0] != new.shape[0]:
        raise InputError(f"placements {tuple(old.shape)} -> {tuple(new.shape)} do not fit "
                         f"{len(ranks)} old and {size} new ranks of equal slots")
    fine, coarse = (old, new) if down else (new, old)
    mapped = torch.full_like(fine, -1)
    for r, t in zip(ranks, targets):
        if t >= 0:
            mapped[:, (r if down else t) * S:((r if down else t) + 1) * S] = \
                coarse[:, (t if down else r) * S:((t if down else r) + 1) * S]
    return (old, mapped) if down else (mapped, new)


@dataclass
class AsyncStep:
    """The ranks before one step of vLLM's asynchronous rebalance (`migrate_async`):
    `committed`, the layers whose maps switched so far; `landed`, the layers whose slots all
    hold the new placement; `mismatch`, over ranks, layers and slots, the slots whose weights
    are not the expert that rank's committed `physical_to_logical_map` names (what its
    dispatch reads); `stale_maps`, the ranks whose committed maps differ from rank 0's."""

    committed: int
    landed: int
    mismatch: int
    stale_maps: int


def migrate_async(old: torch.Tensor, new: torch.Tensor, num_experts: int, topology: Topology,
                  sources: Any = (), shapes: Sequence[Sequence[int]] = SHAPES,
                  drop: Sequence[int] = (), lead: int = 0, wait_s: float = WAIT_S
                  ) -> tuple[Moved, list[AsyncStep]]:
    """vLLM's asynchronous rebalance of `old [L, P]` to `new [L, P]` on every rank of
    `topology`, simulated in this process (`engines.vllm_async`): each rank's async worker in a
    thread of its own, and, as the main threads, before each of `L + 1` steps a check of what
    the ranks serve (`AsyncStep`), then every rank's `_move_to_workspace` of the layer its
    worker posted. `drop` as `migrate`; `lead`, a fault: before each check the maps of the next
    `lead` layers are committed early (the engine's `_commit_eplb_maps_for_layer`), before their
    weights land. Returns what the move did and the `L + 1` checks (the first before any layer
    switched). InputError when a worker posts no layer within `wait_s`, or fails, or when a
    placement has an empty slot (-1)."""
    from ..engines import adapter, vllm_async
    old, new = _placements(old, new)
    _refuse_empty("vllm", old, new)
    L, G = old.shape[0], topology.num_gpus
    run = adapter("vllm", sources)
    loaded = vllm_async.load(run)
    weights = rank_weights(old, num_experts, G, shapes)
    world, group = _world(G, wait_s)
    maps = vllm_async.committed(loaded, old, num_experts)
    states = [vllm_async.rank_state(loaded, old, new, maps, given_to_engine(weights[r], drop),
                                    group, topology.num_nodes) for r in range(G)]
    models = [s.model_states["eplbsim"] for s in states]
    move, commit = loaded.main["_move_to_workspace"], loaded.main["_commit_eplb_maps_for_layer"]
    failed: list[BaseException] = []

    def workers() -> None:
        try:
            world.run(lambda r: vllm_async.work(loaded, states[r]))
        except BaseException as exc:  # handed to the caller below
            failed.append(exc)

    def check(done: int) -> AsyncStep:
        for layer in range(done, min(done + lead, L)):  # the fault: maps ahead of weights
            for model in models:
                commit(model, new_physical_to_logical_map=new[layer], layer=layer)
        holds = slot_experts(weights, num_experts)
        maps = [m.physical_to_logical_map for m in models]
        return AsyncStep(
            committed=sum(int(torch.equal(maps[0][l], new[l])) for l in range(L)),
            landed=int((holds == new).all(1).sum()),
            mismatch=int(sum((holds != m).sum() for m in maps)),
            stale_maps=sum(not torch.equal(m, maps[0]) for m in maps[1:]))

    steps = []
    with run.modules.active(), simulated(world, [loaded.worker, loaded.comm]), \
            vllm_async.stand_ins(loaded, group):
        runner = threading.Thread(target=workers, daemon=True)
        runner.start()
        for done in range(L):  # each check once every worker took its snapshot
            waited = time.monotonic()
            while any(m.pending_result is None for m in models) and runner.is_alive():
                if time.monotonic() - waited > wait_s:
                    raise InputError(f"vLLM's async workers posted no layer within {wait_s:g} "
                                     f"s (layers committed: {done} of {L})")
                time.sleep(0.0005)
            if failed or any(m.pending_result is None for m in models):
                break
            steps.append(check(done))
            for rank, model in enumerate(models):
                move(model_state=model, ep_rank=rank)
        else:
            steps.append(check(L))
        runner.join(wait_s)
    if failed:
        raise failed[0]
    if len(steps) < L + 1:
        raise InputError(f"vLLM's async workers stopped after {len(steps)} of {L} layers")
    return Moved.read(weights, new, num_experts, world.sent,
                      run.logical_maps(new, num_experts)), steps


def transfer_totals(sent: Sequence[tuple[int, int, int]], topology: Topology) -> dict[str, int]:
    """The engine's transfers summed: `nvlink_bytes` (within a node), `rdma_bytes` (across
    nodes), `p2p_ops` (sends), and `max_recv_bytes` (the rank receiving the most)."""
    per_node = topology.gpus_per_node
    recv = [0] * topology.num_gpus
    out = {"nvlink_bytes": 0, "rdma_bytes": 0, "p2p_ops": len(sent), "max_recv_bytes": 0}
    for src, dst, nbytes in sent:
        out["nvlink_bytes" if src // per_node == dst // per_node else "rdma_bytes"] += nbytes
        recv[dst] += nbytes
    out["max_recv_bytes"] = max(recv, default=0)
    return out


__all__ = ["MIGRATIONS", "AsyncStep", "Moved", "Mover", "SHAPES", "elastic", "migrate",
           "migrate_async", "plan", "prepare"]
