"""Matplotlib figures from replay Results; the only eplbsim module that imports matplotlib.

Dimensions: `S` steps, `L` MoE layers, `E` logical experts, `P` physical slots, `R` max replicas
of one expert, `G` GPUs = EP ranks.

Every figure function is pure: it reads `Results` (metrics, `slot_load [S, L, P]`,
`true_load [S, L, E]`, `epochs`) and returns a new `matplotlib.figure.Figure`, built directly
rather than through pyplot, so nothing here selects a backend or touches global state: a script
saves it with ``fig.savefig(path)`` or :func:`save_figure` (``plt.savefig`` saves pyplot's
current figure, which this is not), and a notebook (after ``%matplotlib inline``) shows it as a
cell's last expression. Nothing is computed beyond what the plot needs; numbers come from the
metrics `replay` already measured. Colours are the Okabe-Ito palette (colour-blind safe), and
each policy has its own colour and marker (`policy_styles`). An axis of counts, shares or times
starts at 0 and one of max / mean ratios at 1.0, or its label says where it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from matplotlib import rcParams
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from .dispatch import POLICIES, resolve_policy
from .errors import InputError
from .files import atomic_file
from .metrics import rebalance_stalls
from .schedule.switch import phases
from .registry import name_of
from .results import Results

# Okabe & Ito (2008), "Color Universal Design": safe for the common colour-vision deficiencies.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
             "#000000")
# Each policy's own colour and marker, the same in every figure that draws policies
# (`policy_styles`): the i-th policy, registered ones (`dispatch.POLICIES`) first in their
# order, gets OKABE_ITO[i % 8] and POLICY_MARKERS[i % 7]. Eight colours and seven markers
# (coprime) give the first 56 policies distinct pairs, and neighbours differ in both.
POLICY_MARKERS = ("o", "s", "D", "^", "v", "P", "X")
# Multiplicity c per (token, slot) pair: dropped, correct, duplicated; greys, as the colours
# stand for policies.
_MULT_COLORS = {"0": "0.55", "1": "0.86", "2+": "0.15"}
_MODE_LINES = {"none": "-", "a2a": "-."}  # line style per mode in time series
_MODE_FACE = {"a2a": "white"}  # marker face per mode in dot panels; "none" and others filled
_MULT_LABELS = {"0": "c = 0 (dropped)", "1": "c = 1 (correct)", "2+": "c ≥ 2 (duplicated)"}

_LOAD_PANELS = (  # (metric, panel title, axis label) of `policy_comparison`'s ratio panels
    ("gpu_imbalance", "GPU imbalance", "max / mean\nGPU load"),
    ("replica_skew_max", "Replica skew,\nworst step", "max / mean\nreplica load"),
    ("replica_skew_cumulative", "Replica skew,\nsummed over steps", "max / mean\nreplica load"),
)
_SHARED_PANEL = ("gpu_imbalance_with_shared", "GPU imbalance,\nshared experts too",
                 "max / mean\nGPU work")


def _load_panels(results: Sequence[Results]) -> tuple[tuple[str, str, str], ...]:
    """`_LOAD_PANELS`, GPU imbalance counting the shared experts' work too when some policy
    places that work (Waterfill) and so every result counts it."""
    if any(resolve_policy(r.spec.dispatch.policy)[1].places_shared for r in results) and \
            all(r.metrics.get(_SHARED_PANEL[0]) is not None for r in results):
        return (_SHARED_PANEL, *_LOAD_PANELS[1:])
    return _LOAD_PANELS


# ----------------------------------------------------------------------------- figures

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
    labels = _labels(results)
    rows = list(dict.fromkeys(labels))  # y positions, top to bottom
    modes = list(dict.fromkeys(r.spec.dispatch.mode for r in results))
    none_idx = [i for i, r in enumerate(results) if r.spec.dispatch.mode == "none"]
    styles = policy_styles(r.policy for r in results)

    panels = _load_panels(results)
    n_panels = len(panels) + (2 if none_idx else 0)
    lines = max(label.count("\n") + 1 for label in rows)
    scale = rcParams["font.size"] / PAPER_STYLE["font.size"]  # sizes grow with the text
    fig = Figure(figsize=(scale * min(8.0, 1.6 + 1.45 * n_panels),
                          scale * (1.7 + (0.1 + 0.13 * lines) * len(rows))), layout="constrained")
    axes = fig.subplots(1, n_panels, sharey=True)
    offsets = {m: (i - (len(modes) - 1) / 2) * 0.36 for i, m in enumerate(modes)}
    for ax, (key, title, xlabel) in zip(axes, panels):
        for r, label in zip(results, labels):
            _dot(ax, r.metrics.get(key), rows.index(label) + offsets[r.spec.dispatch.mode],
                 r.policy, styles[r.policy], r.spec.dispatch.mode, baseline=1.0)
        top = max([r.metrics[key] for r in results if r.metrics.get(key) is not None], default=1.0)
        span = max(top - 1.0, 0.05)
        ax.set_xlim(1.0 - 0.06 * span, 1.0 + 1.08 * span)
        ax.axvline(1.0, color="0.2", linewidth=0.8)
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel(f"{xlabel}\n(1 = perfect)")
    keys = [_mode_key(m) for m in modes] if len(modes) > 1 else []

    if none_idx:
        by_label = {labels[i]: results[i] for i in none_idx}  # last one wins on duplicates
        ax_agree, ax_mult = axes[len(panels):]
        for y, label in enumerate(rows):
            r = by_label.get(label)
            if r is None:  # no result of this label in "none" mode
                _na(ax_agree, 0.0, y, horizontal=True)
                continue
            _dot(ax_agree, r.metrics.get("rank_agreement"), y, r.policy, styles[r.policy],
                 "none", baseline=0.0)
        ax_agree.axvline(1.0, color="0.2", linewidth=0.8, linestyle=":")
        ax_agree.set_xlim(-0.06, 1.08)
        ax_agree.set_title("Rank agreement\n(none mode)", fontsize="medium")
        ax_agree.set_xlabel("fraction of pairs\nall ranks agree on")
        _multiplicity_bars(ax_mult, [by_label.get(label) for label in rows])
        keys += ax_mult.get_legend_handles_labels()[0]

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=3, steps=[1, 2, 5, 10]))
        ax.grid(True, axis="x", alpha=0.3)
        ax.grid(True, axis="y", alpha=0.15)
    axes[0].set_yticks(range(len(rows)), rows)
    axes[0].set_ylim(len(rows) - 0.5, -0.5)
    if keys:
        fig.legend(handles=keys, loc="outside lower center", ncols=len(keys), fontsize="small")
    fig.suptitle(_common_title(results))
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

    title = f"{result.policy} dispatch ({result.spec.dispatch.mode} mode): executed load per replica, " \
            f"layer {layer}"
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
            ys = [_replica_load(result, placement, s, layer, e, j)  # [S]
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
        _from_baseline(ax, 0.0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small", loc="best")
    for ax in axes[n:]:
        ax.set_visible(False)
    for ax in axes[max(0, n - ncols):n]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    return fig


def time_series_figure(results: Sequence[Results]) -> Figure:
    """Imbalance over time across rebalances: three panels sharing the step axis.

    1. executed GPU imbalance per step (mean over layers), one line per result (colour per
       policy label, solid for "none", dash-dotted for "a2a"), with the even-split promise of
       the placement in service (thick grey) and of the segment's best placement (dotted),
       both from the first result;
    2. the worst replica skew of each step, one line per result (same key as panel 1);
    3. expert copies at each rebalance of the first result's schedule, stacked by source (same
       GPU, same node, other node); a skipped rebalance is marked with a cross.
    Dotted vertical lines mark the rebalance steps in every panel.

    results: at least one `Results` (e.g. from `replay.compare`). Returns a new Figure.
    """
    results = list(results)
    if not results:
        raise InputError("time_series_figure needs at least one result")
    first = results[0]
    series = [r.time_series() for r in results]
    steps = series[0]["step"]
    fig = Figure(figsize=(11.5, 9.0), layout="constrained")
    ax_imb, ax_skew, ax_move = fig.subplots(3, 1, sharex=True)
    labels = [label.replace("\n", ", ") for label in _labels(results)]
    colors = {lb: OKABE_ITO[i % len(OKABE_ITO)] for i, lb in enumerate(dict.fromkeys(labels))}
    for cols, label, r in zip(series, labels, results):
        style = dict(color=colors[label], linestyle=_MODE_LINES.get(r.spec.dispatch.mode, "-"),
                     linewidth=1.3, label=f"{label} ({r.spec.dispatch.mode})")
        ax_imb.plot(steps, cols["gpu_imbalance"], **style)
        ax_skew.plot(steps, cols["replica_skew_max"], **style)
    ax_imb.plot(steps, series[0]["placement_imbalance"], color="0.55", linewidth=2.5,
                alpha=0.5, zorder=0, label="promise of the placement in service")
    ax_imb.plot(steps, series[0]["factor_solver"], color="0.2", linestyle=":", linewidth=1.2,
                label="promise of the best placement\n(solved on the true loads)")
    ax_imb.set_ylabel("GPU imbalance\n(max / mean GPU load)")
    ax_skew.set_ylabel("replica skew, worst expert\n(max / mean replica load)")
    for ax in (ax_imb, ax_skew):
        _from_baseline(ax, 1.0)
    rows = first.migrations()
    bottom = [0] * len(rows)
    xs = [row["step"] for row in rows]
    width = max(1.0, 0.25 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 4))
    for kind, color, text in (("same_gpu", OKABE_ITO[2], "same GPU"),
                              ("same_node", OKABE_ITO[0], "same node"),
                              ("cross_node", OKABE_ITO[5], "other node")):
        heights = [row[kind] for row in rows]
        ax_move.bar(xs, heights, width=width, bottom=bottom, color=color,
                    label=f"copied from {text}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    skipped = [row["step"] for row in rows if row["skipped"]]
    if skipped:
        ax_move.plot(skipped, [0] * len(skipped), "x", color="0.2", markersize=8,
                     label="rebalance skipped")
    if not rows:
        ax_move.text(0.5, 0.5, "no rebalance in this run", ha="center", va="center",
                     transform=ax_move.transAxes, color="0.35")
    ax_move.set_ylabel("experts moved\n(slots changed)")
    ax_move.set_xlabel("step")
    for ax in (ax_imb, ax_skew, ax_move):
        for x in xs:
            ax.axvline(x, color="0.6", linestyle=":", linewidth=0.8, zorder=0)
        ax.grid(True, axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0] and ax is not ax_skew:  # skew shares imb's key
            ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    plan = first.spec.schedule
    schedule = ("one placement from the whole trace" if plan.rebalance_every is None else
                f"rebalance every {plan.rebalance_every} steps, predictor "
                f"{name_of(plan.predictor)}, window {plan.window or plan.rebalance_every}")
    fig.suptitle(f"Imbalance over time: solver {first.solver}, {schedule}")
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = 150) -> tuple[Path, ...]:
    """Write `fig` as PNG; for a `.pdf` path, the PDF there and a PNG beside it.

    path: ending `.png` or `.pdf` (no suffix means `.png`); parent folders are created, and each
    file is written through a temporary sibling. Returns the paths written (without dates or versions inside, so an unchanged figure
    gives unchanged files). Raises InputError for any other suffix.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == "":
        path, suffix = path.with_suffix(".png"), ".png"
    if suffix not in (".png", ".pdf"):
        raise InputError(f"save_figure writes .png or .pdf, got {str(path)!r}")
    written = []
    if suffix == ".pdf":  # no creation date: the same figure gives the same bytes
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format="pdf", metadata={"CreationDate": None})
        written.append(path)
    png = path.with_suffix(".png")
    with atomic_file(png) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, metadata={"Software": None})
    written.append(png)
    return tuple(written)


