"""Tests for eplbsim.plots: every figure renders, saves, and is not blank; None metrics are fine;
every paper figure, drawn from small inputs, reads at 100% on a laptop screen.

Dimensions: `S` steps, `L` layers, `E` experts, `P` physical slots.
"""

import re

import matplotlib.image
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D

from eplbsim import plots
from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES as ALL_POLICIES
from eplbsim.plots.figures import DPI, FIGURES
from eplbsim.plots.legibility import shown_texts
from eplbsim.replay import compare, replay
from eplbsim.runspec import RunSpec
from eplbsim.schedule.switch import phases
from eplbsim.traces.coactivation import coactivation
from eplbsim.traces.request_synth import synthesize_requests
from eplbsim.traces.synth import synthesize
from eplbsim.traces.workload import Workload, batch
from drawn import drawer

CONFIG = RunSpec.of(gpus=4, redundant=4)
POLICIES = ["static", "random", "row", "ordinal"]
TIMED = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8, cost="roofline", model="olmoe-1b-7b",
                   device_profile="h200")
# A figure must read at 100% on a laptop screen: at most this many pixels (width, height) at
# the DPI `figures.build` saves with, i.e. 8 x 6 inches.
MAX_PX = (1600, 1200)
RATIO_AXIS = re.compile(r"max / mean|lower bound")  # axis labels of ratios whose ideal is 1.0


@pytest.fixture(scope="module")
def results(trace):
    return compare(trace, POLICIES, ["none", "a2a"], CONFIG)


@pytest.fixture(scope="module")
def field(trace):
    """Every registered policy in both modes it runs in: the field_policies figure's input."""
    return compare(trace, list(ALL_POLICIES), ["none", "a2a"], CONFIG)


@pytest.fixture(scope="module")
def timed(trace):
    return compare(trace, ["row", "ordinal"], ["none", "a2a"], TIMED)


@pytest.fixture(scope="module")
def hazard():
    trace = synthesize("drift", seed=3, steps=24, tokens=96, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=4, rebalance_every=6,
                      rebalance_mode="async", switch_delay=3, policy="row")
    return [replay(trace, spec.replace(mode=m)) for m in ("a2a", "none")]


@pytest.fixture(scope="module")
def batching():
    """`(rows, counts)` of `workload_batching`: two batchings x two policies, and the counts
    of an unbatched trace."""
    reqs = synthesize_requests("requests", seed=0, num_requests=6, prompt_mean=4.0,
                               output_mean=4.0, layers=1, experts=16, top_k=2)
    rows = []
    for name, w in (("sum", Workload(dp=2)), ("max", Workload(dp=2, dp_layout="max"))):
        rows += [(name, r) for r in compare(batch(reqs, w).trace, ["row", "ordinal"], ["none"],
                                            CONFIG)]
    return rows, batch(reqs, Workload()).trace.counts()


def _assert_png(path):
    assert path.exists() and path.stat().st_size > 0
    pixels = matplotlib.image.imread(path)  # [H, W, 3 or 4] floats in [0, 1]
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert float(np.var(pixels[..., :3])) > 0


def test_policy_comparison_both_modes(results, tmp_path):
    fig = plots.policy_comparison(results)
    assert isinstance(fig, Figure)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert "GPU imbalance" in titles
    assert any("agreement" in t for t in titles) and any("multiplicity" in t for t in titles)
    written = plots.save_figure(fig, tmp_path / "sub" / "dir" / "cmp.png", dpi=60)
    assert written == (tmp_path / "sub" / "dir" / "cmp.png",)
    _assert_png(written[0])


def test_policy_comparison_a2a_only(results, tmp_path):
    a2a = [r for r in results if r.spec.dispatch.mode == "a2a"]
    assert all(r.metrics["rank_agreement"] is None for r in a2a)
    fig = plots.policy_comparison(a2a)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert not any("agreement" in t for t in titles)  # none-mode panels are left out
    _assert_png(plots.save_figure(fig, tmp_path / "a2a.png", dpi=60)[0])


def test_policy_comparison_marks_missing_metrics(trace, tmp_path):
    # no redundant slots: every expert has one replica, so replica skew is None ("n/a")
    res = compare(trace, ["row", "ordinal"], ["none"], RunSpec.of(gpus=4, redundant=0))
    assert res[0].metrics["replica_skew_max"] is None
    fig = plots.policy_comparison(res)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("n/a") >= 4  # two policies x two skew panels
    _assert_png(plots.save_figure(fig, tmp_path / "na.png", dpi=60)[0])


