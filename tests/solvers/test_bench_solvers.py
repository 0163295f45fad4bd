"""benchmarks/bench_solvers.py runs and reports every solver on every case."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_solvers.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_solvers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_solvers_reports_gaps_at_or_above_one(capsys):
    bench = load_script()
    assert bench.main(["--layers", "2", "--repeats", "1", "--time-limit", "0.5",
                       "--solvers", "trivial,deepseek,lpt-hier,exact", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cases = {r["case"] for r in rows}
    assert len(cases) >= 2
    for row in rows:
        if "skipped" in row:
            assert row["solver"] == "exact" and "too large" in row["skipped"]
            continue
        assert row["gap"] >= 1 - 1e-9 and row["seconds"] > 0
        assert row["hier_gap"] >= 1 - 1e-9 or row["groups"] == 1  # global ones may beat it
    grouped = [r for r in rows if r["solver"] == "deepseek" and r["groups"] > 1]
    assert grouped, "deepseek runs hierarchically where the case has groups"
