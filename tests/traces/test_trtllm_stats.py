"""Importing TensorRT-LLM expert statistics (meta_info.json + rank{r}.safetensors, written here
byte for byte in the safetensors layout)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.traces.counts import CountsTrace
from eplbsim.traces.formats.trtllm import is_trtllm_stats, read_safetensors, read_trtllm_stats

from log_writers import write_safetensors as _safetensors

P, K = 6, 2
ITERS, LAYERS = (100, 101, 102), (3, 5)  # model layer ids: dense layers 0-2 and 4 not counted


def _counts(rank: int, it: int, layer: int) -> np.ndarray:
    return np.random.default_rng(1000 * rank + 10 * it + layer).integers(0, 50, P)


def _dump(folder, ranks=(0, 1), meta=None) -> None:
    (folder / "meta_info.json").write_text(json.dumps(
        meta if meta is not None else {"num_experts": P, "num_experts_per_token": K}))
    for r in ranks:
        _safetensors(folder / f"rank{r}.safetensors",
                     {f"{i}_{layer}": _counts(r, i, layer) for i in ITERS for layer in LAYERS})


def test_counts_sum_ranks_into_steps(tmp_path):
    _dump(tmp_path)
    _safetensors(tmp_path / "rank0_raw.safetensors", {"x": np.zeros(3, np.float32)})  # ignored
    assert is_trtllm_stats(tmp_path)
    ct = read_trtllm_stats(tmp_path)
    assert isinstance(ct, CountsTrace) and ct.counts.shape == (len(ITERS), len(LAYERS), P)
    for s, it in enumerate(ITERS):
        for li, layer in enumerate(LAYERS):
            assert np.array_equal(ct.counts[s, li], _counts(0, it, layer) + _counts(1, it, layer))
    assert ct.meta["iterations"] == list(ITERS) and ct.meta["model_layers"] == list(LAYERS)
    assert ct.meta["ranks"] == [0, 1] and ct.meta["num_experts_per_token"] == K
    assert ct.meta["counted"] == "slots" and ct.meta["source"] == "trtllm"


def test_one_rank_alone(tmp_path):
    _dump(tmp_path)
    ct = read_trtllm_stats(tmp_path, rank=1)
    assert ct.meta["ranks"] == [1]
    assert np.array_equal(ct.counts[0, 0], _counts(1, ITERS[0], LAYERS[0]))
    with pytest.raises(InputError, match=r"no rank4\.safetensors; the ranks are \[0, 1\]"):
        read_trtllm_stats(tmp_path, rank=4)


def test_a_key_missing_from_one_rank_counts_zero_there(tmp_path):
    _dump(tmp_path, ranks=(0,))
    _safetensors(tmp_path / "rank1.safetensors", {"100_3": _counts(1, 100, 3)})
    ct = read_trtllm_stats(tmp_path)
    assert np.array_equal(ct.counts[0, 0], _counts(0, 100, 3) + _counts(1, 100, 3))
    assert np.array_equal(ct.counts[1, 1], _counts(0, 101, 5))


def test_int32_tensors_are_read(tmp_path):
    path = tmp_path / "t.safetensors"
    _safetensors(path, {"1_2": np.arange(4, dtype=np.int32)})
    assert read_safetensors(path)["1_2"].tolist() == [0, 1, 2, 3]


def test_detection(tmp_path):
    assert not is_trtllm_stats(tmp_path)
    (tmp_path / "meta_info.json").write_text("{}")
    assert not is_trtllm_stats(tmp_path)


def _write_rank0(folder, payload: bytes) -> None:
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": P,
                                                      "num_experts_per_token": K}))
    (folder / "rank0.safetensors").write_bytes(payload)


def _header(obj) -> bytes:
    text = json.dumps(obj).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("payload, match", [
    (b"\x01\x02", r"rank0\.safetensors: truncated \(2 bytes"),
    (struct.pack("<Q", 999) + b"{}", r"rank0\.safetensors: header length 999 exceeds"),
    (struct.pack("<Q", 4) + b"{no}", r"rank0\.safetensors: header is not UTF-8 JSON"),
    (_header([1]), r"rank0\.safetensors: header must be a JSON object"),
    (_header({"100_3": {"dtype": "F32", "shape": [P], "data_offsets": [0, 4 * P]}})
     + bytes(4 * P), r"rank0\.safetensors: tensor '100_3': dtype 'F32'; counts must be integers"),
    (_header({"100_3": {"dtype": "I64", "shape": [P], "data_offsets": [0, 80]}}) + bytes(8 * P),
     r"tensor '100_3': data_offsets \[0, 80\] do not lie within the 48 data bytes"),
    (_header({"100_3": {"dtype": "I64", "shape": [P], "data_offsets": [0, 8]}}) + bytes(8 * P),
     r"tensor '100_3': data_offsets span 8 bytes, but I64 \[6\] needs 48"),
    (_header({"100_3": {"dtype": "I64", "shape": [-1], "data_offsets": [0, 8]}}) + bytes(8),
     r"tensor '100_3': shape must be a list of non-negative integers"),
    (_header({"100_3": [1]}), r"tensor '100_3': its header entry must be an object"),
    (_header({"bias": {"dtype": "I64", "shape": [P], "data_offsets": [0, 8 * P]}})
     + bytes(8 * P), r"rank0\.safetensors: tensor 'bias' is not named \"\{iter\}_\{layer\}\""),
    (_header({"100_3": {"dtype": "I64", "shape": [P + 1], "data_offsets": [0, 8 * P + 8]}})
     + bytes(8 * P + 8), r"tensor 100_3 has shape \[7\], but meta_info\.json gives 6 slots"),
    (_header({"100_3": {"dtype": "I64", "shape": [P], "data_offsets": [0, 8 * P]}})
     + np.full(P, -1, np.int64).tobytes(), r"tensor 100_3 has counts outside \[0, 2\*\*53\]"),
    (_header({"__metadata__": {}}), r"rank0\.safetensors: holds no tensors"),
])
def test_malformed_files_name_the_file_and_tensor(tmp_path, payload, match):
    _write_rank0(tmp_path, payload)
    with pytest.raises(InputError, match=match):
        read_trtllm_stats(tmp_path)


def test_a_missing_grid_cell_is_named(tmp_path):
    (tmp_path / "meta_info.json").write_text(json.dumps({"num_experts": P,
                                                        "num_experts_per_token": K}))
    _safetensors(tmp_path / "rank0.safetensors", {"100_3": _counts(0, 100, 3),
                                                  "100_5": _counts(0, 100, 5),
                                                  "101_3": _counts(0, 101, 3)})
    with pytest.raises(InputError, match=r"no rank file counts layer 5 in iteration 101 \(tensor "
                                         r"101_5\)"):
        read_trtllm_stats(tmp_path)


@pytest.mark.parametrize("meta, match", [
    ("null", r"meta_info\.json: expected an object .* \(rank 0 counted nothing\?\)"),
    ("{", r"meta_info\.json: not valid JSON"),
    ('{"num_experts": 6}', r"meta_info\.json: num_experts_per_token must be an integer"),
    ('{"num_experts": true, "num_experts_per_token": 2}',
     r"meta_info\.json: num_experts must be an integer"),
])
def test_malformed_meta_info(tmp_path, meta, match):
    _dump(tmp_path)
    (tmp_path / "meta_info.json").write_text(meta)
    with pytest.raises(InputError, match=match):
        read_trtllm_stats(tmp_path)


def test_no_rank_files(tmp_path):
    (tmp_path / "meta_info.json").write_text(json.dumps({"num_experts": P,
                                                        "num_experts_per_token": K}))
    with pytest.raises(InputError, match=r"no rank\{r\}\.safetensors files"):
        read_trtllm_stats(tmp_path)
