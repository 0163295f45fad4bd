"""Every public figure function of eplbsim.plots, drawn from inputs that crowd it (every
registered policy and a user's long-named ones, both modes, chunked steps, long solver names):
no two texts overlap, none leaves the canvas; each policy looks the same in every figure and
unlike every other; step axes tick whole steps; a small chunk's spike is marked as such.

Dimensions: `S` steps, `L` layers, `E` experts.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from eplbsim import plots
from eplbsim.dispatch import FAULTS, POLICIES
from eplbsim.engines import ENGINE_POLICIES
from eplbsim.plots.legibility import shown_texts
from eplbsim.plots.style import REGISTERED
from eplbsim.replay import compare, replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.coactivation import coactivation
from eplbsim.traces.prefill_chunks import ChunkView
from eplbsim.traces.request_synth import synthesize_requests
from eplbsim.traces.synth import synthesize
from eplbsim.traces.workload import Workload, batch
from drawn import drawer

SPEC = RunSpec.of(gpus=4, gpus_per_node=2, redundant=4)
TIMED = SPEC.replace(cost="roofline", model="deepseek-v3", device_profile="h200")
DPI = 100  # enough to measure text boxes in points, quick to render


def _long_named(base: str, name: str):
    """A user's policy: `base`'s function under another (long) name."""
    fn = POLICIES[base].fn

    def policy(topk_ids, view, ctx):
        return fn(topk_ids, view, ctx)
    policy.__name__ = name
    return policy


# a user's policies, named as people name prototypes
USERS = [_long_named("ordinal", "ordinal_offset_rotating_with_step_and_layer_v2"),
         _long_named("row", "row_modulo_baseline_from_the_paper")]
MANY = [*POLICIES, *FAULTS, *USERS]  # every registered policy one can run here, and the users'
IN_NONE = [p for p in MANY if not isinstance(p, str) or "none" in (POLICIES | FAULTS)[p].modes]
LONG = [USERS[0], "row", "ordinal"]  # for the figures of a panel a policy


@pytest.fixture(scope="module")
def many(trace):
    return compare(trace, MANY, ["none", "a2a"], SPEC)


@pytest.fixture(scope="module")
def chunked():
    """A trace whose one step of 33 tokens is cut into chunks of 16: 16, 16, then 1."""
    base = synthesize("uniform", steps=2, tokens=33, layers=2, experts=16, top_k=4, seed=0)
    return ChunkView(base, 16, dict(base.meta))


def _rebalanced(policies, trace, **settings):
    spec = SPEC.replace(rebalance_every=4, **settings)
    return [replay(trace, spec.replace(policy=p, mode=m)) for p in policies
            for m in ("none", "a2a")]


def _drift():
    return synthesize("drift", steps=16, tokens=64, layers=2, experts=16, top_k=2, seed=0)


def _batching(_):
    reqs = synthesize_requests("requests", seed=0, num_requests=6, prompt_mean=4.0,
                               output_mean=4.0, layers=1, experts=16, top_k=2)
    rows = []
    for name in ("sum", "max", "max + graphs (routed padding)"):  # names as a notebook writes
        layout = "sum" if name == "sum" else "max"
        rows += [(name, r) for r in compare(batch(reqs, Workload(dp=2, dp_layout=layout)).trace,
                                            IN_NONE, ["none"], SPEC)]
    return plots.workload_batching(rows, batch(reqs, Workload()).trace.counts())


def _traffic():
    spec = SPEC.replace(mode="a2a", policy="ordinal", cost="roofline")
    tr = synthesize("clustered", steps=2, tokens=64, layers=2, experts=16, top_k=4, seed=0)
    return {case: [replay(tr, spec.replace(solver=s)) for s in ("deepseek", "affinity",
                                                                "lpt-hier")]
            for case in ("clustered, 2 nodes of 2 GPUs", "the same, once more")}


def _redundancy(trace):
    return plots.redundancy_curves([{**r.row(), "redundant": redundant} for redundant in (0, 4)
                                    for r in compare(trace, IN_NONE, ["none"],
                                                     SPEC.replace(redundant=redundant))])


def _review():
    layers = 12
    return plots.review_figure(
        {"layer_imbalance": {"candidate": [1.1] * layers, "baseline": [1.2] * layers},
         "step_ms": {"candidate": np.ones(8), "baseline": np.ones(8) * 1.1},
         "replica_share": {"candidate": np.linspace(0.5, 1.5, 6),
                           "baseline": np.linspace(0.2, 1.8, 6)}},
        USERS[0].__name__, "ordinal")


def _replica_pair(many):
    pair = [r for r in many if r.policy in ("row", USERS[0].__name__)
            and r.spec.dispatch.mode == "none"]
    expert = int((pair[0].epochs[0][2].logcnt[0] >= 2).nonzero()[0])
    return plots.replica_loads_pair(pair, layer=0, expert=expert)


# Every public figure function, drawn from crowded inputs: name -> (fixture getter) -> Figure.
CROWDED = {
    "policy_comparison": lambda get: plots.policy_comparison(get("many")),
    "policy_mode_bars": lambda get: plots.policy_mode_bars(get("many")),
    "time_series_figure": lambda get: plots.time_series_figure(get("many")),
    "time_series_figure, rebalancing": lambda get: plots.time_series_figure(
        _rebalanced(LONG, _drift())),
    "time_series_figure, chunked": lambda get: plots.time_series_figure(
        compare(get("chunked"), LONG, ["none", "a2a"], SPEC)),
    "replica_loads_over_time": lambda get: plots.replica_loads_over_time(
        next(r for r in get("many") if r.policy == USERS[0].__name__)),
    "replica_loads_pair": lambda get: _replica_pair(get("many")),
    "redundancy_curves": lambda get: _redundancy(get("trace")),
    "solver_gap_lines": lambda get: plots.solver_gap_lines(
        [{"solver": s, "redundant": r, "gap": 1.0 + g / (1 + r)}
         for s, g in (("deepseek (groups on nodes)", 0.05), ("lpt", 0.01),
                      ("a_solver_of_my_own_with_a_long_name", 0.03)) for r in (0, 8, 16)]),
    "predictor_time_series": lambda get: plots.predictor_time_series(
        [replay(_drift(), SPEC.replace(policy=USERS[0], mode="a2a", rebalance_every=4,
                                       predictor=p)) for p in ("window", "ema", "oracle")],
        (4, 10)),
    "time_bars_and_stalls": lambda get: plots.time_bars_and_stalls(
        compare(get("trace"), MANY, ["none", "a2a"], TIMED),
        [replay(_drift(), TIMED.replace(policy=p, mode="a2a", rebalance_every=4))
         for p in LONG]),
    "switch_hazard": lambda get: plots.switch_hazard(
        _rebalanced(LONG, _drift(), rebalance_mode="async", switch_delay=3)),
    "workload_batching": _batching,
    "expert_load_heatmap": lambda get: plots.expert_load_heatmap(get("chunked").counts()),
    "top_share_over_steps": lambda get: plots.top_share_over_steps(get("chunked").counts()),
    "step_imbalance": lambda get: plots.step_imbalance(get("chunked").counts()),
    "coactivation_heatmap": lambda get: plots.coactivation_heatmap(
        coactivation(synthesize("clustered", steps=2, tokens=64, layers=2, experts=16,
                                top_k=4, seed=0))),
    "balance_against_traffic": lambda get: plots.balance_against_traffic(_traffic()),
    "communication_and_time": lambda get: plots.communication_and_time(_traffic()),
    "review_figure": lambda get: _review(),
}


@pytest.fixture(scope="module")
def crowded(request):
    """`crowded(name)`: the figure `CROWDED[name]` draws in the paper style, rendered."""
    return drawer(request, CROWDED, DPI)


def test_every_public_figure_function_is_drawn_crowded():
    functions = {n for n in plots.__all__ if callable(getattr(plots, n))
                 and getattr(plots, n).__module__.startswith("eplbsim.plots.")
                 and getattr(getattr(plots, n), "__annotations__", {}).get("return") == "Figure"}
    drawn = {name.split(",")[0] for name in CROWDED}
    assert functions - {"trace_figures"} <= drawn, functions - drawn
    assert set(plots.TRACE_FIGURES.values()) <= {getattr(plots, n) for n in drawn}


@pytest.mark.parametrize("name", list(CROWDED))
def test_crowded_figure_texts_do_not_overlap_nor_leave_the_canvas(crowded, name):
    fig = crowded(name)
    assert len(shown_texts(fig)) > 5  # the measure sees the figure's texts
    assert plots.illegible(fig) == []


def _bars(names, rotation=0, label="pairs"):
    """Bars named `names` on a 2-inch wide figure, their x labels turned by `rotation`."""
    fig = plots.Figure(figsize=(2, 2), layout="constrained")
    ax = fig.subplots()
    ax.bar(range(len(names)), range(1, len(names) + 1), tick_label=names)
    ax.tick_params(axis="x", labelrotation=rotation)
    ax.set_ylabel(label)
    return fig


def test_illegible_names_the_texts_that_run_together_or_leave_the_figure():
    """The crowded bars of issue 61 ("quotalp-goldenmetro"), each problem a line naming its
    texts; turned labels read; a note placed past the right edge leaves the figure."""
    names = ["quota", "lp-golden", "metro", "ordinal", "spill"]
    with plots.paper_style():
        crowded, turned = _bars(names), _bars(names, rotation=90)
    problems = plots.illegible(crowded)
    assert "'quota' overlaps 'lp-golden'" in problems
    assert "'lp-golden' overlaps 'metro'" in problems
    assert all(" overlaps " in p for p in problems)
    assert plots.illegible(turned) == []
    turned.text(0.97, 0.5, "policy")  # starts inside the figure, ends past its right edge
    assert plots.illegible(turned) == ["'policy' leaves the figure"]


ROOT = Path(__file__).resolve().parents[2]
# A call that draws a figure: matplotlib's Figure, a paper figure, a public figure function.
DRAWS = re.compile(r"\b(?:Figure\(|FIGURES\[|(?:%s)\()" % "|".join(
    n for n in plots.__all__ if getattr(getattr(plots, n), "__annotations__", {}).get("return")
    == "Figure"))


def _code_of_the_docs():
    """`{file name: [its code]}`: each notebook's code cells, each guide's python blocks."""
    code = {p.name: ["".join(c["source"]) for c in json.loads(p.read_text())["cells"]
                     if c["cell_type"] == "code"]
            for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    for p in sorted((ROOT / "docs" / "guide").glob("*.md")):
        code[p.name] = re.findall(r"^```python\n(.*?)^```$", p.read_text(), re.S | re.M)
    return code


def test_notebooks_and_guides_draw_in_the_paper_style_and_check_each_figure():
    """Every notebook and guide that draws a figure draws it inside `paper_style()`, without
    pyplot, and asserts `not illegible(...)` once a figure drawn or more (the notebook and guide
    tests run them, so their figures are measured)."""
    drawing = []
    for name, cells in _code_of_the_docs().items():
        assert not any("pyplot" in c or "plt." in c for c in cells), name
        draws = [len(DRAWS.findall(c)) for c in cells]
        if sum(draws):
            drawing.append(name)
        assert all("paper_style()" in c for c, n in zip(cells, draws) if n), name
        checks = sum(c.count("assert not illegible(") for c in cells)
        assert checks >= sum(draws), (name, checks, sum(draws))
    assert {"01_quickstart.ipynb", "04_paper_figures.ipynb", "07-figures.md",
            "08-python.md"} <= set(drawing)


# ------------------------------------------------------------------------- a policy's look

def _lab(color):
    """CIELAB (D65) of a matplotlib colour: distances in it follow what the eye sees."""
    rgb = np.array(to_rgb(color))
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                    [0.0193, 0.1192, 0.9505]]) @ linear / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_every_registered_policy_has_a_colour_of_its_own():
    names = [*POLICIES, *FAULTS, *ENGINE_POLICIES]
    assert set(REGISTERED) == set(names) and "sglang:static" in REGISTERED
    styles = plots.policy_styles(names)
    labs = {n: _lab(s["color"]) for n, s in styles.items()}
    closest = min((math.dist(labs[a], labs[b]), a, b) for i, a in enumerate(names)
                  for b in names[i + 1:])
    assert closest[0] > 20, closest  # CIELAB distance: 2.3 is a just noticeable difference
    for name, s in styles.items():  # no policy in a reference line's grey or black
        lightness, a, b = labs[name]
        assert math.hypot(a, b) > 25, (name, s)
    for a, b in (("row", "metro"), ("ordinal", "spill"), ("quota", "lp-golden")):
        assert styles[a]["color"] != styles[b]["color"]


def test_a_policys_style_depends_on_its_name_only():
    whole = plots.policy_styles(REGISTERED)
    assert plots.policy_styles(["quota", "row"]) == {n: whole[n] for n in ("quota", "row")}
    assert plots.policy_style("sglang:static") == whole["sglang:static"]
    mine = plots.policy_style("my_policy")
    assert mine == plots.policy_style("my_policy")  # the same every time
    taken = {s["color"] for s in whole.values()}
    users = [f"user_policy_{i}" for i in range(40)]
    assert all(plots.policy_style(u)["color"] not in taken for u in users)
    assert len({tuple(plots.policy_style(u).values()) for u in users}) > 30  # spread out
    assert all(plots.policy_style(u)["marker"] in plots.POLICY_MARKERS for u in users)


def _policy_lines(fig):
    """`{policy: {(colour, marker)}}` of the marked lines and bars labelled by a policy."""
    looks = {}
    for ax in fig.axes:
        for line in ax.lines:
            if line.get_marker() not in (None, "None", "") and line.get_label() in NAMES:
                looks.setdefault(line.get_label(), set()).add(
                    (to_rgb(line.get_color()), line.get_marker()))
    for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        for text, handle in zip(legend.get_texts(), legend.legend_handles):
            if text.get_text() in NAMES and hasattr(handle, "get_marker"):
                looks.setdefault(text.get_text(), set()).add(
                    (to_rgb(handle.get_color()), handle.get_marker()))
    return looks


NAMES = {*POLICIES, *FAULTS, *(u.__name__ for u in USERS)}


@pytest.mark.parametrize("name", ["time_series_figure", "time_series_figure, rebalancing",
                                  "redundancy_curves", "switch_hazard", "time_bars_and_stalls"])
def test_a_policy_looks_the_same_in_every_figure(crowded, name):
    looks = _policy_lines(crowded(name))
    assert looks
    for policy, seen in looks.items():
        style = plots.policy_style(policy)
        assert seen == {(to_rgb(style["color"]), style["marker"])}, (name, policy)
    reference = _policy_lines(crowded("policy_comparison"))
    assert all(reference[p] == looks[p] for p in looks if p in reference)


def test_policy_mode_bars_colour_a_policy_as_its_dots(crowded, many):
    """Each bar in its policy's colour, filled in "none" and hollow in "a2a"; the rows named
    by policy, top down in the results' order."""
    ax = crowded("policy_mode_bars").axes[0]
    names = [t.get_text().replace("\n", "") for t in ax.get_yticklabels()]
    assert names == list(dict.fromkeys(r.policy for r in many)) and len(names) == len(MANY)
    bars = {}  # (row, filled) -> edge colour
    for bar in ax.patches:
        row = round(bar.get_y() + bar.get_height() / 2)
        filled = to_rgb(bar.get_facecolor()) != (1.0, 1.0, 1.0)
        bars[(names[row], filled)] = to_rgb(bar.get_edgecolor())
    assert len(bars) > 40
    for (name, _), edge in bars.items():
        assert edge == to_rgb(plots.policy_style(name)["color"]), name
    assert ("row", True) in bars and ("row", False) in bars  # both modes, told apart by fill


