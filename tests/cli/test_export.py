"""`eplbsim export --format sglang`: the placement and logical_count forms of SGLang's
`--init-expert-location`, round trips, the engine's loading rules, and the CLI."""

import json

import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.placement.io import (check_sglang_placement, read_sglang_placement,
                                  sglang_logical_count, sglang_placement)
from eplbsim.traces.counts import CountsTrace, save_counts_trace
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import save_trace

from cli_helpers import assert_input_error, run

E, P = 8, 12


def random_phy2log(L, rng):
    """[L, P]: every expert once, then P - E random replicas, shuffled per layer."""
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)]))
            for _ in range(L)]
    return np.stack(rows)


def test_round_trip_with_dense_layers_interleaved():
    rng = np.random.default_rng(0)
    phy2log = random_phy2log(3, rng)
    moe = [1, 3, 4]  # model layers 0 and 2 are dense
    obj = sglang_placement(phy2log, E, 5, moe)
    assert list(obj) == ["physical_to_logical_map"]
    full = obj["physical_to_logical_map"]
    assert len(full) == 5 and all(len(r) == P for r in full)
    assert all(type(v) is int for r in full for v in r)
    for dense in (0, 2):
        assert full[dense] == [p % E for p in range(P)]
    check_sglang_placement(json.loads(json.dumps(obj)), E)
    np.testing.assert_array_equal(read_sglang_placement(obj, E, moe), phy2log)
    # torch input and the identity default give the same rows
    import torch
    same = sglang_placement(torch.as_tensor(phy2log), E, 3, [0, 1, 2])
    np.testing.assert_array_equal(read_sglang_placement(same, E), phy2log)


def test_round_trip_through_a_file(tmp_path):
    phy2log = random_phy2log(2, np.random.default_rng(1))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(sglang_placement(phy2log, E, 4, [3, 0])))
    np.testing.assert_array_equal(read_sglang_placement(path, E, [3, 0]), phy2log)
    np.testing.assert_array_equal(read_sglang_placement(str(path), E, [0, 3]), phy2log[::-1])


@pytest.mark.parametrize("moe, match", [([1, 2], "2 moe layers given for 3"),
                                        ([1, 1, 2], "named more than once"),
                                        ([1, 2, 5], "outside the model's layers [0, 5)"),
                                        ([-1, 2, 3], "outside the model's layers")])
def test_bad_moe_layers(moe, match):
    phy2log = random_phy2log(3, np.random.default_rng(2))
    with pytest.raises(InputError, match=match.replace("[", r"\[").replace(")", r"\)")):
        sglang_placement(phy2log, E, 5, moe)
    with pytest.raises(InputError):
        sglang_logical_count(np.ones((3, E)), 5, moe)


def test_bad_phy2log_is_refused():
    good = random_phy2log(1, np.random.default_rng(3))
    with pytest.raises(InputError, match="outside"):
        sglang_placement(good + 1, E, 1, [0])
    missing = good.copy()
    missing[missing == 5] = 4
    with pytest.raises(InputError, match="expert 5 has no slot"):
        sglang_placement(missing, E, 1, [0])
    with pytest.raises(InputError, match="integers"):
        sglang_placement(good.astype(float), E, 1, [0])


def test_checker_rejects_each_broken_rule():
    good = sglang_placement(random_phy2log(2, np.random.default_rng(4)), E, 3, [0, 2])
    check_sglang_placement(good, E)
    rows = good["physical_to_logical_map"]
    cases = [
        ({**good, "logical_count": [[0] * E]}, "rule 1"),
        ({"phy2log": rows}, "rule 1"),
        (rows, "rule 1"),
        ({"physical_to_logical_map": []}, "rule 2"),
        ({"physical_to_logical_map": [rows[0], rows[1][:-1], rows[2]]}, "rule 2"),
        ({"physical_to_logical_map": [rows[0], rows[1], rows[2][:-1] + [E]]}, "rule 3"),
        ({"physical_to_logical_map": [rows[0], rows[1], rows[2][:-1] + [-1]]}, "rule 3"),
        ({"physical_to_logical_map": [rows[0], rows[1], rows[2][:-1] + [1.0]]}, "rule 3"),
        ({"physical_to_logical_map": [rows[0], rows[1], rows[2][:-1] + [True]]}, "rule 3"),
        ({"physical_to_logical_map": [rows[0], [0] * P, rows[2]]}, "rule 4"),
    ]
    for obj, rule in cases:
        with pytest.raises(InputError, match=rule):
            check_sglang_placement(obj, E)
        with pytest.raises(InputError, match=rule):
            read_sglang_placement(obj, E)


def test_logical_count_shape_and_totals():
    counts = np.random.default_rng(5).integers(0, 50, (4, 2, E))  # [S, L, E]
    obj = sglang_logical_count(counts, 6, [5, 1])
    assert list(obj) == ["logical_count"]
    full = np.array(obj["logical_count"])
    assert full.shape == (6, E)
    assert all(type(v) is int for r in obj["logical_count"] for v in r)
    np.testing.assert_array_equal(full[5], counts.sum(0)[0])
    np.testing.assert_array_equal(full[1], counts.sum(0)[1])
    assert full[[0, 2, 3, 4]].sum() == 0 and full.sum() == counts.sum()
    # [L, E] summed counts give the same object
    assert sglang_logical_count(counts.sum(0).astype(float), 6, [5, 1]) == obj
    with pytest.raises(InputError, match="whole numbers"):
        sglang_logical_count(np.full((2, E), 0.5), 6, [5, 1])
    with pytest.raises(InputError, match="shape"):
        sglang_logical_count(np.ones(E), 6, [5])


