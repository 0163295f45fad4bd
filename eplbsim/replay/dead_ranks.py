"""A run whose EP ranks die (DESIGN.md §16): from step `fail_at` on, the survivors serve on the
recovery placement, the pairs of experts left with no replica are lost, and the repair's
copies are priced as a rebalance's.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs = EP
ranks; `P'`, `G'` the survivors'.

`survive(trace, spec)` turns a run with `fail_ranks` into the survivors' run: the placement in
service at `fail_at` (the run's own: solved from the whole trace, given, or the schedule's
then) is repaired by `recovery` (`solvers.recovery`: a twin of vLLM #46370's or #38862's
recovery, or `resolve`, the run's solver on the survivors' slots, from the loads it solved the
placement in service from: the whole trace, or with a schedule the `window` steps before the
failure); the survivors are compacted in rank order (as #38862 strips the dead columns), on
nodes of the run's size where those divide them, else one node. The survivors' run serves that
placement over the steps from `fail_at` with the lost experts' pairs masked (`traces.lost`), so
every metric is the survivors' (a dead GPU does no work and is not averaged in) and the
dispatch never meets an expert with no replica; the placement is `partial` when one is lost.
What was lost and copied is the run's `Failure`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from ..cost.rebalance import copies_stall_seconds, layer_scale, model_bytes, model_ms
from ..engines import resolve_solver
from ..placement import Placement
from ..placement.topology import Topology
from ..runspec import RunSpec
from ..runspec.parts import SchedulePart
from ..schedule.transfers import transfer_kinds
from ..solvers import solve
from ..solvers.recovery import (RECOVERIES, RECOVERY_NAMES, lost_pairs, repair_slots,
                                replica_counts, resolve_survivors, survivor_slots)
from ..traces.lost import lost_view


@dataclass(frozen=True)
class Failure:
    """What dead ranks did to a run (module doc), its figures for the whole model.

    dead, at, recovery: the dead ranks, the first step they are dead, the recovery's name
    lost_experts: (layer, expert) pairs left with no replica
    lost_pairs:   routed pairs of those experts over the steps from `at`, never served
    lost_frac:    their share of the routed pairs of those steps (0 when there are none)
    copies:       survivor slots whose expert changed (`solvers.recovery.repair_copies`)
    from_disk:    of those, copies of experts no survivor held (no peer has the weights)
    repair_bytes: every copy's bytes, the whole model (`cost.rebalance.model_bytes`)
    repair_disk_bytes: the disk reloads' share of them
    repair_ms:    the stall of the copies from surviving peers, priced as a sync
                  rebalance's (`cost.rebalance.copies_stall_seconds`), the whole model; the
                  disk reloads are not in it (a device profile has no disk bandwidth)
    """

    dead: tuple[int, ...]
    at: int
    recovery: str
    lost_experts: int
    lost_pairs: float
    lost_frac: float
    copies: int
    from_disk: int
    repair_bytes: int
    repair_disk_bytes: int
    repair_ms: float

    def words(self) -> str:
        """One line for a run's header."""
        ranks = ",".join(map(str, self.dead))
        return (f"ranks {ranks} dead from step {self.at}, recovery {self.recovery}: "
                f"{self.lost_experts} (layer, expert) lost ({self.lost_frac:.2%} of the pairs); "
                f"the repair copies {self.copies} slots, {self.repair_bytes / 2**30:.3g} GiB "
                f"in the model, {self.from_disk} of them from disk "
                f"({self.repair_disk_bytes / 2**30:.3g} GiB, not priced), the peers' copies "
                f"stalling {self.repair_ms:.4g} ms")


def healthy(spec: RunSpec) -> RunSpec:
    """`spec` with no rank dead: the run the ranks serve before the failure."""
    return spec.replace(fail_ranks=None, fail_at=0, recovery=RECOVERY_NAMES[0])


