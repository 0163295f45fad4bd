"""Tests of eplbsim.traces.formats.positional: logs of one record per layer call in execution
order (no step, layer or token key) read as Traces of one step per pass, through `open_trace`
and the command line; and the real Qwen3-30B-A3B vLLM log when ../shared has it.

Dimensions: `S` passes, `T_s` tokens of pass `s`, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError, InputWarning
from eplbsim.traces.formats import open_trace
from eplbsim.traces.formats.positional import read_positional
from eplbsim.traces.steps import flag_steps

from cli_helpers import assert_input_error, run
from id_helpers import distinct

QWEN = Path(__file__).resolve().parents[2] / "traces" / "qwen3-30b-a3b-vllm" / "ep_states.jsonl"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / \
    "qwen3-30b-a3b-vllm-routing" / "ep_states.jsonl"


def _passes(sizes, L=3, K=2, E=8, seed=0):
    rng = np.random.default_rng(seed)
    return [distinct(rng.integers(-1, E, size=(T, L, K))) for T in sizes]  # [T_s, L, K] each


def _records(passes, key="topk_ids"):
    """One record per (pass, layer) in execution order, as a hook after expert selection writes
    them (with the shape of the weights beside the ids, as vLLM's hook does)."""
    return [{"topk_weights": list(ids[:, j].shape), key: ids[:, j].tolist()}
            for ids in passes for j in range(ids.shape[1])]


def _write(path, records, end="\n"):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + end)
    return path


def test_record_n_is_layer_n_mod_L_of_pass_n_div_L(tmp_path):
    passes = _passes([2, 5, 1])
    log = _write(tmp_path / "ep.jsonl", [{"type": "meta", "model": "m", "num_experts": 8}]
                 + _records(passes))
    trace = open_trace(log, layers_per_pass=3, skip_type="meta")
    assert trace.tokens_per_step.tolist() == [2, 5, 1] and trace.num_layers == 3
    assert trace.num_experts == 8 and trace.meta["model"] == "m"
    assert trace.meta["format"] == "positional" and trace.meta["skipped_records"] == 1
    for s, ids in enumerate(passes):
        assert torch.equal(trace.step(s), torch.from_numpy(ids).int())
    # other keys: --ids-key
    keyed = _write(tmp_path / "keyed.jsonl", _records(passes, key="ids"))
    assert torch.equal(read_positional(keyed, layers_per_pass=3, ids_key="ids").topk_ids,
                       trace.topk_ids)
    with pytest.raises(InputError, match=r"keyed\.jsonl:1: missing key\(s\) topk_ids.*ids_key=\.\.\."):
        read_positional(keyed, layers_per_pass=3)


def test_an_incomplete_last_pass_is_dropped_with_one_warning(tmp_path):
    passes = _passes([2, 3, 4])
    log = _write(tmp_path / "cut.jsonl", _records(passes)[:-2])  # pass 2 has 1 of 3 layers
    with pytest.warns(InputWarning) as caught:
        trace = read_positional(log, layers_per_pass=3)
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        f"{log}:7: the last pass (pass 2, from here) has 1 of its 3 layer records (7 records "
        f"are not a multiple of layers_per_pass=3)")
    assert trace.tokens_per_step.tolist() == [2, 3]
    # a last line cut short mid-write loses its record, with its own warning
    lines = [json.dumps(r) for r in _records(passes)]
    torn = _write(tmp_path / "torn.jsonl", lines[:6] + [lines[6][:20]], end="")
    with pytest.warns(InputWarning) as caught:
        trace = read_positional(torn, layers_per_pass=3)
    assert [str(w.message).split(": ")[1] for w in caught] == [
        "the last line is cut short (not valid JSON, no line break at its end), as when the "
        "positional router log's writer is stopped mid-write; its record is left out"]
    assert trace.tokens_per_step.tolist() == [2, 3]


def test_bad_logs_are_named(capsys, tmp_path):
    passes = _passes([2, 3])
    records = _records(passes)
    records[4]["topk_ids"] = records[4]["topk_ids"][:2]  # layer 1 of pass 1: 2 tokens of 3
    log = _write(tmp_path / "bad.jsonl", records)
    with pytest.raises(InputError, match=r"bad\.jsonl:5: layer 1 of pass 1 has 2 tokens, but its "
                                         r"layer 0 \(line 4\) has 3"):
        read_positional(log, layers_per_pass=3)
    with pytest.raises(InputError, match="no complete pass of 9 layer records"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InputWarning)
            read_positional(_write(tmp_path / "short.jsonl", _records(_passes([2, 2]))),
                            layers_per_pass=9)
    with pytest.raises(InputError, match=r"layers_per_pass must be an integer"):
        read_positional(log, layers_per_pass=0)
    # without --layers-per-pass the step-keyed reader says which flag reads it
    assert_input_error(capsys, "trace", "info", log, match="--layers-per-pass L")


