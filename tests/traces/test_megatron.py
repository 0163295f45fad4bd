"""Tests of eplbsim.traces.formats.megatron: Megatron-core router traces
(`router_trace_rank{r}.jsonl`) read from a directory, a set of files or one file, ranks'
tokens concatenated per step with `src_rank`, and every malformed record named as `file:line`.

Dimensions: `S` steps, `T` tokens of a rank's step, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces.formats.megatron import is_megatron_trace, read_megatron

from id_helpers import distinct
from log_writers import MEGATRON_LAYERS as LAYERS
from log_writers import megatron_record as _rec
from log_writers import write_jsonl as _write
from log_writers import write_megatron_rank as _rank_file



def _ids(T, L=2, K=2, E=8, seed=0):
    return distinct(np.random.default_rng(seed).integers(-1, E, size=(T, L, K)))


@pytest.fixture
def traced(tmp_path):
    ranks = {0: [_ids(3, seed=1), _ids(1, seed=2), _ids(2, seed=3)],
             2: [_ids(2, seed=4), _ids(0), _ids(4, seed=5)]}
    files = {r: _rank_file(tmp_path, r, steps, first=7) for r, steps in ranks.items()}
    (tmp_path / "hidden_states_rank0.bin").write_bytes(b"\x00\x01")
    return tmp_path, ranks, files


def test_directory_and_files_read_in_rank_order(traced):
    d, ranks, files = traced
    for source in (d, [files[2], files[0]]):
        tr = read_megatron(source, experts=8)
        assert tr.num_steps == 3 and tr.num_layers == 2 and tr.num_experts == 8
        for s in range(3):
            want = np.concatenate([ranks[0][s], ranks[2][s]])
            assert torch.equal(tr.step(s), torch.from_numpy(want).int())
            assert tr.step_src_rank(s).tolist() == [0] * len(ranks[0][s]) + [2] * len(
                ranks[2][s])
        assert tr.meta["model_layers"] == LAYERS and tr.meta["ranks"] == [0, 2]
        assert tr.meta["first_step"] == 7 and tr.meta["last_step"] == 9
        assert tr.meta["skipped_records"] == 0  # the MTP records are the draft now
        d = tr.draft  # write_megatron_rank's MTP record: (mtp_idx 0, layer 0), layer 3's ids
        assert d.num_steps == 3 and d.num_layers == 1 and d.meta["mtp_layers"] == [[0, 0]]
        for s in range(3):
            assert torch.equal(d.step(s)[:, 0], tr.step(s)[:, 0])
            assert torch.equal(d.step_src_rank(s), tr.step_src_rank(s))
        assert 'MTP records "block": "mtp" as the draft' in tr.meta["read_as"]
        assert tr.meta["files"] == ["router_trace_rank0.jsonl", "router_trace_rank2.jsonl"]
    one = read_megatron(files[2])
    assert one.tokens_per_step.tolist() == [2, 0, 4] and set(one.src_rank.tolist()) == {2}
    all_ids = np.concatenate(ranks[2])
    assert one.num_experts == int(all_ids.max()) + 1  # largest id + 1


def test_detection(traced, tmp_path_factory):
    d, _, files = traced
    assert is_megatron_trace(d) and is_megatron_trace(files[0])
    other = tmp_path_factory.mktemp("other")
    assert not is_megatron_trace(other)
    assert not is_megatron_trace(_write(other / "router_trace.jsonl", []))
    with pytest.raises(InputError, match="holds no router_trace_rank"):
        read_megatron(other)
    with pytest.raises(InputError, match="at least one rank file"):
        read_megatron([])


R = [[1, 2]]


@pytest.mark.parametrize("records, line, words", [
    ([_rec(0, 0, 0, R), "{oops"], 2, "not valid JSON"),
    ([[1, 2]], 1, "JSON object"),
    ([{"step": 0, "layer": 0, "rank": 0, "topk": 2, "top_indices": R}], 1,
     "missing key(s) num_tokens"),
    ([_rec(-1, 0, 0, R)], 1, "step must be"),
    ([_rec(0, 0, "0", R)], 1, "rank must be"),
    ([_rec(0, 0, 0, R, topk=0)], 1, "topk must be"),
    ([_rec(0, 0, 0, R, num_tokens=2)], 1, "num_tokens is 2 but top_indices has 1 rows"),
    ([_rec(0, 0, 0, [[1, 2, 3]])], 1, "rows of 3 ids, topk is 2"),
    ([_rec(0, 0, 0, [[1, 2], [3]])], 1, "ragged top_indices"),
    ([_rec(0, 0, 0, [[1, 2.0]])], 1, "integer ids"),
    ([_rec(0, 0, 0, [[1, 8]])], 1, "expert id 8 outside [-1, 8)"),
    ([_rec(0, 0, 0, [[4, 4]])], 1, "chooses expert 4 twice"),
    ([_rec(0, 0, 0, R), _rec(0, 1, 0, [[1, 2, 3]], topk=3)], 2, "topk 3, earlier records 2"),
    ([_rec(0, 0, 0, R), _rec(0, 1, 1, R)], 2, "rank 1, earlier records of the file rank 0"),
    ([_rec(0, 0, 1, R)], 1, "rank 1 in the file of rank 0"),
    ([_rec(0, 0, 0, R), _rec(0, 0, 0, R)], 2, "layer 0 of step 0 appears twice"),
    ([_rec(0, 0, 0, R), _rec(0, 1, 0, R + R)], 2, "has 2 tokens, other layers of the step 1"),
    ([_rec(1, 0, 0, R), _rec(0, 0, 0, R)], 2, "contiguous and ascending"),
    ([_rec(0, 0, 0, R), _rec(1, 0, 0, R), _rec(0, 0, 0, R)], 3, "contiguous and ascending"),
    ([_rec(0, 0, 0, R), _rec(0, 1, 0, R), _rec(1, 1, 0, R)], 3,
     "step 1 (starting here) lacks layer(s) [0]"),
    ([_rec(0, 0, 0, R), _rec(1, 0, 0, R), _rec(1, 2, 0, R)], 2, "has layer(s) [2] beyond"),
])
def test_bad_records_name_file_and_line(tmp_path, records, line, words):
    path = _write(tmp_path / "router_trace_rank0.jsonl", records)
    with pytest.raises(InputError) as err:
        read_megatron(tmp_path, experts=8)
    assert f"{path}:{line}: " in str(err.value)
    assert words in str(err.value)


@pytest.mark.parametrize("rank0, rank1, bad, line, words", [
    ([_rec(0, 0, 0, R), _rec(1, 0, 0, R)], [_rec(0, 0, 1, R)], 0, 2, "step 1 is not in"),
    ([_rec(0, 0, 0, R)], [_rec(0, 0, 1, R), _rec(3, 0, 1, R)], 1, 2, "step 3 is not in"),
    ([_rec(0, 0, 0, R)], [_rec(0, 1, 1, R)], 1, 1, "lacks layer(s) [0]"),
    ([_rec(0, 0, 0, R)], [_rec(0, 0, 0, R)], 1, 1, "rank 0 again"),
])
def test_files_must_agree(tmp_path, rank0, rank1, bad, line, words):
    paths = [_write(tmp_path / "a.jsonl", rank0), _write(tmp_path / "b.jsonl", rank1)]
    with pytest.raises(InputError) as err:
        read_megatron(paths)
    assert f"{paths[bad]}:{line}: " in str(err.value)
    assert words in str(err.value)


def test_files_without_decoder_records_or_tokens(tmp_path):
    mtp = _write(tmp_path / "router_trace_rank0.jsonl", [_rec(0, 0, 0, R, block="mtp")])
    with pytest.raises(InputError, match="no decoder records"):
        read_megatron(mtp)
    empty = _write(tmp_path / "router_trace_rank1.jsonl", [_rec(0, 0, 1, [])])
    with pytest.raises(InputError, match="no token rows"):
        read_megatron(empty)
    with pytest.raises(InputError, match="no such file"):
        read_megatron(tmp_path / "router_trace_rank9.jsonl")


def test_mtp_records_are_the_draft_of_their_own_rows_and_top_k(tmp_path):
    ids = _ids(3)
    mtp = np.argsort(np.random.default_rng(5).random((5, 6)), -1)[:, :3]  # 5 rows, top-3 of 6
    records = [_rec(0, layer, 0, ids[:, j]) for j, layer in enumerate(LAYERS)]
    records += [dict(_rec(0, 1, 0, mtp[:, :2] if i else mtp), block="mtp", mtp_idx=i,
                     topk=2 if i else 3) for i in range(2)]
    path = _write(tmp_path / "router_trace_rank0.jsonl", records)
    with pytest.raises(InputError, match="topk 2, earlier MTP records 3"):
        read_megatron(path)
    records[-1] = dict(records[-1], topk=3, top_indices=mtp.tolist())
    d = read_megatron(_write(path, records)).draft
    assert d.num_layers == 2 and d.top_k == 3 and d.meta["mtp_layers"] == [[0, 1], [1, 1]]
    assert torch.equal(d.step(0)[:, 1], torch.from_numpy(mtp).int())
    records.append(dict(records[-1], step=1))  # step 1: one MTP layer of two, no decoder
    records[-2:-1] = []
    with pytest.raises(InputError):
        read_megatron(_write(path, records))