# ------------------------------------------------------------------------- steps and chunks

@pytest.mark.parametrize("name", ["time_series_figure", "time_series_figure, chunked",
                                  "expert_load_heatmap", "top_share_over_steps",
                                  "step_imbalance", "replica_loads_over_time",
                                  "replica_loads_pair", "switch_hazard",
                                  "predictor_time_series"])
def test_step_axes_tick_whole_steps(crowded, name):
    fig = crowded(name)
    axes = [axis for ax in fig.axes if ax.get_visible() for axis in (ax.xaxis, ax.yaxis)
            if axis.get_label_text() == "step"]
    assert axes
    for axis in axes:
        low, high = sorted(axis.get_view_interval())
        shown = [t for t in axis.get_ticklocs() if low <= t <= high]
        assert shown and all(float(t).is_integer() for t in shown), (name, shown)


def test_a_small_chunks_spike_is_marked_as_its_size(crowded, chunked):
    """The 1-token leftover chunk (top-4 over 16 experts) has max / mean 4.0: the figure draws
    the least max / mean each step's pairs allow through it and each step's pairs below."""
    fig = crowded("step_imbalance")
    ax, ax_pairs = fig.axes
    floor = next(line for line in ax.lines if "least" in line.get_label())
    sizes = chunked.tokens_per_step.numpy()  # [S] 16, 16, 1, 16, 16, 1
    small = int(np.argmin(sizes))
    assert sizes[small] == 1 and floor.get_ydata()[small] == pytest.approx(4.0)
    median = next(line for line in ax.lines if line.get_label() == "median layer")
    assert median.get_ydata()[small] == pytest.approx(4.0)  # the spike sits on the floor
    assert [b.get_height() for b in ax_pairs.patches] == [4.0 * t for t in sizes]
    assert ax_pairs.get_ylabel().startswith("pairs a step")
    even = plots.step_imbalance(synthesize("uniform", steps=3, tokens=64, layers=1,
                                           experts=16, top_k=4, seed=0).counts())
    assert len(even.axes) == 1 and all("least" not in ln.get_label() for ln in even.axes[0].lines)