# ----------------------------------------------------------------------------- paper figures

# One style for every publication figure: small serif-free text, the Okabe-Ito cycle, no top or
# right spines, TrueType fonts in PDFs (editable text). Applied with `paper_style()`.
PAPER_STYLE = {
    "font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "legend.fontsize": 8,
    "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.spines.top": False,
    "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3, "pdf.fonttype": 42,
    "lines.linewidth": 1.4, "legend.frameon": False,
}


def paper_style() -> Any:
    """A context manager applying `PAPER_STYLE` (and the Okabe-Ito colour cycle) to the
    figures built and saved inside it; nothing global changes."""
    import matplotlib
    from cycler import cycler
    return matplotlib.rc_context({**PAPER_STYLE, "axes.prop_cycle": cycler(color=OKABE_ITO)})


def policy_styles(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """The fixed colour and marker of each policy in `names`, for `plot(**style)`: the i-th of
    the registered policies (`dispatch.POLICIES` order) then of the other names (first seen
    first) gets `{"color": OKABE_ITO[i % 8], "marker": POLICY_MARKERS[i % 7]}`, so a policy
    looks the same in every figure and the first 56 look different from each other."""
    names = list(dict.fromkeys(names))
    order = list(POLICIES) + [n for n in names if n not in POLICIES]
    return {n: {"color": OKABE_ITO[order.index(n) % len(OKABE_ITO)],
                "marker": POLICY_MARKERS[order.index(n) % len(POLICY_MARKERS)]} for n in names}


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
    for ax, data, ylabel, title in (
            (ax_all, share, "MoE layer", "whole trace, every layer"),
            (ax_time, steps, "step", f"layer {layer}, every step")):
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis",
                          origin="lower", vmin=0)
        ax.set_xlabel("logical expert")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(False)
        fig.colorbar(image, ax=ax, label="share of the pairs (%)")
    ax_all.set_yticks(range(L))
    fig.suptitle(f"Expert load ({S} steps, {L} layers, {E} experts)")
    return fig


