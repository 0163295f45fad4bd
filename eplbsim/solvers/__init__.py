"""Placement solvers: pure functions from expert loads to `phy2log`, in a plain dict registry.

Holds `SOLVERS` (here, one module a solver), the lower bounds and the migration-aware
layout. Takes in `load [L, E]` and a `Topology`; gives out `phy2log [L, P]`. Imports `base`,
`placement` and `cost` (affinity prices traffic): a solver never sees a token.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.

A solver is `solver(load, num_slots, topology, num_groups=1, **options) -> phy2log`, or
`-> (phy2log, info)` with a dict reporting on the solve (e.g. a proven bound):
  load:       float64 numpy `[L, E]` pairs per logical expert (non-negative, finite)
  num_slots:  `P`, a multiple of `G`, at least `E`
  topology:   a Topology; slot `p` lives on GPU `p // (P // G)`, GPU `g` on node
              `g // gpus_per_node`
  num_groups: expert groups for group-limited routing (contiguous blocks of `E / num_groups`)
  options:    keyword-only extras a solver may take, e.g. `anti_colocation` (no two replicas of
              one expert on one GPU) or `time_limit`; `solve` rejects options a solver lacks.
              An option in `COMPOSED_OPTIONS` (`balance`) is another solver the solver builds
              on: the solver takes it as a callable, and `solve` resolves a registry name
              into it, so no solver module imports this registry (no import loop)
  returns     int64 numpy `[L, P]`, the logical expert held by each physical slot.
Add one with one function and one line in `SOLVERS`; `solve` also takes any such callable.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import numpy as np
import torch

from ..base.errors import InputError, InputWarning, warn_caller
from ..base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_LOAD, MAX_SLOTS, check_at_most
from ..base.registry import lookup, name_of
from ..placement import Placement
from ..placement.topology import Topology
from .affinity import affinity
from .atom import atom_biased, atom_naive
from .budget import budget, widened
from .deepseek import deepseek
from .exact import exact
from .few_moves import check_previous, fewest_moves, moved_slots
from .flashlb import flashlb
from .flashlb_paper import flashlb_paper
from .lplb import lplb
from .lpt import lpt, lpt_hier
from .metro import metro
from .topology_aware import topology_aware
from .trivial import trivial
from .trtllm import trtllm_online

Solver = Callable[[np.ndarray, int, Topology, int], np.ndarray]

# Options `solve` itself takes for every solver (`solve_with_info`), beside each solver's own.
SOLVE_OPTIONS = ("migration_tolerance",)

# Options that name another solver the solver composes with (affinity keeps its `balance`
# solver's replication, as DeepSeek's eplb.py composes its stages): `solve_with_info` hands the
# solver the callable a registry name names (module doc).
COMPOSED_OPTIONS = ("balance",)

SOLVERS: dict[str, Solver] = {
    "trivial": trivial,
    "deepseek": deepseek,
    "exact": exact,
    "lpt": lpt,
    "lpt-hier": lpt_hier,
    "flashlb": flashlb,
    "flashlb-paper": flashlb_paper,
    "lplb": lplb,
    "trtllm-online": trtllm_online,
    "affinity": affinity,
    "budget": budget,
    "metro": metro,
    "topology-aware": topology_aware,
    "atom-naive": atom_naive,
    "atom-biased": atom_biased,
}

# Solvers whose placements are wider than the slots they are given, which are then a budget:
# `budget` spends `(P - E) x L` redundant slots unevenly over the layers, the rest of each
# layer's slots empty (-1). Each maps `(E, P, topology)` to the placement's slots.
WIDENS: dict[Solver, Callable[[int, int, Topology], int]] = {budget: widened}

# Solvers whose slot layout is part of the placement: `solve(previous=...)` does not lay their
# result over the placement in service (lplb's copies sit on GPUs its redundancy topology links;
# topology-aware's experts sit on the ranks their tokens come from; permuting GPUs or repairing
# the old placement would break the links).
KEEP_LAYOUT = frozenset({lplb, affinity, budget, topology_aware})

# Solvers that place no redundant experts (SGLang's topology-aware planner, which raises
# NotImplementedError there): `solve` refuses them a slot count other than the experts'.
NO_REDUNDANCY = frozenset({topology_aware})

# Solvers that never put two replicas of one expert on one GPU where the shape allows it
# (vLLM's FlashLB spreads an expert's replicas over distinct ranks): `solve(previous=...)`
# keeps that, as it does for any solver given `anti_colocation`.
SEPARATE_REPLICAS = frozenset({flashlb})


def find_solver(solver: str | Solver) -> Solver:
    """The solver a registry name or a callable names; InputError for an unknown name. An
    engine's solver (`sglang:deepseek`) is resolved above this package, where the engines are
    known (`engines.resolve_solver`), into the callable that runs it."""
    return lookup(SOLVERS, solver, "solver")


def placement_slots(solver: str | Solver, num_experts: int, num_slots: int,
                    topology: Topology) -> int:
    """The slots a layer of `solver`'s placements has when it is given `num_slots`:
    `num_slots`, or what a widening solver (`WIDENS`) makes of them."""
    widen = WIDENS.get(find_solver(solver))
    return num_slots if widen is None else widen(num_experts, num_slots, topology)


def solve_with_info(solver: str | Solver, load: Any, num_slots: int, topology: Topology,
                    num_groups: int = 1, *, previous: Any = None,
                    migration_tolerance: float = 0.005,
                    **options: Any) -> tuple[Placement, dict[str, Any]]:
    """Validate the inputs, run `solver` (a registry name or a callable) and wrap its result.

    load: `[L, E]` pairs per logical expert (numpy, torch or nested lists; never modified)
    previous: a Placement or `[L, P]` phy2log now in service; then, per layer, the result is
      the one of two candidates that changes fewer slots: the solver's placement laid out over
      the previous one (`align_to_previous`: same GPU loads), or the previous placement repaired
      for the new loads and replica counts (`warm_start`) when its max GPU load is within
      `migration_tolerance` (relative) of the solver's and it keeps the solver's rules (no two
      replicas of an expert on one GPU for a solver in `SEPARATE_REPLICAS` or given
      `anti_colocation`). Either way an expert that stays on its GPU stays in its slot.
      `info["moved_slots"]` reports it. A solver in `KEEP_LAYOUT` keeps its own layout;
      `info["moved_slots"]` still counts.
    num_groups: expert groups; groups that do not divide the experts are balanced globally (one
      group), as vLLM's and FastDeploy's `rebalance_experts` do, with an InputWarning and
      `info["notes"]` saying so
    options: keyword options the solver takes (e.g. `anti_colocation`, `time_limit`); an option
      it does not take is an InputError naming the ones it does; one in `COMPOSED_OPTIONS`
      (`balance`, a registry name or a callable) reaches the solver as the solver it names
    -> (Placement over `E` experts with `phy2log [L, P]`, the solver's report: a dict, empty
    unless the solver returned `(phy2log, info)` or `previous` was given). A solver's
    `info["order"]` (`[L, E, R]`, its replica order: `deepseek`'s and the engines' solvers
    give one) becomes the placement's `order`, as an engine publishes a solved placement
    (ascending when the placement was laid over `previous`, which loses the solver's ranks).
    InputError on bad input.
    """
    fn = find_solver(solver)
    array = as_load(load)  # [L, E] private float64 copy
    num_layers, num_experts = array.shape
    _check_shape(num_experts, num_slots, topology, num_groups)
    if fn in NO_REDUNDANCY and num_slots != num_experts:
        raise InputError(f"solver {name_of(fn)} places no redundant experts: it needs as many "
                         f"slots as the {num_experts} experts, got {num_slots}")
    notes = []
    if num_experts % num_groups:
        notes.append(f"{num_groups} groups do not divide the {num_experts} experts: balanced "
                     f"globally, as one group (vLLM's and FastDeploy's rebalance_experts do so "
                     f"where the groups do not divide over the nodes, and fail otherwise)")
        warn_caller(notes[-1], InputWarning)
        num_groups = 1
    options = check_options(fn, {**options, "migration_tolerance": migration_tolerance})
    migration_tolerance = options.pop("migration_tolerance")
    for key in COMPOSED_OPTIONS:
        if key in options:
            options[key] = find_solver(options[key])
    result = fn(array, num_slots, topology, num_groups, **options)
    phy2log, info = result if isinstance(result, tuple) else (result, {})
    phy2log = np.asarray(phy2log)  # [L, P]
    width = placement_slots(fn, num_experts, num_slots, topology)
    if phy2log.shape != (num_layers, width):
        raise InputError(f"solver {name_of(fn)} returned shape {phy2log.shape}, "
                         f"expected [layers, slots] = {(num_layers, width)}")
    info = dict(info)
    order = info.pop("order", None)  # the solver's replica order (an engine's solver gives it)
    if previous is not None and fn in KEEP_LAYOUT:
        prev = np.asarray(previous.phy2log.numpy() if isinstance(previous, Placement)
                          else previous)
        check_previous(prev, phy2log, num_experts, topology)
        info["moved_slots"] = int(moved_slots(prev, phy2log).sum())
    elif previous is not None:
        prev = previous.phy2log.numpy() if isinstance(previous, Placement) else previous
        separate = fn in SEPARATE_REPLICAS or bool(options.get("anti_colocation"))
        phy2log = fewest_moves(array, np.asarray(phy2log), np.asarray(prev), topology,
                               num_groups, migration_tolerance, separate, info)
    if notes:
        info["notes"] = [*info.get("notes", []), *notes]
    placement = Placement(torch.from_numpy(np.array(phy2log, dtype=np.int64)), num_experts,
                          topology)
    if order is not None:  # laid over the previous placement, the solver's ranks are lost:
        order = placement.log2phy if previous is not None and fn not in KEEP_LAYOUT else order
        placement = Placement(placement.phy2log, num_experts, topology, torch.as_tensor(order))
    return placement, info


def solve(solver: str | Solver, load: Any, num_slots: int, topology: Topology,
          num_groups: int = 1, **options: Any) -> Placement:
    """Place experts for the given loads: `solve_with_info` without its report.

    solver:     a `SOLVERS` name, an engine's (`ENGINE:ALGORITHM`, resolved above:
                `engines.resolve_solver`), `path/file.py:function` or a callable
    load:       float `[L, E]` pairs per logical expert (non-negative, finite)
    num_slots:  `P`, a multiple of `G`, at least `E`
    topology:   the cluster (`G` GPUs in `N` nodes)
    num_groups: expert groups for group-limited routing
    options:    the solver's keyword options and `SOLVE_OPTIONS` (`previous`, ...)
    Returns the `Placement` (`phy2log [L, P]`).
    """
    return solve_with_info(solver, load, num_slots, topology, num_groups, **options)[0]


def solver_options(fn: Solver) -> list[str]:
    """The keyword options a solver takes beyond `(load, num_slots, topology, num_groups)`."""
    params = list(inspect.signature(fn).parameters.values())[4:]
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_options(fn: Solver, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with switches as booleans; InputError for an option neither `fn` nor `solve`
    takes (`SOLVE_OPTIONS`), and for a value of the wrong kind: a switch (a boolean default)
    takes true, false, 1 or 0; a number a finite, non-negative number."""
    params = inspect.signature(fn).parameters
    defaults = {name: params[name].default for name in solver_options(fn)}
    defaults.update(migration_tolerance=inspect.signature(solve_with_info).parameters[
        "migration_tolerance"].default)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise InputError(f"solver {name_of(fn)} has no option {', '.join(unknown)}; its "
                             f"options are: {', '.join(solver_options(fn)) or 'none'} (and "
                             f"{', '.join(SOLVE_OPTIONS)} for every solver)")
    out = dict(options)
    for key, value in options.items():
        default = defaults.get(key)
        if isinstance(default, bool):
            if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
                raise InputError(f"solver option {key} must be true or false (or 1 or 0), got "
                                 f"{value!r}")
            out[key] = bool(value)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (isinstance(default, (int, float)) and not isinstance(default, bool)
                and not (number and math.isfinite(value) and value >= 0)):
            raise InputError(f"solver option {key} must be a finite number >= 0, got {value!r}")
    return out


