"""A run's rebalances moved by the engine's own updater (`--migration sglang|vllm`), checked slot
by slot and priced beside eplbsim's own migration model (DESIGN.md §14, §8).

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs.

Every rank's weights start as the first placement's (`weights.rank_weights`). At each rebalance
that moves experts (a segment whose placement differs from the one before) the engine moves
the weights the ranks hold then, from the placement in service to the new one
(`migration.migrate`, every rank in one process), so a slot left wrong stays wrong until a
later move overwrites it. The steps the new placement serves execute each pair on the slot
the dispatch chose; a pair executed on a slot whose weights are not its expert's is computed
by the wrong expert (`moved_wrong_frac`).

For SGLang the map each rank commits (`ExpertLocationMetadata.update`) is compared with the one
the dispatch reads, `init_by_mapping` of the new placement (`map_mismatch`,
`migration.committed_apart`); vLLM's maps are `compute_logical_maps` of the new placement,
what its dispatch reads.

The engine's transfers are priced as eplbsim's model prices its copies
(`cost.rebalance.copies_stall_seconds`: each receiving GPU's copies over HBM, NVLink and RDMA,
the slowest decides), beside the model's own stall of the same rebalance
(`metrics.rebalance_stalls`). A copy is one expert's tensors in the toy shapes
(`weights.SHAPES`): the copies each GPU received by point-to-point sends, by link; its other
changed slots filled on the GPU (inferred: the updater's local copies are not observed).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np
import torch

from ..cost.rebalance import copies_stall_seconds, layer_scale, model_bytes, model_ms
from ..engines import as_sources
from ..metrics.declared import rebalance_stalls
from ..placement import refuse_empty_slots
from ..schedule.switch import held_experts, phases
from . import MIGRATIONS, migrate
from .weights import SHAPES, rank_weights

FIELDS = ("slot_mismatch", "lost_experts", "map_mismatch", "moved_wrong_frac",
          "engine_copies_nvlink", "engine_copies_rdma", "engine_p2p_ops", "engine_moved_bytes",
          "engine_cross_node_bytes", "engine_stall_ms", "first_wrong_step")
_DONE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # first segment
# -> {(engine, sources, dropped tensors): its moves}


def planned_moves(spec: Any, segments: Sequence[Any]) -> list[Any] | None:
    """The engine's move at each segment's start, chained from the first placement's weights
    (module doc): per segment a `Moved`, None for the first and for one whose placement is
    the one before (a skipped rebalance; read from the placements alone, which is all a real
    rank other than 0 receives); None under `--migration eplbsim`. `--unmoved I` leaves tensor
    `I` out of what the engine is given. Computed once per schedule (the segments' first
    object), engine source and fault: every policy of a comparison shares it. InputError in
    one line when a segment's placement has an empty slot (-1): the engine's updater takes
    none."""
    engine = spec.schedule.migration
    if engine == "eplbsim":
        return None
    for seg in segments:
        refuse_empty_slots(seg.placement, f"--migration {engine} ({MIGRATIONS[engine]})",
                           f"the placement serving from step {seg.start}")
    sources = as_sources(spec.dispatch.engine_source)
    drop = () if spec.schedule.unmoved is None else (spec.schedule.unmoved,)
    cache = _DONE.setdefault(segments[0], {})
    if (engine, sources, drop) not in cache:
        first = segments[0].placement
        E, topology = first.num_experts, first.topology
        weights = rank_weights(first.phy2log, E, topology.num_gpus, SHAPES)
        out: list[Any] = [None]
        for before, seg in zip(segments, segments[1:]):
            if torch.equal(before.placement.phy2log, seg.placement.phy2log):
                out.append(None)  # kept (a skipped rebalance): nothing moves
                continue
            moved = migrate(engine, before.placement.phy2log, seg.placement.phy2log, E,
                            topology, sources, drop=drop, weights=weights)
            weights = moved.weights
            out.append(moved)
        cache[engine, sources, drop] = out
    return cache[engine, sources, drop]


def segment_holds(spec: Any, segments: Sequence[Any]) -> list[torch.Tensor] | None:
    """What each slot holds while each segment serves, int64 `[L, P]` a segment (the first
    placement's experts until the first move, then each move's result); None under
    `--migration eplbsim`."""
    moves = planned_moves(spec, segments)
    if moves is None:
        return None
    holds, out = segments[0].placement.phy2log, []
    for moved in moves:
        holds = holds if moved is None else moved.holds
        out.append(holds)
    return out


def serving_stretches(spec: Any, segments: Sequence[Any]) -> list[tuple[int, int, Any, Any, Any]]:
    """The replay's stretches `(start, stop, placement, serving, held)`: `schedule.switch.phases`
    with what each slot holds (`held [L, P]`, or None where every slot holds what the serving
    placement names): the experts the engine's updater left (`segment_holds`, `--migration`),
    the placements of ranks switching at different steps (async), and with `--map-lead N` the
    old experts for the first N steps after each move while the new maps already serve."""
    moved = segment_holds(spec, segments)
    lead = spec.schedule.map_lead
    starts = [seg.start for seg in segments]
    out = []
    for start, stop, placement, serving in phases(segments):
        held = None if serving is None else held_experts(serving)
        i = max(j for j, first in enumerate(starts) if first <= start)
        if moved is not None:
            held = moved[i]
        if lead and i and start == starts[i] and not torch.equal(
                segments[i - 1].placement.phy2log, placement.phy2log):
            old = segments[i - 1].placement.phy2log if moved is None else moved[i - 1]
            out.append((start, min(stop, start + lead), placement, serving, old))
            start = min(stop, start + lead)
        if start < stop:
            out.append((start, stop, placement, serving, held))
    return out


def engine_moves(results: Any) -> dict[str, Any] | None:
    """The run's rebalances by its `--migration` engine (module doc): `rows` (one dict a
    rebalance that moved experts: `step`, `mismatched_slots`, `lost` (layer, expert) pairs,
    `map_mismatched_ranks`, copies by link, `p2p_ops`, `max_recv_copies`, `engine_stall_ms`
    and `model_stall_ms` when a cost model is named) and `totals` (`FIELDS`; `slot_mismatch`
    the fraction of slots over rebalances and layers). None for `--migration eplbsim`."""
    spec, segments = results.spec, results.segments
    moves = planned_moves(spec, segments)
    if moves is None:
        return None
    first = segments[0].placement
    topology = first.topology
    G, per_node = topology.num_gpus, topology.gpus_per_node
    copy_bytes = sum(4 * int(np.prod(s)) for s in SHAPES)  # one expert's tensors, float32
    priced = spec.cost.cost is not None
    device = spec.cost.profiles()[1] if priced else None
    model_stalls = dict(rebalance_stalls(results)) if priced else {}  # eplbsim's own, by step
    scale = layer_scale(spec.cost, results.true_load.shape[1])
    rows, wrong = [], 0
    slot_load = results.slot_load
    holds = segment_holds(spec, segments)
    for i, (before, seg, moved) in enumerate(zip(segments, segments[1:], moves[1:]), 1):
        if slot_load is not None:
            bad = (holds[i] != seg.placement.phy2log) & (seg.placement.phy2log >= 0)
            if bad.any():
                wrong += int(slot_load[seg.start:seg.stop].long()[:, bad].sum())
        if moved is None:
            continue
        old, new = before.placement.phy2log, seg.placement.phy2log
        recv = np.zeros((G, 2))  # copies received per GPU: same node, another node
        for src, dst, nbytes in moved.sent:
            recv[dst, int(src // per_node != dst // per_node)] += nbytes / copy_bytes
        changed = np.bincount(seg.placement.slot_gpu.numpy(),
                              weights=((old != new) & (new >= 0)).sum(0).numpy(), minlength=G)
        local = np.maximum(changed - recv.sum(1), 0)
        row = {"step": seg.start, "mismatched_slots": int(moved.mismatch.sum()),
               "lost": len(moved.lost), "map_mismatched_ranks": moved.map_mismatch,
               "copies_same_gpu": int(local.sum()), "copies_nvlink": int(recv[:, 0].sum()),
               "copies_rdma": int(recv[:, 1].sum()), "p2p_ops": len(moved.sent),
               "max_recv_copies": int(recv.sum(1).max(initial=0))}
        if priced:
            copies = np.stack([local, recv[:, 0], recv[:, 1]], 1)  # [G, 3] copies by source
            row["engine_stall_ms"] = model_ms(
                copies_stall_seconds(copies, spec.expert_bytes(), device), scale)
            row["model_stall_ms"] = model_stalls[seg.start]
        rows.append(row)
    pairs = 0
    if slot_load is not None and len(segments) > 1:
        pairs = int(slot_load[segments[1].start:].long().sum())
    L, P = first.phy2log.shape
    totals = {"slot_mismatch": sum(r["mismatched_slots"] for r in rows)
              / max(len(rows) * L * P, 1),
              "lost_experts": sum(r["lost"] for r in rows),
              "map_mismatch": sum(r["map_mismatched_ranks"] for r in rows),
              "moved_wrong_frac": wrong / pairs if pairs else 0.0,
              "engine_copies_nvlink": sum(r["copies_nvlink"] for r in rows),
              "engine_copies_rdma": sum(r["copies_rdma"] for r in rows),
              "engine_p2p_ops": sum(r["p2p_ops"] for r in rows),
              "engine_moved_bytes": model_bytes(
                  sum(r["copies_same_gpu"] + r["copies_nvlink"] + r["copies_rdma"] for r in rows),
                  spec.expert_bytes(), scale),
              "engine_cross_node_bytes": model_bytes(sum(r["copies_rdma"] for r in rows),
                                                     spec.expert_bytes(), scale),
              "engine_stall_ms": sum(r.get("engine_stall_ms", 0.0) for r in rows)
              if priced else None,
              "first_wrong_step": next((seg.start for seg in segments
                                        if (_wrong_output(results, seg) or 0) > 0), None)}
    return {"rows": rows, "totals": totals}


def _wrong_output(results: Any, seg: Any) -> float | None:
    """How wrong the output is over segment `seg`'s steps: the toy layer's relative error in
    "none", the share of pairs sent to a slot holding another expert in "a2a"; None for
    counts only."""
    c = results.counters
    if c is None:
        return None
    steps = slice(seg.start, seg.stop)
    if results.spec.dispatch.mode == "a2a":
        valid = int(c.valid[steps].sum())
        return int(c.wrong[steps].sum()) / valid if valid else 0.0
    err = c.error[steps]
    norm = float(err[..., 1].sum())
    return float(err[..., 0].sum() / norm) ** 0.5 if norm > 0 else 0.0
