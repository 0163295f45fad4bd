"""Figures of one trace, before any placement: where its load goes (`paper.expert_load_heatmap`),
how much of each step the hottest experts carry, and each step's max / mean expert load.
`eplbsim figures --trace FILE` draws them for a user's own trace (`trace_figures`).

Dimensions: `S` steps, `L` MoE layers, `E` logical experts.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from matplotlib.figure import Figure

from ..loads import max_over_mean, top_share
from .paper import expert_load_heatmap
from .style import OKABE_ITO, from_baseline


def _layers(L: int) -> str:
    return f"{L} layer" + ("" if L == 1 else "s")


def _over_steps(per_step: np.ndarray, title: str, ylabel: str, baseline: float) -> Figure:
    """`per_step [S, L]` over the steps: the one layer's line, or with several the median over
    the layers and the band from their lowest to their highest."""
    S, L = per_step.shape
    fig = Figure(figsize=(6.4, 3.2), layout="constrained")
    ax = fig.subplots()
    steps = np.arange(S)
    if L == 1:
        ax.plot(steps, per_step[:, 0], color=OKABE_ITO[0], marker="." if S <= 64 else None)
    else:
        with np.errstate(all="ignore"):
            low, mid, high = (np.nanmin(per_step, 1), np.nanmedian(per_step, 1),
                              np.nanmax(per_step, 1))
        ax.fill_between(steps, low, high, color=OKABE_ITO[0], alpha=0.25, linewidth=0,
                        label="lowest to highest layer")
        ax.plot(steps, mid, color=OKABE_ITO[0], label="median layer")
        ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{S} steps, {_layers(L)}", fontsize="medium")
    from_baseline(ax, baseline)
    return fig


def top_share_over_steps(counts: Any, k: int | None = None) -> Figure:
    """The share of each step's pairs that its `k` hottest experts carry (default an eighth of
    the experts, at least one), per layer. counts: `[S, L, E]` routed pairs. An even load
    gives `k / E`."""
    c = torch.as_tensor(np.asarray(counts, dtype=np.float64))
    E = c.shape[-1]
    k = max(1, E // 8) if k is None else k
    share = 100 * top_share(c, k).numpy()  # [S, L]
    fig = _over_steps(share, f"Share of each step's pairs on its {k} hottest of {E} experts",
                      "share of the pairs (%)", 0.0)
    ax = fig.axes[0]
    ax.axhline(100 * k / E, color="0.5", linestyle=":", linewidth=1, label="an even load")
    ax.legend(loc="best", fontsize="small")
    return fig


def step_imbalance(counts: Any) -> Figure:
    """Each step's max / mean load over the experts, per layer (1.0 is even). counts:
    `[S, L, E]` routed pairs."""
    c = torch.as_tensor(np.asarray(counts, dtype=np.float64))
    return _over_steps(max_over_mean(c).numpy(), "Max / mean expert load of each step",
                       "max / mean\nexpert load", 1.0)


TRACE_FIGURES: dict[str, Callable[[Any], Figure]] = {  # name -> figure of counts [S, L, E]
    "expert_load": expert_load_heatmap,
    "top_share": top_share_over_steps,
    "step_imbalance": step_imbalance,
}


def trace_figures(counts: Any, names: Any = None) -> dict[str, Figure]:
    """The figures `names` (default every one of `TRACE_FIGURES`) of a trace's `counts
    [S, L, E]`, by name."""
    return {name: TRACE_FIGURES[name](counts) for name in (names or TRACE_FIGURES)}
