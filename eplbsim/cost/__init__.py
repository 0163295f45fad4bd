"""The cost model (DESIGN.md §8): what a replay counted, in seconds.

Holds the model shapes and device profiles, the compute models (`COST_MODELS`), the
communication of both modes and the rebalance stalls. Takes in counted loads (pairs per GPU and
layer), a model and a device; gives out seconds. Imports `base`, `placement` (the topology) and
`traces` (the model a trace names).

Dimensions: `...` any leading dims (steps, layers), `P` slots, `G` GPUs.

- `shapes.MODELS`: model shapes, `devices.DEVICES`: device profiles, each with its source.
- `COST_MODELS`: expert compute per GPU per layer, `fn(pairs, active, shape, device,
  **options) -> seconds [..., G]` (`compute.roofline`, `measured.measured`: aiconfigurator-core's
  measured kernels, an optional extra); a user callable of that form is taken as well, its
  keyword parameters being its options (`check_options`).
- `comm`: "a2a" dispatch and combine, the "none" all-reduce.
- `layer_seconds`: one layer's compute, its balanced reference and its total with
  communication.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..base.errors import InputError
from ..base.registry import lookup, name_of
from .compute import roofline
from .devices import DEVICES, DeviceProfile
from .measured import describe as measured_table
from .measured import measured
from .shapes import MODELS, ModelShape

CostModel = Callable[..., torch.Tensor]

COST_MODELS: dict[str, CostModel] = {
    "roofline": roofline,
    "measured": measured,
}


def check_options(model: CostModel | str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` if the cost model takes each as a keyword parameter (after `pairs, active,
    shape, device`) with a value of its default's kind (a number for a number, text for
    text; an `eta_*` efficiency in (0, 1]); else InputError listing its options."""
    fn = lookup(COST_MODELS, model, "cost model")
    params = list(inspect.signature(fn).parameters.values())[4:]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise InputError(f"cost model {name_of(fn)} has no option {', '.join(unknown)}; its "
                         f"options are: {', '.join(defaults) or 'none'}")
    for key, value in options.items():
        default = defaults[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(default, str) and not isinstance(value, str):
            raise InputError(f"cost option {key} must be text, got {value!r}")
        if isinstance(default, float) and not (number and value > 0):
            raise InputError(f"cost option {key} must be a number > 0, got {value!r}")
        if key.startswith("eta_") and value > 1:  # an efficiency: a share of the peak
            raise InputError(f"cost option {key} is an efficiency, a share of the device's "
                             f"peak in (0, 1], got {value!r}: above 1 claims faster than the "
                             f"device")
    return dict(options)


def describe(model: CostModel | str, shape: ModelShape, device: DeviceProfile, num_gpus: int,
             options: dict[str, Any] | None = None) -> str:
    """What a run's compute times come from: the measured table a `measured` run reads (which
    also checks, before a replay, that the table has the shape and EP size), else the model's
    name and options."""
    fn = lookup(COST_MODELS, model, "cost model")
    options = options or {}
    if fn is measured:
        return measured_table(shape, device, num_gpus, **options)
    given = ", ".join(f"{k}={v}" for k, v in options.items())
    return name_of(fn) + (f" ({given})" if given else "")


def layer_seconds(pairs: torch.Tensor, active: torch.Tensor, comm_s: torch.Tensor,
                  shape: ModelShape | str, device: DeviceProfile | str,
                  model: CostModel | str = "roofline", overlap: bool = False,
                  options: dict[str, Any] | None = None,
                  least_reads: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Seconds of each layer from the pairs each GPU executes `pairs [..., G]`, its slots
    with pairs `active [..., G]` (`metrics.gpu_loads` of the executed loads and of their
    nonzero entries) and the layer's communication `comm_s [...]`, float64 `[...]` each:

    - `compute`: the slowest GPU's expert time (`model`);
    - `compute_balanced`: the balanced reference (DESIGN.md §8), every GPU at the mean pairs
      reading `least_reads [...]` experts' weights: a run passes the step's routed experts,
      each read once, spread over the GPUs (`metrics.Chunk.least_reads`), the same for every
      policy; default the mean active slots. Never above `compute` for a model convex in
      pairs and weights and growing with them (`roofline`) while `least_reads` is at most the
      mean active slots; equal to it when every GPU has the same pairs and reads that many;
    - `total`, `total_balanced`: compute plus communication, or their max with `overlap`.

    `options` are the model's keyword options (`check_options`)."""
    shape = lookup(MODELS, shape, "model") if isinstance(shape, str) else shape
    device = lookup(DEVICES, device, "device profile") if isinstance(device, str) else device
    fn = lookup(COST_MODELS, model, "cost model")
    options = options or {}
    compute = fn(pairs, active, shape, device, **options).amax(-1)
    reads = active.to(torch.float64).mean(-1) if least_reads is None else least_reads
    balanced = fn(pairs.to(torch.float64).mean(-1, keepdim=True).expand(pairs.shape),
                  reads.to(torch.float64).unsqueeze(-1).expand(pairs.shape), shape, device,
                  **options).amax(-1)
    comm_s = comm_s.to(torch.float64)
    join: Any = torch.maximum if overlap else torch.add
    return {"compute": compute, "compute_balanced": balanced, "comm": comm_s,
            "total": join(compute, comm_s), "total_balanced": join(balanced, comm_s)}