def policy_mode_bars(results: Sequence[Results]) -> Figure:
    """GPU imbalance and worst-step replica skew of every (policy, mode): grouped bars rising
    from the ideal 1.0, one colour per mode. results: e.g. `replay.compare` output."""
    results = list(results)
    if not results:
        raise InputError("policy_mode_bars needs at least one result")
    labels = _labels(results)
    groups = list(dict.fromkeys(labels))
    modes = list(dict.fromkeys(r.spec.dispatch.mode for r in results))
    fig = Figure(figsize=(7.0, 2.8), layout="constrained")
    for ax, key, ylabel in zip(fig.subplots(1, 2), ("gpu_imbalance", "replica_skew_max"), (
            "GPU imbalance (max / mean GPU load)",
            "replica skew, worst step\n(max / mean replica load)")):
        _grouped_ratio_bars(ax, results, labels, groups, modes, key)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y")
        ax.grid(False, axis="x")
    fig.axes[0].legend(title="mode", loc="upper left")
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
    ax_agree.set_ylabel("rank agreement (fraction of pairs)")
    ax_mult.set_ylabel("fraction of pairs")
    ax_mult.plot([], [], "k-", label="c ≥ 2 (duplicated)")
    ax_mult.plot([], [], "k--", label="c = 0 (dropped)")
    ax_mult.legend(loc="lower right", bbox_to_anchor=(1.0, 0.36))
    ax_err.set_ylabel("output error ||Y − Y*|| / ||Y*||")
    for ax in (ax_agree, ax_mult, ax_err):
        ax.set_xlabel("redundant experts (slots)")
        _from_baseline(ax, 0.0)
    ax_agree.legend(title="policy", loc="center right")
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
            ax.plot(steps, [_replica_load(result, placement, s, layer, expert, j)
                            for s in steps], color=OKABE_ITO[j % len(OKABE_ITO)],
                    label=f"replica {j} (GPU {gpu})")
        even = result.true_load[:, layer, expert].double() / n
        ax.plot(steps, even.tolist(), "k--", linewidth=1, label="even split")
        ax.set_title(f"{result.policy}")
        ax.set_xlabel("step")
    _from_baseline(axes[0], 0.0)
    _legend_once(axes[-1], axes, loc="lower right", fontsize=7)
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
    _from_baseline(ax_imb, 1.0)
    ax_imb.legend(title="predictor", loc="lower left", bbox_to_anchor=(0.0, 1.0),
                  ncol=len(results), title_fontsize=8, alignment="left")
    ax_move.set_ylabel("experts moved\n(slots)")
    ax_move.set_xlabel("step")
    return fig


