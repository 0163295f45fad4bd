"""The cost model (DESIGN.md §8): what a replay counted, in seconds.

Dimensions: `...` any leading dims (steps, layers), `P` slots, `G` GPUs.

- `shapes.MODELS`: model shapes, `devices.DEVICES`: device profiles, each with its source.
- `COST_MODELS`: expert compute per GPU per layer, `fn(pairs, active, shape, device) ->
  seconds [..., G]` (`compute`); a user callable of that form is taken as well.
- `comm`: "a2a" dispatch and combine, the "none" all-reduce.
- `layer_seconds`: one layer's compute, its balanced reference and its total with
  communication.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..registry import lookup
from .compute import roofline
from .devices import DEVICES, DeviceProfile
from .shapes import MODELS, ModelShape

CostModel = Callable[[torch.Tensor, torch.Tensor, ModelShape, DeviceProfile], torch.Tensor]

COST_MODELS: dict[str, CostModel] = {
    "roofline": roofline,
}


def layer_seconds(pairs: torch.Tensor, active: torch.Tensor, comm_s: torch.Tensor,
                  shape: ModelShape | str, device: DeviceProfile | str,
                  model: CostModel | str = "roofline",
                  overlap: bool = False) -> dict[str, torch.Tensor]:
    """Seconds of each layer from the pairs each GPU executes `pairs [..., G]`, its slots
    with pairs `active [..., G]` (`metrics.gpu_loads` of the executed loads and of their
    nonzero entries) and the layer's communication `comm_s [...]`, float64 `[...]` each:

    - `compute`: the slowest GPU's expert time (`model`);
    - `compute_balanced`: the same with every GPU at the mean pairs and the mean active slots
      (the same work spread evenly; never above `compute` for a convex model such as
      `roofline`, equal to it when every GPU has the same pairs and active slots);
    - `total`, `total_balanced`: compute plus communication, or their max with `overlap`.
    """
    shape = lookup(MODELS, shape, "model") if isinstance(shape, str) else shape
    device = lookup(DEVICES, device, "device profile") if isinstance(device, str) else device
    fn = lookup(COST_MODELS, model, "cost model")
    compute = fn(pairs, active, shape, device).amax(-1)
    even = [x.mean(-1, keepdim=True).expand(x.shape) for x in (pairs, active)]
    balanced = fn(*even, shape, device).amax(-1)
    comm_s = comm_s.to(torch.float64)
    join: Any = torch.maximum if overlap else torch.add
    return {"compute": compute, "compute_balanced": balanced, "comm": comm_s,
            "total": join(compute, comm_s), "total_balanced": join(balanced, comm_s)}
