"""What every eplbsim figure shares: the Okabe-Ito colours, each policy's own colour and marker
(`policy_style`), the paper style, saving, and the drawing helpers the figure modules use
(labels, titles, baselines, legends, dots, grouped bars).

Dimensions: `G` GPUs = EP ranks.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any, Iterable, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..base.errors import InputError
from ..base.files import atomic_file
from ..dispatch import FAULTS, POLICIES
from ..engines import ENGINE_POLICIES
from ..replay.results import Results

# Okabe & Ito (2008), "Color Universal Design": safe for the common colour-vision deficiencies.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
             "#000000")


# The policies' colours: Okabe-Ito's seven hues (not its black, the reference lines' colour),
# then colours picked one at a time from an sRGB grid (CIELAB lightness 28 to 82, chroma 30 to
# 70: neither grey nor glaring) as the one farthest from all picked before; any two differ by
# a CIELAB distance of 23 or more. `REGISTERED` takes the first ones, unknown names the rest.
POLICY_COLORS = (
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#5A4B0F",
    "#5A2D96", "#F0C396", "#96002D", "#87E169", "#A596FF", "#3C7800", "#A50078", "#FF8778",
    "#5A3C69", "#3CE1E1", "#FF87F0", "#A5B45A", "#782D00", "#F04B87", "#B4782D", "#1E5A2D",
    "#D2C3FF", "#00E196", "#A55A5A", "#008796", "#96D2A5", "#005AC3", "#A59600", "#872D5A",
    "#1EA54B", "#0096FF", "#A55AB4", "#8778B4", "#C33C2D", "#FFA5B4", "#96874B", "#F0C35A")


POLICY_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">", "p")


# Every policy a run can name, in a fixed order: the registry (`dispatch.POLICIES`), the faults
# (`dispatch.FAULTS`), the engines' algorithms (`engines.ENGINE_POLICIES`). The i-th has
# POLICY_COLORS[i] and POLICY_MARKERS[i % 10].
REGISTERED = tuple(dict.fromkeys([*POLICIES, *FAULTS, *ENGINE_POLICIES]))
_REGISTERED_INDEX = {name: i for i, name in enumerate(REGISTERED)}


# Multiplicity c per (token, slot) pair: dropped, correct, duplicated; greys, as the colours
# stand for policies.
MULT_COLORS = {"0": "0.55", "1": "0.86", "2+": "0.15"}


MODE_LINES = {"none": "-", "a2a": "-."}  # line style per mode in time series


# Marker fills of one policy's runs that differ in another setting (`run_lines`), in order.
FILLS = ("full", "none", "bottom", "left", "top", "right")
VARIANT_LINES = ("-", "--", ":", (0, (5, 1, 1, 1)))  # and their lines, with modes apart


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


def policy_style(name: str) -> dict[str, str]:
    """The colour and marker `name` has in every figure, for `plot(**style)`: a pure function
    of the name. The i-th of `REGISTERED` has `POLICY_COLORS[i]` (no two alike) and
    `POLICY_MARKERS[i % 10]`; any other name (a user's callable, a policy file) one of the
    colours no registered policy has and a marker, both picked by the CRC-32 of the name (the
    same in every process)."""
    i = _REGISTERED_INDEX.get(name)
    if i is not None:
        return {"color": POLICY_COLORS[i], "marker": POLICY_MARKERS[i % len(POLICY_MARKERS)]}
    spare = POLICY_COLORS[len(REGISTERED):]
    h = zlib.crc32(name.encode("utf-8"))
    return {"color": spare[h % len(spare)],
            "marker": POLICY_MARKERS[h // len(spare) % len(POLICY_MARKERS)]}



def policy_styles(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """`policy_style` of each of `names`, first seen first."""
    return {n: policy_style(n) for n in dict.fromkeys(names)}


def styles_in_order(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """`{"color": OKABE_ITO[i % 8], "marker": POLICY_MARKERS[i % 10]}` for the i-th of
    `names` (first seen first), for things other than policies (solvers): neighbours differ
    in both."""
    return {n: {"color": OKABE_ITO[i % len(OKABE_ITO)],
                "marker": POLICY_MARKERS[i % len(POLICY_MARKERS)]}
            for i, n in enumerate(dict.fromkeys(names))}


def run_lines(results: Sequence[Results], modes_apart: bool = False) -> list[dict[str, Any]]:
    """Each result's look as a line over steps, for `plot(**look)`: its policy's colour and
    marker (`policy_style`); the marker full for the first run label (`run_labels`) of a
    policy and filled otherwise (`FILLS`) for each other label of it, so runs of one policy
    that differ in a setting differ too; the line solid in "none" and dash-dotted in "a2a"
    (`MODE_LINES`), or, with `modes_apart` (each mode in a panel of its own), solid, dashed,
    dotted, ... for the first, second, third label of the policy (`VARIANT_LINES`)."""
    seen: dict[str, list[str]] = {}  # policy -> its run labels, first seen first
    looks = []
    for r, label in zip(results, run_labels(list(results))):
        labels = seen.setdefault(r.policy, [])
        if label not in labels:
            labels.append(label)
        i = labels.index(label)
        looks.append({**policy_style(r.policy), "fillstyle": FILLS[i % len(FILLS)],
                      "linestyle": VARIANT_LINES[i % len(VARIANT_LINES)] if modes_apart
                      else MODE_LINES.get(r.spec.dispatch.mode, "-")})
    return looks


NAME_WIDTH = 24  # characters of a name on one line of a label; longer ones wrap (`wrap_name`)


def wrap_name(text: str, width: int = NAME_WIDTH) -> str:
    """`text` with each line longer than `width` characters broken after a space, `_`, `-`,
    `:` or `,` (a user's `ordinal_offset_rotating_with_step` wraps where it reads), never
    inside a word unless the word alone is longer."""
    out = []
    for line in text.split("\n"):
        row = ""
        for piece in re.findall(r"[^ _\-:,]*[ _\-:,]?", line):
            if row and len(row) + len(piece.rstrip()) > width:
                out.append(row.rstrip())
                row = ""
            row += piece
        out.append(row.rstrip())
    return "\n".join(out)


def legend_below(fig: Figure, handles: Sequence[Any], fontsize: float = 7.0) -> None:
    """One legend for the whole figure under its panels, in as many columns as its width holds
    for the longest entry, the figure made taller by the legend's rows so the panels keep
    their room (a legend of 30 policies does not squeeze the plots to slivers). Entries'
    labels are wrapped (`wrap_name`). Call it last."""
    for handle in handles:
        handle.set_label(wrap_name(handle.get_label()))
    labels = [h.get_label() for h in handles]
    char = 0.5 * fontsize / 72  # inches a character takes, about
    longest = max((len(line) for label in labels for line in label.split("\n")), default=1)
    width, height = fig.get_size_inches()
    ncols = max(1, min(len(handles), int((width - 0.3) / (longest * char + 0.45))))
    lines = [max(label.count("\n") + 1 for label in labels[i:i + ncols])
             for i in range(0, len(labels), ncols)]
    fig.set_size_inches(width, height + sum(lines) * 1.25 * fontsize / 72 + 0.06 * len(lines))
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=fontsize)


def step_axis(axis: Any) -> None:
    """Make `axis` (an `ax.xaxis` or `ax.yaxis`) a step axis: labelled "step", ticks on
    whole steps only (never -0.5 or 1.5)."""
    axis.set_label_text("step")
    axis.set_major_locator(MaxNLocator(integer=True))


def pairs_per_step(ax: Any, pairs: Any) -> None:
    """`pairs [S]` (routed pairs of each step, a layer) as grey bars on `ax`, from 0: marks
    the steps that chunking or a ragged batch left small, where max / mean is high because a
    few pairs cannot spread over the experts, not because the load is skewed."""
    ax.bar(range(len(pairs)), pairs, width=0.8, color="0.6", linewidth=0)
    ax.set_ylabel("pairs a step\n(a layer)")
    from_baseline(ax, 0.0)
    step_axis(ax.xaxis)


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


def handles_once(axes: Sequence[Any]) -> list[Any]:
    """The labelled artists of all `axes`, each label once (first artist wins), to key them in
    one legend instead of a legend per panel repeating the same entries."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    return list(handles.values())


def legend_once(ax: Any, axes: Sequence[Any], **kwargs: Any) -> None:
    """One legend on `ax` for the labelled artists of all `axes` (`handles_once`)."""
    ax.legend(handles=handles_once(axes), **kwargs)


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


def ratio_bars(ax: Any, results: list[Results], rows: list[str], modes: list[str], key: str,
               values: bool) -> None:
    """Row `y` of `ax`: the results whose run label (`run_labels`) is `rows[y]`, a horizontal
    bar each rising from the ideal 1.0 to their metric `key`, one bar a mode (top down in
    `modes` order), in the policy's colour (`policy_style`), filled for "none" and hollow
    for the others (`MODE_FACE`); "n/a" where the metric is None; each bar's value at its end
    when `values`."""
    height = 0.8 / len(modes)
    top = 1.0
    for r, label in zip(results, run_labels(results)):
        mode = r.spec.dispatch.mode
        y = rows.index(label) + (modes.index(mode) - (len(modes) - 1) / 2) * height
        v = r.metrics.get(key)
        if v is None:
            mark_na(ax, 1.0, y, horizontal=True)
            continue
        color = policy_style(r.policy)["color"]
        bar = ax.barh([y], [v - 1.0], height=height * 0.9, left=1.0, edgecolor=color,
                      linewidth=1.0, color=MODE_FACE.get(mode, color))
        if values:
            ax.bar_label(bar, labels=[f"{v:.2f}"], fontsize="x-small", padding=2)
        top = max(top, v)
    ax.axvline(1.0, color="0.2", linewidth=0.8)
    span = max(top - 1.0, 0.05)
    ax.set_xlim(1.0 - 0.02 * span, 1.0 + (1.2 if values else 1.05) * span)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.grid(True, axis="x", alpha=0.3)
    ax.grid(False, axis="y")


def mode_patch(mode: str) -> Patch:
    """The legend entry for `mode`'s bars: a grey box, filled or hollow like them."""
    return Patch(facecolor=MODE_FACE.get(mode, "0.3"), edgecolor="0.3", label=f"{mode} mode")


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
    ax.set_title("Pair multiplicity\nc (none mode)", fontsize="medium")