def test_policy_comparison_labels_differing_settings(trace):
    res = [replay(trace, RunSpec.of(policy="random", rng=rng, gpus=4, redundant=4))
           for rng in ("independent", "shared")]
    fig = plots.policy_comparison(res)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks == ["random\nrng=independent", "random\nrng=shared"]


def test_policy_comparison_rejects_empty():
    with pytest.raises(InputError):
        plots.policy_comparison([])


@pytest.mark.parametrize("policy", ["row", "ordinal"])
def test_replica_loads_over_time(results, policy, tmp_path):
    res = next(r for r in results if r.policy == policy and r.spec.dispatch.mode == "none")
    fig = plots.replica_loads_over_time(res, layer=1, experts=3)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert 1 <= len(panels) <= 3
    S = res.slot_load.shape[0]
    for ax in panels:
        replica_lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("replica")]
        assert len(replica_lines) >= 2
        assert all(len(ln.get_xdata()) == S for ln in replica_lines)
    _assert_png(plots.save_figure(fig, tmp_path / f"{policy}.png", dpi=60)[0])


def test_replica_loads_show_row_starving_a_twin(results):
    # the template trace: `row` leaves one replica of a 2-replica expert idle, `ordinal` does not
    row = next(r for r in results if r.policy == "row" and r.spec.dispatch.mode == "none")
    ordinal = next(r for r in results if r.policy == "ordinal" and r.spec.dispatch.mode == "none")

    def min_replica_total(res):
        fig = plots.replica_loads_over_time(res, layer=0, experts=16)
        return min(sum(ln.get_ydata()) for ax in fig.axes if ax.get_visible()
                   for ln in ax.get_lines() if ln.get_label().startswith("replica"))

    assert min_replica_total(row) == 0
    assert min_replica_total(ordinal) > 0


def test_replica_loads_over_time_with_rebalancing(trace, tmp_path):
    res = replay(trace, RunSpec.of(gpus=4, redundant=4, rebalance_every=2))
    assert len(res.epochs) == 2
    fig = plots.replica_loads_over_time(res)
    _assert_png(plots.save_figure(fig, tmp_path / "rebalance.png", dpi=60)[0])


def test_replica_loads_over_time_without_replicas(trace, tmp_path):
    res = replay(trace, RunSpec.of(gpus=4, redundant=0))
    fig = plots.replica_loads_over_time(res)
    assert any("no replicated expert" in t.get_text() for ax in fig.axes for t in ax.texts)
    _assert_png(plots.save_figure(fig, tmp_path / "none.png", dpi=60)[0])


def test_replica_loads_over_time_rejects_bad_layer(results):
    with pytest.raises(InputError):
        plots.replica_loads_over_time(results[0], layer=2)
    with pytest.raises(InputError):
        plots.replica_loads_over_time(results[0], experts=0)


def test_save_figure_pdf_writes_png_beside(results, tmp_path):
    fig = plots.policy_comparison(results[:2])
    written = plots.save_figure(fig, tmp_path / "new" / "fig.pdf", dpi=60)
    assert written == (tmp_path / "new" / "fig.pdf", tmp_path / "new" / "fig.png")
    assert written[0].read_bytes().startswith(b"%PDF")
    _assert_png(written[1])
    with pytest.raises(InputError):
        plots.save_figure(fig, tmp_path / "fig.svg", dpi=60)


def test_plots_leave_pyplot_alone(results):
    import sys

    def open_figures():
        pyplot = sys.modules.get("matplotlib.pyplot")
        return pyplot.get_fignums() if pyplot else []

    before = open_figures()
    plots.policy_comparison(results)
    plots.replica_loads_over_time(results[0])
    # figures are built without pyplot: no global figure registry is touched, no backend chosen
    assert open_figures() == before


def test_time_series_figure_marks_rebalances(tmp_path):
    tr = synthesize("burst", steps=16, tokens=64, layers=2, experts=16, top_k=2, seed=0)
    res = compare(tr, ["row", "ordinal"], ["none", "a2a"],
                  RunSpec.of(gpus=4, redundant=4, rebalance_every=4))
    fig = plots.time_series_figure(res)
    imb, skew, moves = fig.axes[:3]
    assert len([ln for ln in imb.get_lines() if ln.get_label() in ("row", "ordinal")]) == 4
    assert {ln.get_linestyle() for ln in imb.get_lines() if ln.get_label() == "row"} == {
        "-", "-."}  # the modes told apart by line
    rows = res[0].migrations()
    kinds = [k for k in ("same_gpu", "same_node", "cross_node") if any(r[k] for r in rows)]
    assert len(moves.patches) == len(rows) * len(kinds) > 0  # a bar a rebalance and kind moved
    assert len(moves.get_legend().get_texts()) == len(kinds)
    assert moves.get_xlabel() == "step" and "GPU imbalance" in imb.get_ylabel()
    written = plots.save_figure(fig, tmp_path / "ts.pdf", dpi=60)
    assert [p.suffix for p in written] == [".pdf", ".png"]
    _assert_png(written[1])


