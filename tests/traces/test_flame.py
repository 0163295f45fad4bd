"""Importing FLAME-MoE routing traces (parquet files written here in the data set's layout)."""

from __future__ import annotations

import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.traces.formats.flame import is_flame, read_flame
from eplbsim.traces.trace import Trace
from log_writers import write_flame_layer as _layer_file

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N, K, E = 10, 3, 16
LAYERS = (2, 3, 4)


def _indices(seed: int, n: int = N) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int16)


def _iteration(folder, iteration: int = 5473) -> object:
    d = folder / f"iter_{iteration:04d}"
    d.mkdir(parents=True)
    for layer in LAYERS:
        _layer_file(d / f"layer_{layer:02d}.parquet", _indices(layer))
    return d


def test_an_iteration_directory_becomes_steps(tmp_path):
    d = _iteration(tmp_path)
    assert is_flame(d)
    trace = read_flame(d, step_tokens=4)
    assert isinstance(trace, Trace)
    assert trace.num_layers == len(LAYERS) and trace.top_k == K
    assert trace.tokens_per_step.tolist() == [4, 4, 2]
    want = np.stack([_indices(layer) for layer in LAYERS], 1)  # [N, L, K]
    assert np.array_equal(trace.topk_ids.numpy(), want)
    assert trace.num_experts == int(want.max()) + 1
    assert trace.meta["model_layers"] == list(LAYERS) and trace.meta["iteration"] == 5473
    assert trace.meta["source"] == "flame-moe" and trace.meta["step_tokens"] == 4


def test_a_data_set_directory_picks_an_iteration(tmp_path):
    model = tmp_path / "flame-moe-290m"
    _iteration(model / "actives", 540)
    _iteration(model / "actives", 1080)
    (model / "samples").mkdir()
    assert is_flame(model)
    with pytest.raises(InputError, match=r"holds iterations \[540, 1080\]; choose one"):
        read_flame(model)
    with pytest.raises(InputError, match=r"has no iteration 7; it has \[540, 1080\]"):
        read_flame(model, iteration=7)
    trace = read_flame(model, iteration=540, max_tokens=5, experts=64)
    assert trace.meta["iteration"] == 540 and trace.num_tokens == 5 and trace.num_experts == 64
    assert trace.num_steps == 1


def test_one_layer_file(tmp_path):
    d = _iteration(tmp_path)
    trace = read_flame(d / "layer_03.parquet")
    assert trace.num_layers == 1 and trace.meta["model_layers"] == [3]
    assert trace.meta["iteration"] == 5473 and trace.num_steps == 1
    with pytest.raises(InputError, match="iteration picks among iter_NNNN directories"):
        read_flame(d / "layer_03.parquet", iteration=5473)


def test_detection(tmp_path):
    assert not is_flame(tmp_path)
    (tmp_path / "x.json").write_text("{}")
    assert not is_flame(tmp_path / "x.json")


def _rows(rows: list, type_=None):
    return pa.table({"indices": pa.array(rows, type=type_ or pa.list_(pa.int16()))})


@pytest.mark.parametrize("table, options, match", [
    (pa.table({"token_id": pa.array([1, 2], pa.int32())}), {},
     r"layer_02\.parquet: no indices column .* the columns are token_id"),
    (_rows([[1, 2, 3], None]), {}, r"layer_02\.parquet: row 1: indices is null"),
    (_rows([[1, 2, 3], [1, 2]]), {}, r"layer_02\.parquet: row 1: 2 indices, expected 3"),
    (_rows([[1, 2, 3], [4, None, 5]]), {}, r"layer_02\.parquet: row 1: indices holds a null"),
    (_rows([[1, 2, 3], [4, 99, 5]]), {"experts": 16},
     r"layer_02\.parquet: row 1: expert ids \[4, 99, 5\] outside \[-1, 16\)"),
    (_rows([[1, 2, 3], [4, 5, 4]]), {}, r"layer_02\.parquet: row 1 routes expert 4 twice"),
    (_rows([[1, 2, 3], [4, 2**64 - 1, 5]], pa.list_(pa.uint64())), {},
     r"layer_02\.parquet: row 1: expert ids \[4, 18446744073709551615, 5\] outside"),
    (_rows([[1.0, 2.0]], pa.list_(pa.float32())), {},
     r"layer_02\.parquet: indices must be lists of integer ids"),
    (_rows([]), {}, r"layer_02\.parquet: holds no rows"),
])
def test_malformed_rows_name_the_file_and_row(tmp_path, table, options, match):
    d = tmp_path / "iter_0100"
    d.mkdir()
    pq.write_table(table, d / "layer_02.parquet")
    with pytest.raises(InputError, match=match):
        read_flame(d, **options)


def test_layer_files_of_different_lengths(tmp_path):
    d = _iteration(tmp_path)
    _layer_file(d / "layer_04.parquet", _indices(4, N - 1))
    with pytest.raises(InputError, match=r"layer_04\.parquet: 9 rows, but layer_02\.parquet has "
                                         r"10"):
        read_flame(d)


def test_not_parquet(tmp_path):
    (tmp_path / "layer_02.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match=r"layer_02\.parquet: not a readable parquet file"):
        read_flame(tmp_path)


def test_bad_options(tmp_path):
    d = _iteration(tmp_path)
    with pytest.raises(InputError, match="step_tokens must be an integer >= 1"):
        read_flame(d, step_tokens=0)
