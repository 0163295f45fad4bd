"""Tests of eplbsim.traces.formats.jsonl: JSONL router logs read (in memory and streamed into the directory
form), written back, converted by the CLI, and every malformed line named as `file:line`.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.cli import main
from eplbsim.traces.directory import DirTrace, load_trace_dir
from eplbsim.traces.formats.jsonl import read_jsonl, write_jsonl
from eplbsim.traces.trace import Trace, load_trace

from id_helpers import distinct


def _trace(steps=(3, 0, 4), L=3, K=2, E=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = distinct(rng.integers(-1, E, size=(sum(steps), L, K)))
    return Trace(ids, np.concatenate([[0], np.cumsum(steps)]), E, None, {})


def _same_rows(a, b):
    assert (a.num_steps, a.num_layers, a.top_k) == (b.num_steps, b.num_layers, b.top_k)
    for s in range(a.num_steps):
        assert torch.equal(a.step(s), b.step(s))


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def test_round_trip_memory_and_directory(tmp_path):
    tr = _trace()
    write_jsonl(tr, tmp_path / "log.jsonl")
    mem = read_jsonl(tmp_path / "log.jsonl", 8)
    assert isinstance(mem, Trace) and mem.num_experts == 8
    _same_rows(tr, mem)
    d = read_jsonl(tmp_path / "log.jsonl", 8, out=tmp_path / "d")
    assert isinstance(d, DirTrace)
    _same_rows(tr, d)
    assert d.meta["format"] == "jsonl" and d.meta["first_step"] == 0 and d.meta["last_step"] == 2
    assert torch.equal(d.counts(), tr.counts())


def test_layers_in_any_order_and_step_gaps(tmp_path):
    rows = [[1, 2], [3, -1]]
    log = _write(tmp_path / "a.jsonl", [
        {"step": 5, "layer": 1, "topk_ids": rows}, {"step": 5, "layer": 0, "topk_ids": rows},
        "", {"step": 9, "layer": 0, "topk_ids": [[0, 3]]},
        {"step": 9, "layer": 1, "topk_ids": [[4, 0]]}])
    tr = read_jsonl(log)
    assert tr.num_steps == 2 and tr.num_experts == 5  # largest id + 1
    assert tr.step(1).tolist() == [[[0, 3], [4, 0]]]
    assert tr.meta["first_step"] == 5 and tr.meta["last_step"] == 9
    d = read_jsonl(log, out=tmp_path / "d")
    assert d.num_experts == 5
    _same_rows(tr, d)


def test_cli_convert_all_ways(tmp_path, capsys):
    tr = _trace()
    write_jsonl(tr, tmp_path / "log.jsonl")
    assert main(["trace", "convert", str(tmp_path / "log.jsonl"), "--out",
                 str(tmp_path / "d"), "--experts", "8"]) == 0
    _same_rows(tr, load_trace_dir(tmp_path / "d"))
    assert main(["trace", "convert", str(tmp_path / "log.jsonl"), "--out",
                 str(tmp_path / "a.npz"), "--experts", "8"]) == 0
    _same_rows(tr, load_trace(tmp_path / "a.npz"))
    assert main(["trace", "convert", str(tmp_path / "d"), "--out",
                 str(tmp_path / "back.jsonl")]) == 0
    assert (tmp_path / "back.jsonl").read_text() == (tmp_path / "log.jsonl").read_text()
    assert main(["trace", "convert", str(tmp_path / "a.npz"), "--out",
                 str(tmp_path / "b.npz"), "--experts", "8"]) == 2
    assert main(["trace", "convert", str(tmp_path / "log.jsonl"), "--out",
                 str(tmp_path / "e"), "--experts", "4"]) == 2
    assert "log.jsonl:" in capsys.readouterr().err


R = [[1, 2]]


@pytest.mark.parametrize("records, line, words", [
    (['{"step": 0, "layer": 0, "topk_ids": [[1, 2]]}', "{oops"], 2, "not valid JSON"),
    ([[1, 2]], 1, "JSON object"),
    ([{"step": 0, "topk_ids": R}], 1, "missing key(s) layer"),
    ([{"step": -1, "layer": 0, "topk_ids": R}], 1, "step must be"),
    ([{"step": 0, "layer": "0", "topk_ids": R}], 1, "layer must be"),
    ([{"step": 0, "layer": 0, "topk_ids": [1, 2]}], 1, "list of rows"),
    ([{"step": 0, "layer": 0, "topk_ids": [[1, 2], [3]]}], 1, "ragged"),
    ([{"step": 0, "layer": 0, "topk_ids": [[1, 2.5]]}], 1, "integers"),
    ([{"step": 0, "layer": 0, "topk_ids": R}, {"step": 0, "layer": 1, "topk_ids": [[1, 2, 3]]}],
     2, "rows of 3 ids"),
    ([{"step": 0, "layer": 0, "topk_ids": [[1, 8]]}], 1, "expert id 8 outside [-1, 8)"),
    ([{"step": 0, "layer": 0, "topk_ids": [[-2, 1]]}], 1, "expert id -2"),
    ([{"step": 0, "layer": 0, "topk_ids": R}, {"step": 0, "layer": 0, "topk_ids": R}], 2,
     "appears twice"),
    ([{"step": 0, "layer": 0, "topk_ids": R}, {"step": 0, "layer": 1, "topk_ids": R + R}], 2,
     "has 2 tokens"),
    ([{"step": 0, "layer": 0, "topk_ids": R}, {"step": 0, "layer": 1, "topk_ids": R},
      {"step": 1, "layer": 1, "topk_ids": R}], 3, "lacks layer(s) [0]"),
    ([{"step": 0, "layer": 0, "topk_ids": R}, {"step": 1, "layer": 0, "topk_ids": R},
      {"step": 1, "layer": 2, "topk_ids": R}], 2, "layer(s) [2] beyond"),
    ([{"step": 0, "layer": 1, "topk_ids": R}], 1, "lacks layer(s) [0]"),
    ([{"step": 1, "layer": 0, "topk_ids": R}, {"step": 0, "layer": 0, "topk_ids": R}], 2,
     "ascending"),
    ([{"step": 0, "layer": 0, "topk_ids": R}, {"step": 1, "layer": 0, "topk_ids": R},
      {"step": 0, "layer": 0, "topk_ids": R}], 3, "ascending"),
])
@pytest.mark.parametrize("to_dir", [False, True])
def test_bad_lines_name_file_and_line(tmp_path, records, line, words, to_dir):
    log = _write(tmp_path / "bad.jsonl", records)
    with pytest.raises(InputError) as err:
        read_jsonl(log, 8, out=tmp_path / "d" if to_dir else None)
    assert f"bad.jsonl:{line}: " in str(err.value)
    assert words in str(err.value)


def test_empty_missing_and_binary_files(tmp_path):
    with pytest.raises(InputError, match="no records"):
        read_jsonl(_write(tmp_path / "e.jsonl", ["", "  "]), 8)
    with pytest.raises(InputError, match="no such file"):
        read_jsonl(tmp_path / "none.jsonl", 8)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InputError, match="bin.jsonl"):
        read_jsonl(tmp_path / "bin.jsonl", 8)