def time_bars_and_stalls(results: Sequence[Results], over_time: Sequence[Results]) -> Figure:
    """Left: MoE time per step of every (policy, mode) in `results`, expert compute and
    communication stacked, the balanced reference (every GPU at the mean load) dashed. Right:
    MoE time per step of each of `over_time` (one trace and schedule, rebalancing), with the
    stall each rebalance costs when serving waits for its copies (`sync`); the time axis is
    zoomed into the lines, and its label says where it starts. Every result must have a cost
    model (`spec.cost`)."""
    results, over_time = list(results), list(over_time)
    if not results or not over_time:
        raise InputError("time_bars_and_stalls needs results in both panels")
    fig = Figure(figsize=(7.0, 2.8), layout="constrained")
    ax_bar, ax_time = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.4, 1]})
    labels = [f"{name}\n{r.spec.dispatch.mode}" for name, r in zip(_labels(results), results)]
    x = np.arange(len(results))
    compute = [r.metrics["compute_ms"] for r in results]
    comm = [r.metrics["comm_ms"] for r in results]
    ax_bar.bar(x, compute, color=OKABE_ITO[0], label="expert compute")
    ax_bar.bar(x, comm, bottom=compute, color=OKABE_ITO[1], label="communication")
    for i, r in enumerate(results):
        ax_bar.hlines(r.metrics["moe_ms_balanced"], i - 0.4, i + 0.4, colors="k",
                      linestyles="--", linewidth=1.0, label="balanced" if i == 0 else None)
    ax_bar.set_xticks(x, labels)
    ax_bar.set_ylabel("MoE time per step (ms)")
    ax_bar.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=7)
    ax_bar.grid(False, axis="x")
    stalls = ax_time.twinx()
    for i, (name, r) in enumerate(zip(_labels(over_time), over_time)):
        color = OKABE_ITO[i % len(OKABE_ITO)]
        series = r.time_series()
        ax_time.plot(series["step"], series["moe_ms"], color=color, label=name)
        marks = rebalance_stalls(r)
        stalls.bar([step + (i - (len(over_time) - 1) / 2) * 0.8 for step, _ in marks],
                   [ms for _, ms in marks], width=0.8, color=color, alpha=0.5)
    ax_time.set_xlabel("step")
    bottom = ax_time.get_ylim()[0]  # zoomed into the lines (a few percent apart): say so
    ax_time.set_ylabel("MoE time per step (ms)"
                       + (f"\n(axis starts at {bottom:.3g}, not 0)" if bottom > 0 else ""))
    stalls.set_ylabel("rebalance stall (ms, bars)")
    stalls.grid(False)
    ax_time.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(over_time), fontsize=7)
    return fig