def survive(trace: Any, spec: RunSpec, true_load: torch.Tensor,
            segments: Sequence[Any]) -> tuple[Any, RunSpec, Failure]:
    """`(trace', spec', failure)`: the survivors' run of `trace` under `spec` (decided for the
    trace, `replay.spec_for_trace`, with `fail_ranks`), `true_load [S, L, E]` its routed pairs
    and `segments` the schedule of its `healthy` run (module doc). InputError when `fail_at`
    is not a step of the trace."""
    topo = spec.topology
    S, L, E = true_load.shape
    if topo.fail_at >= S:
        raise InputError(f"fail_at {topo.fail_at} is not a step of the trace (it has {S})")
    before = next(s.placement for s in segments if s.start <= topo.fail_at < s.stop)
    dead, G, P = topo.fail_ranks, topo.gpus, before.num_slots
    alive = G - len(dead)
    per_node = before.topology.gpus_per_node
    survivors = Topology(alive, per_node if alive % per_node == 0 else alive)
    slots = survivor_slots(P, dead, G)
    if topo.recovery == "resolve":
        after = resolve_survivors(_solver(spec, trace), _resolve_load(spec, true_load),
                                  len(slots), alive, survivors.gpus_per_node)
    else:
        after = RECOVERIES[topo.recovery](before.phy2log, dead, G, E)
        if after.shape[1] == P:  # #46370 keeps the dead slots (-1): the survivors' are the rest
            after = after[:, slots]
    lost = replica_counts(after, E) == 0  # [L, E]
    served = Placement(after, E, survivors, partial=bool(lost.any()))
    pairs, frac = lost_pairs(true_load[topo.fail_at:], after)
    failure = Failure(dead, topo.fail_at, topo.recovery, int(lost.sum()), pairs, frac,
                      **_repair(spec, before.phy2log[:, slots], served, L))
    survived = replace(spec, schedule=SchedulePart(expert_bytes=spec.schedule.expert_bytes),
                       solver=replace(spec.solver, placement=served, solve_from="all"),
                       topology=replace(healthy(spec).topology, gpus=alive,
                                        redundant=len(slots) - E,
                                        gpus_per_node=survivors.gpus_per_node))
    return lost_view(trace, topo.fail_at, lost), survived, failure


def _solver(spec: RunSpec, trace: Any) -> Any:
    """The run's solver bound for `resolve_survivors`: `(load, slots, topology) -> phy2log`,
    with its options, and the run's expert groups where the load holds every expert."""
    name = resolve_solver(spec.solver.solver, spec.dispatch.engine_source)
    groups = spec.topology.groups or trace.num_groups or 1

    def place(load: torch.Tensor, num_slots: int, topology: Topology) -> torch.Tensor:
        return solve(name, load, num_slots, topology,
                     groups if load.shape[1] == trace.num_experts else 1,
                     **spec.solver.solver_options).phy2log
    return place


def _resolve_load(spec: RunSpec, true_load: torch.Tensor) -> torch.Tensor:
    """The loads `[L, E]` a full re-solve reads: those the placement in service was solved
    from, the whole trace's; with a schedule, the `window` steps before the failure (the whole
    trace's when it comes first)."""
    at, schedule = spec.topology.fail_at, spec.schedule
    if schedule.rebalance_every is None or at == 0:
        return true_load.sum(0).double()
    window = schedule.window or schedule.rebalance_every
    return true_load[max(0, at - window):at].sum(0).double()


def _repair(spec: RunSpec, old: torch.Tensor, served: Placement, num_layers: int
            ) -> dict[str, Any]:
    """What turning the survivors' old slots `old [L, P']` into `served` copies: each changed
    slot's copy from the nearest survivor holding its expert (`schedule.transfers`), or from
    disk where none does; bytes and the peers' stall for the whole model."""
    E = served.num_experts
    kinds = transfer_kinds(Placement(old, E, served.topology, partial=True), served)  # [L, P']
    changed, disk = repair_slots(old, served.phy2log, E)
    peers = np.where(disk.numpy(), -1, kinds)  # [L, P'] the copies a survivor sends
    per_gpu = np.zeros((served.topology.num_gpus, 3))
    gpu = np.broadcast_to(served.slot_gpu.numpy(), kinds.shape)
    for kind in range(3):
        np.add.at(per_gpu[:, kind], gpu[peers == kind], 1)
    scale = layer_scale(spec.cost, num_layers)
    expert_bytes = spec.expert_bytes()
    device = spec.cost.profiles()[1]
    copies, from_disk = int(changed.sum()), int(disk.sum())
    return {"copies": copies, "from_disk": from_disk,
            "repair_bytes": model_bytes(copies, expert_bytes, scale),
            "repair_disk_bytes": model_bytes(from_disk, expert_bytes, scale),
            "repair_ms": model_ms(copies_stall_seconds(per_gpu, expert_bytes, device), scale)}