def _has_bool(rows: Any) -> bool:
    """Whether nested lists hold a boolean (numpy would read True as 1)."""
    return isinstance(rows, bool) or (isinstance(rows, (list, tuple))
                                      and any(_has_bool(r) for r in rows))


def as_load(load: Any) -> np.ndarray:
    """A fresh float64 `[L, E]` copy of `load`, checked to be non-negative and finite."""
    if isinstance(load, torch.Tensor):
        load = load.detach().cpu().numpy()
    try:
        given = np.asarray(load)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise InputError(f"load is not a numeric [layers, experts] array ({exc})") from None
    if given.dtype.kind == "b" or _has_bool(load):
        raise InputError("load holds true/false values; it must hold numbers (pair counts)")
    if given.dtype.kind not in "iuf":
        what = {"U": "text", "S": "bytes",
                "O": "a value that is not one (null, a list or an object)"}.get(
            given.dtype.kind, f"{given.dtype} values")
        raise InputError(f"load must hold numbers (pair counts), got {what}")
    array = np.array(given, dtype=np.float64)  # always a copy
    if array.ndim != 2:
        raise InputError(f"load must be 2-D [layers, experts], got shape {array.shape}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InputError(f"load must have at least one layer and one expert, "
                         f"got shape {array.shape}")
    if not np.isfinite(array).all():
        raise InputError("load holds NaN or infinite values")
    if (array < 0).any():
        raise InputError("load holds negative values; loads are pair counts")
    check_at_most(array.shape[0], MAX_LAYERS, "the number of layers")
    check_at_most(array.shape[1], MAX_EXPERTS, "the number of experts")
    with np.errstate(over="ignore"):  # a sum that overflows is inf, refused just below
        totals = array.sum(1)
    if totals.max() > MAX_LOAD:
        raise InputError("load sums above 2**53 in a layer: loads are pair counts, which "
                         "float64 holds exactly only up to that")
    return array


def _check_shape(num_experts: int, num_slots: int, topology: Topology, num_groups: int) -> None:
    """Raise InputError unless `E <= P`, `G | P` and `num_groups` is a positive integer (one
    that does not divide `E` falls back to one group: `solve_with_info`)."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)):
        raise InputError(f"the number of slots must be an integer, got {num_slots!r}")
    if num_slots < num_experts:
        raise InputError(f"fewer slots than experts: {num_slots} physical slots for "
                         f"{num_experts} logical experts")
    check_at_most(int(num_slots), MAX_SLOTS, "the number of slots")
    if num_slots % topology.num_gpus:
        raise InputError(f"{num_slots} slots are not divisible by {topology.num_gpus} GPUs")
    if (isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer))
            or num_groups < 1):
        raise InputError(f"the number of groups must be a positive integer, got {num_groups!r}")
