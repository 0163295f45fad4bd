"""What a notebook shows of the objects a run makes: a short repr (never a dump of tensors), a
comparison that prints as the run command's table, and pandas frames."""

import sys

import pytest
import torch

from eplbsim import RunSpec, compare
from eplbsim.replay.results import flat_row
from eplbsim.traces.request_synth import synthesize_requests
from eplbsim.traces.steps import select
from eplbsim.traces.synth import synthesize
from eplbsim.traces.workload import Workload, batch

LONG = 300  # characters: a repr longer than this is a dump, not a summary


@pytest.fixture(scope="module")
def comparison():
    trace = synthesize("skewed", steps=3, tokens=2048, layers=2, experts=16, top_k=4)
    return trace, compare(trace, ["row", "static"], ["none"],
                          RunSpec.of(gpus=4, rebalance_every=1, window=1))


def test_every_object_of_a_run_has_a_short_repr(comparison):
    trace, results = comparison
    result = results[0]
    requests = synthesize_requests("requests", layers=2, experts=16, top_k=4, seed=0,
                                   num_requests=8)
    objects = [trace, select(trace, "1:"), result, result.counters, result.segments[1],
               result.segments[1].rebalance, result.segments[0].placement,
               requests, requests.requests[0], batch(requests, Workload())]
    for obj in objects:
        text = repr(obj)
        assert len(text) < LONG and "tensor(" not in text and "array(" not in text, text
    assert repr(result).startswith("Results(row, none: 3 steps x 2 layers, P=32; "
                                   "gpu_imbalance ")
    assert repr(trace) == "Trace(3 steps, 6144 tokens, L=2, E=16, K=4)"


def test_a_comparison_prints_as_the_run_table_and_is_still_a_list(comparison):
    _, results = comparison
    assert isinstance(results, list) and len(results) == 2
    lines = repr(results).splitlines()
    assert lines[0].split()[:3] == ["policy", "mode", "gpu_imb"]
    assert [ln.split()[0] for ln in lines[1:3]] == ["row", "static"]
    assert lines[3].startswith("work: pairs executed over pairs routed")  # the run's notes


def test_results_turn_into_pandas_frames(comparison):
    pd = pytest.importorskip("pandas")
    _, results = comparison
    frame = results.to_pandas()
    assert isinstance(frame, pd.DataFrame) and list(frame["policy"]) == ["row", "static"]
    assert list(frame.columns) == list(flat_row(results[0].row()))
    assert frame.loc[1, "gpu_imbalance"] == results[1].metrics["gpu_imbalance"]
    series = results[0].to_pandas(series=True)
    assert list(series["step"]) == [0, 1, 2] and "gpu_imbalance" in series
    assert len(results[0].to_pandas(series=True, per_layer=True)) == 6


def test_the_plot_functions_return_figures_that_save(tmp_path, comparison):
    from matplotlib.figure import Figure

    from eplbsim.plots import policy_comparison
    _, results = comparison
    fig = policy_comparison(results)
    assert isinstance(fig, Figure)
    fig.savefig(tmp_path / "p.png")  # a Figure saves itself; pyplot's savefig saves pyplot's
    assert (tmp_path / "p.png").stat().st_size > 1000



def test_the_header_says_steps_and_layers_as_a_reader_counts_them():
    """Steps of unequal sizes read as a mean, rounded; one layer is "1 layer"; a log of the
    model's layer 8 says so, as `trace info` does."""
    from eplbsim.replay.results import describe
    from eplbsim.traces import Trace
    ids = torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]], [[1, 3]], [[0, 2]], [[2, 1]]])
    ragged = Trace.from_arrays(ids, tokens_per_step=[3, 4], num_experts=4, layers=[8])
    header = describe(ragged, RunSpec.of(gpus=2, redundant=0))
    assert header.startswith("arrays: 2 steps of 3.5 tokens on average, 1 layer (the model's "
                              "8), E=4, K=2 | "), header
    even = Trace.from_arrays(ids[:6], tokens_per_step=[3, 3], num_experts=4)
    assert ": 2 steps x 3 tokens, 1 layer, E=4" in describe(even, RunSpec.of(gpus=2,
                                                                          redundant=0))