def test_cli_from_solve_json(capsys, tmp_path):
    csv = tmp_path / "c.csv"
    csv.write_text("layer,expert,count\n" + "\n".join(
        f"{layer},{e},{(e + 1) * (layer + 1)}" for layer in (1, 3) for e in range(E)) + "\n")
    code, out, _ = run(capsys, "solve", "--counts", csv, "--redundant", 4, "--gpus", 4,
                       "--json")
    assert code == 0
    solved = json.loads(out)
    assert solved["layers"] == [1, 3]
    solve_json = tmp_path / "solve.json"
    solve_json.write_text(out)
    dest = tmp_path / "sglang.json"
    code, out, _ = run(capsys, "export", "--format", "sglang", "--placement", solve_json,
                       "--num-model-layers", 4, "--out", dest)
    assert code == 0 and len(out.strip().splitlines()) == 1 and str(dest) in out
    obj = json.loads(dest.read_text())
    check_sglang_placement(obj, E)
    np.testing.assert_array_equal(read_sglang_placement(obj, E, [1, 3]), solved["phy2log"])
    assert obj["physical_to_logical_map"][0] == [p % E for p in range(P)]
    # a bare phy2log with explicit layers
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(solved["phy2log"]))
    code, _, _ = run(capsys, "export", "--format", "sglang", "--placement", bare,
                     "--num-model-layers", 3, "--moe-layers", "2,0", "--out", dest)
    assert code == 0
    np.testing.assert_array_equal(read_sglang_placement(dest, E, [2, 0]), solved["phy2log"])


def test_cli_from_counts_and_trace_files(capsys, tmp_path):
    counts = np.random.default_rng(6).integers(0, 9, (3, 2, E))
    npz = tmp_path / "c.npz"
    save_counts_trace(CountsTrace(counts, {"model_layers": [1, 2], "num_model_layers": 3}), npz)
    dest = tmp_path / "lc.json"
    code, out, _ = run(capsys, "export", "--format", "sglang", "--counts", npz, "--out", dest)
    assert code == 0 and "logical_count [3, 8]" in out
    full = np.array(json.loads(dest.read_text())["logical_count"])
    np.testing.assert_array_equal(full[1:], counts.sum(0))
    assert full[0].sum() == 0

    trace = synthesize("uniform", steps=2, tokens=16, layers=2, experts=E, top_k=2, seed=0)
    tpath = tmp_path / "t.npz"
    save_trace(trace, tpath)
    code, _, _ = run(capsys, "export", "--format", "sglang", "--counts", tpath,
                     "--num-model-layers", 2, "--out", dest)
    assert code == 0
    full = np.array(json.loads(dest.read_text())["logical_count"])
    np.testing.assert_array_equal(full, trace.counts().sum(0).numpy())


def test_cli_bad_inputs(capsys, tmp_path):
    phy2log = random_phy2log(2, np.random.default_rng(7))
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"phy2log": phy2log.tolist()}))
    out = tmp_path / "o.json"
    base = ["export", "--format", "sglang", "--out", out]
    assert_input_error(capsys, *base, "--placement", tmp_path / "nope.json",
                       "--num-model-layers", 2, match="no such file")
    assert_input_error(capsys, *base, "--placement", good, match="--num-model-layers")
    assert_input_error(capsys, *base, "--placement", good, "--num-model-layers", 2,
                       "--moe-layers", "0,x", match="comma-separated integers")
    assert_input_error(capsys, *base, "--placement", good, "--num-model-layers", 2,
                       "--moe-layers", "0,2", match="outside the model's layers")
    assert_input_error(capsys, *base, "--placement", good, "--num-model-layers", 3,
                       "--moe-layers", "1,1", match="more than once")
    assert_input_error(capsys, *base, "--placement", good, "--num-model-layers", 3,
                       "--moe-layers", "1", match="1 moe layers given for 2")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"logcnt": [[1]]}))
    assert_input_error(capsys, *base, "--placement", bad, "--num-model-layers", 2,
                       match="phy2log")
    bad.write_text("{not json")
    assert_input_error(capsys, *base, "--placement", bad, "--num-model-layers", 2,
                       match="not a JSON placement")
    assert_input_error(capsys, *base, "--counts", bad, "--num-model-layers", 2,
                       match=str(bad))
    assert not out.exists()


def test_cli_an_infinite_layer_count_is_named_in_one_line(capsys, tmp_path):
    out = tmp_path / "o.json"
    base = ["export", "--format", "sglang", "--out", out]
    placement = tmp_path / "p.json"  # Python's json writes and reads Infinity
    placement.write_text(json.dumps({"phy2log": [list(range(E))], "layers": [float("inf")]}))
    assert_input_error(capsys, *base, "--placement", placement, "--num-model-layers", 2,
                       match="moe layers must be integers, got [inf]")
    counts = tmp_path / "c.npz"
    np.savez(counts, counts=np.ones((1, 1, E)),
             meta=np.array(json.dumps({"num_model_layers": float("inf")})))
    assert_input_error(capsys, *base, "--counts", counts,
                       match=f"{counts}: its num_model_layers: the model's layer count must be "
                             f"an integer in [1, 4096], got inf")
    assert not out.exists()
