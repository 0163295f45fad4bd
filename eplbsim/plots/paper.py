"""The paper figures of the notebooks: heatmaps, bars by policy and mode, redundancy and solver
curves, predictors over time, time and stalls, switch hazards and workload batching.

Dimensions: `S` steps, `L` MoE layers, `E` logical experts, `P` physical slots.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from ..base.errors import InputError
from ..base.registry import name_of
from ..metrics import rebalance_stalls
from ..replay.results import Results
from ..schedule.switch import phases
from .runs import replica_load
from .style import (OKABE_ITO, from_baseline, handles_once, legend_below, legend_once, mode_patch,
                    policy_styles, ratio_bars, run_labels, run_lines, step_axis, wrap_name)



LAYER_TICKS = 16  # layers a heatmap names one by one; more get evenly spaced ticks
BAR_PANEL_CHARS = 36  # 7-point characters across one bar panel of `workload_batching` (2 in)


def expert_load_heatmap(counts: Any, layer: int = 0) -> Figure:
    """Where the load goes: each layer's share of pairs per expert over the whole trace, and
    `layer`'s share per expert at every step.

    counts: `[S, L, E]` routed pairs (numpy or torch). Returns a new Figure (two heatmaps,
    viridis, shares in percent of the layer's or the step's pairs)."""
    c = np.asarray(counts, dtype=np.float64)  # [S, L, E]
    S, L, E = c.shape
    if not 0 <= layer < L:
        raise InputError(f"layer must be in [0, {L}), got {layer}")
    whole = c.sum(0)  # [L, E]
    share = 100 * whole / np.maximum(whole.sum(-1, keepdims=True), 1)
    steps = 100 * c[:, layer] / np.maximum(c[:, layer].sum(-1, keepdims=True), 1)  # [S, E]
    fig = Figure(figsize=(7.0, 3.4), layout="constrained")
    ax_all, ax_time = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
    panels = [(ax_time, steps, "step", f"layer {layer}, every step")]
    if L == 1:  # one layer: its share per expert as bars, not one row stretched into stripes
        ax_all.bar(np.arange(E), share[0], width=1.0, color="#0072B2")
        ax_all.set(xlabel="logical expert", ylabel="share of the pairs (%)",
                   title="whole trace, its layer")
        ax_all.set_xlim(-0.5, E - 0.5)
    else:
        panels.insert(0, (ax_all, share, "MoE layer", "whole trace, every layer"))
    for ax, data, ylabel, title in panels:
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis",
                          origin="lower", vmin=0)
        ax.set_xlabel("logical expert")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(False)
        fig.colorbar(image, ax=ax, label="share of the pairs (%)")
    step_axis(ax_time.yaxis)
    if L > 1:  # every layer named up to LAYER_TICKS of them, else evenly spaced whole numbers
        ax_all.yaxis.set_major_locator(MaxNLocator(nbins=min(L, LAYER_TICKS), integer=True))
    fig.suptitle(f"Expert load ({S} steps, {L} layer{'' if L == 1 else 's'}, {E} experts)")
    return fig


VALUED_ROWS = 8  # up to this many policies, policy_mode_bars writes each bar's value


def policy_mode_bars(results: Sequence[Results]) -> Figure:
    """GPU imbalance and worst-step replica skew of every (policy, mode): a row a run label
    (`run_labels`), a horizontal bar a mode rising from the ideal 1.0, in the policy's colour
    (`policy_style`), filled for "none" and hollow for "a2a" (`style.ratio_bars`); up to
    `VALUED_ROWS` rows each bar says its value. The figure grows a row at a time.
    results: e.g. `replay.compare` output."""
    results = list(results)
    if not results:
        raise InputError("policy_mode_bars needs at least one result")
    rows = list(dict.fromkeys(run_labels(results)))
    modes = list(dict.fromkeys(r.spec.dispatch.mode for r in results))
    names = [wrap_name(label) for label in rows]
    lines = sum(name.count("\n") + 1 for name in names)
    fig = Figure(figsize=(7.0, 0.9 + max(0.13 * lines, (0.1 + 0.12 * len(modes)) * len(rows))),
                 layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, xlabel in zip(axes, ("gpu_imbalance", "replica_skew_max"), (
            "GPU imbalance\n(max / mean GPU load)",
            "replica skew, worst step\n(max / mean replica load)")):
        ratio_bars(ax, results, rows, modes, key, values=len(rows) <= VALUED_ROWS)
        ax.set_xlabel(xlabel)
    axes[0].set_yticks(range(len(rows)), names)
    if len(modes) > 1:
        fig.legend(handles=[mode_patch(m) for m in modes], loc="outside right upper",
                   fontsize="small")
    return fig


def redundancy_curves(rows: Sequence[dict[str, Any]]) -> Figure:
    """Rank agreement, multiplicity and output error against the number of redundant experts,
    one line per policy ("none" mode).

    rows: table rows (`Results.row()` plus `redundant`), several policies and redundancies."""
    rows = list(rows)
    if not rows:
        raise InputError("redundancy_curves needs at least one row")
    fig = Figure(figsize=(7.2, 2.6), layout="constrained")
    ax_agree, ax_mult, ax_err = fig.subplots(1, 3, sharex=True)
    styles = policy_styles(r["policy"] for r in rows)
    for i, (policy, own) in enumerate(styles.items()):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["redundant"])
        xs = [r["redundant"] for r in mine]
        # later policies drawn thinner on top, so coinciding lines (at 1 or 0) stay visible
        style = dict(**own, ms=3.5, linewidth=max(0.8, 2.8 - 0.6 * i))
        ax_agree.plot(xs, [r["rank_agreement"] for r in mine], label=policy, **style)
        ax_mult.plot(xs, [r["multiplicity"]["2+"] for r in mine], **style)
        ax_mult.plot(xs, [r["multiplicity"]["0"] for r in mine], linestyle="--", **style)
        ax_err.plot(xs, [r["output_rel_error"] for r in mine], **style)
    ax_agree.set_ylabel("rank agreement\n(fraction of pairs)")
    ax_mult.set_ylabel("fraction of pairs")
    ax_err.set_ylabel("output error\n||Y − Y*|| / ||Y*||")
    for ax in (ax_agree, ax_mult, ax_err):
        ax.set_xlabel("redundant experts (slots)")
        from_baseline(ax, 0.0)
    keys = [*ax_agree.get_legend_handles_labels()[0],
            Line2D([], [], color="k", label="c ≥ 2 (duplicated)"),
            Line2D([], [], color="k", linestyle="--", label="c = 0 (dropped)")]
    legend_below(fig, keys)
    fig.suptitle('"none" mode: what disagreeing ranks do as redundancy grows')
    return fig


def replica_loads_pair(results: Sequence[Results], layer: int, expert: int) -> Figure:
    """One expert's replicas over time under each result's policy (e.g. `row` and `ordinal`
    on the template scenario), one panel per result sharing the y axis; dashed: the even
    split; one legend, in the last panel. All results must use one placement with >= 2
    replicas of `expert` in `layer`."""
    results = list(results)
    if not results:
        raise InputError("replica_loads_pair needs at least one result")
    fig = Figure(figsize=(3.5 * len(results), 2.6), layout="constrained")
    axes = fig.subplots(1, len(results), sharey=True, squeeze=False)[0]
    for ax, result in zip(axes, results):
        (_, _, placement), = result.epochs[:1]
        n = int(placement.logcnt[layer, expert])
        if n < 2:
            raise InputError(f"expert {expert} has {n} replica in layer {layer}")
        steps = range(result.slot_load.shape[0])
        for j in range(n):
            gpu = int(placement.slot_gpu[placement.log2phy[layer, expert, j]])
            ax.plot(steps, [replica_load(result, placement, s, layer, expert, j)
                            for s in steps], color=OKABE_ITO[j % len(OKABE_ITO)],
                    label=f"replica {j} (GPU {gpu})")
        even = result.true_load[:, layer, expert].double() / n
        ax.plot(steps, even.tolist(), "k--", linewidth=1, label="even split")
        ax.set_title(wrap_name(result.policy))
        step_axis(ax.xaxis)
    from_baseline(axes[0], 0.0)
    legend_once(axes[-1], axes, loc="lower right", fontsize=7)
    axes[0].set_ylabel("pairs executed per step")
    fig.suptitle(f"One hot expert's replicas (layer {layer}, expert {expert})")
    return fig


def solver_gap_lines(rows: Sequence[dict[str, Any]]) -> Figure:
    """Each solver's placement gap (max GPU load over the lower bound, 1 = provably optimal)
    against the number of redundant slots. rows: dicts with `solver`, `redundant`, `gap`."""
    rows = list(rows)
    if not rows:
        raise InputError("solver_gap_lines needs at least one row")
    fig = Figure(figsize=(3.6, 2.8), layout="constrained")
    ax = fig.subplots()
    markers = "os^Dv"
    for i, solver in enumerate(dict.fromkeys(r["solver"] for r in rows)):
        mine = sorted((r for r in rows if r["solver"] == solver), key=lambda r: r["redundant"])
        ax.plot([r["redundant"] for r in mine], [r["gap"] for r in mine],
                marker=markers[i % len(markers)], ms=4, color=OKABE_ITO[i % len(OKABE_ITO)],
                label=solver)
    ax.axhline(1.0, color="0.2", linewidth=0.8)
    ax.set_xlabel("redundant experts (slots)")
    ax.set_ylabel("max GPU load / lower bound")
    ax.legend(title="solver")
    return fig


def predictor_time_series(results: Sequence[Results], highlight: tuple[int, int] | None = None
                          ) -> Figure:
    """GPU imbalance per step under each result's predictor (same trace and schedule), and
    the experts each one moved at every rebalance. `highlight`: a `[start, stop)` span of
    steps to shade (e.g. a burst)."""
    results = list(results)
    if not results:
        raise InputError("predictor_time_series needs at least one result")
    fig = Figure(figsize=(7.0, 3.8), layout="constrained")
    ax_imb, ax_move = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    width = 0.8 * (results[0].spec.schedule.rebalance_every or 1) / (len(results) + 1)
    for i, result in enumerate(results):
        name = name_of(result.spec.schedule.predictor)
        color = OKABE_ITO[i % len(OKABE_ITO)]
        series = result.time_series()
        ax_imb.plot(series["step"], series["gpu_imbalance"], color=color, label=name)
        moves = result.migrations()
        ax_move.bar([m["step"] + (i - (len(results) - 1) / 2) * width for m in moves],
                    [m["moved_slots"] for m in moves], width=width, color=color, label=name)
    for ax in (ax_imb, ax_move):
        if highlight is not None:
            ax.axvspan(*highlight, color="0.85", zorder=0, linewidth=0)
        for m in results[0].migrations():
            ax.axvline(m["step"], color="0.5", linestyle=":", linewidth=0.8, zorder=1)
    ax_imb.set_ylabel("GPU imbalance\n(max / mean GPU load)")
    from_baseline(ax_imb, 1.0)
    ax_imb.legend(title="predictor", loc="lower left", bbox_to_anchor=(0.0, 1.0),
                  ncol=len(results), title_fontsize=8, alignment="left")
    ax_move.set_ylabel("experts moved\n(slots)")
    step_axis(ax_move.xaxis)
    return fig


def time_bars_and_stalls(results: Sequence[Results], over_time: Sequence[Results]) -> Figure:
    """Left: MoE time per step of every (policy, mode) in `results`, expert compute and
    communication stacked (greys), the balanced reference (`moe_ms_balanced`) dashed; its
    labels turn upright past `VALUED_ROWS` bars, and the figure widens with them. Right:
    MoE time per step of each of `over_time` (one trace and schedule, rebalancing) in its look
    (`run_lines`), with the stall each rebalance costs when serving waits for its copies
    (`sync`) as bars in its colour; the time axis is zoomed into the lines, and its label says
    where it starts. One legend, below. Every result must have a cost model (`spec.cost`)."""
    results, over_time = list(results), list(over_time)
    if not results or not over_time:
        raise InputError("time_bars_and_stalls needs results in both panels")
    upright = len(results) > VALUED_ROWS
    labels = [f"{name} ({r.spec.dispatch.mode})".replace("\n", ", ") if upright
              else wrap_name(f"{name}\n{r.spec.dispatch.mode}")
              for name, r in zip(run_labels(results), results)]
    bars = max(3.6, 0.2 * len(results))  # inches: upright labels side by side
    below = 0.05 * max(len(label) for label in labels) if upright else 0.0  # and their length
    fig = Figure(figsize=(bars + 3.4, 2.8 + below), layout="constrained")
    ax_bar, ax_time = fig.subplots(1, 2, gridspec_kw={"width_ratios": [bars, 2.6]})
    x = np.arange(len(results))
    compute = [r.metrics["compute_ms"] for r in results]
    comm = [r.metrics["comm_ms"] for r in results]
    ax_bar.bar(x, compute, color="0.45", label="expert compute")
    ax_bar.bar(x, comm, bottom=compute, color="0.75", label="communication")
    for i, r in enumerate(results):
        ax_bar.hlines(r.metrics["moe_ms_balanced"], i - 0.4, i + 0.4, colors="k",
                      linestyles="--", linewidth=1.0, label="balanced" if i == 0 else None)
    ax_bar.set_xticks(x, labels, rotation=90 if upright else 0,
                      fontsize="x-small" if upright else None)
    ax_bar.set_ylabel("MoE time per step (ms)")
    ax_bar.grid(False, axis="x")
    stalls = ax_time.twinx()
    for i, (name, r, look) in enumerate(zip(run_labels(over_time), over_time,
                                            run_lines(over_time))):
        series = r.time_series()
        ax_time.plot(series["step"], series["moe_ms"], label=name, markersize=4,
                     markevery=max(1, len(series["step"]) // 12), **look)
        marks = rebalance_stalls(r)
        stalls.bar([step + (i - (len(over_time) - 1) / 2) * 0.8 for step, _ in marks],
                   [ms for _, ms in marks], width=0.8, color=look["color"], alpha=0.5)
    step_axis(ax_time.xaxis)
    bottom = ax_time.get_ylim()[0]  # zoomed into the lines (a few percent apart): say so
    ax_time.set_ylabel("MoE time per step (ms)"
                       + (f"\n(axis starts at {bottom:.3g}, not 0)" if bottom > 0 else ""))
    stalls.set_ylabel("rebalance stall\n(ms, bars)")
    stalls.grid(False)
    legend_below(fig, [*ax_bar.get_legend_handles_labels()[0],
                       *ax_time.get_legend_handles_labels()[0]])
    return fig


def switch_hazard(results: Sequence[Results]) -> Figure:
    """What ranks switching placements at different steps corrupt, per step, for results of
    async rebalancing (`spec.schedule.rebalance_mode`): in "a2a" (top) the share of pairs sent
    to a slot holding another expert's weights (`wrong_expert_frac`), in "none" (bottom) the
    share of pairs not executed exactly once; one line per result in its look (`run_lines`,
    modes apart: the policy's colour and marker, a line style for each other setting; the
    same in both panels, one legend below), each hazard window (steps on which its ranks
    serve different placements) shaded in its colour, the rebalance decisions dotted."""
    results = list(results)
    modes = [m for m in ("a2a", "none") if any(r.spec.dispatch.mode == m for r in results)]
    if not modes:
        raise InputError("switch_hazard needs at least one result")
    fig = Figure(figsize=(7.0, 1.3 + 1.4 * len(modes)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(modes), 1, sharex=True))
    labels = run_labels(results)
    looks = run_lines(results, modes_apart=True)
    for ax, mode in zip(axes, modes):
        for name, r, look in zip(labels, results, looks):
            if r.spec.dispatch.mode != mode:
                continue
            color = look["color"]
            series = r.time_series()
            share = (series["wrong_expert_frac"] if mode == "a2a"
                     else 1 - series["multiplicity_1"])
            ax.plot(series["step"], 100 * share, label=name.replace("\n", ", "),
                    drawstyle="steps-post", markersize=4,
                    markevery=max(1, len(series["step"]) // 12), **look)
            for lo, hi, _, serving in phases(r.segments):
                if serving is not None:
                    ax.axvspan(lo, hi, color=color, alpha=0.15, linewidth=0, zorder=0)
        for m in results[0].migrations():
            ax.axvline(m["step"], color="0.5", linestyle=":", linewidth=0.8, zorder=1)
        ax.set_ylabel("wrong-expert pairs (%)\na2a" if mode == "a2a"
                      else "pairs not run once (%)\nnone")
        from_baseline(ax, 0.0)
    legend_below(fig, handles_once(axes))
    step_axis(axes[-1].xaxis)
    return fig


def workload_batching(rows: Sequence[tuple[str, Results]], counts: Any,
                      layer: int = 0) -> Figure:
    """How an engine's batching moves the load (DESIGN.md §9). Left and middle: replica skew
    (mean over replicated experts, per step) and GPU imbalance of every `(batching, result)` of
    `rows`, grouped by batching (its name wrapped to the group's width), one bar per policy
    (in its `policy_styles` colour). Right: `layer`'s share of pairs per expert at every step
    of one batched trace's routed loads `counts [S, L, E]` (the phantom experts routed padding
    heats show as bright columns)."""
    rows = list(rows)
    if not rows:
        raise InputError("workload_batching needs at least one result")
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 3 or not 0 <= layer < c.shape[1]:
        raise InputError(f"counts must be [steps, layers, experts] with layer {layer}")
    fig = Figure(figsize=(8.0, 2.8), layout="constrained")
    ax_skew, ax_gpu, ax_heat = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 1]})
    batchings = list(dict.fromkeys(name for name, _ in rows))
    names = [wrap_name(b, max(BAR_PANEL_CHARS // len(batchings), 6)) for b in batchings]
    policies = list(dict.fromkeys(r.policy for _, r in rows))
    styles = policy_styles(policies)
    width = 0.8 / len(policies)
    for ax, key, label in ((ax_skew, "replica_skew_mean", "replica skew\n(max / mean)"),
                           (ax_gpu, "gpu_imbalance", "GPU imbalance\n(max / mean)")):
        for j, policy in enumerate(policies):
            xs, heights = [], []
            for name, r in rows:
                if r.policy == policy:
                    xs.append(batchings.index(name) + (j - (len(policies) - 1) / 2) * width)
                    heights.append(r.metrics[key] - 1.0)
            ax.bar(xs, heights, width=width * 0.92, bottom=1.0, color=styles[policy]["color"],
                   label=policy)
        ax.axhline(1.0, color="0.2", linewidth=0.8)
        ax.set_xticks(range(len(batchings)), names, fontsize=7)
        ax.set_ylabel(label)
        ax.grid(False, axis="x")
    share = 100 * c[:, layer] / np.maximum(c[:, layer].sum(-1, keepdims=True), 1)  # [S, E]
    image = ax_heat.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest",
                           vmin=0)
    ax_heat.set_xlabel("expert")
    ax_heat.grid(False)
    fig.colorbar(image, ax=ax_heat, label=f"layer {layer} pairs (%)")
    step_axis(ax_heat.yaxis)
    legend_below(fig, ax_skew.get_legend_handles_labels()[0])
    return fig
