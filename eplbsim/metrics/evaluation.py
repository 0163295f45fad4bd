"""Evaluating `METRICS` on a run: the components of every chunk, the summary (`Results.metrics`)
and the time series.

Dimensions: `S` steps, `L` layers.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import torch

from ..base.loops import summed
from .counters import Chunk
from .declared import METRICS, Metric
from .reductions import PER_LAYER, PER_STEP, WHOLE, total


def components(chunked: Iterable[Chunk], num_steps: int, num_layers: int, present: set[str],
               metrics: dict[str, Metric] | None = None
               ) -> dict[str, tuple[torch.Tensor, ...] | None]:
    """Every per-(step, layer) metric's components over the run, `[S, L]` each, assembled from
    the chunks in order, every metric of a chunk before the next (so memory holds one chunk's
    intermediates, not the run's); None for a metric that needs what the run lacks (`present`
    holds "executed", "counters" and "cost" when the run has them)."""
    chosen = {key: metric for key, metric in (METRICS if metrics is None else metrics).items()
              if metric.parts is not None}
    out: dict[str, tuple[torch.Tensor, ...] | None] = {
        key: None for key, metric in chosen.items()
        if metric.needs is not None and metric.needs not in present}
    for chunk in chunked:
        for key, metric in chosen.items():
            if key in out and out[key] is None:
                continue
            values = metric.parts(chunk)
            if key not in out:
                out[key] = tuple(torch.empty((num_steps, num_layers), dtype=v.dtype)
                                 for v in values)
            for dst, v in zip(out[key], values):
                dst[chunk.lo:chunk.hi] = v
    return {key: out.get(key) for key in chosen}


def _plain(value: torch.Tensor) -> float | int | None:
    """A 0-d tensor as a Python number, None for NaN."""
    if value.is_floating_point():
        number = float(value)
        return None if math.isnan(number) else number
    return int(value)


def _defined(metric: Metric, results: Any) -> bool:
    """Whether `metric` is defined for `results`: its mode ran and what it needs is there."""
    return ((metric.modes is None or results.spec.dispatch.mode in metric.modes)
            and (metric.needs is None or metric.needs in results.present))


def summary(results: Any, metrics: dict[str, Metric] | None = None) -> dict[str, Any]:
    """The value of every metric over the whole run of `results` (a `Results`), in order:
    None where undefined (another mode, or what it needs is absent); a `subkeys` metric as a
    dict."""
    out: dict[str, Any] = {}
    for key, metric in (METRICS if metrics is None else metrics).items():
        if not _defined(metric, results):
            out[key] = None
        elif metric.whole is not None:
            out[key] = metric.whole(results)
        else:
            value = metric.reduce(*results.components[key], dims=WHOLE)
            out[key] = (_plain(value) if metric.subkeys is None else
                        {sub: _plain(v) for sub, v in zip(metric.subkeys, value)})
    return out


def time_series(results: Any, per_layer: bool = False,
                metrics: dict[str, Metric] | None = None) -> dict[str, np.ndarray]:
    """Every per-(step, layer) metric per step (`per_layer`: per step and layer), as columns of
    equal length: `step` (and `layer`), `pairs` (routed non-padding pairs), then each metric's
    flat columns; NaN where undefined. Per step, pooled ratios sum counts over layers first;
    means average the layers' values, maxima maximise them."""
    S, L, _ = results.true_load.shape
    dims = PER_LAYER if per_layer else PER_STEP
    rows = S * L if per_layer else S
    columns = ({"step": torch.arange(S)} if not per_layer else
               {"step": torch.arange(S).repeat_interleave(L), "layer": torch.arange(L).repeat(S)})
    columns["pairs"] = total(summed(results.true_load, -1), dims=dims)
    for key, metric in (METRICS if metrics is None else metrics).items():
        if metric.parts is None:
            continue
        names = metric.flat_keys(key)
        if _defined(metric, results):
            value = metric.reduce(*results.components[key], dims=dims)
        else:
            value = torch.full((rows, len(names)), math.nan, dtype=torch.float64)
        value = value.reshape(rows, len(names))
        for i, name in enumerate(names):
            columns[name] = value[:, i]
    return {k: v.flatten().numpy() for k, v in columns.items()}
