"""Extending eplbsim in one place each: a metric (one entry in METRICS), a policy with its
properties (one entry in POLICIES) and a mode-independent option (one field in a part) reach
the table, JSON, CSV, time series and sweep rows without touching anything else.

Dimensions: `T` tokens, `K` top-k, `L` layers, `G` GPUs.
"""

import csv
import json
from dataclasses import dataclass

from eplbsim import runspec
from eplbsim.dispatch import POLICIES, DispatchPolicy, candidate_counts, replica_slots
from eplbsim.metrics import METRICS, Metric, peak
from eplbsim.replay import compare
from eplbsim.replay.results import format_table
from eplbsim.replay.sweep import cell_row, parse_spec
from eplbsim.runspec import DispatchPart, Integer, RunSpec, knob
from eplbsim.traces import synthesize

from cli_helpers import run

SMALL = ["--steps", "3", "--tokens", "48", "--layers", "2", "--experts", "16", "--top-k", "4",
         "--gpus", "4", "--gpus-per-node", "2", "--redundant", "8"]
SWEEP = {"fixed": {"scenario": "skewed", "steps": 3, "tokens": 48, "layers": 2, "experts": 16,
                   "top_k": 4, "gpus": 4, "gpus_per_node": 2, "redundant": 8}}


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_metric_in_one_entry(monkeypatch, capsys, tmp_path):
    """The busiest GPU's pairs: one function (its components) and one entry."""
    monkeypatch.setitem(METRICS, "busiest_gpu_pairs", Metric(
        "busiest", lambda chunk: (chunk.gpu_load.amax(-1),), peak, needs="executed"))
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "row", "--mode", "none",
                       "--out", tmp_path)
    assert code == 0 and "busiest" in out.splitlines()[1].split()
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "row", "--mode", "none", "--json")
    (row,) = json.loads(out)
    assert row["busiest_gpu_pairs"] > 0 and list(row)[-1] == "busiest_gpu_pairs"
    (saved,) = _csv(tmp_path / "results.csv")
    assert float(saved["busiest_gpu_pairs"]) == row["busiest_gpu_pairs"]
    series = _csv(tmp_path / "timeseries.csv")
    assert max(float(r["busiest_gpu_pairs"]) for r in series) == row["busiest_gpu_pairs"]
    (cell,) = parse_spec({**SWEEP, "grid": {"policy": ["row"]}}, tmp_path)
    assert cell_row(cell)["busiest_gpu_pairs"] == row["busiest_gpu_pairs"]


def _last_replica(topk_ids, view, ctx):
    """Every pair to its expert's last replica: rank-invariant, and badly balanced."""
    n = candidate_counts(topk_ids, view, ctx.layer)
    return replica_slots(topk_ids, view, ctx.layer, n - 1)


def test_a_policy_with_its_properties_in_one_entry(monkeypatch, capsys, tmp_path):
    calls = []

    def counted(topk_ids, view, ctx):
        calls.append(ctx.rank)
        return _last_replica(topk_ids, view, ctx)

    monkeypatch.setitem(POLICIES, "last", DispatchPolicy(
        counted, rank_invariant=True, source="a test", summary="the last replica"))
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "last,ordinal", "--mode", "none",
                       "--out", tmp_path)
    assert code == 0 and [ln.split()[0] for ln in out.splitlines()[2:4]] == ["last", "ordinal"]
    # rank-invariant: the four ranks share one computation per layer and step, and agree
    assert len(calls) == 3 * 2 and set(calls) == {0}
    rows = json.loads((tmp_path / "results.json").read_text())
    assert rows[0]["policy"] == "last" and rows[0]["rank_agreement"] == 1.0
    assert rows[0]["replica_skew_mean"] > rows[1]["replica_skew_mean"]
    assert _csv(tmp_path / "results.csv")[0]["policy"] == "last"
    (cell,) = parse_spec({**SWEEP, "grid": {"policy": ["last"]}}, tmp_path)
    assert cell_row(cell)["policy"] == "last"
    calls.clear()
    monkeypatch.setitem(POLICIES, "last", DispatchPolicy(counted))  # no claim: never shared
    run(capsys, "run", *SMALL, "--policies", "last", "--mode", "none", "--json")
    assert sorted(set(calls)) == [0, 1, 2, 3]


@dataclass(frozen=True)
class TaggedDispatch(DispatchPart):
    """The dispatch part with one more field: a trial number every row carries."""

    trial: int = knob(0, "a trial number carried into every row", Integer(0))


def test_an_option_in_one_field(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(runspec.PARTS, "dispatch", TaggedDispatch)
    code, out, _ = run(capsys, "run", *SMALL, "--policies", "row", "--trial", "7", "--json")
    rows = json.loads(out)
    assert code == 0 and {r["trial"] for r in rows} == {7} and {r["mode"] for r in rows} == {
        "none", "a2a"}
    code, _, _ = run(capsys, "run", *SMALL, "--policies", "row", "--mode", "a2a", "--trial",
                     "7", "--out", tmp_path)
    assert code == 0 and _csv(tmp_path / "results.csv")[0]["trial"] == "7"
    cells = parse_spec({**SWEEP, "grid": {"trial": [1, 2]}}, tmp_path)
    assert [cell_row(c)["trial"] for c in cells] == [1, 2] and cells[0].id != cells[1].id
    trace = synthesize("skewed", steps=2, tokens=48, layers=2, experts=16, top_k=4)
    base = RunSpec.of(gpus=4, redundant=8, policy="row")
    rows = [r.row() for t in (1, 2) for r in compare(trace, ["row"], ["none"],
                                                    base.replace(trial=t))]
    assert format_table(rows).splitlines()[0].split()[:3] == ["policy", "mode", "trial"]
    code, _, err = run(capsys, "run", *SMALL, "--trial", "-1")
    assert code == 2 and "--trial: must be an integer >= 0, got -1" in err
