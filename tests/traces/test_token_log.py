"""Tests of eplbsim.traces.formats.token_log: per-token router logs in both forms read as
Traces (steps from a key or from token-index restarts) and RequestSets, a header record skipped,
and every malformed record named as `file:line`.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError, InputWarning
from eplbsim.traces.formats.jsonl import write_jsonl
from eplbsim.traces.formats.token_log import (is_token_log, read_token_requests,
                                               read_token_trace)
from eplbsim.traces.requests import RequestSet
from eplbsim.traces.trace import Trace

from cli_helpers import run
from id_helpers import distinct


def _ids(T, L=3, K=2, E=8, seed=0):
    return distinct(np.random.default_rng(seed).integers(-1, E, size=(T, L, K)))


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def _per_layer(ids, layer_ids, **extra):
    """Records of one (token, layer) each, token after token, layers in reverse order."""
    return [{**extra, "token_idx": t, "layer": layer_ids[j], "topk_ids": ids[t, j].tolist()}
            for t in range(ids.shape[0]) for j in reversed(range(ids.shape[1]))]


def test_header_and_token_index_restarts(tmp_path):
    steps = [_ids(3, seed=1), _ids(1, seed=2), _ids(1, seed=3), _ids(4, seed=4)]
    records = [{"type": "header", "model": "m", "num_layers": 3}]
    for ids in steps:  # one-token steps follow each other: token 0 again starts a step
        records += _per_layer(ids, [1, 3, 5], type="route")
    log = _write(tmp_path / "log.jsonl", records)
    tr = read_token_trace(log, skip_type="header", experts=8)
    assert isinstance(tr, Trace) and tr.num_experts == 8
    assert tr.tokens_per_step.tolist() == [3, 1, 1, 4]
    for s, ids in enumerate(steps):
        assert torch.equal(tr.step(s), torch.from_numpy(ids).int())
    assert tr.meta["model_layers"] == [1, 3, 5] and tr.meta["skipped_records"] == 1
    assert tr.meta["steps_from"] == "token-index restarts"
    with pytest.raises(InputError, match=r"log\.jsonl:1: missing key\(s\) token_idx, topk_ids; "
                                         r"this record has type, model, num_layers: name the "
                                         r"log's keys with token_key=\.\.\..* or skip records "
                                         r"of another kind with skip_type=\"header\"$"):
        read_token_trace(log)


def test_a_skipped_header_names_the_model_and_the_experts(tmp_path):
    ids = _ids(4, E=5)
    records = [{"type": "meta", "model": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "num_experts": 60},
               *_per_layer(ids, [0, 1, 2], type="route")]
    tr = read_token_trace(_write(tmp_path / "log.jsonl", records), skip_type="meta")
    assert tr.meta["model"] == "Qwen/Qwen1.5-MoE-A2.7B-Chat" and tr.num_experts == 60
    assert read_token_trace(tmp_path / "log.jsonl", skip_type="meta", experts=8).num_experts == 8
    records = [*_per_layer(ids, [0, 1, 2]), {"type": "meta", "num_experts": 3}]
    with pytest.raises(InputError, match=r"log\.jsonl:13: num_experts 3, but an earlier record "
                                         r"routes to expert 4"):
        read_token_trace(_write(tmp_path / "log.jsonl", records), skip_type="meta")


def test_restart_on_any_decrease(tmp_path):
    a, b = _ids(2, L=1, seed=5), _ids(2, L=1, seed=6)
    log = _write(tmp_path / "log.jsonl", [
        {"token_idx": 5 + t, "layer": 0, "topk_ids": a[t, 0].tolist()} for t in range(2)] + [
        {"token_idx": 2 + t, "layer": 0, "topk_ids": b[t, 0].tolist()} for t in range(2)])
    tr = read_token_trace(log)
    assert tr.tokens_per_step.tolist() == [2, 2]
    assert tr.num_experts == int(max(a.max(), b.max())) + 1  # largest id + 1
    assert torch.equal(tr.step(1), torch.from_numpy(b).int())


def test_every_layer_form_with_step_key_in_any_order(tmp_path):
    steps = {9: _ids(2, seed=7), 5: _ids(3, seed=8)}
    records = [{"s": s, "tok": t, "ids": ids[t].tolist()}
               for s, ids in steps.items() for t in range(ids.shape[0])]
    records = records[::-1]
    log = _write(tmp_path / "log.jsonl", [records[0], "", *records[1:]])
    tr = read_token_trace(log, step_key="s", token_key="tok", ids_key="ids", experts=8)
    assert tr.tokens_per_step.tolist() == [3, 2]
    assert torch.equal(tr.step(0), torch.from_numpy(steps[5]).int())
    assert torch.equal(tr.step(1), torch.from_numpy(steps[9]).int())
    assert tr.meta["first_step"] == 5 and tr.meta["last_step"] == 9
    assert "model_layers" not in tr.meta


def test_requests_in_first_appearance_order(tmp_path):
    reqs = {"b": _ids(4, seed=9), 7: _ids(2, seed=10)}
    records = [{"request_id": r, "token_idx": t, "layer": j, "topk_ids": ids[t, j].tolist(),
                "prompt_len": 3 if r == "b" else 1}
               for r, ids in reqs.items() for t in range(ids.shape[0]) for j in range(3)]
    rng = np.random.default_rng(0)
    records = [records[0]] + [records[i] for i in rng.permutation(len(records) - 1) + 1]
    for rec in records[1:]:  # one record of each request suffices
        if rec["request_id"] == 7 and rec["token_idx"] == 1:
            del rec["prompt_len"]
    log = _write(tmp_path / "req.jsonl", records)
    rs = read_token_requests(log, prompt_len_key="prompt_len", experts=8)
    assert isinstance(rs, RequestSet) and rs.num_experts == 8
    assert [r.id for r in rs.requests] == ["b", "7"]
    assert [r.prompt_len for r in rs.requests] == [3, 1]
    assert all(r.arrival is None for r in rs.requests)
    for r, ids in zip(rs.requests, reqs.values()):
        assert np.array_equal(r.ids, ids)
    plain = read_token_requests(log, experts=8)
    assert [r.prompt_len for r in plain.requests] == [4, 2]  # every token counts as prompt
    assert plain.meta["model_layers"] == [0, 1, 2]


def test_detection_tells_token_logs_from_step_logs(tmp_path):
    ids = _ids(2)
    assert is_token_log(_write(tmp_path / "a.jsonl", [{"type": "h"}] + _per_layer(ids, [0, 1, 2])))
    assert is_token_log(_write(tmp_path / "b.jsonl", [{"tok": 0, "topk_ids": [1, 2]}]))
    tr = Trace(ids, [0, 2], 8)
    write_jsonl(tr, tmp_path / "steps.jsonl")
    assert not is_token_log(tmp_path / "steps.jsonl")
    assert not is_token_log(_write(tmp_path / "bad.jsonl", ["{oops"]))
    assert not is_token_log(tmp_path / "none.jsonl")
    assert not is_token_log(_write(tmp_path / "a.json", _per_layer(ids, [0, 1, 2])))


def test_empty_missing_and_binary_logs(tmp_path):
    log = _write(tmp_path / "e.jsonl", ["", {"type": "header"}])
    with pytest.raises(InputError, match=r"no token records \(1 of type 'header' skipped\)"):
        read_token_trace(log, skip_type="header")
    with pytest.raises(InputError, match="experts must be"):
        read_token_requests(log, experts=0)
    with pytest.raises(InputError, match="no such file"):
        read_token_trace(tmp_path / "none.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InputError, match="bin.jsonl: not UTF-8"):
        read_token_trace(tmp_path / "bin.jsonl")


def test_a_torn_last_line_loses_its_record_with_one_warning(tmp_path, capsys):
    """An engine stopped mid-write leaves a last line cut short: that record is left out with
    a warning naming file:line; a line cut short anywhere else is an error."""
    ids = _ids(3)
    whole = _write(tmp_path / "whole.jsonl", _per_layer(ids, [0, 1, 2]))
    torn = tmp_path / "torn.jsonl"
    cut = json.dumps(_tok(3, 0, [1, 2]))[:-5]
    torn.write_text(whole.read_text() + cut)
    with pytest.warns(InputWarning, match=r"torn\.jsonl:10: the last line is cut short"):
        read = read_token_trace(torn)
    assert torch.equal(read.topk_ids, read_token_trace(whole).topk_ids)
    for text in (whole.read_text() + cut + "\n",  # a line break after it: not torn
                 cut + "\n" + whole.read_text()):  # not the last line
        torn.write_text(text)
        with pytest.raises(InputError, match="not valid JSON"):
            read_token_trace(torn)
    torn.write_text(whole.read_text() + cut)
    code, out, err = run(capsys, "trace", "info", torn)
    assert code == 0 and "tokens 3" in out, err
    assert err.splitlines() == [f"eplbsim: warning: {torn}:10: the last line is cut short (not "
                                f"valid JSON, no line break at its end), as when the router "
                                f"log's writer is stopped mid-write; its record is left out"]


def _tok(t, layer, ids, **extra):
    return {"token_idx": t, "layer": layer, "topk_ids": ids, **extra}


REQ = {"request_key": "r", "prompt_len_key": "p"}


@pytest.mark.parametrize("records, options, line, words", [
    ([_tok(0, 0, [1, 2]), "{oops"], {}, 2, "not valid JSON"),
    ([[1, 2]], {}, 1, "JSON object"),
    ([{"layer": 0, "topk_ids": [1, 2]}], {}, 1, "missing key(s) token_idx"),
    ([{"token_idx": 0, "topk_ids": [1, 2]}], {}, 1, "missing key(s) layer"),
    ([{"type": "x", "token_idx": 0}], {"skip_type": "header"}, 1, "missing key(s) topk_ids"),
    ([_tok(-1, 0, [1, 2])], {}, 1, "token_idx must be an integer"),
    ([_tok("0", 0, [1, 2])], {}, 1, "token_idx must be an integer"),
    ([_tok(0, 1.0, [1, 2])], {}, 1, "layer must be an integer"),
    ([_tok(0, 0, [])], {}, 1, "non-empty list"),
    ([_tok(0, 0, 3)], {}, 1, "non-empty list"),
    ([_tok(0, 0, [1, 2.5])], {}, 1, "integer ids"),
    ([_tok(0, 0, [1, True])], {}, 1, "integer ids"),
    ([_tok(0, 0, [1, 8])], {"experts": 8}, 1, "expert id 8 outside [-1, 8)"),
    ([_tok(0, 0, [-2, 1])], {}, 1, "expert id -2"),
    ([_tok(0, 0, [3, 3])], {}, 1, "chooses expert 3 twice"),
    ([_tok(0, 0, [1, 2]), _tok(0, 1, [1, 2, 3])], {}, 2, "rows of 3 ids, earlier rows have 2"),
    ([_tok(0, 0, [1, 2]), _tok(1, 0, [1, 2]), _tok(1, 0, [2, 3])], {}, 3,
     "layer 0 of token 1 of step 0 appears twice"),
    ([_tok(0, 0, [1, 2]), _tok(0, 1, [1, 2]), _tok(1, 0, [1, 2])], {}, 3,
     "token 1 of step 0 (first record here) lacks layer(s) [1]"),
    ([_tok(0, 0, [1, 2]), {"token_idx": 1, "topk_ids": [[1, 2]]}], {}, 2,
     "earlier records hold one layer each"),
    ([{"token_idx": 0, "topk_ids": [[1, 2]]}, _tok(1, 0, [1, 2])], {}, 2,
     "earlier records hold every layer each"),
    ([{"token_idx": 0, "topk_ids": [[1, 2], [3, 4]], "layer": 0}], {}, 1,
     "also names layer 0"),
    ([{"token_idx": 0, "topk_ids": [[1, 2], [3]]}], {}, 1, "ragged topk_ids"),
    ([{"token_idx": 0, "topk_ids": [[]]}], {}, 1, "holds no ids"),
    ([{"token_idx": 0, "topk_ids": [[1, 2], 3]}], {}, 1, "list of rows"),
    ([{"token_idx": 0, "topk_ids": [[1, 2]]}, {"token_idx": 1, "topk_ids": [[1, 2], [1, 2]]}],
     {}, 2, "2 layers, earlier records hold 1"),
    ([{"token_idx": 3, "topk_ids": [[1, 2]]}, {"token_idx": 3, "topk_ids": [[1, 2]]}], {}, 2,
     "token 3 of step 0 appears twice"),
    ([_tok(0, 0, [1, 2], s=-3)], {"step_key": "s"}, 1, "s must be an integer"),
    ([_tok(0, 0, [1, 2])], {"step_key": "s"}, 1, "missing key(s) s"),
    ([_tok(0, 0, [1, 2], s=4), _tok(1, 0, [1, 2], s=2), _tok(0, 0, [1, 2], s=4)],
     {"step_key": "s"}, 3, "layer 0 of token 0 of step 4 appears twice"),
    ([_tok(0, 0, [1, 2], r=[1])], REQ, 1, "r must be a string or an integer"),
    ([_tok(0, 0, [1, 2], r="a", p=1), _tok(1, 0, [1, 2], r="a", p=2)], REQ, 2,
     "p 2, but line 1 gives 1 for request 'a'"),
    ([_tok(0, 0, [1, 2], r="a", p=1), _tok(0, 0, [1, 2], r="b")], REQ, 2,
     "request 'b' (first record here) has no p"),
    ([_tok(0, 0, [1, 2], r="a"), _tok(1, 0, [1, 2], r="a", p=3)], REQ, 2,
     "prompt length 3 exceeds the 2 tokens of request 'a'"),
    ([_tok(0, 0, [1, 2], r="a", p=-1)], REQ, 1, "p must be an integer"),
])
def test_bad_records_name_file_and_line(tmp_path, records, options, line, words):
    log = _write(tmp_path / "bad.jsonl", records)
    read = read_token_requests if "request_key" in options else read_token_trace
    with pytest.raises(InputError) as err:
        read(log, **options)
    assert f"bad.jsonl:{line}: " in str(err.value)
    assert words in str(err.value)


def _layer_major(steps, layer_ids, **extra):
    """Records of one (token, layer) each, step after step, layer after layer (all tokens of a
    layer, ascending, then the next layer): how a hook per layer writes a step."""
    return [{**extra, "token_idx": t, "layer": layer_ids[j], "topk_ids": ids[t, j].tolist()}
            for ids in steps for j in range(ids.shape[1]) for t in range(ids.shape[0])]


def test_a_layer_major_log_reads_as_its_token_major_writing(tmp_path):
    steps = [_ids(3, seed=11), _ids(1, seed=12), _ids(1, seed=13), _ids(4, seed=14)]
    token_major = [r for ids in steps for r in _per_layer(ids, [0, 2, 4])]
    a = read_token_trace(_write(tmp_path / "t.jsonl", token_major), experts=8)
    b = read_token_trace(_write(tmp_path / "l.jsonl", _layer_major(steps, [0, 2, 4])),
                         experts=8)
    assert b.tokens_per_step.tolist() == [3, 1, 1, 4]
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.counts(), b.counts())
    assert b.meta["model_layers"] == [0, 2, 4]
    # with a step key the order never mattered
    keyed = [{**r, "s": s} for s, ids in enumerate(steps) for r in _layer_major([ids], [0, 2, 4])]
    c = read_token_trace(_write(tmp_path / "k.jsonl", keyed[::-1]), step_key="s", experts=8)
    assert torch.equal(c.topk_ids, a.topk_ids)


def test_tokens_missing_from_some_layers(capsys, tmp_path):
    steps = [_ids(3, seed=21), _ids(4, seed=22)]
    records = _layer_major(steps, [0, 1, 2])
    gone = [(0, 1, 2), (1, 3, 1), (1, 3, 2)]  # (step, token, layer) never written
    starts = np.cumsum([0] + [ids.shape[0] * 3 for ids in steps])
    drop = {int(starts[s]) + layer * steps[s].shape[0] + t for s, t, layer in gone}
    log = _write(tmp_path / "ragged.jsonl", [r for i, r in enumerate(records) if i not in drop])
    # [ step 0: 3 tokens x 3 layers less one record | step 1: 4 tokens x 3 layers less two ]
    with pytest.raises(InputError) as err:
        read_token_trace(log)
    assert str(err.value) == (f"{log}:2: token 1 of step 0 (first record here) lacks layer(s) "
                              f"[2]; 2 of the log's 7 tokens lack some layer (in 2 steps): "
                              f"incomplete=\"drop\" leaves them out")
    with pytest.warns(InputWarning) as caught:
        trace = read_token_trace(log, incomplete="drop")
    assert [str(w.message) for w in caught] == [
        f"{log}: 2 of the log's 7 tokens lack some layer (in 2 steps); incomplete=\"drop\" left "
        f"them out"]
    assert trace.tokens_per_step.tolist() == [2, 3]
    assert torch.equal(trace.step(0), torch.from_numpy(steps[0][[0, 2]]).int())
    assert torch.equal(trace.step(1), torch.from_numpy(steps[1][:3]).int())
    assert int(trace.counts().sum()) == int((steps[0][[0, 2]] >= 0).sum()
                                            + (steps[1][:3] >= 0).sum())
    code, out, err = run(capsys, "trace", "info", log, "--incomplete", "drop", "--json")
    assert code == 0 and json.loads(out)["tokens"] == 5
    assert "2 of the log's 7 tokens lack some layer" in err
    with pytest.raises(InputError, match="incomplete must be one of error, drop"):
        read_token_trace(log, incomplete="keep")
    # a request log drops them the same way, with the same one warning, by requests
    kept = [r for i, r in enumerate(records) if i not in drop]
    requests = [{**r, "request_id": "ab"[int(i >= 8)]} for i, r in enumerate(kept)]
    req = _write(tmp_path / "req.jsonl", requests)
    with pytest.raises(InputError, match=r"lack some layer \(in 2 requests\): incomplete="
                       r"\"drop\" leaves them out$"):
        read_token_requests(req)
    with pytest.warns(InputWarning, match=r"2 of the log's 7 tokens lack some layer \(in 2 "
                      r"requests\); incomplete=\"drop\" left them out"):
        got = read_token_requests(req, incomplete="drop")
    assert [r.ids.shape[0] for r in got.requests] == [2, 3]
    assert [r.prompt_len for r in got.requests] == [2, 3]  # every token kept counts as prompt
    code, out, err = run(capsys, "trace", "info", req, "--request-key", "request_id",
                         "--incomplete", "drop", "--json")
    assert code == 0 and json.loads(out)["requests"] == 2
    assert "2 of the log's 7 tokens lack some layer (in 2 requests)" in err


def test_gating_weights_follow_their_tokens_in_either_form(tmp_path):
    """Per-layer records with `topk_weights`, written layer by layer, and every-layer records
    with `gating_probs` over the experts give the same weights, in token order; the toy MoE
    of a replay then weighs by them. A request log reads its ids alone."""
    ids = _ids(4, seed=31)
    rng = np.random.default_rng(2)
    probs = rng.random((4, 3, 8))
    want = np.where(ids >= 0, np.take_along_axis(probs, ids.clip(0), 2), 0).astype(np.float32)
    per_layer = [{"token_idx": t, "layer": j, "topk_ids": ids[t, j].tolist(),
                  "topk_weights": want[t, j].tolist()} for j in range(3) for t in range(4)]
    a = read_token_trace(_write(tmp_path / "a.jsonl", per_layer), experts=8)
    every = [{"token_idx": t, "topk_ids": ids[t].tolist(), "gating_probs": probs[t].tolist()}
             for t in range(4)]
    b = read_token_trace(_write(tmp_path / "b.jsonl", every), experts=8)
    assert torch.equal(a.topk_weights, torch.from_numpy(want))
    assert torch.allclose(b.topk_weights, a.topk_weights)
    with pytest.warns(InputWarning, match="only 11 of its 12 records hold gating weights"):
        some = read_token_trace(_write(tmp_path / "c.jsonl", per_layer[:-1] + [
            {k: v for k, v in per_layer[-1].items() if k != "topk_weights"}]), experts=8)
    assert some.topk_weights is None
    asked = read_token_requests(_write(tmp_path / "r.jsonl", [dict(r, request_id="q")
                                                              for r in per_layer]), experts=8)
    assert asked.num_layers == 3