def switch_hazard(results: Sequence[Results]) -> Figure:
    """What ranks switching placements at different steps corrupt, per step, for results of
    async rebalancing (`spec.schedule.rebalance_mode`): in "a2a" (top) the share of pairs sent
    to a slot holding another expert's weights (`wrong_expert_frac`), in "none" (bottom) the
    share of pairs not executed exactly once; one line per result, coloured by its label (the
    same in both panels, one legend), each hazard window (steps on which its ranks serve
    different placements) shaded in its colour, the rebalance decisions dotted."""
    results = list(results)
    modes = [m for m in ("a2a", "none") if any(r.spec.dispatch.mode == m for r in results)]
    if not modes:
        raise InputError("switch_hazard needs at least one result")
    fig = Figure(figsize=(7.0, 1.3 + 1.4 * len(modes)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(modes), 1, sharex=True))
    labels = _labels(results)
    colors = {lb: OKABE_ITO[i % len(OKABE_ITO)] for i, lb in enumerate(dict.fromkeys(labels))}
    for ax, mode in zip(axes, modes):
        for name, r in zip(labels, results):
            if r.spec.dispatch.mode != mode:
                continue
            color = colors[name]
            series = r.time_series()
            share = (series["wrong_expert_frac"] if mode == "a2a"
                     else 1 - series["multiplicity_1"])
            ax.plot(series["step"], 100 * share, color=color, label=name, drawstyle="steps-post")
            for lo, hi, _, serving in phases(r.segments):
                if serving is not None:
                    ax.axvspan(lo, hi, color=color, alpha=0.15, linewidth=0, zorder=0)
        for m in results[0].migrations():
            ax.axvline(m["step"], color="0.5", linestyle=":", linewidth=0.8, zorder=1)
        ax.set_ylabel("wrong-expert pairs (%)\na2a" if mode == "a2a"
                      else "pairs not run once (%)\nnone")
        _from_baseline(ax, 0.0)
    _legend_once(axes[0], axes, loc="upper right", fontsize=7, ncol=2)
    axes[-1].set_xlabel("step")
    return fig


