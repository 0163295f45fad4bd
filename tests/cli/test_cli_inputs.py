"""What `run` makes of the inputs a newcomer brings: a real per-token log with a warm-up pass,
a placement file, a model whose experts do not divide over the GPUs, a migration priced in the
model's bytes."""

import json

import numpy as np
import pytest

from eplbsim.cost import MODELS
from eplbsim.traces.steps import SHAPING

from cli_helpers import assert_input_error, run

L, K, E = 2, 4, 16


def _log(path, warm_rows=64, steps=6, tokens=8, seed=0):
    """A per-token router log as vLLM-style serving writes one: a header record of type
    "meta", a start-up profiling pass of `warm_rows` identical rows, then `steps` steps of
    `tokens` routed tokens (token indices restart at each step)."""
    rng = np.random.default_rng(seed)
    records = [{"type": "meta", "model": "toy", "num_layers": L}]
    warm = rng.permutation(E)[:K].tolist()
    records += [{"token_idx": t, "layer": j, "topk_ids": warm}
                for t in range(warm_rows) for j in range(L)]
    for _ in range(steps):
        records += [{"token_idx": t, "layer": j,
                     "topk_ids": rng.choice(E, K, replace=False).tolist()}
                    for t in range(tokens) for j in range(L)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_per_token_log_runs_in_one_command_without_its_warm_up(capsys, tmp_path):
    log = _log(tmp_path / "moe_routes.jsonl")
    args = ["run", "--trace", log, "--skip-type", "meta", "--token-key", "token_idx",
            "--ids-key", "topk_ids", "--gpus", "4", "--policies", "row", "--mode", "none"]
    code, out, err = run(capsys, *args, "--drop-warmup")
    assert code == 0, err
    assert "6 steps x 8 tokens (steps: 6 of 7 (1 warm-up dropped))" in out
    with_warmup = json.loads(run(capsys, *args, "--json")[1])[0]
    without = json.loads(run(capsys, *args, "--drop-warmup", "--json")[1])[0]
    assert with_warmup["placement_imbalance"] != without["placement_imbalance"]
    # the same steps chosen by number give the same numbers; the rows say how they were chosen
    chosen = json.loads(run(capsys, *args, "--select-steps", "1:", "--json")[1])[0]
    assert (chosen["select_steps"], chosen["drop_warmup"], without["drop_warmup"]) == \
        ("1:", False, True)
    assert {k: v for k, v in chosen.items() if k not in SHAPING} == \
        {k: v for k, v in without.items() if k not in SHAPING}
    # its header is recognised as one without a flag, and no key needs naming either
    bare = json.loads(run(capsys, "run", "--trace", log, "--gpus", "4", "--policies", "row",
                          "--mode", "none", "--json")[1])[0]
    assert bare == with_warmup


def test_trace_info_flags_warm_up_and_outlier_steps(capsys, tmp_path):
    log = _log(tmp_path / "moe_routes.jsonl", warm_rows=100)
    code, out, _ = run(capsys, "trace", "info", log, "--skip-type", "meta")
    assert code == 0
    assert "flagged warm-up (every row routed alike, or start-up steps before the first dummy): " \
           "1 step (0), 100 tokens; --drop-warmup leaves them out" in out
    assert "flagged size outliers (over 8x the median 8 tokens): 1 step (0)" in out
    code, out, _ = run(capsys, "trace", "info", log, "--skip-type", "meta", "--drop-warmup")
    flagged = {line.split(":")[0].strip(): line.rsplit("; ", 1)[1]
               for line in out.splitlines() if line.strip().startswith("flagged")}
    assert code == 0 and flagged == {  # the lines name the whole trace's flagged steps
        "flagged warm-up (every row routed alike, or start-up steps before the first dummy)":
            "--drop-warmup left them out",
        "flagged size outliers (over 8x the median 8 tokens)": "--drop-outliers leaves them out"}
    info = json.loads(run(capsys, "trace", "info", log, "--skip-type", "meta", "--json")[1])
    assert info["flagged"] == {"warmup": [0], "dummy": [], "outlier": [0]} \
        and info["steps"] == 7
    info = json.loads(run(capsys, "trace", "info", log, "--skip-type", "meta", "--json",
                          "--drop-outliers")[1])
    assert info["steps"] == 6 and info["tokens"] == 48
    assert_input_error(capsys, "trace", "info", log, "--skip-type", "meta", "--select-steps",
                       "9", match="step 9 is outside the trace's 7 steps")


def test_every_reading_command_takes_the_reading_flags(capsys, tmp_path):
    log = _log(tmp_path / "moe_routes.jsonl")
    reading = ["--skip-type", "meta", "--drop-warmup"]
    out = tmp_path / "t.npz"
    code, text, _ = run(capsys, "trace", "convert", log, "--out", out, *reading)
    assert code == 0 and "6 steps, 48 tokens" in text
    code, text, _ = run(capsys, "trace", "info", out)
    assert code == 0 and "steps 6, tokens 48" in text
    code, text, _ = run(capsys, "solve", "--counts", log, *reading, "--gpus", "4", "--json")
    assert code == 0 and len(json.loads(text)["phy2log"]) == L
    assert run(capsys, "export", "--format", "sglang", "--counts", log, *reading,
               "--num-model-layers", "3", "--out", tmp_path / "e.json")[0] == 0


def test_a_placement_file_decides_the_slots_and_the_rows_say_so(capsys, tmp_path):
    code, out, _ = run(capsys, "solve", "--load", _json(tmp_path / "load.json", [
        [float(e + 1) for e in range(E)]] * L), "--redundant", "3", "--gpus", "1", "--json")
    assert code == 0
    phy2log = json.loads(out)["phy2log"]  # 19 slots: they divide over 1 GPU only
    placement = _json(tmp_path / "p.json", {"phy2log": phy2log})
    small = ["--scenario", "uniform", "--steps", "2", "--tokens", "32", "--layers", str(L),
             "--experts", str(E), "--top-k", str(K), "--gpus", "1", "--policies", "row",
             "--mode", "none"]
    code, out, err = run(capsys, "run", *small, "--placement", placement)
    assert code == 0, err
    assert "P=19 slots (redundant 3: the placement file's), placement " in out
    assert "solver deepseek" not in out
    row = json.loads(run(capsys, "run", *small, "--placement", placement, "--json")[1])[0]
    assert row["redundant"] == 3 and row["placement"] == str(placement)
    # nothing was solved: the decomposition into solver and prediction is left out
    assert row["factor_solver"] is None and row["factor_prediction"] is None
    assert row["factor_dispatch"] is not None
    assert_input_error(capsys, "run", *small, "--placement", placement, "--redundant", "4",
                       match="has 19 slots for 16 experts (redundant 3), but redundant is 4")


def test_the_default_redundancy_fits_any_model(capsys):
    small = ["--scenario", "uniform", "--steps", "2", "--tokens", "64", "--layers", "1",
             "--experts", "60", "--top-k", "4", "--policies", "row", "--mode", "a2a"]
    code, out, err = run(capsys, "run", *small, "--gpus", "32")
    assert code == 0, err
    assert "32 GPUs (8/node), P=96 slots (redundant 36: the default 32, one a GPU and at least " \
           "16, rounded up so 32 GPUs divide the 96 slots)" in out
    assert_input_error(capsys, "run", *small, "--gpus", "32", "--redundant", "32",
                       match="60 experts + 32 redundant = 92 slots do not divide over 32 GPUs; "
                             "redundant 4 or 36 would")


def test_migrations_are_priced_in_the_models_expert_bytes_or_the_given_ones(capsys):
    base = ["run", "--scenario", "drift", "--steps", "12", "--tokens", "256", "--layers", "2",
            "--experts", str(E), "--top-k", str(K), "--gpus", "4", "--policies", "row",
            "--mode", "a2a", "--rebalance-every", "4", "--cost", "roofline", "--json"]
    model = MODELS["mixtral-8x7b"]
    own = json.loads(run(capsys, *base, "--model", "mixtral-8x7b")[1])[0]
    given = json.loads(run(capsys, *base, "--model", "mixtral-8x7b", "--expert-bytes",
                           "1000")[1])[0]
    assert own["moved_slots"] > 0 and own["rebalance_stall_ms"] > 0
    scale = model.moe_layers / 2  # the whole model's bytes: its layers, the trace's 2
    assert own["moved_bytes"] == round(own["moved_slots"] * model.expert_weight_bytes * scale)
    assert given["moved_bytes"] == round(given["moved_slots"] * 1000 * scale)
    # the stall moves the same slots over the same links: it scales with the bytes
    assert given["rebalance_stall_ms"] == pytest.approx(
        own["rebalance_stall_ms"] * 1000 / model.expert_weight_bytes)


def test_a_shared_expert_policy_says_why_every_row_counts_the_shared_expert(capsys):
    code, out, _ = run(capsys, "run", "--scenario", "uniform", "--steps", "2", "--tokens", "64",
                       "--policies", "row,waterfill", "--mode", "a2a")
    assert code == 0
    assert "model deepseek-v3 (58 MoE layers; the trace holds 4; the default: the trace " \
           "names no model), shared experts 1 (1 " \
           "routed pair of work a token and layer: waterfill places them, so every row counts " \
           "them)" in out.splitlines()[0]


def _json(path, obj):
    path.write_text(json.dumps(obj))
    return path


def test_out_never_writes_over_a_request_file(capsys, tmp_path):
    rng = np.random.default_rng(0)
    rows = [[rng.choice(E, K, replace=False).tolist() for _ in range(L)] for _ in range(6)]
    response = {"id": "r", "object": "chat.completion", "model": "m",
                "prompt_routed_experts": rows[:4],
                "choices": [{"index": 0, "routed_experts": rows[4:]}]}
    requests = _json(tmp_path / "results.json", response)  # a name run --out writes
    before = requests.read_bytes()
    assert_input_error(capsys, "run", "--requests", requests, "--gpus", "2", "--policies",
                       "row", "--out", tmp_path, match="results.json")
    assert requests.read_bytes() == before