def test_the_text_header_names_the_model_the_trace_names_as_json_does(capsys):
    """A log naming its model is priced as it (`--json`'s `model`): the text header says which
    model and why, with or without a cost model; a trace naming none does not name the
    default it would be priced as."""
    from eplbsim.replay import compare
    from eplbsim.replay.results import describe
    from eplbsim.traces import Trace
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(60, generator=g)[:4] for _ in range(8)]).view(8, 1, 4)
    named = Trace.from_arrays(ids, tokens_per_step=[4, 4], num_experts=60,
                              meta={"model": "Qwen/Qwen1.5-MoE-A2.7B-Chat"})
    spec = RunSpec.of(gpus=4, redundant=4)
    rows = compare(named, ["row"], ["none"], spec)
    header = describe(named, rows[0].spec, spec)
    assert rows[0].row()["model"] == "qwen1.5-moe-a2.7b"
    assert ", model qwen1.5-moe-a2.7b (24 MoE layers; the trace holds 1; named by the trace's " \
        "meta: 'Qwen/Qwen1.5-MoE-A2.7B-Chat')" in header, header
    plain = Trace.from_arrays(ids, tokens_per_step=[4, 4], num_experts=60)
    assert "model" not in describe(plain, spec, spec)


def test_policies_that_coincide_on_a_run_are_said_once_under_the_table():
    """Two policies whose rows agree in every metric of a mode read as a bug unless said."""
    from eplbsim.replay.results import table_notes
    metrics = {"gpu_imbalance": 1.25, "rank_agreement": 1.0, "replica_skew_max": 2.0,
               "executed_work": 1.0}
    rows = [{"policy": "row", "mode": "none", **metrics},
            {"policy": "vllm:hash", "mode": "none", "engine": "vllm 0.33.0", **metrics},
            {"policy": "ordinal", "mode": "none", **metrics, "replica_skew_max": 1.01},
            {"policy": "row", "mode": "a2a", **metrics},
            {"policy": "vllm:hash", "mode": "a2a", "engine": "vllm 0.33.0", **metrics}]
    notes = table_notes(rows)
    assert notes == ["vllm:hash (vllm 0.33.0) gives the same numbers as row in every column "
                     "(none, a2a): they choose alike on this trace and placement"]
    assert table_notes(rows[2:4]) == []  # different numbers, or different modes: nothing said


def test_the_header_says_the_engines_rows_read_their_own_replica_lists():
    """`--view` shapes eplbsim's policies' candidates; an engine's dispatch builds its own from
    the placement, and the header says so, rather than "view full" for every row."""
    from eplbsim.replay.results import describe
    trace = synthesize("skewed", steps=2, tokens=16, layers=1)
    spec = RunSpec.of(gpus=4, redundant=4, view="sglang")
    assert ", view sglang, " in describe(trace, spec, policies=["row", "ordinal"])
    assert ", view sglang (the engines' rows: each engine's own replica lists), " in describe(
        trace, spec, policies=["sglang:dynamic", "row"])
    assert ", view: each engine's own replica lists, " in describe(
        trace, spec, policies=["sglang:dynamic", "vllm:hash"])


def _mixtral_shaped(warm_up=False):
    """Four 32-token steps of 8 experts, top-2 (Mixtral-8x7B's shape) over 2 layers; with
    `warm_up`, a profiling pass first (every row routed alike), as a real log's first step."""
    from eplbsim.traces import Trace
    trace = synthesize("skewed", steps=4, tokens=32, layers=2, experts=8, top_k=2)
    steps = [trace.step(s) for s in range(trace.num_steps)]
    if warm_up:
        steps.insert(0, steps[0][:1].expand(32, -1, -1).clone())
    return Trace.from_steps(steps, num_experts=8)


