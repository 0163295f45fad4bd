"""Rebalance schedules: when the placement is re-solved, from which predicted loads, and the best
placement each stretch of steps could have had (what each move costs: `migration`).

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.

A schedule cuts the steps into segments at rebalance points:
- no `rebalance_every`: one segment, on the placement solved from the whole trace's loads (or
  the given `placement`, which excludes a schedule);
- `rebalance_every = n`, `window = W` (default n): steps `[0, W)` run on the initial placement
  (trivial, or `initial`); at each step `r = W + k n < S` the predictor forecasts the next
  `min(n, S - r)` steps from the steps before `r`, and the solver re-solves for that forecast,
  laid out over the placement in service when `migration_aware` (`solve(previous=...)`). With
  `skip_above = b` a rebalance is skipped, keeping the placement in service, when that
  placement's balancedness on the forecast is above `b`.

Each segment also records its *best* placement: what the solver returns, at the same point and
from the same placement in service, for the true loads of the segment's own steps. A placement's
promise on the true loads factors as (best's promise) x (ours / best's): solver quality times the
loss from prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from ..base.loops import summed
from ..base.registry import lookup, name_of
from ..placement import Placement, trivial_placement
from ..placement.loads import balancedness, gpu_loads, nanmean_or_none
from ..placement.topology import Topology
from ..solvers import find_solver, placement_slots, solve, solver_options
from .predictors import DEFAULT_DECAY, PREDICTORS, takes_hash_layers
from .switch import switched
from .transfers import transfer_counts


@dataclass(frozen=True, eq=False)
class Rebalance:
    """The decision taken at one rebalance point.

    step:         the first step served by the result
    skipped:      True when the placement in service was kept (balancedness above the threshold)
    balancedness: the placement in service's mean-over-layers balancedness (mean / max GPU load
                  of its even-split promise) on the forecast; NaN when the forecast is all zero
    transfers:    int64 `[L, 3]` expert copies per layer into slots whose expert changed
                  (none into a slot left empty), by source: same GPU, same node, other node
                  (`TRANSFER_KINDS`); zero when skipped
    """

    step: int
    skipped: bool
    balancedness: float
    transfers: np.ndarray

    @property
    def moved_slots(self) -> int:
        """Slots that received a copy (their expert changed; a slot left empty copies
        nothing), over all layers."""
        return int(self.transfers.sum())

    def __repr__(self) -> str:
        what = "skipped" if self.skipped else f"moved {self.moved_slots} slots"
        return f"Rebalance(step {self.step}, {what}, balancedness {self.balancedness:.4f})"


@dataclass(frozen=True, eq=False)
class Segment:
    """Steps `[start, stop)` served by one placement decision.

    placement: the placement in service over these steps
    best:      the solver's placement for these steps' true loads, at the same point (the
               placement itself when one is given: nothing is solved)
    rebalance: the decision that made it (taken at `rebalance.step`, which is `start` unless
               the copies land later: `async`); None for the first segment
    switch:    int64 `[G]` each rank's first step on `placement` when the ranks switch at
               different steps (`switch.switched`), all `>= start`; None when all switch at
               `start`
    """

    start: int
    stop: int
    placement: Placement
    best: Placement
    rebalance: Rebalance | None
    switch: np.ndarray | None = None

    def __repr__(self) -> str:
        made = "first" if self.rebalance is None else repr(self.rebalance)
        return f"Segment(steps {self.start}:{self.stop}, {made}, {self.placement!r})"


def plan(true_load: torch.Tensor, schedule: Any, solver: Any, topology: Topology,
         num_slots: int, num_groups: int, placement: Placement | None = None,
         initial: Placement | None = None, seed: int = 0,
         window_inputs: dict[str, Callable[[int, int], np.ndarray]] | None = None,
         hash_layers: Sequence[int] = ()) -> tuple[Segment, ...]:
    """The segments of a schedule over routed loads `true_load [S, L, E]` (module doc).

    schedule:  the run's schedule part (`runspec.SchedulePart`: `rebalance_every`, `window`,
               `predictor`, `decay`, `skip_above`, `migration_aware`, and how the ranks switch:
               `switch.switched`, whose delays `seed` draws), already checked
    solver:    the run's solver part (`runspec.SolverPart`: `solver` and `solver_options`)
    placement: a placement to serve every step instead of solving; initial: the placement
               before the first rebalance (default trivial)
    window_inputs: solver option -> `(lo, hi) -> array`, what the trace's steps `[lo, hi)`
               give a solver that takes that option beside their loads: `coactivation`, the
               expert pair counts `[L, E, E]` (`traces.coactivation`, for `affinity`), and
               `source_load`, the pairs each source rank sends each expert `[L, G, E]`
               (`ranks.traffic.source_load`, for `topology-aware`); empty for counts-only
               inputs
    hash_layers: the hash-routed layers (`traces.layer_kinds`), for a predictor that takes
               them (`predictors.hashed`)
    Pure: solves every placement up front; the same inputs give the same segments. InputError
    on a placement that does not fit, or a predictor that returns something other than
    `[L, E]` finite, non-negative loads.
    """
    S, L, E = true_load.shape

    takes = solver_options(find_solver(solver.solver))

    def solve_for(load: torch.Tensor, previous: Placement | None, lo: int, hi: int) -> Placement:
        """The solver's placement for `load [L, E]`; a solver that takes `history` (e.g.
        `flashlb`) also gets the per-step loads of steps `[lo, hi)` it stands for, one that
        takes an option of `window_inputs` what those steps give it."""
        extra = {"previous": previous} if previous is not None else {}
        if "history" in takes:
            extra["history"] = true_load[lo:hi].to(torch.float64).numpy()
        for option, of_steps in (window_inputs or {}).items():
            if option in takes:
                extra[option] = of_steps(lo, hi)
        return solve(solver.solver, load, num_slots, topology, num_groups,
                     **{**solver.solver_options, **extra})

    if placement is not None:
        given = _check_given(placement, L, E, topology, "given placement")
        return (Segment(0, S, given, given, None),)  # nothing solved: no solver to compare
    every = schedule.rebalance_every
    if every is None:
        solved = solve_for(summed(true_load, 0), None, 0, S)  # the whole trace's [L, E]
        return (Segment(0, S, solved, solved, None),)

    window = every if schedule.window is None else schedule.window
    predictor = lookup(PREDICTORS, schedule.predictor, "predictor")
    kinds = {"hash_layers": tuple(hash_layers)} if takes_hash_layers(predictor) else {}
    decay = (schedule.decay if schedule.decay is not None
             else DEFAULT_DECAY.get(predictor, 1.0 - 1.0 / window))
    width = placement_slots(solver.solver, E, num_slots, topology)  # a budget's are wider
    current = (trivial_placement(L, E, width, topology, num_slots) if initial is None
               else _check_given(initial, L, E, topology, "initial placement"))
    bounds = [0] + list(range(window, S, every)) + [S]
    segments = []
    for lo, hi in zip(bounds, bounds[1:]):
        truth = summed(true_load[lo:hi], 0).to(torch.float64)  # [L, E]
        previous = current if schedule.migration_aware else None
        if lo == 0:
            segments.append(Segment(lo, hi, current, solve_for(truth, previous, lo, hi), None))
            continue
        forecast = _check_forecast(predictor(true_load[:lo], true_load[lo:hi], window, decay,
                                             **kinds), L, E, predictor)
        promised = gpu_loads(current.expected_load(forecast), topology.num_gpus)  # [L, G]
        promised_balance = nanmean_or_none(balancedness(promised))
        promised_balance = math.nan if promised_balance is None else promised_balance
        skipped = schedule.skip_above is not None and promised_balance > schedule.skip_above
        new = current if skipped else solve_for(forecast, previous, max(0, lo - window), lo)
        best = (new if not skipped and torch.equal(forecast, truth)
                else solve_for(truth, previous, lo, hi))
        rebalance = Rebalance(lo, skipped, promised_balance, transfer_counts(current, new))
        segments.append(Segment(lo, hi, new, best, rebalance))
        current = new
    return switched(segments, schedule, seed, topology.num_gpus, S)


def epochs(segments: tuple[Segment, ...]) -> list[tuple[int, int, Placement]]:
    """`(start, stop, placement)` of each stretch of steps on one placement (consecutive
    segments that kept the placement, as a skipped rebalance does, are merged)."""
    out: list[tuple[int, int, Placement]] = []
    for seg in segments:
        if out and out[-1][2] is seg.placement:
            out[-1] = (out[-1][0], seg.stop, seg.placement)
        else:
            out.append((seg.start, seg.stop, seg.placement))
    return out


def _check_given(placement: Placement, num_layers: int, num_experts: int, topology: Topology,
                 what: str) -> Placement:
    """`placement` if it fits the trace and topology; else InputError."""
    if not isinstance(placement, Placement):
        raise InputError(f"the {what} must be a Placement, got {type(placement).__name__}")
    if placement.num_experts != num_experts or placement.num_layers != num_layers:
        raise InputError(f"the {what} is for {placement.num_layers} layers and "
                         f"{placement.num_experts} experts; the trace has {num_layers} layers "
                         f"and {num_experts} experts")
    if placement.topology != topology:
        raise InputError(f"the {what} is laid out on {placement.topology}, but the "
                         f"configuration asks for {topology}")
    return placement


def _check_forecast(forecast: object, num_layers: int, num_experts: int,
                    predictor: object) -> torch.Tensor:
    """A predictor's output as float64 `[L, E]`, or InputError naming the predictor."""
    name = name_of(predictor)
    if not isinstance(forecast, torch.Tensor):
        raise InputError(f"predictor {name} returned {type(forecast).__name__}, not a tensor")
    if tuple(forecast.shape) != (num_layers, num_experts):
        raise InputError(f"predictor {name} returned shape {tuple(forecast.shape)}, expected "
                         f"[layers, experts] = {(num_layers, num_experts)}")
    forecast = forecast.detach().cpu().to(torch.float64)
    if not torch.isfinite(forecast).all() or (forecast < 0).any():
        raise InputError(f"predictor {name} returned NaN, infinite or negative loads")
    return forecast
