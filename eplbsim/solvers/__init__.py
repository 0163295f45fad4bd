"""Placement solvers: pure functions from expert loads to `phy2log`, in a plain dict registry.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.

A solver is `solver(load, num_slots, topology, num_groups=1) -> phy2log`:
  load:       float64 numpy `[L, E]` pairs per logical expert (non-negative, finite)
  num_slots:  `P`, a multiple of `G`, at least `E`
  topology:   a Topology; slot `p` lives on GPU `p // (P // G)`, GPU `g` on node
              `g // gpus_per_node`
  num_groups: expert groups for group-limited routing (contiguous blocks of `E / num_groups`)
  returns     int64 numpy `[L, P]`, the logical expert held by each physical slot.
Add one with one function and one line in `SOLVERS`; `solve` also takes any such callable.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import InputError
from ..placement import Placement
from ..registry import lookup, name_of
from ..topology import Topology
from .deepseek import deepseek
from .trivial import trivial

Solver = Callable[[np.ndarray, int, Topology, int], np.ndarray]

SOLVERS: dict[str, Solver] = {
    "trivial": trivial,
    "deepseek": deepseek,
}


def solve(solver: str | Solver, load: Any, num_slots: int, topology: Topology,
          num_groups: int = 1) -> Placement:
    """Validate the inputs, run `solver` (a registry name or a callable) and wrap its result.

    load: `[L, E]` pairs per logical expert (numpy, torch or nested lists; never modified)
    -> Placement over `E` experts with `phy2log [L, P]`. Raises InputError on bad input.
    """
    fn = lookup(SOLVERS, solver, "solver")
    array = _as_load(load)  # [L, E] private float64 copy
    num_layers, num_experts = array.shape
    _check_shape(num_experts, num_slots, topology, num_groups)
    phy2log = np.asarray(fn(array, num_slots, topology, num_groups))  # [L, P]
    if phy2log.shape != (num_layers, num_slots):
        raise InputError(f"solver {name_of(fn)} returned shape {phy2log.shape}, "
                         f"expected [layers, slots] = {(num_layers, num_slots)}")
    return Placement(torch.from_numpy(np.array(phy2log, dtype=np.int64)), num_experts, topology)


def _as_load(load: Any) -> np.ndarray:
    """A fresh float64 `[L, E]` copy of `load`, checked to be non-negative and finite."""
    if isinstance(load, torch.Tensor):
        load = load.detach().cpu().numpy()
    try:
        array = np.array(load, dtype=np.float64)  # always a copy
    except (TypeError, ValueError) as exc:
        raise InputError(f"load is not a numeric [layers, experts] array ({exc})") from None
    if array.ndim != 2:
        raise InputError(f"load must be 2-D [layers, experts], got shape {array.shape}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InputError(f"load must have at least one layer and one expert, "
                         f"got shape {array.shape}")
    if not np.isfinite(array).all():
        raise InputError("load holds NaN or infinite values")
    if (array < 0).any():
        raise InputError("load holds negative values; loads are pair counts")
    return array


def _check_shape(num_experts: int, num_slots: int, topology: Topology, num_groups: int) -> None:
    """Raise InputError unless `E <= P`, `G | P` and `num_groups | E`."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)):
        raise InputError(f"the number of slots must be an integer, got {num_slots!r}")
    if num_slots < num_experts:
        raise InputError(f"fewer slots than experts: {num_slots} physical slots for "
                         f"{num_experts} logical experts")
    if num_slots % topology.num_gpus:
        raise InputError(f"{num_slots} slots are not divisible by {topology.num_gpus} GPUs")
    if (isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer))
            or num_groups < 1):
        raise InputError(f"the number of groups must be a positive integer, got {num_groups!r}")
    if num_experts % num_groups:
        raise InputError(f"{num_groups} groups do not divide the {num_experts} experts")
