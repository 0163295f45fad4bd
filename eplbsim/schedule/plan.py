"""Rebalance schedules: when the placement is re-solved, from which predicted loads, what each
move costs, and the best placement each stretch of steps could have had.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.

A schedule cuts the steps into segments at rebalance points:
- no `rebalance_every`: one segment, on the placement solved from the whole trace's loads (or
  the given `placement`);
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
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import metrics as M
from ..errors import InputError
from ..placement import Placement, trivial_placement
from .predictors import PREDICTORS
from ..registry import lookup, name_of
from ..solvers import solve
from ..topology import Topology

if TYPE_CHECKING:
    from ..replay import ReplayConfig

# One DeepSeek-V3 routed expert in bf16: gate, up and down projections of 7168 x 2048, 2 bytes.
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048 * 2
TRANSFER_KINDS = ("same_gpu", "same_node", "cross_node")


@dataclass(frozen=True, eq=False)
class Rebalance:
    """The decision taken at one rebalance point.

    step:         the first step served by the result
    skipped:      True when the placement in service was kept (balancedness above the threshold)
    balancedness: the placement in service's mean-over-layers balancedness (mean / max GPU load
                  of its even-split promise) on the forecast; NaN when the forecast is all zero
    transfers:    int64 `[L, 3]` expert copies per layer into slots whose expert changed, by
                  source: same GPU, same node, other node (`TRANSFER_KINDS`); zero when skipped
    """

    step: int
    skipped: bool
    balancedness: float
    transfers: np.ndarray

    @property
    def moved_slots(self) -> int:
        """Slots whose expert changed, over all layers."""
        return int(self.transfers.sum())


@dataclass(frozen=True, eq=False)
class Segment:
    """Steps `[start, stop)` served by one placement decision.

    placement: the placement in service over these steps
    best:      the solver's placement for these steps' true loads, at the same point
    rebalance: the decision taken at `start`; None for the first segment
    """

    start: int
    stop: int
    placement: Placement
    best: Placement
    rebalance: Rebalance | None


def transfer_counts(old: Placement, new: Placement) -> np.ndarray:
    """Expert copies needed to turn `old` into `new`: int64 `[L, 3]` per layer, by where the
    nearest old replica of a changed slot's new expert sits: on the slot's GPU, on its node, or
    only on other nodes (every expert has a replica in `old`, so some source always exists)."""
    old_p2l, new_p2l = old.phy2log, new.phy2log  # [L, P]
    if old_p2l.shape != new_p2l.shape or old.topology != new.topology:
        raise InputError(f"cannot compare placements of shapes {tuple(old_p2l.shape)} on "
                         f"{old.topology} and {tuple(new_p2l.shape)} on {new.topology}")
    L, P = old_p2l.shape
    E, G, N = old.num_experts, old.topology.num_gpus, old.topology.num_nodes
    gpu, node = old.slot_gpu, old.slot_node  # [P]
    layer = torch.arange(L).view(L, 1).expand(L, P)
    held_gpu = torch.zeros(L, G, E, dtype=torch.bool)
    held_gpu[layer, gpu.expand(L, P), old_p2l] = True  # [L, G, E] expert held on a GPU
    held_node = held_gpu.view(L, N, G // N, E).any(2)  # [L, N, E]
    changed = old_p2l != new_p2l  # [L, P]
    on_gpu = held_gpu[layer, gpu.expand(L, P), new_p2l] & changed
    on_node = held_node[layer, node.expand(L, P), new_p2l] & changed & ~on_gpu
    other = changed & ~on_gpu & ~on_node
    return torch.stack([on_gpu.sum(1), on_node.sum(1), other.sum(1)], 1).numpy()


def plan(true_load: torch.Tensor, cfg: "ReplayConfig", topology: Topology,
         num_groups: int) -> tuple[Segment, ...]:
    """The segments of `cfg`'s schedule over routed loads `true_load [S, L, E]` (module doc).

    Pure: solves every placement up front; the same inputs give the same segments. InputError
    on a bad setting or a predictor that returns something other than `[L, E]` finite,
    non-negative loads.
    """
    S, L, E = true_load.shape
    num_slots = E + cfg.num_redundant
    if cfg.num_redundant < 0:
        raise InputError(f"the number of redundant slots must be >= 0, got {cfg.num_redundant}")

    def solve_for(load: torch.Tensor, previous: Placement | None) -> Placement:
        return solve(cfg.solver, load, num_slots, topology, num_groups,
                     **({"previous": previous} if previous is not None else {}))

    whole = true_load.sum(0)  # [L, E]
    if cfg.placement is not None:
        given = _check_given(cfg.placement, L, E, topology, "given placement")
        return (Segment(0, S, given, solve_for(whole, None), None),)
    if cfg.rebalance_every is None:
        unused = [name for name, value, default in (
            ("window", cfg.window, None), ("predictor", cfg.predictor, "window"),
            ("decay", cfg.decay, None), ("initial", cfg.initial, None),
            ("skip_above", cfg.skip_above, None)) if value != default]
        if unused:
            raise InputError(f"{', '.join(unused)} only apply with rebalance_every (a "
                             f"rebalance schedule); without it one placement is solved from "
                             f"the whole trace")
        solved = solve_for(whole, None)
        return (Segment(0, S, solved, solved, None),)

    every, window, decay = _check_schedule(cfg)
    predictor = lookup(PREDICTORS, cfg.predictor, "predictor")
    current = (trivial_placement(L, E, num_slots, topology) if cfg.initial is None
               else _check_given(cfg.initial, L, E, topology, "initial placement"))
    bounds = [0] + list(range(window, S, every)) + [S]
    segments = []
    for lo, hi in zip(bounds, bounds[1:]):
        truth = true_load[lo:hi].sum(0).to(torch.float64)  # [L, E]
        previous = current if cfg.migration_aware else None
        if lo == 0:
            segments.append(Segment(lo, hi, current, solve_for(truth, previous), None))
            continue
        forecast = _check_forecast(predictor(true_load[:lo], true_load[lo:hi], window, decay),
                                   L, E, predictor)
        promised = M.gpu_loads(current.expected_load(forecast), topology.num_gpus)  # [L, G]
        balancedness = M.nanmean_or_none(M.balancedness(promised))
        balancedness = math.nan if balancedness is None else balancedness
        skipped = cfg.skip_above is not None and balancedness > cfg.skip_above
        new = current if skipped else solve_for(forecast, previous)
        best = new if not skipped and torch.equal(forecast, truth) else solve_for(truth, previous)
        rebalance = Rebalance(lo, skipped, balancedness, transfer_counts(current, new))
        segments.append(Segment(lo, hi, new, best, rebalance))
        current = new
    return tuple(segments)


def _check_schedule(cfg: "ReplayConfig") -> tuple[int, int, float]:
    """(every, window, decay) of a rebalancing config; InputError on a bad value."""
    every = cfg.rebalance_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InputError(f"rebalance_every must be a positive integer, got {every!r}")
    window = every if cfg.window is None else cfg.window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError(f"window must be a positive integer, got {window!r}")
    decay = 1.0 - 1.0 / window if cfg.decay is None else cfg.decay
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
        raise InputError(f"decay must be in [0, 1], got {decay!r}")
    skip = cfg.skip_above
    if skip is not None and not (isinstance(skip, (int, float)) and 0.0 <= skip <= 1.0):
        raise InputError(f"skip_above is a balancedness threshold in [0, 1], got {skip!r}")
    return every, window, float(decay)


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