def test_time_series_figure_without_rebalancing(results, tmp_path):
    fig = plots.time_series_figure(results[:1])
    assert len(fig.axes) == 2  # no panel of moves when nothing moved
    _assert_png(plots.save_figure(fig, tmp_path / "flat.png", dpi=60)[0])
    with pytest.raises(InputError, match="at least one"):
        plots.time_series_figure([])


@pytest.mark.parametrize("fn", [plots.policy_mode_bars, plots.redundancy_curves,
                                plots.replica_loads_pair, plots.solver_gap_lines,
                                plots.predictor_time_series])
def test_paper_plots_reject_empty_input(fn):
    args = (0, 0) if fn is plots.replica_loads_pair else ()
    with pytest.raises(InputError, match="at least one"):
        fn([], *args)


def test_paper_style_leaves_rcparams_alone(results):
    import matplotlib
    before = dict(matplotlib.rcParams)
    with plots.paper_style():
        fig = plots.policy_mode_bars(results)
        assert matplotlib.rcParams["font.size"] == plots.PAPER_STYLE["font.size"]
    assert dict(matplotlib.rcParams) == before
    assert len(fig.axes) == 2 and "GPU imbalance" in fig.axes[0].get_xlabel()


def test_heatmap_and_replica_pair_check_their_arguments(trace, results):
    with pytest.raises(InputError, match="layer must be in"):
        plots.expert_load_heatmap(trace.counts(), layer=9)
    row = results[2]
    single = int((row.epochs[0][2].logcnt[0] == 1).nonzero()[0])
    with pytest.raises(InputError, match="1 replica"):
        plots.replica_loads_pair([row], layer=0, expert=single)


def test_time_bars_and_stalls_draw_both_panels_and_reject_empty(timed):
    fig = plots.time_bars_and_stalls(timed, timed[:1])
    bars, line = fig.axes[0], fig.axes[1]
    assert len(bars.patches) == 2 * len(timed)  # compute and communication of each
    assert len(line.lines) == 1
    if line.get_ylim()[0] > 0:  # zoomed into the line: the label says so
        assert "axis starts at" in line.get_ylabel()
    with pytest.raises(InputError):
        plots.time_bars_and_stalls([], timed)


def test_switch_hazard_shades_each_hazard_window_and_rejects_empty(hazard):
    fig = plots.switch_hazard(hazard)
    windows = sum(serving is not None for *_, serving in phases(hazard[0].segments))
    assert windows > 0
    for ax in fig.axes:
        assert len(ax.lines) >= 1 and len(ax.patches) == windows
    # a setting keeps its colour across the panels, and one legend keys it
    assert fig.axes[0].lines[0].get_color() == fig.axes[1].lines[0].get_color()
    assert [ax.get_legend() for ax in fig.axes] == [None, None] and len(fig.legends) == 1
    assert len(plots.switch_hazard(hazard[:1]).axes) == 1
    with pytest.raises(InputError):
        plots.switch_hazard([])


def test_workload_batching_groups_by_batching_and_draws_the_heatmap(batching):
    rows, counts = batching
    fig = plots.workload_batching(rows, counts)
    skew, gpu, heat = fig.axes[:3]
    assert len(skew.patches) == len(gpu.patches) == 4 and len(heat.images) == 1
    with pytest.raises(InputError):
        plots.workload_batching([], None)
    with pytest.raises(InputError):
        plots.workload_batching(rows, np.zeros((2, 1, 16)), layer=3)


def test_policy_styles_are_fixed_by_the_registry():
    styles = plots.policy_styles(ALL_POLICIES)
    assert styles["static"] == {"color": plots.POLICY_COLORS[0], "marker": plots.POLICY_MARKERS[0]}
    assert len({st["color"] for st in styles.values()}) == len(ALL_POLICIES) > 8
    # a policy's style does not depend on which others a figure shows, nor on their order
    assert plots.policy_styles(["quota", "row"]) == {n: styles[n] for n in ("quota", "row")}


