"""The paper figures: every one in the registry rebuilds, is not blank, fits a laptop screen at
100%, is the same on every build, and matches the committed set in `figures/`.

Dimensions: `H` x `W` pixels of a PNG.
"""

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.plots.figures import FIGURES, build

from cli_helpers import assert_input_error, run
from test_plots import MAX_PX

COMMITTED = Path(__file__).resolve().parents[2] / "figures"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("figures")
    return out, build(out)


def test_build_writes_a_pdf_and_a_png_per_figure(built):
    out, paths = built
    assert sorted(p.name for p in paths) == sorted(f"{n}.{ext}" for n in FIGURES
                                                   for ext in ("pdf", "png"))
    for path in paths:
        assert path.parent == out and path.stat().st_size > 5000


@pytest.mark.parametrize("name", list(FIGURES))
def test_figure_is_not_blank_and_matches_the_committed_one(built, name):
    out, _ = built
    assert (out / f"{name}.pdf").read_bytes().startswith(b"%PDF")
    pixels = matplotlib.image.imread(out / f"{name}.png")  # [H, W, 4] floats in [0, 1]
    assert pixels.shape[0] > 300 and pixels.shape[1] > 300
    rgb = pixels[..., :3]
    assert float(rgb.var()) > 1e-3  # ink on the page
    assert float((rgb.mean(-1) < 0.5).mean()) > 0.005  # and not just a frame
    committed = COMMITTED / f"{name}.png"
    assert committed.exists(), f"figures/{name}.png is not committed: run `eplbsim figures`"
    want = matplotlib.image.imread(committed)[..., :3]
    assert want.shape == rgb.shape, "figure size changed: rerun `eplbsim figures`"
    assert float(np.abs(want - rgb).mean()) < 2e-3, "figure changed: rerun `eplbsim figures`"


@pytest.mark.parametrize("name", list(FIGURES))
def test_figure_fits_a_laptop_screen_at_100_percent(built, name):
    out, _ = built
    height, width = matplotlib.image.imread(out / f"{name}.png").shape[:2]
    assert width <= MAX_PX[0] and height <= MAX_PX[1], f"{width} x {height} px"


def test_the_same_build_gives_the_same_bytes(built, tmp_path):
    out, _ = built
    again = build(tmp_path, ["solver_gap"])
    for path in again:
        assert path.read_bytes() == (out / path.name).read_bytes()


def test_figures_command(capsys, tmp_path):
    code, out, _ = run(capsys, "figures", "--list")
    assert code == 0 and all(name in out for name in FIGURES)
    code, out, _ = run(capsys, "figures", "--only", "solver_gap", "--out", tmp_path)
    assert code == 0 and (tmp_path / "solver_gap.png").exists()
    assert_input_error(capsys, "figures", "--only", "nope", "--out", tmp_path,
                       match="unknown figure 'nope'")


def test_build_rejects_an_empty_selection(tmp_path):
    with pytest.raises(InputError):
        build(tmp_path, [])


def test_figures_of_your_own_trace(capsys, tmp_path):
    """`figures --trace` draws a user's trace with the reading flags; one layer's whole-trace
    panel is bars, not one row stretched, and the title says "1 layer"."""
    from eplbsim.plots import TRACE_FIGURES, trace_figures
    from eplbsim.traces.synth import synthesize
    routes = Path(__file__).resolve().parents[2] / "traces" / "moe_routes_small.jsonl"
    out = tmp_path / "mine"
    code, printed, err = run(capsys, "figures", "--trace", routes, "--skip-type", "meta",
                             "--drop-warmup", "--out", out)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{n}.{e}" for n in TRACE_FIGURES for e in ("pdf", "png"))
    for name in TRACE_FIGURES:
        height, width = matplotlib.image.imread(out / f"{name}.png").shape[:2]
        assert width <= MAX_PX[0] and height <= MAX_PX[1], name
    assert_input_error(capsys, "figures", "--trace", routes, "--skip-type", "meta",
                       match="--out DIR")
    assert_input_error(capsys, "figures", "--trace", routes, "--skip-type", "meta", "--out",
                       routes, match="moe_routes_small.jsonl")
    one = synthesize("skewed", steps=4, tokens=64, layers=1, experts=16, top_k=4, seed=0)
    figs = trace_figures(one.counts())
    heat = figs["expert_load"]
    assert "1 layer," in heat._suptitle.get_text()
    assert not heat.axes[0].images and len(heat.axes[0].patches) == 16  # one bar an expert
    assert all("1 layer" in f.axes[0].get_title() for n, f in figs.items() if n != "expert_load")
    four = trace_figures(synthesize("skewed", steps=4, tokens=64, layers=4, experts=16,
                                    top_k=4, seed=0).counts(), ["expert_load"])
    assert four["expert_load"].axes[0].images  # several layers: a heatmap
