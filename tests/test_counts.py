"""Counts CSV input: filters, shapes, and clear errors."""

from pathlib import Path

import numpy as np
import pytest

from eplbsim.counts import load_counts_csv, parse_where
from eplbsim.errors import InputError

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "olmoe-routing-counts" \
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
    ("m,layer,expert,count\na,0,0,1\nb,0,0,2\n", None, "filter with --where on m"),
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
