"""The `eplbsim` command: outputs, JSON shapes, and bad input -> one line, status 2."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from eplbsim.metrics import METRICS
from eplbsim.schedule.transfers import MIGRATION_FIELDS
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import load_trace, save_trace

from cli_helpers import assert_input_error, run

SMALL = ["--steps", "3", "--tokens", "64", "--layers", "2", "--experts", "16", "--top-k", "4",
         "--gpus", "4", "--gpus-per-node", "2", "--redundant", "8"]


def test_run_json_rows_carry_every_metric_key(capsys):
    code, out, _ = run(capsys, "run", *SMALL, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["policy"], r["mode"]) for r in rows] == [
        (p, m) for m in ("none", "a2a") for p in ("static", "random", "row", "ordinal")]
    for row in rows:
        assert set(METRICS) <= set(row) and row["solver"] == "deepseek"
        assert set(row["multiplicity"]) == {"0", "1", "2+"}


def test_run_table_and_out_dir(capsys, tmp_path):
    code, out, _ = run(capsys, "run", *SMALL, "--scenario", "template", "--policies",
                       "row,ordinal", "--mode", "none", "--out", tmp_path / "res")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["policy", "mode"]
    assert [ln.split()[0] for ln in lines[2:4]] == ["row", "ordinal"]
    rows = json.loads((tmp_path / "res" / "results.json").read_text())
    assert len(rows) == 2
    csv = (tmp_path / "res" / "results.csv").read_text().splitlines()
    assert "multiplicity_2+" in csv[0] and len(csv) == 3
    assert (tmp_path / "res" / "policies.png").stat().st_size > 1000


def test_run_on_a_trace_file_matches_the_scenario(capsys, tmp_path):
    path = tmp_path / "t.npz"
    code, _, _ = run(capsys, "trace", "synth", "uniform", "--out", path, "--steps", "3",
                     "--tokens", "64", "--layers", "2", "--experts", "16", "--top-k", "4")
    assert code == 0
    from_file = run(capsys, "run", "--trace", path, "--gpus", "4", "--redundant", "8",
                    "--policies", "ordinal", "--json")[1]
    from_scenario = run(capsys, "run", *SMALL, "--scenario", "uniform", "--gpus-per-node", "4",
                        "--policies", "ordinal", "--json")[1]
    assert json.loads(from_file) == json.loads(from_scenario)


def test_trace_synth_and_info(capsys, tmp_path):
    path = tmp_path / "s.npz"
    code, out, _ = run(capsys, "trace", "synth", "template", "--out", path, "--steps", "2",
                       "--tokens", "32", "--experts", "32", "-o", "noise=0.1", "--seed", "4")
    assert code == 0 and path.exists()
    trace = load_trace(path)
    assert trace.meta["params"]["noise"] == 0.1 and trace.meta["params"]["seed"] == 4
    code, out, _ = run(capsys, "trace", "info", path)
    assert code == 0 and "steps 2, tokens 64" in out and "top-k 8" in out
    info = json.loads(run(capsys, "trace", "info", path, "--json")[1])
    assert info["experts"] == 32 and len(info["layer_skew"]) == 4
    counts = trace.counts().sum(0).double()
    assert info["layer_skew"][1]["max_over_mean"] == pytest.approx(
        float(counts[1].max() / counts[1].mean()))


EXAMPLE = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]


def test_solve_reproduces_the_published_example(capsys, tmp_path):
    load = tmp_path / "load.json"
    load.write_text(json.dumps(EXAMPLE))
    code, out, _ = run(capsys, "solve", "--load", load, "--slots", 16, "--gpus", 8,
                       "--gpus-per-node", 4, "--groups", 4, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["phy2log"] == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                 [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert sum(result["logcnt"][0]) == 16
    assert result["placement_imbalance"] >= 1.0


def test_bad_trace_ids_are_reported(capsys, tmp_path):
    trace = synthesize("uniform", steps=1, tokens=4, layers=1, experts=8, top_k=2)
    path = tmp_path / "bad.npz"
    save_trace(trace, path)
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["topk_ids"][0, 0, 0] = 300
    np.savez(path, **arrays)
    assert_input_error(capsys, "run", "--trace", path, match="expert id 300 but the trace "
                       "declares 8 experts")
    arrays["topk_ids"][0, 0, 0] = -2
    np.savez(path, **arrays)
    assert_input_error(capsys, "trace", "info", path, match="expert id -2")


def test_truncated_and_foreign_files_are_reported(capsys, tmp_path):
    good = tmp_path / "good.npz"
    save_trace(synthesize("uniform", steps=2, tokens=16, layers=1, experts=8, top_k=2), good)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert_input_error(capsys, "run", "--trace", cut, match=str(cut))
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.zeros(3))
    assert_input_error(capsys, "trace", "info", foreign,
                       match="an array of shape [3] (float64) is neither counts")
    assert_input_error(capsys, "run", "--trace", tmp_path / "nope.npz", match="no such file")


@pytest.mark.parametrize("args,match", [
    (["--redundant", "7"], "23 slots do not divide over 4 GPUs; redundant 4 or 8 would"),
    (["--gpus-per-node", "3"], "4 GPUs cannot be split into nodes of 3"),
    (["--mode", "sideways"], "unknown mode 'sideways'"),
    (["--policies", "row,nope"], "unknown policy 'nope'"),
    (["-o", "sigma=-1"], "sigma"),
])
def test_bad_run_options(capsys, args, match):
    assert_input_error(capsys, "run", *SMALL, *args, match=match)


def test_solve_bad_inputs(capsys, tmp_path):
    load = tmp_path / "load.json"
    load.write_text(json.dumps(EXAMPLE))
    assert_input_error(capsys, "solve", "--load", load, "--slots", 8, "--gpus", 4,
                       match="fewer")
    load.write_text("[[1, 2], [3")
    assert_input_error(capsys, "solve", "--load", load, "--slots", 4, "--gpus", 2,
                       match="not a JSON")
    load.write_text(json.dumps([[1, float("nan")]]))
    assert_input_error(capsys, "solve", "--load", load, "--slots", 2, "--gpus", 2,
                       match="NaN")
    load.write_text(json.dumps([[1, -3]]))
    assert_input_error(capsys, "solve", "--load", load, "--slots", 2, "--gpus", 2,
                       match="negative")


def test_cuda_device_without_cuda_is_an_input_error(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert_input_error(capsys, "run", *SMALL, "--device", "cuda", match="no CUDA device")


def test_console_script_is_installed():
    import shutil
    import subprocess
    import sys
    exe = shutil.which("eplbsim", path=str(Path(sys.executable).parent))
    assert exe, "the eplbsim console script is not installed next to this python"
    done = subprocess.run([exe, "run", *SMALL, "--policies", "row", "--mode", "a2a",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["policy"] == "row"


def test_solve_counts_csv_with_filters_and_redundancy(capsys, tmp_path):
    csv = tmp_path / "c.csv"
    rows = ["model,domain,layer,expert,count"]
    rows += [f"m,{d},{layer},{e},{(e + 1) * (3 if d == 'x' else 1)}"
             for d in ("x", "y") for layer in (3, 9) for e in range(8)]
    csv.write_text("\n".join(rows) + "\n")
    code, out, _ = run(capsys, "solve", "--counts", csv, "--where", "domain=x", "--redundant", 8,
                       "--gpus", 4, "--solver", "lpt", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["layers"] == [3, 9] and len(result["phy2log"][0]) == 16
    assert 1.0 <= result["placement_gap"] < 1.2 and len(result["placement_gap_per_layer"]) == 2
    assert_input_error(capsys, "solve", "--counts", csv, "--gpus", 4,
                       match="filter with --where on model, domain")


def test_solve_previous_reports_moved_slots(capsys, tmp_path):
    load = tmp_path / "load.json"
    load.write_text(json.dumps(EXAMPLE))
    first = tmp_path / "first.json"
    first.write_text(run(capsys, "solve", "--load", load, "--slots", 16, "--gpus", 8,
                         "--json")[1])
    changed = [[v + (3 if i % 4 == 0 else 0) for i, v in enumerate(row)] for row in EXAMPLE]
    load.write_text(json.dumps(changed))
    code, out, _ = run(capsys, "solve", "--load", load, "--slots", 16, "--gpus", 8,
                       "--previous", first, "--json")
    assert code == 0
    result = json.loads(out)
    previous = json.loads(first.read_text())["phy2log"]
    moved = sum(a != b for r0, r1 in zip(previous, result["phy2log"]) for a, b in zip(r0, r1))
    assert result["moved_slots"] == moved <= result["fresh_moved_slots"]


def test_solve_exact_with_options_and_anti_colocation(capsys, tmp_path):
    load = tmp_path / "load.json"
    load.write_text(json.dumps([[600, 560, 120, 120, 20, 10, 10, 10]]))
    code, out, _ = run(capsys, "solve", "--load", load, "--slots", 16, "--gpus", 8,
                       "--solver", "exact", "--anti-colocation", "-o", "node_limit=200", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["objective"][0] == pytest.approx(590 / 3)
    for gpu in range(8):
        pair = result["phy2log"][0][2 * gpu: 2 * gpu + 2]
        assert pair[0] != pair[1]
    assert_input_error(capsys, "solve", "--load", load, "--slots", 16, "--gpus", 8,
                       "-o", "time_limit=3", match="solver deepseek has no option time_limit")


def test_run_on_counts_reports_the_promise_and_refuses_policies(capsys, tmp_path):
    from eplbsim.traces.counts import CountsTrace, save_counts_trace
    path = tmp_path / "c.npz"
    counts = np.random.default_rng(0).integers(0, 50, (4, 2, 16))
    save_counts_trace(CountsTrace(counts), path)
    code, out, _ = run(capsys, "run", "--trace", path, "--gpus", 4, "--redundant", 4, "--json")
    assert code == 0
    (row,) = json.loads(out)
    assert row["policy"] == "(even split)" and row["rank_agreement"] is None
    assert row["gpu_imbalance"] is None and row["placement_imbalance"] >= 1.0
    assert row["placement_gap"] >= 1.0
    assert_input_error(capsys, "run", "--trace", path, "--policies", "row",
                       match="holds expert counts, not token rows")


REBALANCE = ["--tokens", "48", "--layers", "2", "--experts", "16", "--top-k", "4", "--gpus",
             "4", "--gpus-per-node", "2", "--redundant", "8"]


def test_run_without_rebalances_writes_the_migrations_header(capsys, tmp_path):
    code, _, err = run(capsys, "run", *REBALANCE, "--policies", "row", "--mode", "none",
                       "--out", tmp_path / "res")
    with open(tmp_path / "res" / "migrations.csv", newline="") as f:
        assert code == 0 and list(csv.reader(f)) == [list(MIGRATION_FIELDS)], err


def test_run_rebalancing_writes_time_series_and_migrations(capsys, tmp_path):
    out_dir = tmp_path / "res"
    code, out, _ = run(capsys, "run", *REBALANCE, "--scenario", "burst", "--rebalance-every",
                       "5", "--window", "4", "--policies", "row,ordinal", "--mode", "a2a",
                       "--expert-bytes", "10", "--out", out_dir)
    assert code == 0
    assert "solver x prediction x dispatch" in out and "cross_node" in out
    # no --steps: max(32, W + 4N) = 32 steps; rebalances at 4, 9, .., 29
    with open(out_dir / "migrations.csv") as f:
        reader = csv.DictReader(f)
        migrations = list(reader)
    assert reader.fieldnames == list(MIGRATION_FIELDS)
    assert [int(r["step"]) for r in migrations] == [4, 9, 14, 19, 24, 29]
    for r in migrations:  # the whole model's bytes: deepseek-v3's 58 layers, the trace's 2
        assert int(r["bytes"]) == 10 * int(r["moved_slots"]) * 58 // 2
    assert "bytes and stalls in the whole model's 58" in out
    series = list(csv.DictReader(open(out_dir / "timeseries.csv")))
    assert len(series) == 2 * 32 and {r["policy"] for r in series} == {"row", "ordinal"}
    moved = sum(int(r["moved_slots"]) for r in series if r["policy"] == "row")
    assert moved == sum(int(r["moved_slots"]) for r in migrations) > 0
    for name in ("timeseries.png", "timeseries.pdf", "policies.png", "policies.pdf"):
        assert (out_dir / name).stat().st_size > 1000
    rows = json.loads((out_dir / "results.json").read_text())
    for row in rows:
        product = row["factor_solver"] * row["factor_prediction"] * row["factor_dispatch"]
        assert product == pytest.approx(row["gpu_imbalance"], rel=0.05)
        assert row["rebalances"] == 6


def test_run_per_layer_time_series_and_initial_placement(capsys, tmp_path):
    code, out, _ = run(capsys, "solve", "--load", _write_json(tmp_path / "load.json",
                       [[1.0] * 16, [2.0] * 16]), "--redundant", "8", "--gpus", "4",
                       "--gpus-per-node", "2", "--json")
    (tmp_path / "initial.json").write_text(out)
    code, out, _ = run(capsys, "run", *REBALANCE, "--steps", "12", "--rebalance-every", "6",
                       "--initial", tmp_path / "initial.json", "--predictor", "ema",
                       "--policies", "ordinal", "--mode", "none", "--per-layer", "--out",
                       tmp_path / "res")
    assert code == 0
    series = list(csv.DictReader(open(tmp_path / "res" / "timeseries.csv")))
    assert [(r["step"], r["layer"]) for r in series[:3]] == [("0", "0"), ("0", "1"), ("1", "0")]
    assert len(series) == 12 * 2


def _write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize("args,match", [
    (["--rebalance-every", "4", "--initial", "missing.json"], "missing.json: no such file"),
    (["--rebalance-every", "4", "--decay", "2"], "--decay: must be a number in [0, 1]"),
    (["--rebalance-every", "4", "--skip-above", "-1"], "--skip-above: must be a number in"),
])
def test_bad_rebalance_options(capsys, args, match):
    assert_input_error(capsys, "run", *SMALL, *args, match=match)


def test_initial_placement_file_must_fit(capsys, tmp_path):
    wrong = _write_json(tmp_path / "wrong.json", {"phy2log": [[0, 1, 2, 3]]})
    assert_input_error(capsys, "run", *SMALL, "--rebalance-every", "2", "--initial", wrong,
                       match="4 physical slots are fewer than the 16 logical experts")
    ragged = _write_json(tmp_path / "ragged.json", [[0, 1], [2]])
    assert_input_error(capsys, "run", *SMALL, "--rebalance-every", "2", "--initial", ragged,
                       match="not a [layers][slots] list of integers")


def test_run_with_a_cost_model_prints_time_and_speedup(capsys):
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "row,ordinal", "--cost", "roofline",
                       "--model", "mixtral-8x7b", "--device-profile", "mi300x",
                       "--baseline", "row")
    assert code == 0
    assert ("time of the whole model (mixtral-8x7b: 32 MoE layers, the trace's 2 standing for "
            "them") in out and "cost roofline, device mi300x" in out
    header = next(line for line in out.splitlines() if "moe_ms" in line).split()
    assert header[:3] == ["policy", "mode", "layer_us"] and header[-1] == "speedup"
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "row,ordinal", "--cost", "roofline",
                       "--baseline", "row", "--json")
    rows = json.loads(out)
    assert [r["speedup"] == 1.0 for r in rows] == [True, False, True, False]
    for r in rows:
        assert r["speedup"] == pytest.approx(
            next(b["moe_ms"] for b in rows if b["mode"] == r["mode"]
                 and b["policy"] == "row") / r["moe_ms"])
        # the trace's 2 layers stand for deepseek-v3's 58: a step is 58 mean layers
        assert r["moe_ms"] == pytest.approx(r["layer_us"] * 58 / 1e3)
        assert r["moe_tokens_per_s"] == pytest.approx(64 / (r["moe_ms"] / 1e3))


def test_time_counts_the_models_shared_experts(capsys):
    """With a cost model every token also runs the model's shared expert (deepseek-v3 has
    one): leaving it out (--shared-experts 0) understates the time."""
    args = ["run", *SMALL, "--policies", "row", "--mode", "a2a", "--cost", "roofline", "--json"]
    counted = json.loads(run(capsys, *args)[1])[0]
    left_out = json.loads(run(capsys, *args, "--shared-experts", "0")[1])[0]
    assert counted["compute_ms"] > left_out["compute_ms"]
    out = run(capsys, *args[:-1])[1]
    assert "model deepseek-v3 (58 MoE layers; the trace holds 2; the default: the trace " \
           "names no model), shared experts 1 (1 " \
           "routed pair of work a token and layer: the cost model prices the model's whole " \
           "layer)" in out


def test_corrupt_rows_show_no_speedup(capsys):
    args = ["run", *SMALL, "--policies", "row,static", "--mode", "none", "--cost", "roofline",
            "--baseline", "row"]
    rows = json.loads(run(capsys, *args, "--json")[1])
    static = next(r for r in rows if r["policy"] == "static")
    assert static["output_corrupt"] and static["speedup"] is None and static["moe_ms"] > 0
    assert not rows[0]["output_corrupt"] and rows[0]["speedup"] == 1.0
    out = run(capsys, *args)[1]
    line = next(ln for ln in out.splitlines() if ln.startswith("static") and "%" in ln)
    assert line.split()[-1] == "corrupt"
    assert "corrupt: static (none): ranks disagree" in out
    # the main table says what gpu_imb counts: static's doubled pairs are executed work
    assert static["executed_work"] > 1 and "work: pairs executed over pairs routed" in out


def test_time_columns_show_significant_digits(capsys):
    out = run(capsys, "run", *SMALL, "--policies", "row,ordinal", "--mode", "a2a", "--cost",
              "roofline")[1]
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if "moe_ms" in ln)
    header, rows = lines[at].split(), [ln.split() for ln in lines[at + 1:at + 3]]
    for row in rows:
        cells = dict(zip(header, row))
        assert "," in cells["tokens/s"] or "." not in cells["tokens/s"]  # a whole number
        assert cells["overhead"].endswith("%")
        digits = cells["moe_ms"].replace(".", "").lstrip("0")
        assert len(digits) == 4  # four significant digits, whatever the scale


@pytest.mark.skipif(sys.version_info < (3, 11), reason="aiconfigurator-core needs Python 3.11+")
def test_run_with_the_measured_cost_model_names_its_table(capsys):
    args = ["run", "--scenario", "template", "--steps", "3", "--tokens", "1024", "--layers", "2",
            "--policies", "row,ordinal", "--cost", "measured", "--model", "deepseek-v3",
            "--device-profile", "h200", "--gpus", "32", "--gpus-per-node", "8"]
    code, out, _ = run(capsys, *args)
    assert code == 0 and "moe_ms" in out
    assert "compute: aiconfigurator-core" in out and "trtllm" in out and "EP 32" in out
    code, out, _ = run(capsys, *args, "--json")
    rows = json.loads(out)
    assert all(r["moe_ms"] > 0 and "fp8_block" in r["cost_source"] for r in rows)
    assert_input_error(capsys, *args[:-4], "--gpus", "10", "--gpus-per-node", "5",
                       match="not at 10 GPUs")
    assert_input_error(capsys, *args[:-6], "--model", "olmoe-1b-7b", "--device-profile", "h200",
                       "--gpus", "8", match="has no MoE kernel of H 2048 I 1024 E 64 K 8 "
                       "bfloat16; nearest of its ")


def test_run_baseline_needs_a_cost_model_and_a_listed_policy(capsys):
    assert_input_error(capsys, "run", *SMALL, "--baseline", "row", match="needs --cost")
    assert_input_error(capsys, "run", *SMALL, "--policies", "row", "--cost", "roofline",
                       "--baseline", "static", match="no such row")
    assert_input_error(capsys, "run", *SMALL, "--cost", "guess", match="unknown cost model")


def test_policies_and_solvers_list_the_registries_and_the_readme_holds_them(capsys):
    from eplbsim.cli.registries import markdown_table, policy_rows, solver_rows
    from eplbsim.dispatch import POLICIES
    from eplbsim.solvers import SOLVERS
    code, out, _ = run(capsys, "policies", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == list(POLICIES)
    assert {r["name"]: r["class"] for r in rows}["trtllm"] == "invariant unless --rank-offset"
    code, out, _ = run(capsys, "solvers")
    assert code == 0 and all(name in out for name in SOLVERS)
    guide = (Path(__file__).resolve().parents[2] / "docs/guide/11-policies.md").read_text()
    for table in (policy_rows(), solver_rows()):
        assert markdown_table(table) in guide, "the guide's table is stale: eplbsim ... --markdown"


def test_run_an_a2a_only_policy_beside_others_and_alone(capsys):
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "row,waterfill", "--json")
    rows = json.loads(out)
    assert code == 0 and [(r["policy"], r["mode"]) for r in rows] == [
        ("row", "none"), ("row", "a2a"), ("waterfill", "a2a")]
    assert {r["shared_experts"] for r in rows} == {1}  # every row counts DeepSeek-V3's
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "waterfill")
    assert code == 0 and "shared experts 1 (1 routed pair of work" in out
    code, _, err = run(capsys, "run", *SMALL, "--policies", "waterfill", "--mode", "none")
    assert code == 2 and "runs only in a2a mode" in err


def test_gap_is_shown_only_when_it_differs_from_the_promise(capsys):
    def header(*extra):
        out = run(capsys, "run", *SMALL, "--policies", "row", "--mode", "none", *extra)[1]
        return out.splitlines()[1].split()
    rows = json.loads(run(capsys, "run", *SMALL, "--policies", "row", "--mode", "none",
                          "--json")[1])
    same = f"{rows[0]['placement_gap']:.4f}" == f"{rows[0]['placement_imbalance']:.4f}"
    assert ("gap" in header()) != same
    assert "work" not in header()  # every pair executed once: nothing to say


def test_run_prints_the_dispatch_cap_of_each_redundancy(capsys):
    from eplbsim.cost.buffers import GIB, cap_table
    from eplbsim.cost.catalog import model_shape
    code, out, _ = run(capsys, "run", "--scenario", "skewed", "--steps", "2", "--tokens", "64",
                       "--layers", "2", "--experts", "64", "--policies", "ordinal", "--mode",
                       "a2a", "--gpus", "16", "--dispatch-buffer-gib", "32", "--model",
                       "deepseek-v4-flash")
    assert code == 0
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("dispatch cap of a 32 GiB"))
    assert "hidden 4096, 16 ranks" in lines[at]
    shown = [line.split() for line in lines[at + 2:at + 7]]
    redundants = [int(r[0]) for r in shown]
    assert redundants == [0, 16, 32, 48, 64]  # the run's own (16) among them
    want = cap_table(32 * GIB, model_shape("deepseek-v4-flash").hidden, 64, 16, redundants)
    for row, cap in zip(shown, want):  # the cap falls as the redundant experts grow
        assert int(row[2].replace(",", "")) == cap["cap"]
    assert [r["cap"] for r in want] == sorted((r["cap"] for r in want), reverse=True)
    marked = [r for r in shown if r[-2:] == ["(this", "run)"]]
    table_cap = next(line for line in lines if line.startswith("ordinal")).split()
    assert len(marked) == 1 and marked[0][2].replace(",", "") in [c.replace(",", "")
                                                                  for c in table_cap]