def workload_batching(rows: Sequence[tuple[str, Results]], counts: Any,
                      layer: int = 0) -> Figure:
    """How an engine's batching moves the load (DESIGN.md §9). Left and middle: replica skew
    (mean over replicated experts, per step) and GPU imbalance of every `(batching, result)` of
    `rows`, grouped by batching, one bar per policy (in its `policy_styles` colour). Right:
    `layer`'s share of pairs per expert at every step of one batched trace's routed loads
    `counts [S, L, E]` (the phantom experts routed padding heats show as bright columns)."""
    rows = list(rows)
    if not rows:
        raise InputError("workload_batching needs at least one result")
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 3 or not 0 <= layer < c.shape[1]:
        raise InputError(f"counts must be [steps, layers, experts] with layer {layer}")
    fig = Figure(figsize=(8.0, 2.8), layout="constrained")
    ax_skew, ax_gpu, ax_heat = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 1]})
    batchings = list(dict.fromkeys(name for name, _ in rows))
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
        ax.set_xticks(range(len(batchings)), batchings, fontsize=7)
        ax.set_ylabel(label)
        ax.grid(False, axis="x")
    ax_skew.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(policies), fontsize=7)
    share = 100 * c[:, layer] / np.maximum(c[:, layer].sum(-1, keepdims=True), 1)  # [S, E]
    image = ax_heat.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest",
                           vmin=0)
    ax_heat.set_xlabel("expert")
    ax_heat.set_ylabel("step")
    ax_heat.grid(False)
    fig.colorbar(image, ax=ax_heat, label=f"layer {layer} pairs (%)")
    return fig


# ----------------------------------------------------------------------------- helpers

def _labels(results: list[Results]) -> list[str]:
    """Policy name, plus each setting (`RunSpec.labels`) that differs between results; `rng`
    and `drift_p` are shown only for `random`, the one policy they affect."""
    rows = [r.row() for r in results]
    fixed = {"policy", "mode", "placement", "device"}
    extra = [k for k in results[0].spec.labels() if k not in fixed
             and len({repr(row[k]) for row in rows}) > 1]
    out = []
    for row in rows:
        parts = [row["policy"]]
        for k in extra:
            if k in ("rng", "drift_p") and row["policy"] != "random":
                continue
            parts.append(f"{k}={row[k]}")
        out.append("\n".join(parts))
    return out


def _common_title(results: list[Results]) -> str:
    bits = ["Policy comparison"]
    solvers = {r.solver for r in results}
    if len(solvers) == 1:
        bits.append(f"solver {solvers.pop()}")
    for name, fmt in (("mode", "{} mode"), ("gpus", "{} GPUs"),
                      ("redundant", "{} redundant slots")):
        vals = {r.spec.get(name) for r in results}
        if len(vals) == 1:
            bits.append(fmt.format(vals.pop()))
    return bits[0] + (": " + ", ".join(bits[1:]) if len(bits) > 1 else "")


def _from_baseline(ax: Any, baseline: float) -> None:
    """Start `ax`'s y axis at its natural `baseline` (0 for counts and shares, 1.0 for max /
    mean ratios), a little below it so marks on it show, wherever the data start: an axis
    zoomed into its data would exaggerate small changes. Call it after drawing."""
    top = max(ax.get_ylim()[1], baseline + 1e-9)
    ax.set_ylim(baseline - 0.03 * (top - baseline), top)


