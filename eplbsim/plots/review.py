"""The review page's figure: GPU imbalance by layer (bars up to `REVIEW_BARS` layers) or over
the held-out steps, candidate against baseline.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .style import handles_once, legend_below



REVIEW_BARS = 16  # up to this many layers, the review draws GPU imbalance by layer as bars


def review_figure(series: dict[str, Any], candidate: str, baseline: str) -> Figure:
    """A review's small multiples (`review.Report.series`), candidate beside baseline: GPU
    imbalance by layer (grouped bars rising from 1 up to `REVIEW_BARS` layers, lines beyond),
    ms a step over the scored steps, and each replicated slot's executed pairs over its even
    share (sorted); one legend below, the names wrapped (`style.wrap_name`)."""
    fig = Figure(figsize=(10.5, 2.8), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    layers = len(series["layer_imbalance"]["candidate"])
    for i, (name, label, style) in enumerate((("candidate", candidate, "-o"),
                                              ("baseline", baseline, "--s"))):
        per_layer = np.array(series["layer_imbalance"][name], dtype=float)  # None -> NaN
        if layers <= REVIEW_BARS:
            axes[0].bar(np.arange(layers) + (i - 0.5) * 0.4, per_layer - 1, width=0.4, bottom=1,
                        label=label)
        else:
            axes[0].plot(per_layer, style, ms=3, label=label)
        if series["step_ms"][name] is not None:
            axes[1].plot(series["step_ms"][name], style, ms=3, label=label)
        axes[2].plot(series["replica_share"][name], style, ms=2, label=label)
    for ax, title, xlabel in zip(axes, ("GPU imbalance by layer", "ms a step",
                                        "replica load / even share"),
                                 ("layer", "scored step", "replicated slot (sorted)")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.tick_params(labelsize=8)
    if layers <= REVIEW_BARS:
        axes[0].set_xticks(range(layers))
        axes[0].set_xlim(-0.75, layers - 0.25)
    legend_below(fig, handles_once(axes[:1]), fontsize=8)
    return fig