def test_policy_comparison_gives_each_policy_its_own_colour_and_marker(field):
    fig = plots.policy_comparison(field)
    looks = {}  # policy -> {(colour, marker)} of its dots in the GPU imbalance panel
    for line in fig.axes[0].lines:
        if line.get_marker() not in (None, "None", ""):
            looks.setdefault(line.get_label(), set()).add((to_rgba(line.get_color()),
                                                           line.get_marker()))
    assert sorted(looks) == sorted(ALL_POLICIES) and len(looks) > 8
    assert all(len(pairs) == 1 for pairs in looks.values())  # the same in both modes
    assert len(set().union(*looks.values())) == len(looks)  # and no two policies alike


# ----------------------------------------------------------------------------- paper layout

@pytest.fixture(scope="module")
def predictors():
    tr = synthesize("burst", steps=16, tokens=64, layers=2, experts=16, top_k=2, seed=0,
                    start=4, length=6)
    spec = CONFIG.replace(policy="ordinal", mode="a2a", rebalance_every=4)
    return [replay(tr, spec.replace(predictor=p)) for p in ("window", "ema", "oracle")]


@pytest.fixture(scope="module")
def timed_over_time():
    tr = synthesize("drift", steps=16, tokens=64, layers=2, experts=16, top_k=2, seed=0)
    return [replay(tr, TIMED.replace(policy=p, mode="a2a", rebalance_every=4))
            for p in ("row", "ordinal")]


def _redundancy_rows(trace):
    return [{**r.row(), "redundant": redundant} for redundant in (0, 4, 8)
            for r in compare(trace, POLICIES, ["none"], CONFIG.replace(redundant=redundant))]


def _replica_pair(results):
    pair = [r for r in results if r.policy in ("row", "ordinal") and r.spec.dispatch.mode == "none"]
    expert = int((pair[0].epochs[0][2].logcnt[0] == 2).nonzero()[0])
    return plots.replica_loads_pair(pair, layer=0, expert=expert)


# Each paper figure's plot, drawn from small inputs of the same shape (fixture name -> value).
SMALL = {
    "expert_load_heatmap": lambda get: plots.expert_load_heatmap(get("trace").counts()),
    "policies_by_mode": lambda get: plots.policy_mode_bars(get("results")),
    "redundancy_sweep": lambda get: plots.redundancy_curves(_redundancy_rows(get("trace"))),
    "template_replicas": lambda get: _replica_pair(get("results")),
    "solver_gap": lambda get: plots.solver_gap_lines(
        [{"solver": s, "redundant": r, "gap": 1.0 + g / (1 + r)}
         for s, g in (("deepseek", 0.05), ("lpt", 0.01)) for r in (0, 8, 16)]),
    "rebalance_over_time": lambda get: plots.predictor_time_series(get("predictors"), (4, 10)),
    "time_by_policy": lambda get: plots.time_bars_and_stalls(get("timed"),
                                                             get("timed_over_time")),
    "switch_hazard": lambda get: plots.switch_hazard(get("hazard")),
    "workload_batching": lambda get: plots.workload_batching(*get("batching")),
    "field_policies": lambda get: plots.policy_comparison(get("field")),
    "coactivation": lambda get: plots.coactivation_heatmap(coactivation(get("clustered"))),
    "balance_traffic": lambda get: plots.balance_against_traffic(get("traffic")),
    "traffic_time": lambda get: plots.communication_and_time(get("traffic")),
}


@pytest.fixture(scope="module")
def clustered():
    return synthesize("clustered", steps=3, tokens=128, layers=2, experts=16, top_k=4, seed=0)


@pytest.fixture(scope="module")
def traffic(clustered, trace):
    """deepseek and affinity on the clustered and the template traces, with fan-out."""
    spec = RunSpec.of(gpus=4, redundant=4, mode="a2a", policy="ordinal", cost="roofline")
    return {name: [replay(t, spec.replace(solver=s)) for s in ("deepseek", "affinity")]
            for name, t in (("clustered", clustered), ("template", trace))}


def test_the_traffic_figures_need_fan_out(results):
    with pytest.raises(InputError, match="cost model"):
        plots.balance_against_traffic({"bare": results[:1]})


@pytest.fixture(scope="module")
def paper(request):
    """`paper(name)`: the figure `SMALL[name]` draws in the paper style, rendered at `DPI`."""
    return drawer(request, SMALL, DPI)


def _look(handle):
    """What a legend entry's key looks like: a line's colour, style and marker; a patch's fill."""
    if isinstance(handle, Line2D):
        return ("line", to_rgba(handle.get_color()), handle.get_linestyle(), handle.get_marker(),
                to_rgba(handle.get_markerfacecolor()))
    face = np.asarray(handle.get_facecolor(), dtype=float).ravel()[:4]
    return (type(handle).__name__, tuple(np.round(face, 3)), handle.get_hatch())


