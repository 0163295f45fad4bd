"""Matplotlib figures from replay Results; the only eplbsim module that imports matplotlib.

Dimensions: `S` steps, `L` MoE layers, `E` logical experts, `P` physical slots, `R` max replicas
of one expert, `G` GPUs = EP ranks.

Every figure function is pure: it reads `Results` (metrics, `slot_load [S, L, P]`,
`true_load [S, L, E]`, `epochs`) and returns a new `matplotlib.figure.Figure`, built directly
rather than through pyplot, so nothing here selects a backend or touches global state: a script
saves it with :func:`save_figure`, and a notebook (after ``%matplotlib inline``) shows it as a
cell's last expression. Nothing is computed beyond what the plot needs; numbers come from the
metrics `replay` already measured. Colours are the Okabe-Ito palette (colour-blind safe).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from matplotlib.figure import Figure

from .errors import InputError
from .registry import name_of
from .replay import ReplayConfig, Results

# Okabe & Ito (2008), "Color Universal Design": safe for the common colour-vision deficiencies.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
             "#000000")
# Multiplicity c per (token, slot) pair: dropped, correct, duplicated.
_MULT_COLORS = {"0": "#E69F00", "1": "#009E73", "2+": "#D55E00"}
_MODE_LINES = {"none": "-", "a2a": "-."}  # line style per mode in time series
_MULT_LABELS = {"0": "c = 0 (dropped)", "1": "c = 1 (correct)", "2+": "c ≥ 2 (duplicated)"}

_LOAD_PANELS = (
    ("gpu_imbalance", "GPU imbalance", "max / mean GPU load"),
    ("replica_skew_max", "Replica skew, worst step", "max / mean replica load"),
    ("replica_skew_cumulative", "Replica skew, summed over steps", "max / mean replica load"),
)


# ----------------------------------------------------------------------------- figures

def policy_comparison(results: Sequence[Results]) -> Figure:
    """Bar panels comparing the policies (and modes) of `results`, e.g. from `replay.compare`.

    Panels: `gpu_imbalance`, `replica_skew_max`, `replica_skew_cumulative` for every result
    (bars rise from the ideal 1.0; one bar colour per mode); then, only when some results are
    in "none" mode, `rank_agreement` and the `multiplicity` histogram (stacked c = 0 / 1 / 2+)
    for those results. A metric that is None (undefined) gets no bar and an "n/a" mark.
    Bars are labelled by policy, plus whatever else (solver, view, rng) differs between results.

    results: at least one `Results`. Returns a new Figure; raises InputError when empty.
    """
    results = list(results)
    if not results:
        raise InputError("policy_comparison needs at least one result")
    labels = _labels(results)
    groups = list(dict.fromkeys(labels))  # x positions, in first-seen order
    modes = list(dict.fromkeys(r.config.mode for r in results))
    none_idx = [i for i, r in enumerate(results) if r.config.mode == "none"]

    nrows, ncols = (2 if none_idx else 1), 3
    width = ncols * max(4.6, 0.5 * len(groups) * len(modes) + 1.4)
    fig = Figure(figsize=(width, 4.0 * nrows + 0.5), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()

    for ax, (key, title, ylabel) in zip(axes, _LOAD_PANELS):
        _grouped_ratio_bars(ax, results, labels, groups, modes, key)
        ax.set_title(title)
        ax.set_ylabel(f"{ylabel} (1 = perfect)")
    mode_legend = axes[0].get_legend_handles_labels() if len(modes) > 1 else None

    if none_idx:
        sub_labels = list(dict.fromkeys(labels[i] for i in none_idx))
        by_label = {labels[i]: results[i] for i in none_idx}  # last one wins on duplicates
        _agreement_bars(axes[3], [by_label[lb] for lb in sub_labels], sub_labels)
        _multiplicity_bars(axes[4], [by_label[lb] for lb in sub_labels], sub_labels)
        # the sixth cell holds the legends
        key_ax = axes[5]
        key_ax.axis("off")
        mult_legend = key_ax.legend(*axes[4].get_legend_handles_labels(), loc="upper left",
                                    title="multiplicity (bottom panels)", fontsize="small")
        if mode_legend:
            key_ax.add_artist(mult_legend)
            key_ax.legend(*mode_legend, loc="lower left", title="mode (top panels)",
                          fontsize="small")
    elif mode_legend:
        fig.legend(*mode_legend, title="mode", loc="outside upper right", ncols=len(modes),
                   fontsize="small")

    fig.suptitle(_common_title(results), fontsize="large")
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
    starts = [start for start, _ in result.epochs] + [S]
    step_place = [placement for (start, placement), stop in zip(result.epochs, starts[1:])
                  for _ in range(start, stop)]
    max_cnt = _max_replicas(result, layer)  # [E]
    routed = result.true_load[:, layer].sum(0)  # [E]
    candidates = [e for e in sorted(range(routed.numel()), key=lambda e: (-int(routed[e]), e))
                  if max_cnt[e] >= 2][:experts]

    title = f"{result.policy} dispatch ({result.config.mode} mode): executed load per replica, " \
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
                placement = result.epochs[0][1]
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
        ax.set_ylim(bottom=-0.04 * max(ax.get_ylim()[1], 1.0))
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
        style = dict(color=colors[label], linestyle=_MODE_LINES.get(r.config.mode, "-"),
                     linewidth=1.3, label=f"{label} ({r.config.mode})")
        ax_imb.plot(steps, cols["gpu_imbalance"], **style)
        ax_skew.plot(steps, cols["replica_skew_max"], **style)
    ax_imb.plot(steps, series[0]["placement_imbalance"], color="0.55", linewidth=2.5,
                alpha=0.5, zorder=0, label="promise of the placement in service")
    ax_imb.plot(steps, series[0]["factor_solver"], color="0.2", linestyle=":", linewidth=1.2,
                label="promise of the best placement\n(solved on the true loads)")
    ax_imb.set_ylabel("GPU imbalance\n(max / mean GPU load)")
    ax_skew.set_ylabel("replica skew, worst expert\n(max / mean replica load)")
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
    cfg = first.config
    schedule = ("one placement from the whole trace" if cfg.rebalance_every is None else
                f"rebalance every {cfg.rebalance_every} steps, predictor "
                f"{name_of(cfg.predictor)}, window {cfg.window or cfg.rebalance_every}")
    fig.suptitle(f"Imbalance over time: solver {first.solver}, {schedule}")
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = 150) -> tuple[Path, ...]:
    """Write `fig` as PNG; for a `.pdf` path, the PDF there and a PNG beside it.

    path: ending `.png` or `.pdf` (no suffix means `.png`); parent folders are created.
    Returns the paths written. Raises InputError for any other suffix.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == "":
        path, suffix = path.with_suffix(".png"), ".png"
    if suffix not in (".png", ".pdf"):
        raise InputError(f"save_figure writes .png or .pdf, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if suffix == ".pdf":
        fig.savefig(path, format="pdf")
        written.append(path)
    png = path.with_suffix(".png")
    fig.savefig(png, format="png", dpi=dpi)
    written.append(png)
    return tuple(written)


# ----------------------------------------------------------------------------- helpers

def _labels(results: list[Results]) -> list[str]:
    """Policy name, plus each setting (solver, view, rng, config field) that differs between
    results; `rng` and `drift_p` are shown only for `random`, the one policy they affect."""
    rows = [r.row() for r in results]
    extra = [k for k in ("solver", "view") if len({row[k] for row in rows}) > 1]
    fixed = {"policy", "mode", "solver", "view", "placement", "device"}
    extra += [f.name for f in fields(ReplayConfig) if f.name not in fixed
              and len({repr(getattr(r.config, f.name)) for r in results}) > 1]
    out = []
    for r, row in zip(results, rows):
        parts = [row["policy"]]
        for k in extra:
            if k in ("rng", "drift_p") and row["policy"] != "random":
                continue
            parts.append(f"{k}={row[k] if k in row else getattr(r.config, k)}")
        out.append("\n".join(parts))
    return out


def _common_title(results: list[Results]) -> str:
    cfgs = [r.config for r in results]
    bits = ["Policy comparison"]
    solvers = {r.solver for r in results}
    if len(solvers) == 1:
        bits.append(f"solver {solvers.pop()}")
    for attr, fmt in (("mode", "{} mode"), ("num_gpus", "{} GPUs"),
                      ("num_redundant", "{} redundant slots")):
        vals = {getattr(c, attr) for c in cfgs}
        if len(vals) == 1:
            bits.append(fmt.format(vals.pop()))
    return bits[0] + (": " + ", ".join(bits[1:]) if len(bits) > 1 else "")


def _na(ax: Any, x: float, y: float = 0.0) -> None:
    ax.annotate("n/a", (x, y), xytext=(0, 3), textcoords="offset points", ha="center",
                va="bottom", fontsize="small", color="0.35")


def _grouped_ratio_bars(ax: Any, results: list[Results], labels: list[str], groups: list[str],
                        modes: list[str], key: str) -> None:
    """Bars of a ratio metric (ideal 1.0) rising from 1.0, grouped by label, coloured by mode."""
    width = 0.8 / len(modes)
    top = 1.0
    for m_i, mode in enumerate(modes):
        xs, heights, texts, missing = [], [], [], []
        for r, lb in zip(results, labels):
            if r.config.mode != mode:
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


def _agreement_bars(ax: Any, results: list[Results], labels: list[str]) -> None:
    xs, vals, texts = [], [], []
    for x, r in enumerate(results):
        v = r.metrics.get("rank_agreement")
        if v is None:
            _na(ax, x)
            continue
        xs.append(x)
        vals.append(v)
        texts.append(f"{v:.2f}")
    bars = ax.bar(xs, vals, width=0.6, color=OKABE_ITO[0])
    ax.bar_label(bars, labels=texts, fontsize="x-small", padding=2)
    ax.axhline(1.0, color="0.2", linewidth=0.8, linestyle=":")
    _policy_axis(ax, labels)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("fraction of pairs all ranks agree on")
    ax.set_title('Rank agreement (none mode)')
    ax.grid(True, axis="y", alpha=0.3)


def _multiplicity_bars(ax: Any, results: list[Results], labels: list[str]) -> None:
    bottoms = [0.0] * len(results)
    for key in ("1", "0", "2+"):
        xs, hs, bs = [], [], []
        for x, r in enumerate(results):
            mult = r.metrics.get("multiplicity") or {}
            v = mult.get(key)
            if v is None:
                continue
            xs.append(x)
            hs.append(v)
            bs.append(bottoms[x])
            bottoms[x] += v
        ax.bar(xs, hs, bottom=bs, width=0.6, color=_MULT_COLORS[key], label=_MULT_LABELS[key])
    for x, r in enumerate(results):
        mult = r.metrics.get("multiplicity") or {}
        if any(mult.get(k) is None for k in ("0", "1", "2+")):
            _na(ax, x)
    _policy_axis(ax, labels)
    ax.set_ylim(0, 1.0)
    ax.set_ylabel("fraction of pairs")
    ax.set_title('Pair multiplicity c (none mode)')


def _replica_load(result: Results, placement: Any, s: int, layer: int, e: int,
                  j: int) -> float:
    """Executed pairs of replica `j` of expert `e` at step `s`; NaN if `e` has <= j replicas."""
    log2phy = placement.log2phy  # [L, E, R]
    slot = int(log2phy[layer, e, j]) if j < log2phy.shape[2] else -1
    return float(result.slot_load[s, layer, slot]) if slot >= 0 else float("nan")


def _max_replicas(result: Results, layer: int) -> list[int]:
    """Most replicas each expert of `layer` has in any epoch: `[E]` ints."""
    cnt = None
    for _, placement in result.epochs:
        c = placement.logcnt[layer]  # [E]
        cnt = c if cnt is None else cnt.maximum(c)
    return [int(v) for v in cnt]


__all__ = ["OKABE_ITO", "policy_comparison", "replica_loads_over_time", "save_figure"]
