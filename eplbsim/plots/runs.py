"""Figures of one comparison's runs: policies side by side (`policy_comparison`), one expert's
replica loads over time, and every run's per-step series.

Dimensions: `S` steps, `L` MoE layers, `E` logical experts, `P` physical slots, `R` max
replicas of one expert, `G` GPUs = EP ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

from matplotlib import rcParams
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from ..base.errors import InputError
from ..base.registry import name_of
from ..dispatch import resolve_policy
from ..replay.results import Results
from .style import (MODE_LINES, OKABE_ITO, PAPER_STYLE, common_title, draw_dot, from_baseline,
                    legend_below, mark_na, mode_key, multiplicity_bars, pairs_per_step,
                    policy_styles, run_labels, run_lines, step_axis, wrap_name)


_LOAD_PANELS = (  # (metric, panel title, axis label) of `policy_comparison`'s ratio panels
    ("gpu_imbalance", "GPU imbalance", "max / mean\nGPU load"),
    ("replica_skew_max", "Replica skew,\nworst step", "max / mean\nreplica load"),
    ("replica_skew_cumulative", "Replica skew,\nall steps", "max / mean\nreplica load"),
)


_SHARED_PANEL = ("gpu_imbalance_with_shared", "GPU imbalance,\nshared too",
                 "max / mean\nGPU work")


def _load_panels(results: Sequence[Results]) -> tuple[tuple[str, str, str], ...]:
    """`_LOAD_PANELS`, GPU imbalance counting the shared experts' work too when some policy
    places that work (Waterfill) and so every result counts it."""
    if any(resolve_policy(r.spec.dispatch.policy)[1].places_shared for r in results) and \
            all(r.metrics.get(_SHARED_PANEL[0]) is not None for r in results):
        return (_SHARED_PANEL, *_LOAD_PANELS[1:])
    return _LOAD_PANELS


def policy_comparison(results: Sequence[Results]) -> Figure:
    """Small multiples comparing the policies (and modes) of `results`, e.g. from
    `replay.compare`: one row per label, shared by every panel, and one panel per metric.

    Panels: `gpu_imbalance` (`gpu_imbalance_with_shared` when every result counts the shared
    experts), `replica_skew_max`, `replica_skew_cumulative` of every result, a
    dot per (label, mode) on an axis starting at the ideal 1.0, in the policy's own colour and
    marker (`policy_styles`), filled for "none" and hollow for "a2a" (a row's two dots, top
    down in the order the modes first come); then, only when some results are in "none" mode, `rank_agreement` (dots,
    from 0) and the `multiplicity` (stacked c = 0 / 2+ / 1 shares) of those results. A metric
    that is None (undefined) gets no mark but "n/a". Rows are labelled by policy, plus whatever
    else (solver, view, rng) differs between results; one legend, below the panels, keys the
    modes and the multiplicities. The figure is 8 inches wide at most in the paper style (its
    sizes grow with the font size), whatever the count of panels.

    results: at least one `Results`. Returns a new Figure; raises InputError when empty.
    """
    results = list(results)
    if not results:
        raise InputError("policy_comparison needs at least one result")
    labels = run_labels(results)
    rows = list(dict.fromkeys(labels))  # y positions, top to bottom
    modes = list(dict.fromkeys(r.spec.dispatch.mode for r in results))
    none_idx = [i for i, r in enumerate(results) if r.spec.dispatch.mode == "none"]
    styles = policy_styles(r.policy for r in results)

    panels = _load_panels(results)
    n_panels = len(panels) + (2 if none_idx else 0)
    names = [wrap_name(label) for label in rows]  # the rows' tick labels
    lines = max(name.count("\n") + 1 for name in names)
    scale = rcParams["font.size"] / PAPER_STYLE["font.size"]  # sizes grow with the text
    height = max(min(6.0, 1.7 + (0.1 + 0.13 * lines) * len(rows)),  # 6 inches at most,
                 1.7 + (0.02 + 0.16 * lines) * len(rows))  # unless the rows' labels need more
    fig = Figure(figsize=(scale * min(8.0, 1.6 + 1.45 * n_panels), scale * height),
                 layout="constrained")
    axes = fig.subplots(1, n_panels, sharey=True)
    offsets = {m: (i - (len(modes) - 1) / 2) * 0.36 for i, m in enumerate(modes)}
    for ax, (key, title, xlabel) in zip(axes, panels):
        for r, label in zip(results, labels):
            draw_dot(ax, r.metrics.get(key), rows.index(label) + offsets[r.spec.dispatch.mode],
                 r.policy, styles[r.policy], r.spec.dispatch.mode, baseline=1.0)
        top = max([r.metrics[key] for r in results if r.metrics.get(key) is not None], default=1.0)
        span = max(top - 1.0, 0.05)
        ax.set_xlim(1.0 - 0.06 * span, 1.0 + 1.08 * span)
        ax.axvline(1.0, color="0.2", linewidth=0.8)
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel(f"{xlabel}\n(1 = perfect)")
    keys = [mode_key(m) for m in modes] if len(modes) > 1 else []

    if none_idx:
        by_label = {labels[i]: results[i] for i in none_idx}  # last one wins on duplicates
        ax_agree, ax_mult = axes[len(panels):]
        for y, label in enumerate(rows):
            r = by_label.get(label)
            if r is None:  # no result of this label in "none" mode
                mark_na(ax_agree, 0.0, y, horizontal=True)
                continue
            draw_dot(ax_agree, r.metrics.get("rank_agreement"), y, r.policy, styles[r.policy],
                 "none", baseline=0.0)
        ax_agree.axvline(1.0, color="0.2", linewidth=0.8, linestyle=":")
        ax_agree.set_xlim(-0.06, 1.08)
        ax_agree.set_title("Rank agreement\n(none mode)", fontsize="medium")
        ax_agree.set_xlabel("fraction of pairs\nall ranks agree on")
        multiplicity_bars(ax_mult, [by_label.get(label) for label in rows])
        keys += ax_mult.get_legend_handles_labels()[0]

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=3, steps=[1, 2, 5, 10]))
        ax.grid(True, axis="x", alpha=0.3)
        ax.grid(True, axis="y", alpha=0.15)
    axes[0].set_yticks(range(len(rows)), names)
    axes[0].set_ylim(len(rows) - 0.5, -0.5)
    if keys:
        fig.legend(handles=keys, loc="outside lower center", ncols=len(keys), fontsize="small")
    fig.suptitle(common_title(results))
    return fig


def replica_loads_over_time(result: Results, layer: int = 0, experts: int = 4) -> Figure:
    """Executed load of every replica of a layer's most-loaded replicated experts, per step.

    Picks the `experts` logical experts of `layer` with the most routed pairs over the trace
    (`true_load[:, layer].sum(0)`) among those holding >= 2 replicas in some epoch, one panel
    each. Line `j` is replica `j` (the expert's j-th slot in ascending physical id, taken from the
    placement in force at each step): `slot_load[s, layer, log2phy[layer, e, j]]`. The dashed
    line is the placement's promise, the expert's routed pairs split evenly over its replicas.
    A policy that balances keeps the lines together; `row` on the template trace leaves one at 0.

    result: one `Results`; layer in `[0, L)`; experts >= 1. Returns a new Figure (with a note
    instead of panels when the layer has no replicated expert).
    """
    S, L, _ = result.slot_load.shape
    if not isinstance(layer, int) or not 0 <= layer < L:
        raise InputError(f"layer must be an integer in [0, {L}), got {layer!r}")
    if not isinstance(experts, int) or experts < 1:
        raise InputError(f"experts must be a positive integer, got {experts!r}")
    if not result.epochs:
        raise InputError("the result has no placement epochs (was it produced by replay?)")

    # placement of every step, from the epoch list
    step_place = [placement for start, stop, placement in result.epochs
                  for _ in range(start, stop)]
    max_cnt = _max_replicas(result, layer)  # [E]
    routed = result.true_load[:, layer].sum(0)  # [E]
    candidates = [e for e in sorted(range(routed.numel()), key=lambda e: (-int(routed[e]), e))
                  if max_cnt[e] >= 2][:experts]

    title = (f"{wrap_name(result.policy)} dispatch ({result.spec.dispatch.mode} mode):\n"
             f"executed load per replica, layer {layer}")
    if not candidates:
        fig = Figure(figsize=(7, 2.5), layout="constrained")
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, f"no replicated expert in layer {layer}", ha="center", va="center")
        fig.suptitle(title)
        return fig

    n = len(candidates)
    ncols = 2 if n > 1 else 1
    nrows = -(-n // ncols)
    fig = Figure(figsize=(6.2 * ncols, 2.9 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True).ravel()
    steps = list(range(S))
    single_epoch = len(result.epochs) == 1
    for ax, e in zip(axes, candidates):
        n_max = int(max_cnt[e])
        for j in range(n_max):
            ys = [replica_load(result, placement, s, layer, e, j)  # [S]
                  for s, placement in enumerate(step_place)]
            label = f"replica {j}"
            if single_epoch:
                placement = result.epochs[0][2]
                slot = int(placement.log2phy[layer, e, j])
                label += f" (slot {slot}, GPU {int(placement.slot_gpu[slot])})"
            ax.plot(steps, ys, marker="o", markersize=3, linewidth=1.5,
                    color=OKABE_ITO[j % len(OKABE_ITO)], label=label)
        promise = [float(result.true_load[s, layer, e]) / int(step_place[s].logcnt[layer, e])
                   for s in steps]
        ax.plot(steps, promise, linestyle="--", color="0.15", linewidth=1, zorder=3,
                label="even split")
        ax.set_title(f"expert {e} (up to {n_max} replicas, {int(routed[e])} pairs in total)",
                     fontsize="medium")
        ax.set_ylabel("pairs executed")
        from_baseline(ax, 0.0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small", loc="best")
    for ax in axes[n:]:
        ax.set_visible(False)
    for ax in axes[max(0, n - ncols):n]:
        step_axis(ax.xaxis)
    fig.suptitle(title)
    return fig


def time_series_figure(results: Sequence[Results]) -> Figure:
    """Imbalance over time across rebalances: panels sharing the step axis.

    1. executed GPU imbalance per step (mean over layers), one line per result in its look
       (`run_lines`: the policy's colour and marker, solid for "none", dash-dotted for
       "a2a"), with the even-split promise of the placement in service (thick grey) and of the
       segment's best placement (dotted), both from the first result;
    2. the worst replica skew of each step, one line per result (the same looks);
    3. only when the steps differ in size (chunked prefill, ragged batches): the routed pairs
       of each step (`pairs_per_step`), so a small step's spike is not read as skew;
    4. only when the first result's schedule moved experts or skipped a rebalance: the
       expert copies at each rebalance, stacked by source (same GPU, same node, other node,
       in greys), a skipped rebalance marked with a cross.
    Dotted vertical lines mark the rebalance steps in every panel; one legend, below the
    panels, keys each run label once, the modes and the promises.

    results: at least one `Results` (e.g. from `replay.compare`). Returns a new Figure.
    """
    results = list(results)
    if not results:
        raise InputError("time_series_figure needs at least one result")
    first = results[0]
    series = [r.time_series() for r in results]
    steps = series[0]["step"]
    rows = first.migrations()
    moves = [row for row in rows if row["moved_slots"] or row["skipped"]]
    pairs = first.true_load.double().sum(2).mean(1).numpy()  # [S] pairs a step, a layer
    chunked = len(pairs) > 1 and pairs.min() < pairs.max()
    n_panels = 2 + chunked + bool(moves)
    fig = Figure(figsize=(7.0, 0.8 + 1.6 * n_panels), layout="constrained")
    axes = list(fig.subplots(n_panels, 1, sharex=True, squeeze=False)[:, 0])
    ax_imb, ax_skew = axes[:2]
    looks = run_lines(results)
    every = max(1, len(steps) // 12)  # markers a dozen a line: they key the policy
    for cols, look, label in zip(series, looks, run_labels(results)):
        ax_imb.plot(steps, cols["gpu_imbalance"], markersize=4, markevery=every, label=label,
                    **look)
        ax_skew.plot(steps, cols["replica_skew_max"], markersize=4, markevery=every, **look)
    ax_imb.plot(steps, series[0]["placement_imbalance"], color="0.55", linewidth=2.5,
                alpha=0.5, zorder=0)
    ax_imb.plot(steps, series[0]["factor_solver"], color="0.2", linestyle=":", linewidth=1.2)
    ax_imb.set_ylabel("GPU imbalance\n(max / mean)")
    ax_skew.set_ylabel("replica skew,\nworst expert\n(max / mean)")
    for ax in (ax_imb, ax_skew):
        from_baseline(ax, 1.0)
    if chunked:
        pairs_per_step(axes[2], pairs)
    if moves:
        _moves_panel(axes[-1], moves)
    xs = [row["step"] for row in rows]
    for ax in axes:
        for x in xs:
            ax.axvline(x, color="0.6", linestyle=":", linewidth=0.8, zorder=0)
        ax.grid(True, axis="y", alpha=0.3)
    step_axis(axes[-1].xaxis)
    legend_below(fig, _series_keys(results, looks))
    plan = first.spec.schedule
    schedule = ("one placement from the whole trace" if plan.rebalance_every is None else
                f"rebalance every {plan.rebalance_every} steps, predictor "
                f"{name_of(plan.predictor)}, window {plan.window or plan.rebalance_every}")
    fig.suptitle(f"Imbalance over time\nsolver {first.solver}, {schedule}")
    return fig


_MOVE_KINDS = (("same_gpu", "0.8", "same GPU"), ("same_node", "0.5", "same node"),
               ("cross_node", "0.2", "other node"))  # (column, grey, source) of moved copies


def _moves_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """The expert copies at each rebalance of `rows` (`Results.migrations`), stacked by
    source, a kind only when something came from it; a skipped rebalance as a cross."""
    xs = [row["step"] for row in rows]
    width = max(1.0, 0.25 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 4))
    bottom = [0] * len(rows)
    for kind, grey, text in _MOVE_KINDS:
        heights = [row[kind] for row in rows]
        if any(heights):
            ax.bar(xs, heights, width=width, bottom=bottom, color=grey,
                   label=f"copied from {text}")
            bottom = [b + h for b, h in zip(bottom, heights)]
    skipped = [row["step"] for row in rows if row["skipped"]]
    if skipped:
        ax.plot(skipped, [0] * len(skipped), "x", color="0.2", markersize=8,
                label="rebalance skipped")
    ax.set_ylabel("experts moved\n(slots changed)")
    from_baseline(ax, 0.0)
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _series_keys(results: list[Results], looks: list[dict[str, Any]]) -> list[Line2D]:
    """The time series' legend: each run label once in its look (solid), each mode's line
    style when there are two, and the two promises."""
    keys: dict[str, Line2D] = {}
    for label, look in zip(run_labels(results), looks):
        keys.setdefault(label, Line2D([], [], markersize=4, label=label.replace("\n", ", "),
                                      **{**look, "linestyle": "-"}))
    modes = list(dict.fromkeys(r.spec.dispatch.mode for r in results))
    if len(modes) > 1:
        for mode in modes:
            keys[mode] = Line2D([], [], color="0.3", linestyle=MODE_LINES.get(mode, "-"),
                                label=f"{mode} mode")
    return [*keys.values(),
            Line2D([], [], color="0.55", linewidth=2.5, alpha=0.5,
                   label="promise of the placement in service"),
            Line2D([], [], color="0.2", linestyle=":", linewidth=1.2,
                   label="promise of the best placement\n(solved on the true loads)")]


def replica_load(result: Results, placement: Any, s: int, layer: int, e: int,
                  j: int) -> float:
    """Executed pairs of replica `j` of expert `e` at step `s`; NaN if `e` has <= j replicas."""
    log2phy = placement.log2phy  # [L, E, R]
    slot = int(log2phy[layer, e, j]) if j < log2phy.shape[2] else -1
    return float(result.slot_load[s, layer, slot]) if slot >= 0 else float("nan")


def _max_replicas(result: Results, layer: int) -> list[int]:
    """Most replicas each expert of `layer` has in any epoch: `[E]` ints."""
    cnt = None
    for _, _, placement in result.epochs:
        c = placement.logcnt[layer]  # [E]
        cnt = c if cnt is None else cnt.maximum(c)
    return [int(v) for v in cnt]