def test_every_paper_figure_is_checked_from_small_inputs():
    assert set(SMALL) == set(FIGURES)


@pytest.mark.parametrize("name", list(FIGURES))
def test_paper_figure_fits_a_laptop_screen_at_100_percent(paper, name):
    width, height = paper(name).get_size_inches() * DPI
    assert width <= MAX_PX[0] and height <= MAX_PX[1], f"{width:.0f} x {height:.0f} px"


@pytest.mark.parametrize("name", list(FIGURES))
def test_paper_figure_texts_do_not_overlap_nor_leave_the_canvas(paper, name):
    assert len(shown_texts(paper(name))) > 5  # the measure sees the figure's texts
    assert plots.illegible(paper(name)) == []


@pytest.mark.parametrize("layers", [4, 48, 94])
def test_a_trace_of_many_layers_draws_legibly(layers):
    """`figures --trace` on a real model's depth (Qwen3-30B-A3B has 48 MoE layers, Qwen3-235B
    94): no two texts overlap, and up to LAYER_TICKS layers every layer is named."""
    from eplbsim.plots.paper import LAYER_TICKS
    from eplbsim.plots.trace import trace_figures
    counts = np.random.default_rng(0).integers(0, 50, size=(6, layers, 128))
    with plots.paper_style():
        figures = trace_figures(counts)
        for fig in figures.values():
            fig.set_dpi(DPI)
            FigureCanvasAgg(fig).draw()
    for name, fig in figures.items():
        assert plots.illegible(fig) == [], name
    ticks = figures["expert_load"].axes[0].get_yticks()
    named = [t for t in ticks if 0 <= t < layers]
    assert len(named) == layers if layers <= LAYER_TICKS else len(named) <= LAYER_TICKS + 1


@pytest.mark.parametrize("name", list(FIGURES))
def test_paper_figure_has_no_empty_panel(paper, name):
    panels = {}  # axes drawn over one another (twins) make one panel
    for ax in paper(name).axes:
        if ax.get_visible():
            panels.setdefault(tuple(np.round(ax.get_position().bounds, 6)), []).append(ax)
    empty = [[ax.get_title() for ax in group] for group in panels.values()
             if not any(ax.lines or ax.patches or ax.collections or ax.images or ax.texts
                        for ax in group)]
    assert empty == []


@pytest.mark.parametrize("name", list(FIGURES))
def test_paper_figure_legends_key_each_thing_once(paper, name):
    entries = [(text.get_text(), _look(handle)) for legend in paper(name).findobj(Legend)
               for text, handle in zip(legend.get_texts(), legend.legend_handles)]
    labels = [label for label, _ in entries]
    assert len(set(labels)) == len(labels), labels  # no entry twice, in one legend or two
    assert len({look for _, look in entries}) == len(entries), entries  # no two keys alike


@pytest.mark.parametrize("name", list(FIGURES))
def test_paper_figure_axes_start_at_their_baseline_or_say_so(paper, name):
    # the natural baseline: 1.0 for max / mean ratios (the ideal), else 0 (counts, shares,
    # times, steps); an axis starting above it exaggerates small changes unless its label says
    zoomed = [axis.get_label().get_text() or ax.get_title()
              for ax in paper(name).axes if ax.get_visible() for axis in (ax.xaxis, ax.yaxis)
              if min(axis.get_view_interval())
              > (1.0 if RATIO_AXIS.search(axis.get_label().get_text()) else 0.0)
              and "axis starts at" not in axis.get_label().get_text()]
    assert zoomed == []


def test_a_review_of_one_layer_draws_its_imbalance_as_bars_from_one():
    series = {"layer_imbalance": {"candidate": [1.16], "baseline": [1.19]},
              "step_ms": {"candidate": np.ones(4), "baseline": np.ones(4)},
              "replica_share": {"candidate": np.ones(3), "baseline": np.ones(3)}}
    ax = plots.review_figure(series, "ordinal", "row").axes[0]
    bars = [p for p in ax.patches]
    assert len(bars) == 2 and not ax.get_lines()
    assert [b.get_y() for b in bars] == [1.0, 1.0]
    assert [round(b.get_y() + b.get_height(), 6) for b in bars] == [1.16, 1.19]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0"]
    many = {**series, "layer_imbalance": {k: [1.1] * 40 for k in ("candidate", "baseline")}}
    assert len(plots.review_figure(many, "a", "b").axes[0].get_lines()) == 2