def _legend_once(ax: Any, axes: Sequence[Any], **kwargs: Any) -> None:
    """One legend on `ax` for the labelled artists of all `axes`, each label once (first
    artist wins), instead of a legend per panel repeating the same entries."""
    handles: dict[str, Any] = {}
    for other in axes:
        for handle, label in zip(*other.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    ax.legend(handles.values(), handles.keys(), **kwargs)


def _na(ax: Any, x: float, y: float = 0.0, horizontal: bool = False) -> None:
    """An "n/a" mark at `(x, y)`: above it for vertical bars, right of it for horizontal ones."""
    ax.annotate("n/a", (x, y), xytext=(3, 0) if horizontal else (0, 3),
                textcoords="offset points", ha="left" if horizontal else "center",
                va="center" if horizontal else "bottom", fontsize="small", color="0.35")


def _dot(ax: Any, value: float | None, y: float, policy: str, style: dict[str, str], mode: str,
         baseline: float) -> None:
    """One metric value of `policy` as a dot at `(value, y)` in its `style` (colour and
    marker), filled or hollow by `mode`; "n/a" at the `baseline` when the value is None."""
    if value is None:
        _na(ax, baseline, y, horizontal=True)
        return
    ax.plot([value], [y], linestyle="none", markersize=5, markeredgewidth=1.1, clip_on=False,
            markerfacecolor=_MODE_FACE.get(mode, style["color"]), label=policy, **style)


def _mode_key(mode: str) -> Line2D:
    """The legend entry for `mode`'s dots: a grey circle, filled or hollow like them."""
    return Line2D([], [], linestyle="none", marker="o", markersize=5, markeredgewidth=1.1,
                  color="0.3", markerfacecolor=_MODE_FACE.get(mode, "0.3"), label=f"{mode} mode")


def _grouped_ratio_bars(ax: Any, results: list[Results], labels: list[str], groups: list[str],
                        modes: list[str], key: str) -> None:
    """Bars of a ratio metric (ideal 1.0) rising from 1.0, grouped by label, coloured by mode."""
    width = 0.8 / len(modes)
    top = 1.0
    for m_i, mode in enumerate(modes):
        xs, heights, texts, missing = [], [], [], []
        for r, lb in zip(results, labels):
            if r.spec.dispatch.mode != mode:
                continue
            x = groups.index(lb) + (m_i - (len(modes) - 1) / 2) * width
            v = r.metrics.get(key)
            if v is None:
                missing.append(x)
                continue
            xs.append(x)
            heights.append(v - 1.0)
            texts.append(f"{v:.2f}")
            top = max(top, v)
        bars = ax.bar(xs, heights, width=width * 0.92, bottom=1.0,
                      color=OKABE_ITO[m_i % len(OKABE_ITO)], label=mode)
        ax.bar_label(bars, labels=texts, fontsize="x-small", padding=2)
        for x in missing:
            _na(ax, x, 1.0)
    ax.axhline(1.0, color="0.2", linewidth=0.8)
    _policy_axis(ax, groups)
    ax.set_ylim(1.0 - 0.02 * max(top - 1.0, 0.05), 1.0 + 1.15 * max(top - 1.0, 0.05))
    ax.grid(True, axis="y", alpha=0.3)


def _policy_axis(ax: Any, labels: list[str]) -> None:
    """One tick per policy label along x."""
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_xticks(range(len(labels)), labels, fontsize="small")
    ax.set_xlabel("policy")


def _multiplicity_bars(ax: Any, results: list[Results | None]) -> None:
    """Row `y` of `ax`: `results[y]`'s pair multiplicity as one horizontal bar from 0, the
    shares c = 0 (dropped), c >= 2 (duplicated) and c = 1 stacked in that order ("n/a" for a
    missing result or multiplicity)."""
    lefts = [0.0] * len(results)
    for key in ("0", "2+", "1"):
        ys, widths, starts = [], [], []
        for y, r in enumerate(results):
            v = (r.metrics.get("multiplicity") or {}).get(key) if r is not None else None
            if v is None:
                continue
            ys.append(y)
            widths.append(v)
            starts.append(lefts[y])
            lefts[y] += v
        ax.barh(ys, widths, left=starts, height=0.6, color=_MULT_COLORS[key],
                label=_MULT_LABELS[key])
    for y, r in enumerate(results):
        mult = (r.metrics.get("multiplicity") or {}) if r is not None else {}
        if any(mult.get(k) is None for k in ("0", "1", "2+")):
            _na(ax, 0.0, y, horizontal=True)
    ax.set_xlim(0, 1.0)
    ax.set_xlabel("fraction of pairs")
    ax.set_title("Pair multiplicity c\n(none mode)", fontsize="medium")


def _replica_load(result: Results, placement: Any, s: int, layer: int, e: int,
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


__all__ = ["OKABE_ITO", "PAPER_STYLE", "POLICY_MARKERS", "expert_load_heatmap", "paper_style",
           "policy_comparison", "policy_mode_bars", "policy_styles", "predictor_time_series",
           "redundancy_curves", "replica_loads_over_time", "replica_loads_pair", "save_figure",
           "solver_gap_lines", "time_series_figure"]


REVIEW_BARS = 16  # up to this many layers, the review draws GPU imbalance by layer as bars


def review_figure(series: dict[str, Any], candidate: str, baseline: str) -> Figure:
    """A review's small multiples (`review.Report.series`), candidate beside baseline: GPU
    imbalance by layer (grouped bars rising from 1 up to `REVIEW_BARS` layers, lines beyond),
    ms a step over the scored steps, and each replicated slot's executed pairs over its even
    share (sorted)."""
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
        axes[0].set_ylim(top=axes[0].get_ylim()[1] * 1.02 + 0.02)  # room for the legend
    axes[0].legend(fontsize=8, loc="upper right", ncols=2)
    return fig