def test_time_series_marks_chunks_and_draws_no_empty_panel(crowded):
    chunked = crowded("time_series_figure, chunked")
    labels = [ax.get_ylabel() for ax in chunked.axes]
    assert any(label.startswith("pairs a step") for label in labels)
    assert not any("moved" in label for label in labels)  # one placement: nothing moved
    plain = crowded("time_series_figure")
    assert len(plain.axes) == 2  # equal steps, nothing moved: imbalance and skew only
    rebalancing = crowded("time_series_figure, rebalancing")
    moved = next(ax for ax in rebalancing.axes if "moved" in ax.get_ylabel())
    entries = [(t.get_text(), to_rgb(h.get_facecolor()))
               for t, h in zip(moved.get_legend().get_texts(), moved.get_legend().legend_handles)]
    assert entries and len({colour for _, colour in entries}) == len(entries)


def test_run_out_draws_its_figures_in_the_paper_style(tmp_path, monkeypatch):
    from eplbsim.cli import main
    drawn = {}

    def keep(fig, path, dpi=150):
        drawn[Path(path).stem] = fig
        return ()
    monkeypatch.setattr(plots, "save_figure", keep)
    code = main(["run", "--scenario", "template", "--steps", "3", "--tokens", "32",
                 "--layers", "2", "--experts", "16", "--top-k", "2", "--gpus", "4",
                 "--redundant", "4", "--policies", "row,ordinal", "--mode", "none",
                 "--out", str(tmp_path)])
    assert code == 0 and set(drawn) == {"policies", "timeseries"}
    for name, fig in drawn.items():
        ax = fig.axes[0]
        assert not ax.spines["top"].get_visible(), name
        assert ax.yaxis.label.get_fontsize() == plots.PAPER_STYLE["axes.labelsize"], name
    lines = [line for line in drawn["timeseries"].axes[0].lines if line.get_label() in
             ("row", "ordinal")]
    assert {line.get_label(): line.get_color() for line in lines} == {
        p: plots.policy_style(p)["color"] for p in ("row", "ordinal")}
    assert len(drawn["timeseries"].axes) == 2  # nothing moved, equal steps: no empty panel
