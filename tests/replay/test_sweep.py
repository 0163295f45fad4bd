"""`eplbsim sweep`: spec checks, the table's rows, determinism, resuming, executors."""

import csv
import re
import sys
from pathlib import Path

import pytest

from eplbsim.base.errors import InputError
from eplbsim.cli import main
from eplbsim.metrics import METRICS
from eplbsim.replay import replay
from eplbsim.replay.results import flat_row
from eplbsim.replay.sweep import SIZES, cell_row, parse_spec, read_spec, run_sweep
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import load_trace, save_trace

ROOT = Path(__file__).resolve().parents[2]
SIZES_TOML = """steps = 3
tokens = 64
layers = 2
experts = 16
top_k = 4
"""
# 2 scenarios x 2 policies x 2 seeds = 8 cells
SPEC = """[grid]
scenario = ["skewed", "template"]
policy = ["static", "ordinal"]
seed = [0, 1]
[fixed]
""" + SIZES_TOML + """gpus = 4
gpus_per_node = 2
redundant = 8
"""


def write_spec(folder: Path, text: str = SPEC) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sweep.toml"
    path.write_text(text)
    return path


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 8-cell sweep run once, uninterrupted, on 2 local processes: (spec, out dir)."""
    base = tmp_path_factory.mktemp("reference")
    spec = write_spec(base)
    run = run_sweep(read_spec(spec), base / "out", workers=2, progress=False)
    assert run.ran == 8
    return spec, base / "out"


# ----------------------------------------------------------------------------- the spec

@pytest.mark.parametrize("text, match", [
    ("[grid]\nscenario = ['skewed']\nsize = [1]\n", "[grid] unknown key 'size'"),
    ("[fixed]\nscenario = 'skewed'\ntemperature = 1\n", "[fixed] unknown key 'temperature'"),
    ("[grids]\nscenario = ['skewed']\n", "unknown key grids"),
    ("[grid]\nscenario = ['skewed']\nsolver = 'lpt'\n", "[grid] solver must be a non-empty list"),
    ("[grid]\nscenario = ['skewed']\nseed = []\n", "[grid] seed must be a non-empty list"),
    ("[grid]\nscenario = ['skewed']\nseed = [0, 0]\n", "[grid] seed lists a value twice"),
    ("[grid]\nscenario = ['skewed']\n[fixed]\nsolver = ['lpt']\n",
     "[fixed] solver must be one value"),
    ("[grid]\nscenario = ['skewed', 'zipf']\n", "[grid] scenario: unknown scenario 'zipf'"),
    ("[grid]\nscenario = ['skewed']\npolicy = ['row', 'modulo']\n",
     "[grid] policy: unknown policy 'modulo'"),
    ("[fixed]\nscenario = 'skewed'\nsolver = 'greedy'\n", "[fixed] solver: unknown solver"),
    ("[fixed]\nscenario = 'skewed'\nmode = 'both'\n", "[fixed] mode: unknown mode 'both'"),
    ("[fixed]\nscenario = 'skewed'\ndevice = 'tpu'\n", "[fixed] device: unknown device"),
    ("[fixed]\nscenario = 'skewed'\ngpus = '4'\n", "[fixed] gpus: must be an integer in [1, 65536], got '4'"),
    ("[grid]\nscenario = ['skewed']\nredundant = [-8]\n", "redundant must be >= 0, got -8: fewer slots than experts"),
    ("[fixed]\nscenario = 'skewed'\ndrift_p = 2\n", "drift_p: must be a number in [0, 1]"),
    ("[fixed]\nsolver = 'lpt'\n", "exactly one of scenario, trace or requests"),
    ("[grid]\nscenario = ['skewed']\n[fixed]\nscenario = 'burst'\n",
     "scenario in both [grid] and [fixed]"),
    ("[grid]\nscenario = ['skewed', 'template']\n'option.drift' = [0.1]\n",
     "scenario 'template' has no option drift"),
    ("[fixed]\ntrace = 'missing.npz'\n", "[fixed] trace: "),
    ("out = 3\n[fixed]\nscenario = 'skewed'\n", "out must be a path"),
    ("[fixed]\nscenario = 'skewed'\nexperts = 16\nredundant = 2\ngpus = 4\n",
     "18 slots do not divide over 4 GPUs; redundant 0 or 4 would"),
    ("[fixed]\nscenario = 'skewed'\ngpus = 6\ngpus_per_node = 4\n",
     "6 GPUs cannot be split into nodes of 4"),
    ("[fixed]\nscenario = 'skewed'\nexperts = 4\ntop_k = 8\n", "top_k=8 must not exceed"),
    ("[grid]\nscenario = ['skewed']\nseed = " + str(list(range(101))) + "\nredundant = "
     + str(list(range(0, 800, 8))) + "\n", "the grid has 10100 cells, above the cap of 10000"),
])
def test_bad_specs_name_the_key(tmp_path, text, match):
    with pytest.raises(InputError, match=re.escape(match)):
        read_spec(write_spec(tmp_path, text))


def test_missing_or_malformed_spec_names_the_file(tmp_path):
    with pytest.raises(InputError, match=re.escape(f"{tmp_path / 'none.toml'}: no such file")):
        read_spec(tmp_path / "none.toml")
    bad = write_spec(tmp_path, "[grid\nscenario = 1\n")
    with pytest.raises(InputError, match=re.escape(f"{bad}: not a TOML sweep spec")):
        read_spec(bad)


def test_cells_are_the_product_in_key_order_with_defaults_resolved():
    doc = {"grid": {"scenario": ["skewed", "burst"], "option": {"sigma": [1.0, 2]}},
           "fixed": {"steps": 4, "drift_p": 0}}
    cells = parse_spec(doc, Path("."))
    assert [(c.config["scenario"], c.config["option.sigma"]) for c in cells] == [
        ("skewed", 1.0), ("skewed", 2), ("burst", 1.0), ("burst", 2)]
    assert [c.index for c in cells] == [0, 1, 2, 3]
    assert list(cells[0].config) == [
        "scenario", *SIZES, "option.sigma", *flat_row(RunSpec().labels())]
    cfg = cells[0].config
    assert (cfg["steps"], cfg["tokens"], cfg["drift_p"], cfg["policy"], cfg["gpus"],
            cfg["redundant"], cfg["gpus_per_node"]) == (4, 512, 0.0, "ordinal", 8, None, 8)
    quoted = parse_spec({**doc, "grid": {"scenario": ["skewed", "burst"],
                                         "option.sigma": [1.0, 2]}}, Path("."))
    assert [c.id for c in quoted] == [c.id for c in cells]
    assert len({c.id for c in cells}) == 4


def test_shipped_example_has_at_least_100_cells():
    cells = read_spec(ROOT / "sweeps" / "example.toml").cells
    assert len(cells) >= 100 and len({c.id for c in cells}) == len(cells)


def trace_cells(folder: Path, grid: str) -> list:
    """The cells of a spec over a 3-step trace `t.npz` written to `folder`, with `grid` (TOML
    lines) beside its trace, on 4 GPUs with 8 redundant slots."""
    save_trace(synthesize("skewed", steps=3, tokens=32, layers=2, experts=16, top_k=4),
               folder / "t.npz")
    spec = write_spec(folder / "specs", f"[grid]\ntrace = ['../t.npz']\n{grid}\n[fixed]\n"
                      "gpus = 4\nredundant = 8\n")
    return read_spec(spec).cells


def test_trace_cells_replay_the_file(tmp_path):
    cells = trace_cells(tmp_path, "mode = ['none', 'a2a']")
    assert [c.config["trace"] for c in cells] == ["../t.npz"] * 2
    assert "steps" not in cells[0].config and cells[0].config["where"] is None
    row = cell_row(cells[1])
    expected = replay(load_trace(tmp_path / "t.npz"),
                      RunSpec.of(mode="a2a", gpus=4, redundant=8))
    assert {k: row[k] for k in flat_row(expected.row())} == flat_row(expected.row())


# ----------------------------------------------------------------------------- running

def test_local_sweep_one_row_per_cell_with_config_and_metrics(reference):
    spec, out = reference
    rows = read_rows(out / "results.csv")
    cells = read_spec(spec).cells
    assert [r["cell"] for r in rows] == [c.id for c in cells]
    metrics = [name for key, m in METRICS.items() for name in m.flat_keys(key)]
    assert list(rows[0]) == ["cell", "scenario", *SIZES, *flat_row(RunSpec().labels()), *metrics]
    assert [(r["scenario"], r["policy"], r["seed"]) for r in rows] == [
        (s, p, str(seed)) for s in ("skewed", "template") for p in ("static", "ordinal")
        for seed in (0, 1)]
    assert {(r["gpus"], r["redundant"], r["solver"], r["mode"]) for r in rows} == {
        ("4", "8", "deepseek", "none")}
    assert (out / "spec.toml").read_text() == spec.read_text()

    row = rows[5]  # template, static, seed 1
    trace = synthesize("template", steps=3, tokens=64, layers=2, experts=16, top_k=4, seed=1)
    expected = flat_row(replay(trace, RunSpec.of(policy="static", gpus=4, gpus_per_node=2,
                                                   redundant=8, seed=1)).row())
    assert {k: row[k] for k in expected} == {k: "" if v is None else str(v)
                                             for k, v in expected.items()}
    assert float(row["multiplicity_1"]) < 1.0  # static disagrees across ranks: a real result


def test_parquet_holds_the_same_table(reference):
    pq = pytest.importorskip("pyarrow.parquet")
    _, out = reference
    table = pq.read_table(out / "results.parquet").to_pylist()
    rows = read_rows(out / "results.csv")
    assert [r["cell"] for r in table] == [r["cell"] for r in rows]
    assert table[5]["policy"] == "static" and table[5]["gpus"] == 4
    assert table[5]["gpu_imbalance"] == float(rows[5]["gpu_imbalance"])


def test_two_runs_give_identical_tables(reference, tmp_path):
    spec, out = reference
    run_sweep(read_spec(spec), tmp_path / "again", workers=1, progress=False)
    assert (tmp_path / "again" / "results.csv").read_bytes() == \
        (out / "results.csv").read_bytes()


def test_resume_skips_done_cells_and_cuts_a_torn_line(reference, tmp_path):
    spec, out = reference
    lines = (out / "results.csv").read_bytes().splitlines(keepends=True)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "spec.toml").write_text(spec.read_text())
    # A killed run: rows in completion order, the last one half written.
    (partial / "results.csv").write_bytes(lines[0] + lines[6] + lines[2] + lines[3][:40])
    run = run_sweep(read_spec(spec), partial, workers=2, progress=False)
    assert run.ran == 6
    assert (partial / "results.csv").read_bytes() == (out / "results.csv").read_bytes()
    again = run_sweep(read_spec(spec), partial, workers=2, progress=False)
    assert again.ran == 0
    assert (partial / "results.csv").read_bytes() == (out / "results.csv").read_bytes()


def test_refuses_a_directory_of_another_sweep(reference, tmp_path):
    spec, out = reference
    other = write_spec(tmp_path, SPEC.replace("seed = [0, 1]", "seed = [0, 1, 2]"))
    with pytest.raises(InputError, match="holds another sweep"):
        run_sweep(read_spec(other), out, progress=False)
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="not a sweep's directory"):
        run_sweep(read_spec(spec), tmp_path / "stray", progress=False)


def test_a_failed_cell_stops_the_sweep_with_one_line_and_keeps_rows(tmp_path, capsys):
    # period 8 leaves 16 // 8 = 2 experts per class, fewer than top_k = 4: synthesize refuses
    spec = write_spec(tmp_path, "[grid]\n'option.period' = [2, 8]\nseed = [0, 1]\n[fixed]\n"
                      "scenario = 'template'\n" + SIZES_TOML + "gpus = 4\nredundant = 8\n")
    code = main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("eplbsim: error: cell ")
    assert "option.period=8 " in err[-1] and " seed=0 " in err[-1]
    assert "failed: template: period=8 splits experts=16" in err[-1]
    assert [r["option.period"] for r in read_rows(tmp_path / "out" / "results.csv")] == ["2", "2"]


def test_command_line_runs_and_reports_bad_input(reference, tmp_path, capsys):
    spec, out = reference
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    out_lines = capsys.readouterr().out.splitlines()
    assert out_lines[0] == "8 cells (0 run now, 8 done before):"
    assert out_lines[1].startswith("  gpu_imbalance: ") and out_lines[-1].startswith("wrote ")
    for argv, match in [([str(tmp_path / "none.toml"), "--out", str(tmp_path)], "no such file"),
                        ([str(spec)], "no output directory"),
                        ([str(spec), "--out", str(out), "--address", "auto"],
                         "--address is for --executor ray"),
                        ([str(spec), "--out", str(out), "--executor", "ray", "--address", "auto",
                          "--workers", "2"], "(no --workers)")]:
        assert main(["sweep", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("eplbsim: error:") and match in err[0], err


def test_ray_executor_says_how_to_install_ray(reference, tmp_path, monkeypatch):
    spec, _ = reference
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(InputError, match=re.escape("pip install 'eplbsim[ray]'")):
        run_sweep(read_spec(spec), tmp_path / "ray", executor="ray", progress=False)


def test_ray_executor_gives_the_local_table(reference, tmp_path):
    pytest.importorskip("ray")
    spec, out = reference
    run = run_sweep(read_spec(spec), tmp_path / "ray", executor="ray", workers=2,
                    progress=False)
    assert run.ran == 8
    assert (tmp_path / "ray" / "results.csv").read_bytes() == (out / "results.csv").read_bytes()


def test_a_grid_over_the_steps_read_gives_a_cell_each():
    doc = {"grid": {"select_steps": ["0:2", "2:"]}, "fixed": {"scenario": "skewed", "steps": 4}}
    cells = parse_spec(doc, Path("."))
    assert [c.config["select_steps"] for c in cells] == ["0:2", "2:"]
    assert len({c.id for c in cells}) == 2


def test_a_grid_over_max_batched_tokens_cuts_each_cell_s_trace_as_the_run_spec_does(tmp_path):
    cells = trace_cells(tmp_path, "max_batched_tokens = [8, 32]")
    assert [c.config["max_batched_tokens"] for c in cells] == [8, 32]
    assert len({c.id for c in cells}) == 2
    rows = [cell_row(cell) for cell in cells]
    for row, size in zip(rows, (8, 32)):
        expected = replay(load_trace(tmp_path / "t.npz"),
                          RunSpec.of(gpus=4, redundant=8, max_batched_tokens=size))
        assert {k: row[k] for k in flat_row(expected.row())} == flat_row(expected.row())
    assert rows[0]["gpu_imbalance"] != rows[1]["gpu_imbalance"]  # chunks of 8: other steps