def test_trace_info_reads_a_positional_log(capsys, tmp_path):
    log = _write(tmp_path / "ep.jsonl", _records(_passes([2, 5, 1])))
    code, out, _ = run(capsys, "trace", "info", log, "--layers-per-pass", "3")
    assert code == 0 and "steps 3, tokens 8 (per step 1..5, mean 2.7), layers 3" in out


def test_the_qwen3_vllm_log(capsys):
    """The real log shipped in traces/ (the folder, as it is): 32 passes x 48 layers, a
    15-token warm-up, a 1960-token prefill and 30 4-token dummy batches; what remains of it is
    the prefill, chunked as an engine runs it. Its per-layer counts equal a count of the file's
    lines made here."""
    trace = open_trace(QWEN.parent, layers_per_pass=48)
    assert (trace.num_steps, trace.num_layers, trace.num_experts, trace.top_k) == \
        (32, 48, 128, 8)
    lines = [json.loads(line)["topk_ids"] for line in QWEN.read_text().splitlines()]
    counts = np.zeros((48, 128), dtype=np.int64)
    for n, rows in enumerate(lines):
        np.add.at(counts[n % 48], np.array(rows).ravel(), 1)
    assert np.array_equal(trace.counts().sum(0).numpy(), counts)
    assert "left out: LICENSE, README.md" in trace.meta["read_as"]
    assert trace.tokens_per_step[:3].tolist() == [15, 4, 1960]
    flags = flag_steps(trace)
    assert flags == {"warmup": [0], "dummy": [1] + list(range(3, 32)), "outlier": []}
    code, out, _ = run(capsys, "trace", "info", QWEN, "--layers-per-pass", "48",
                       "--drop-dummy", "--drop-warmup", "--max-batched-tokens", "256")
    assert code == 0
    assert "steps 8, tokens 1960 (per step 168..256, mean 245.0), layers 48, experts 128, " \
           "top-k 8" in out


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/data is absent")
def test_the_shipped_qwen3_log_is_the_original_byte_for_byte():
    assert QWEN.read_bytes() == SHARED.read_bytes()


def test_gating_weights_are_kept_when_every_record_has_values(tmp_path):
    """Weights as values (`topk_weights` of the ids' shape) or as a probability per expert
    (`gating_probs`, gathered at the ids) are kept; a logged shape is none; a log where only
    some records have them keeps none, with one warning."""
    passes = _passes([2, 3])
    rng = np.random.default_rng(1)
    weights = [rng.random(ids.shape).astype(np.float32) for ids in passes]
    valued = [dict(r, topk_weights=w[:, j].tolist()) for r, (w, j) in
              zip(_records(passes), [(w, j) for w in weights for j in range(3)])]
    trace = read_positional(_write(tmp_path / "w.jsonl", valued), layers_per_pass=3)
    for s, w in enumerate(weights):
        assert torch.equal(trace.step_weights(s), torch.from_numpy(w))
    probs = []
    for r, ids in zip(_records(passes), [ids[:, j] for ids in passes for j in range(3)]):
        p = rng.random((ids.shape[0], 8))
        probs.append(dict(r, gating_probs=p.tolist(), want=np.where(
            ids >= 0, np.take_along_axis(p, ids.clip(0), 1), 0).tolist()))
    trace = read_positional(_write(tmp_path / "p.jsonl", probs), layers_per_pass=3)
    assert np.allclose(trace.step_weights(0)[:, 1].numpy(), probs[1]["want"])
    assert read_positional(_write(tmp_path / "s.jsonl", _records(passes)),
                           layers_per_pass=3).step_weights(0) is None
    with pytest.warns(InputWarning, match="only 5 of its 6 records hold gating weights"):
        some = read_positional(_write(tmp_path / "some.jsonl", valued[:5] + _records(passes)[5:]),
                               layers_per_pass=3)
    assert some.step_weights(0) is None
    bad = [dict(valued[0], topk_weights=[[-1.0, 0.5]] * 2)] + valued[1:]
    with pytest.raises(InputError, match=r"bad\.jsonl:1: topk_weights holds -1.0; gating"):
        read_positional(_write(tmp_path / "bad.jsonl", bad), layers_per_pass=3)
    odd = [dict(valued[0], topk_weights=[0.5, 0.5, 0.5])] + valued[1:]
    with pytest.raises(InputError, match="one weight per id"):
        read_positional(_write(tmp_path / "odd.jsonl", odd), layers_per_pass=3)