def test_the_python_api_warns_of_what_the_command_line_warns_of(tmp_path, capsys):
    """`replay` and `compare` say what `eplbsim run` prints under its header (a model priced
    that is not the trace's, a warm-up step), as a `RunWarning` at the caller's own line and
    on the results, shown when they are printed; the command line says each once."""
    from eplbsim import replay
    from eplbsim.base.errors import RunWarning
    from eplbsim.cli import main
    from eplbsim.traces.trace import save_trace
    trace = _mixtral_shaped(warm_up=True)
    spec = RunSpec.of(cost="roofline", gpus=4, policy="ordinal", mode="a2a")
    with pytest.warns(RunWarning) as caught:
        result = replay(trace, spec)
    assert {w.filename for w in caught} == {__file__}  # the caller's line, not eplbsim's
    said = [str(w.message) for w in caught]
    assert list(result.warnings) == said and len(said) == 2
    assert "model deepseek-v3 (the default: the trace names no model) has 256 experts, " \
        "top-8; the trace has E=8, K=2: its loads are priced as that model's" in said[0]
    assert said[1].startswith("the trace holds 1 flagged warm-up step (0)")
    with pytest.warns(RunWarning):
        both = compare(trace, ["ordinal", "row"], ["a2a"], spec)
    assert both.warnings == result.warnings and all(r.warnings == both.warnings for r in both)
    for shown in (repr(result), repr(both)):
        assert [f"warning: {w}" in shown for w in said] == [True, True], shown
    path = tmp_path / "mixtral.npz"
    save_trace(trace, path)
    assert main(["run", "--trace", str(path), "--cost", "roofline", "--gpus", "4",
                 "--policies", "ordinal,row", "--mode", "a2a"]) == 0
    out, err = capsys.readouterr()
    spelled = [w.replace('model=NAME', '--model NAME').replace('drop_warmup=True',
                                                                 '--drop-warmup') for w in said]
    assert "; name the model with model=NAME|config.json" in said[0]  # each names the option
    assert said[1].endswith("drop_warmup=True leaves them out")  # as its caller writes it
    assert [ln for ln in out.splitlines() if ln.startswith("warning: ")] == \
        [f"warning: {w}" for w in spelled]
    assert "warning" not in err  # said once, in the header


def test_a_comparison_with_a_cost_model_prints_its_time_table():
    trace = _mixtral_shaped()
    shown = repr(compare(trace, ["ordinal", "row"], ["a2a"],
                         RunSpec.of(cost="roofline", model="mixtral-8x7b", gpus=4)))
    lines = shown.splitlines()
    assert lines[0].split()[:3] == ["policy", "mode", "gpu_imb"]
    at = lines.index(next(ln for ln in lines if ln.startswith("time of the whole model")))
    assert lines[at + 1].split()[:4] == ["policy", "mode", "layer_us", "moe_ms"]
    assert [ln.split()[0] for ln in lines[at + 2:at + 4]] == ["ordinal", "row"]
    assert lines[-1] == "compute: roofline" and "warning" not in shown  # the trace's model


@pytest.mark.parametrize("cost", ["roofline", pytest.param("measured", marks=pytest.mark.skipif(
    sys.version_info < (3, 11), reason="aiconfigurator-core needs Python 3.11 or later"))])
def test_overhead_and_balanced_ms_reconcile_across_a_whole_table(cost):
    """Every row's `imbalance_overhead` is its `moe_ms` over its `moe_ms_balanced`, less 1 (of
    the means, and step by step), and the balanced reference is the step's routed pairs and
    experts spread evenly, whatever the policy, mode or redundant slots: `balanced_ms` less
    `comm_ms` is one number for the whole table, so rows of equal time have equal overhead
    (issue 59: `row` and `ordinal` at 7.58 ms showed +5.5% and +3.6%, `metro` +35%)."""
    trace = _mixtral_shaped()
    spec = RunSpec.of(cost=cost, model="mixtral-8x7b", device_profile="h100-sxm", gpus=8)
    rows = [r for redundant in (0, 8) for r in compare(
        trace, ["row", "ordinal", "metro"], ["none", "a2a"], spec.replace(redundant=redundant))]
    assert len(rows) == 12
    reference = []
    for r in rows:
        m = r.metrics
        assert m["imbalance_overhead"] == pytest.approx(
            m["moe_ms"] / m["moe_ms_balanced"] - 1, rel=1e-12, abs=1e-12)
        series = r.time_series()
        assert series["imbalance_overhead"] == pytest.approx(
            series["moe_ms"] / series["moe_ms_balanced"] - 1, rel=1e-12, abs=1e-12)
        reference.append(m["moe_ms_balanced"] - m["comm_ms"])
    assert max(reference) - min(reference) < 1e-9 * max(reference)
