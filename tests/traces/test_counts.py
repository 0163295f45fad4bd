"""Counts CSV input: filters, shapes, and clear errors."""

from pathlib import Path

import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.traces.counts import load_counts_csv, parse_where

REAL = Path(__file__).resolve().parents[3] / "shared" / "data" / "olmoe-routing-counts" \
    / "expert_counts.csv"


def write(tmp_path, text, name="c.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_reads_filters_and_orders_layers(tmp_path):
    path = write(tmp_path, "model,layer,expert,count\n"
                           "a,7,1,5\na,0,0,3\na,7,0,2\nb,0,0,99\na,0,2,1\n")
    got = load_counts_csv(path, parse_where("model=a"))
    assert got.layers == (0, 7)
    assert got.load.tolist() == [[3, 0, 1], [2, 5, 0]]
    assert load_counts_csv(path, {"model": "a"}, num_experts=5).load.shape == (2, 5)


@pytest.mark.parametrize("text,where,match", [
    ("layer,expert\n0,0\n", None, "missing count"),
    ("layer,expert,count\n0,0,1\n", "domain=x", "cannot filter on domain"),
    ("layer,expert,count\n0,0,1\n", "layer=5", "no rows match"),
    ("layer,expert,count\n0,x,1\n", None, "must be integers"),
    ("layer,expert,count\n0,0,-1\n", None, "non-negative"),
    ("layer,expert,count\n0,0,nan\n", None, "finite"),
    ("m,layer,expert,count\na,0,0,1\nb,0,0,2\n", None, "filter with where=... on m"),
])
def test_bad_files_name_the_problem(tmp_path, text, where, match):
    with pytest.raises(InputError, match=match):
        load_counts_csv(write(tmp_path, text), parse_where(where))


def test_missing_file_and_bad_where(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_counts_csv(tmp_path / "nope.csv")
    with pytest.raises(InputError, match="COLUMN=VALUE"):
        parse_where("model")


@pytest.mark.skipif(not REAL.exists(), reason="../shared/data is absent")
def test_real_olmoe_counts_load():
    got = load_counts_csv(REAL, parse_where("model=olmoe,domain=arxiv"))
    assert got.layers == (0, 7, 15) and got.load.shape == (3, 64)
    assert np.all(got.load.sum(1) == got.load.sum(1)[0])  # every layer routed the same tokens
    mixtral = load_counts_csv(REAL, parse_where("model=mistral,domain=c4"))
    assert mixtral.load.shape == (3, 8)


def test_counts_trace_validates_and_round_trips(tmp_path):
    from eplbsim.traces.counts import CountsTrace, is_counts_file, load_counts_trace, save_counts_trace
    raw = np.array([[[1, 2, 0], [0, 0, 5]]])  # [S, L, E]
    trace = CountsTrace(raw, {"model_layers": [3, 5]})
    raw[0, 0, 0] = 99
    assert trace.counts[0, 0, 0] == 1, "a private copy"
    path = tmp_path / "c.npz"
    save_counts_trace(trace, path)
    back = load_counts_trace(path)
    assert is_counts_file(path) and np.array_equal(back.counts, trace.counts)
    assert back.meta["model_layers"] == [3, 5] and back.meta["kind"] == "counts"
    for bad, match in ((np.ones((2, 3)), r"\[steps, layers, experts\]"),
                       (-np.ones((1, 1, 2)), "non-negative"), (np.full((1, 1, 2), 0.5), "whole"),
                       (np.full((1, 1, 2), np.nan), "finite")):
        with pytest.raises(InputError, match=match):
            CountsTrace(bad)
    with pytest.raises(InputError, match="model_layers names 1 layers"):
        CountsTrace(np.ones((1, 2, 2)), {"model_layers": [0]})
    cut = tmp_path / "cut.npz"
    cut.write_bytes(path.read_bytes()[:40])
    assert not is_counts_file(cut)
    with pytest.raises(InputError, match=str(cut)):
        load_counts_trace(cut)


def test_layer_counts_from_every_kind_of_file(tmp_path):
    from eplbsim.traces.counts import CountsTrace, save_counts_trace
    from eplbsim.traces.formats import layer_loads, open_trace
    from eplbsim.traces.synth import synthesize
    from eplbsim.traces.trace import save_trace
    trace = synthesize("uniform", steps=3, tokens=8, layers=2, experts=6, top_k=2)
    save_trace(trace, tmp_path / "t.npz")
    got = layer_loads(open_trace(tmp_path / "t.npz"))
    assert np.array_equal(got.load, trace.counts().sum(0).numpy()) and got.layers == (0, 1)
    save_counts_trace(CountsTrace(trace.counts().numpy(), {"model_layers": [1, 4]}),
                      tmp_path / "c.npz")
    got = layer_loads(open_trace(tmp_path / "c.npz"))
    assert np.array_equal(got.load, trace.counts().sum(0).numpy()) and got.layers == (1, 4)
    with pytest.raises(InputError, match=r"where=\.\.\. applies to a counts CSV only, not to a "):
        open_trace(tmp_path / "c.npz", where="model=x")
