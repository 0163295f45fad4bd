"""Tests for eplbsim.plots: every figure renders, saves, and is not blank; None metrics are fine.

Dimensions: `S` steps, `L` layers, `E` experts, `P` physical slots.
"""

import matplotlib.image
import numpy as np
import pytest
from matplotlib.figure import Figure

from eplbsim import plots
from eplbsim.errors import InputError
from eplbsim.replay import compare, replay
from eplbsim.schedule.switch import phases
from eplbsim.spec import RunSpec
from eplbsim.traces.synth import synthesize

CONFIG = RunSpec.of(gpus=4, redundant=4)
POLICIES = ["static", "random", "row", "ordinal"]


@pytest.fixture(scope="module")
def trace():
    return synthesize("template", steps=4, tokens=64, layers=2, experts=16, top_k=2, seed=0)


@pytest.fixture(scope="module")
def results(trace):
    return compare(trace, POLICIES, ["none", "a2a"], CONFIG)


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
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
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
    assert len([ln for ln in imb.get_lines() if ln.get_label() in ("row (none)", "row (a2a)",
                "ordinal (none)", "ordinal (a2a)")]) == 4
    assert len(moves.patches) == 3 * 3  # three rebalances, three kinds of copy
    assert moves.get_xlabel() == "step" and "GPU imbalance" in imb.get_ylabel()
    written = plots.save_figure(fig, tmp_path / "ts.pdf", dpi=60)
    assert [p.suffix for p in written] == [".pdf", ".png"]
    _assert_png(written[1])


def test_time_series_figure_without_rebalancing(results, tmp_path):
    fig = plots.time_series_figure(results[:1])
    assert "no rebalance" in " ".join(t.get_text() for t in fig.axes[2].texts)
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
    assert len(fig.axes) == 2 and "GPU imbalance" in fig.axes[0].get_ylabel()


def test_heatmap_and_replica_pair_check_their_arguments(trace, results):
    with pytest.raises(InputError, match="layer must be in"):
        plots.expert_load_heatmap(trace.counts(), layer=9)
    row = results[2]
    single = int((row.epochs[0][2].logcnt[0] == 1).nonzero()[0])
    with pytest.raises(InputError, match="1 replica"):
        plots.replica_loads_pair([row], layer=0, expert=single)


def test_time_bars_and_stalls_draw_both_panels_and_reject_empty(trace):
    timed = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8, cost="roofline",
                       model="olmoe-1b-7b", device_profile="h200")
    results = compare(trace, ["row", "ordinal"], ["none", "a2a"], timed)
    fig = plots.time_bars_and_stalls(results, results[:1])
    bars, line = fig.axes[0], fig.axes[1]
    assert len(bars.patches) == 2 * len(results)  # compute and communication of each
    assert len(line.lines) == 1
    with pytest.raises(InputError):
        plots.time_bars_and_stalls([], results)


def test_switch_hazard_shades_each_hazard_window_and_rejects_empty():
    trace = synthesize("drift", seed=3, steps=24, tokens=96, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=4, rebalance_every=6,
                      rebalance_mode="async", switch_delay=3, policy="row")
    results = [replay(trace, spec.replace(mode=m)) for m in ("a2a", "none")]
    fig = plots.switch_hazard(results)
    windows = sum(serving is not None for *_, serving in phases(results[0].segments))
    assert windows > 0
    for ax in fig.axes:
        assert len(ax.lines) >= 1 and len(ax.patches) == windows
    assert len(plots.switch_hazard(results[:1]).axes) == 1
    with pytest.raises(InputError):
        plots.switch_hazard([])


def test_workload_batching_groups_by_batching_and_draws_the_heatmap():
    from eplbsim.traces.request_synth import synthesize_requests
    from eplbsim.traces.workload import Workload, batch
    reqs = synthesize_requests("requests", seed=0, num_requests=6, prompt_mean=4.0,
                               output_mean=4.0, layers=1, experts=16, top_k=2)
    spec = RunSpec.of(gpus=4, redundant=4)
    rows = []
    for name, w in (("sum", Workload(dp=2)), ("max", Workload(dp=2, dp_layout="max"))):
        rows += [(name, r) for r in compare(batch(reqs, w).trace, ["row", "ordinal"], ["none"],
                                            spec)]
    fig = plots.workload_batching(rows, batch(reqs, Workload()).trace.counts())
    skew, gpu, heat = fig.axes[:3]
    assert len(skew.patches) == len(gpu.patches) == 4 and len(heat.images) == 1
    with pytest.raises(InputError):
        plots.workload_batching([], None)
    with pytest.raises(InputError):
        plots.workload_batching(rows, np.zeros((2, 1, 16)), layer=3)
