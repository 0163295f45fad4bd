"""The model a run prices, as the command line gives it (issue 42): `--model config.json`,
`eplbsim models`, a trace whose experts differ from the model priced by default, bad configs."""

import json

import pytest

from eplbsim.cli.registries import model_rows
from eplbsim.cost.catalog import shipped
from eplbsim.cost.shapes import MODELS
from eplbsim.runspec import RunSpec
from eplbsim.traces import save_trace, synthesize

from cli_helpers import assert_input_error, run
from test_configs import QWEN3_30B

TRACE = ["--steps", "2", "--tokens", "64", "--layers", "4", "--policies", "row", "--mode", "none"]


def _qwen3_config(tmp_path):
    """Qwen3-30B-A3B's config.json: aiconfigurator-core's copy when installed, else its
    published values."""
    path = tmp_path / "config.json"
    given = shipped().get("Qwen/Qwen3-30B-A3B")
    path.write_text(given.read_text() if given else json.dumps(QWEN3_30B))
    return path


def test_a_config_json_prices_its_model_and_the_header_says_so(tmp_path, capsys):
    config = _qwen3_config(tmp_path)
    shape = RunSpec().replace(model=str(config)).cost.shape
    assert (shape.moe_layers, shape.hidden, shape.intermediate, shape.experts, shape.top_k) \
        == (48, 2048, 768, 128, 8)
    args = ["run", "--scenario", "skewed", *TRACE, "--experts", "128", "--top-k", "8",
            "--model", config, "--cost", "roofline"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    head = out.splitlines()[0]
    assert f"model {config} (48 MoE layers; the trace holds 4; given)" in head
    assert "warning" not in out  # 128 experts, top-8: as the trace
    timed = json.loads(run(capsys, *args, "--json")[1])[0]
    named = json.loads(run(capsys, *args[:-4], "--model", "qwen3-30b-a3b", "--cost",
                           "roofline", "--json")[1])[0]
    assert timed["moe_ms"] == pytest.approx(named["moe_ms"])  # the same shape as the name's


def test_the_default_model_that_differs_from_the_trace_says_so_in_one_line(tmp_path, capsys):
    trace = synthesize("uniform", steps=2, tokens=64, layers=4, experts=60, top_k=4, seed=0)
    save_trace(trace, tmp_path / "t.npz")
    code, out, err = run(capsys, "run", "--trace", tmp_path / "t.npz", "--policies", "row",
                         "--mode", "none", "--cost", "roofline")
    assert code == 0, err
    lines = [line for line in out.splitlines() if "deepseek-v3" in line]
    assert "E=60, K=4" in lines[0] and "model deepseek-v3 (58 MoE layers; the trace holds 4; " \
        "the default: the trace names no model)" in lines[0]
    assert lines[1] == ("warning: model deepseek-v3 (the default: the trace names no model) "
                        "has 256 experts, top-8; the trace has E=60, K=4: its loads are priced "
                        "as that model's; name the model with --model NAME|config.json")
    assert sum(line.startswith("warning") for line in lines) == 1


def test_an_unknown_model_in_the_meta_is_priced_as_the_default_naming_the_closest(tmp_path,
                                                                                 capsys):
    trace = synthesize("uniform", steps=2, tokens=64, layers=2, experts=256, top_k=8, seed=0)
    trace.meta["served_model_name"] = "Qwen3-30B-A4B"
    save_trace(trace, tmp_path / "t.npz")
    code, out, err = run(capsys, "run", "--trace", tmp_path / "t.npz", "--policies", "row",
                         "--mode", "none", "--cost", "roofline")
    assert code == 0, err
    warning = [line for line in out.splitlines() if line.startswith("warning: model")]
    assert len(warning) == 1 and "the trace names 'Qwen3-30B-A4B', which eplbsim does not " \
        "know (closest: " in warning[0] and "qwen3-30b-a3b" in warning[0]
    assert warning[0].endswith("is priced; name the model with --model NAME|config.json")


@pytest.mark.parametrize("config, words", [
    ({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32},
     "not an MoE model (model_type 'llama'): no routed expert count (n_routed_experts"),
    (dict(QWEN3_30B, num_experts=-8), "num_experts must be an integer >= 1 (routed experts), "
                                      "got -8"),
    (dict(QWEN3_30B, num_experts=None), "no routed expert count (n_routed_experts or "
                                        "num_experts"),
    ("{not json", "not a JSON config")])
def test_a_bad_config_is_one_line_and_status_2(tmp_path, capsys, config, words):
    path = tmp_path / "bad.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    assert_input_error(capsys, "run", "--scenario", "uniform", *TRACE, "--model", path,
                       "--cost", "roofline", match=words)
    assert_input_error(capsys, "run", "--scenario", "uniform", *TRACE, "--model", "mixtral-9x7b",
                       match="unknown model 'mixtral-9x7b' (did you mean ")


def test_models_lists_every_known_model(capsys):
    code, out, _ = run(capsys, "models", "--json")
    rows = json.loads(out)
    assert code == 0 and rows == model_rows()
    assert [r["name"] for r in rows[:len(MODELS)]] == list(MODELS)
    qwen = rows[list(MODELS).index("qwen3-30b-a3b")]
    assert {k: qwen[k] for k in ("experts", "top_k", "moe_layers", "layers", "hidden",
                                 "intermediate", "shared", "dtype")} == dict(
        experts=128, top_k=8, moe_layers=48, layers=48, hidden=2048, intermediate=768,
        shared="0", dtype="bf16")
    if shipped():
        assert "Qwen/Qwen3-30B-A3B" in {r["name"] for r in rows}
        assert "Qwen/Qwen3-8B" not in {r["name"] for r in rows}  # not MoE
    code, out, _ = run(capsys, "models")
    assert code == 0 and out.splitlines()[0].split()[:4] == ["name", "E", "K", "MoE/layers"]
    assert "deepseek-v3" in out and "58/61" in out
    v4 = rows[list(MODELS).index("deepseek-v4-flash")]
    assert (v4["hash_layers"], v4["draft"], v4["moe_layers"]) == (3, "1", 43)
    assert rows[list(MODELS).index("deepseek-v4.1-flash")]["draft"] == "3x128/3"
    code, out, _ = run(capsys, "models", "--markdown")
    assert code == 0 and out.startswith("| name | experts |")
