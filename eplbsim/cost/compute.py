"""Expert compute time of each GPU in one layer (DESIGN.md §8), `COST_MODELS` entries.

Dimensions: `...` any leading dims (steps, layers), `P` slots, `G` GPUs.

A cost model is `fn(pairs [..., G], active [..., G], shape, device) -> seconds [..., G]`
(float64): `pairs` the (token, expert) pairs a GPU executes, `active` its slots with at least one
pair (whose weights it reads). Both may be fractional (the balanced reference spreads the mean).
"""

from __future__ import annotations

import torch

from .devices import DeviceProfile
from .shapes import ModelShape

ETA_COMPUTE = 0.9  # roofline's share of peak FLOP/s: above the best measured H200 kernel (0.85)
ETA_MEMORY = 0.95  # roofline's share of HBM bandwidth: above the best plausible measured one (0.92)


def roofline_terms(pairs: torch.Tensor, active: torch.Tensor, shape: ModelShape,
                   device: DeviceProfile, eta_compute: float = ETA_COMPUTE,
                   eta_memory: float = ETA_MEMORY) -> tuple[torch.Tensor, torch.Tensor]:
    """The roofline's two terms, seconds `[..., G]` each: `(arithmetic, reads)`, FLOPs `6 H I`
    a pair over `peak x eta_compute`, and bytes (the weights of every active slot, `3 H I`
    weight elements, plus each pair's activations in and out, `2 H` activation elements) over
    `HBM x eta_memory`."""
    pairs, active = pairs.to(torch.float64), active.to(torch.float64)
    flops = pairs * shape.flops_per_pair
    moved = active * shape.expert_weight_bytes + pairs * 2 * shape.hidden * shape.bytes_of("act")
    return (flops / (device.peak_flops(shape.weight_dtype) * eta_compute),
            moved / (device.hbm * eta_memory))


def roofline(pairs: torch.Tensor, active: torch.Tensor, shape: ModelShape,
             device: DeviceProfile, eta_compute: float = ETA_COMPUTE,
             eta_memory: float = ETA_MEMORY) -> torch.Tensor:
    """`max(arithmetic, reads) + launch` (`roofline_terms`), seconds `[..., G]`. A lower bound
    in spirit: a measured kernel should not be faster."""
    return torch.maximum(*roofline_terms(pairs, active, shape, device, eta_compute,
                                         eta_memory)) + device.launch_s
