"""What every eplbsim figure shares: the Okabe-Ito colours and a marker per policy
(`policy_styles`), the paper style, saving, and the drawing helpers the figure modules use
(labels, titles, baselines, legends, dots, grouped bars).

Dimensions: `G` GPUs = EP ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..base.errors import InputError
from ..base.files import atomic_file
from ..dispatch import POLICIES
from ..replay.results import Results

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
MULT_COLORS = {"0": "0.55", "1": "0.86", "2+": "0.15"}


MODE_LINES = {"none": "-", "a2a": "-."}  # line style per mode in time series


MODE_FACE = {"a2a": "white"}  # marker face per mode in dot panels; "none" and others filled


MULT_LABELS = {"0": "c = 0 (dropped)", "1": "c = 1 (correct)", "2+": "c ≥ 2 (duplicated)"}


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
    order = styles_in_order(list(POLICIES) + [n for n in names if n not in POLICIES])
    return {n: order[n] for n in names}


def styles_in_order(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """`{"color": OKABE_ITO[i % 8], "marker": POLICY_MARKERS[i % 7]}` for the i-th of `names`
    (first seen first): neighbours differ in both, the first 56 in one at least."""
    return {n: {"color": OKABE_ITO[i % len(OKABE_ITO)],
                "marker": POLICY_MARKERS[i % len(POLICY_MARKERS)]}
            for i, n in enumerate(dict.fromkeys(names))}


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


def run_labels(results: list[Results]) -> list[str]:
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


def common_title(results: list[Results]) -> str:
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


def from_baseline(ax: Any, baseline: float) -> None:
    """Start `ax`'s y axis at its natural `baseline` (0 for counts and shares, 1.0 for max /
    mean ratios), a little below it so marks on it show, wherever the data start: an axis
    zoomed into its data would exaggerate small changes. Call it after drawing."""
    top = max(ax.get_ylim()[1], baseline + 1e-9)
    ax.set_ylim(baseline - 0.03 * (top - baseline), top)


def legend_once(ax: Any, axes: Sequence[Any], **kwargs: Any) -> None:
    """One legend on `ax` for the labelled artists of all `axes`, each label once (first
    artist wins), instead of a legend per panel repeating the same entries."""
    handles: dict[str, Any] = {}
    for other in axes:
        for handle, label in zip(*other.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    ax.legend(handles.values(), handles.keys(), **kwargs)


def mark_na(ax: Any, x: float, y: float = 0.0, horizontal: bool = False) -> None:
    """An "n/a" mark at `(x, y)`: above it for vertical bars, right of it for horizontal ones."""
    ax.annotate("n/a", (x, y), xytext=(3, 0) if horizontal else (0, 3),
                textcoords="offset points", ha="left" if horizontal else "center",
                va="center" if horizontal else "bottom", fontsize="small", color="0.35")


def draw_dot(ax: Any, value: float | None, y: float, policy: str, style: dict[str, str], mode: str,
         baseline: float) -> None:
    """One metric value of `policy` as a dot at `(value, y)` in its `style` (colour and
    marker), filled or hollow by `mode`; "n/a" at the `baseline` when the value is None."""
    if value is None:
        mark_na(ax, baseline, y, horizontal=True)
        return
    ax.plot([value], [y], linestyle="none", markersize=5, markeredgewidth=1.1, clip_on=False,
            markerfacecolor=MODE_FACE.get(mode, style["color"]), label=policy, **style)


def mode_key(mode: str) -> Line2D:
    """The legend entry for `mode`'s dots: a grey circle, filled or hollow like them."""
    return Line2D([], [], linestyle="none", marker="o", markersize=5, markeredgewidth=1.1,
                  color="0.3", markerfacecolor=MODE_FACE.get(mode, "0.3"), label=f"{mode} mode")


def grouped_ratio_bars(ax: Any, results: list[Results], labels: list[str], groups: list[str],
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
            mark_na(ax, x, 1.0)
    ax.axhline(1.0, color="0.2", linewidth=0.8)
    policy_axis(ax, groups)
    ax.set_ylim(1.0 - 0.02 * max(top - 1.0, 0.05), 1.0 + 1.15 * max(top - 1.0, 0.05))
    ax.grid(True, axis="y", alpha=0.3)


def policy_axis(ax: Any, labels: list[str]) -> None:
    """One tick per policy label along x."""
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_xticks(range(len(labels)), labels, fontsize="small")
    ax.set_xlabel("policy")


def multiplicity_bars(ax: Any, results: list[Results | None]) -> None:
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
        ax.barh(ys, widths, left=starts, height=0.6, color=MULT_COLORS[key],
                label=MULT_LABELS[key])
    for y, r in enumerate(results):
        mult = (r.metrics.get("multiplicity") or {}) if r is not None else {}
        if any(mult.get(k) is None for k in ("0", "1", "2+")):
            mark_na(ax, 0.0, y, horizontal=True)
    ax.set_xlim(0, 1.0)
    ax.set_xlabel("fraction of pairs")
    ax.set_title("Pair multiplicity c\n(none mode)", fontsize="medium")
