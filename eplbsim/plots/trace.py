"""Figures of one trace, before any placement: where its load goes (`paper.expert_load_heatmap`),
how much of each step the hottest experts carry, and each step's max / mean expert load.
`eplbsim figures --trace FILE` draws them for a user's own trace (`trace_figures`). Which
experts tokens choose together (`coactivation_heatmap`) reads the co-activation, which the
token rows give and the counts do not.

Dimensions: `S` steps, `L` MoE layers, `E` logical experts.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from matplotlib.figure import Figure

from ..base.errors import InputError
from ..placement.loads import max_over_mean, top_share
from ..traces.coactivation import grouped
from .paper import expert_load_heatmap
from .style import OKABE_ITO, from_baseline, pairs_per_step, step_axis


def _layers(L: int) -> str:
    return f"{L} layer" + ("" if L == 1 else "s")


def _over_steps(per_step: np.ndarray, title: str, ylabel: str, baseline: float,
                pairs: np.ndarray | None = None) -> Figure:
    """`per_step [S, L]` over the steps: the one layer's line, or with several the median over
    the layers and the band from their lowest to their highest. With `pairs [S]` (routed pairs
    of each step, a layer) that differ between steps, a panel under it of those pairs
    (`style.pairs_per_step`)."""
    S, L = per_step.shape
    ragged = pairs is not None and len(pairs) > 1 and pairs.min() < pairs.max()
    fig = Figure(figsize=(6.4, 4.2 if ragged else 3.2), layout="constrained")
    if ragged:
        ax, ax_pairs = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        pairs_per_step(ax_pairs, pairs)
    else:
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
    step_axis(ax.xaxis)
    if ragged:
        ax.set_xlabel("")
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
    `[S, L, E]` routed pairs.

    A step of few pairs cannot be even: `n` pairs over `E` experts put at least `ceil(n / E)`
    on one, so max / mean is at least `ceil(n / E) * E / n` (4.0 for a 1-token chunk of top-4
    over 16 experts). Where that floor exceeds 1.05 somewhere it is drawn (dotted grey, the
    median over layers), and where the steps differ in size (chunked prefill, ragged batches)
    a panel under the line shows each step's pairs: a spike on the floor is the step's size,
    not skew."""
    c = torch.as_tensor(np.asarray(counts, dtype=np.float64))
    E = c.shape[-1]
    n = c.sum(-1).numpy()  # [S, L] pairs of each step and layer
    fig = _over_steps(max_over_mean(c).numpy(), "Max / mean expert load of each step",
                      "max / mean\nexpert load", 1.0, pairs=n.mean(1))
    with np.errstate(all="ignore"):
        floor = np.nanmedian(np.where(n > 0, np.ceil(n / E) * E / n, np.nan), 1)  # [S]
    if np.nanmax(floor, initial=1.0) > 1.05:
        ax = fig.axes[0]
        ax.plot(np.arange(len(floor)), floor, color="0.35", linestyle=":", linewidth=1.2,
                label="the least its pairs allow")
        from_baseline(ax, 1.0)
        ax.legend(loc="best", fontsize="small")
    return fig


def coactivation_heatmap(pairs: Any, layer: int = 0, groups: int = 8) -> Figure:
    """How strongly each two experts of `layer` are chosen together: the pair counts of
    `pairs [L, E, E]` (`traces.coactivation`) over the geometric mean of the two experts'
    counts (1: always together), in expert order, and with the experts ordered by a partition
    into `groups` groups that keeps them together (`traces.coactivation.grouped`; `groups`
    lowered to the nearest divisor of `E`): hidden clusters show as blocks on the diagonal."""
    c = np.asarray(pairs, dtype=np.float64)
    L, E = c.shape[0], c.shape[-1]
    if not 0 <= layer < L:
        raise InputError(f"layer must be in [0, {L}), got {layer}")
    groups = max(g for g in range(1, min(groups, E) + 1) if E % g == 0)
    w = c[layer]
    scale = np.sqrt(np.maximum(np.diag(w), 1.0))
    strength = w / scale[:, None] / scale[None, :]
    np.fill_diagonal(strength, np.nan)
    order = np.argsort(grouped(c[layer:layer + 1], groups)[0], kind="stable")
    fig = Figure(figsize=(7.6, 3.6), layout="constrained")
    panels = fig.subplots(1, 2)
    top = np.nanmax(strength) if np.isfinite(strength).any() else 1.0
    for ax, data, title in ((panels[0], strength, "expert order"),
                            (panels[1], strength[np.ix_(order, order)],
                             f"grouped into {groups} groups")):
        image = ax.imshow(data, interpolation="nearest", cmap="viridis", vmin=0, vmax=top)
        ax.set_xlabel("expert" if title == "expert order" else "expert (grouped order)")
        ax.set_ylabel("expert")
        ax.set_title(title, fontsize="medium")
        ax.grid(False)
    fig.colorbar(image, ax=list(panels), label="chosen together\n(pairs / geometric mean)")
    fig.suptitle(f"Co-activation of layer {layer} ({E} experts)")
    return fig


TRACE_FIGURES: dict[str, Callable[[Any], Figure]] = {  # name -> figure of counts [S, L, E]
    "expert_load": expert_load_heatmap,
    "top_share": top_share_over_steps,
    "step_imbalance": step_imbalance,
}


def trace_figures(counts: Any, names: Any = None) -> dict[str, Figure]:
    """The figures `names` (default every one of `TRACE_FIGURES`) of a trace's `counts
    [S, L, E]`, by name."""
    return {name: TRACE_FIGURES[name](counts) for name in (names or TRACE_FIGURES)}
