"""How far a placement is from the lower bound of its loads: `placement_gap` and the report
`eplbsim solve` prints.

Dimensions: `L` layers, `E` logical experts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..placement import Placement
from ..placement.loads import gpu_imbalance, gpu_loads, nanmean_or_none
from ..solvers.bounds import lower_bound


def placement_gap(placement: Placement, load: torch.Tensor | np.ndarray) -> torch.Tensor:
    """How far a placement is from the best possible one on `load`: float64 `[..., L]`.

    load: `[..., L, E]` pairs per logical expert (torch or numpy). The placement's max GPU load
    under an even split (`Placement.expected_load`, summed per GPU) over
    `solvers.bounds.lower_bound` for the same slots and GPUs; 1.0 is optimal, NaN where the
    bound is 0 (no load). A `partial` placement is bounded, per layer, over the experts it
    serves.
    """
    load = torch.as_tensor(load).detach().cpu().to(torch.float64)  # [..., L, E]
    peak = gpu_loads(placement.expected_load(load), placement.topology.num_gpus).amax(-1)
    P, G = placement.num_slots, placement.topology.num_gpus
    if placement.partial:  # each layer's bound over the experts it serves (the rest are lost)
        served = ~placement.lost  # [L, E]
        bound = torch.stack([torch.from_numpy(lower_bound(load[..., layer, kept].numpy(), P, G))
                             for layer, kept in enumerate(served)], -1)  # [..., L]
    else:
        bound = torch.from_numpy(lower_bound(load.reshape(-1, load.shape[-1]).numpy(), P, G))
        bound = bound.view(load.shape[:-1])  # [..., L]
    return torch.where(bound > 0, peak / torch.where(bound > 0, bound, 1.0), math.nan)


def placement_report(placement: Placement, load: torch.Tensor) -> dict[str, Any]:
    """What a placement promises on `load [L, E]`: `placement_imbalance` (mean over layers of
    the even split's max / mean GPU load), `placement_gap` (mean over layers) and
    `placement_gap_per_layer` (`[L]`)."""
    promised = gpu_loads(placement.expected_load(load), placement.topology.num_gpus)
    gap = placement_gap(placement, load)
    return {"placement_imbalance": nanmean_or_none(gpu_imbalance(promised)),
            "placement_gap": nanmean_or_none(gap), "placement_gap_per_layer": gap.tolist()}
