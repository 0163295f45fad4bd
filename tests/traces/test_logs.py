"""eplbsim.traces.formats.logs (and infer, documents): logs of shapes written the way their
tools write them, read by what they hold; each read's ids and per-layer counts checked against
a count made here, and what cannot be told apart refused with the choices.

Dimensions: `S` steps, `T` tokens, `L` layers, `E` experts, `K` top-k.
"""

import csv
import json
import warnings

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces import CountsTrace, Trace
from eplbsim.traces.formats import open_trace

from cli_helpers import assert_input_error, run

MODEL = "Qwen/Qwen1.5-MoE-A2.7B-Chat"  # 60 experts, top-4 (cost.shapes: qwen1.5-moe-a2.7b)
E, K = 60, 4
LAYERS = [0, 8, 12, 18, 23]
TOKENS = [5, 3, 7]  # tokens of each forward pass


def _routing(seed=0, layers=LAYERS, tokens=TOKENS):
    """Every pass's ids and gates, `{layer: [T_s, K]}` a step, distinct ids a row."""
    rng = np.random.default_rng(seed)
    ids = [{layer: np.argsort(rng.random((t, E)), -1)[:, :K] for layer in layers} for t in tokens]
    gates = [{layer: np.round(rng.dirichlet(np.ones(K), t), 4) for layer in layers}
             for t in tokens]
    return ids, gates


def _hook_files(folder, ids, gates, layers=LAYERS):
    """A forward hook's output: one JSON-lines file a layer, a header naming the model, then
    a record a token, token_idx restarting at every forward pass."""
    folder.mkdir(parents=True, exist_ok=True)
    for layer in layers:
        lines = [{"type": "meta", "model_id": MODEL, "vllm_version": "0.8.5"}]
        for step_ids, step_gates in zip(ids, gates):
            lines += [{"layer": layer, "token_idx": t, "topk_ids": step_ids[layer][t].tolist(),
                       "topk_weights": step_gates[layer][t].tolist()}
                      for t in range(step_ids[layer].shape[0])]
        (folder / f"moe_layer{layer}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in lines))
    return [folder / f"moe_layer{layer}.jsonl" for layer in layers]


def _expected(ids, layers=LAYERS):
    """`[N, L, K]` ids stacked in step order, and `[L, E]` counts made with bincount."""
    stacked = np.concatenate([np.stack([s[layer] for layer in layers], 1) for s in ids])
    counts = np.stack([np.bincount(stacked[:, i].ravel(), minlength=E)
                       for i in range(len(layers))])
    return stacked, counts


def _check(trace, ids, layers=LAYERS):
    stacked, counts = _expected(ids, layers)
    assert isinstance(trace, Trace)
    assert np.array_equal(trace.topk_ids.numpy(), stacked)
    assert np.array_equal(trace.counts().sum(0).numpy(), counts)
    assert trace.meta.get("model_layers", list(range(trace.num_layers))) == list(layers)


def test_a_folder_of_per_layer_hook_files_joins_by_step_and_token(tmp_path, capsys):
    ids, gates = _routing()
    files = _hook_files(tmp_path / "logs", ids, gates)
    (tmp_path / "logs" / "README.txt").write_text("written by our hook\n")
    trace = open_trace(tmp_path / "logs")
    _check(trace, ids)
    assert trace.tokens_per_step.tolist() == TOKENS and trace.meta["model"] == MODEL
    weights = np.concatenate([np.stack([g[layer] for layer in LAYERS], 1) for g in gates])
    assert np.allclose(trace.topk_weights.numpy(), weights)
    assert trace.meta["read_as"] == (
        'records of one token in one layer, 5 files joined by (step, token) across layers, '
        'ids from "topk_ids", weights from "topk_weights", layer from "layer", token from '
        '"token_idx", layers [0, 8, 12, 18, 23], steps where "token_idx" restarts, header: '
        f'{MODEL}; left out: README.txt')
    # the files named one by one (the shell's glob) read the same
    same = open_trace([str(f) for f in reversed(files)])
    assert torch.equal(same.topk_ids, trace.topk_ids)
    code, out, err = run(capsys, "trace", "info", *files)
    assert code == 0, err
    assert out.splitlines()[1].startswith("  read as: records of one token in one layer, 5 "
                                          "files")
    info = json.loads(run(capsys, "trace", "info", tmp_path / "logs", "--json")[1])
    assert info["meta"]["read_as"] == trace.meta["read_as"] and info["layers"] == 5
    # the model is priced from the header's name
    code, out, err = run(capsys, "run", "--trace", *files, "--gpus", "4", "--policies", "row",
                         "--mode", "none", "--cost", "roofline", "--json")
    assert code == 0 and json.loads(out)[0]["model"] == "qwen1.5-moe-a2.7b", err


def test_files_of_per_layer_logs_that_disagree_are_refused_in_one_line(tmp_path, capsys):
    ids, gates = _routing(seed=1)
    files = _hook_files(tmp_path / "a", ids, gates)
    short = [dict(s) for s in ids]
    short[1][12] = short[1][12][:2]  # layer 12's file lost a token of step 1
    _hook_files(tmp_path / "b", short, gates, layers=[12])
    with pytest.raises(InputError, match=r"moe_layer12.jsonl: step 1 has 2 tokens, .*"
                       r"moe_layer0.jsonl's step 1 3"):
        open_trace([*files[:2], tmp_path / "b" / "moe_layer12.jsonl"])
    renamed = tmp_path / "a" / "moe_layer9.jsonl"
    files[1].rename(renamed)  # holds layer 8's records
    assert_input_error(capsys, "trace", "info", renamed, match="its name says layer 9, its "
                       "records (\"layer\") layer(s) [8]: rename the file, or name the layer's "
                       "field with --layer-key")


def test_field_names_and_the_header_are_found_and_a_flag_overrules_a_guess(tmp_path):
    """Other names for every field, a header without `type`, one log of two layers."""
    ids, gates = _routing(seed=2, layers=[0, 1], tokens=[4, 6])
    lines = [{"model_name": MODEL, "created": "2026-12-01"}]
    for step_ids, step_gates in zip(ids, gates):
        for layer in (0, 1):
            lines += [{"moe_layer": layer, "pos": t,
                       "selected_experts": step_ids[layer][t].tolist(),
                       "router_probs": step_gates[layer][t].tolist(), "token_id": 100 + t}
                      for t in range(step_ids[layer].shape[0])]
    log = tmp_path / "routes.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    trace = open_trace(log)
    _check(trace, ids, [0, 1])
    assert trace.meta["model"] == MODEL and trace.topk_weights is not None
    assert 'ids from "selected_experts", weights from "router_probs", layer from "moe_layer", ' \
           'token from "pos"' in trace.meta["read_as"]
    # a second list of ids: both named, and the flag that chooses
    twice = [dict(r, backup=r["selected_experts"][::-1]) if "pos" in r else r for r in lines]
    log.write_text("".join(json.dumps(r) + "\n" for r in twice))
    with pytest.raises(InputError, match="the fields 'selected_experts', 'backup' could each "
                       r"hold the top-k ids: choose with ids_key=\.\.\."):
        open_trace(log)
    chosen = open_trace(log, ids_key="backup")
    assert torch.equal(chosen.topk_ids, trace.topk_ids.flip(-1))


def test_nested_per_token_json_reads_token_and_layer_from_the_keys(tmp_path):
    """A forward hook's document: `router_data` a list of `{"token_N": {"layer_M": {...}}}`."""
    ids, gates = _routing(seed=3, layers=[0, 1, 2], tokens=[6])
    doc = {"model": MODEL, "router_data": [
        {f"token_{178 + t}": {f"layer_{layer}": {
            "selected_experts": ids[0][layer][t].tolist(),
            "selected_probs": gates[0][layer][t].tolist()} for layer in (0, 1, 2)}}
        for t in range(6)]}
    path = tmp_path / "router.json"
    path.write_text(json.dumps(doc, indent=1))
    trace = open_trace(path)
    _check(trace, ids, [0, 1, 2])
    assert trace.num_steps == 1 and trace.meta["model"] == MODEL
    assert np.allclose(trace.topk_weights[:, 1].numpy(), gates[0][1])
    assert 'layer from "layer", token from "token"' in trace.meta["read_as"]


def test_dense_gate_rows_read_their_non_zeros_as_ids(tmp_path):
    """A CSV of a column per expert beside layer and token columns, and the same as an array."""
    rng = np.random.default_rng(4)
    T, L, E8, K2 = 7, 2, 8, 2
    gates = np.zeros((T, L, E8))
    for t in range(T):
        for layer in range(L):
            gates[t, layer, rng.choice(E8, K2, replace=False)] = [0.7, 0.3]
    path = tmp_path / "gates.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "token"] + [f"expert_{e}" for e in range(E8)])
        for layer in range(L):
            for t in range(T):
                w.writerow([layer, t] + gates[t, layer].tolist())
    want = np.argsort(-gates, -1, kind="stable")[..., :K2]  # heaviest first
    trace = open_trace(path)
    assert np.array_equal(trace.topk_ids.numpy(), want) and trace.num_experts == E8
    assert np.array_equal(trace.counts().sum(0).numpy(), (gates > 0).sum(0))
    assert np.allclose(trace.topk_weights.numpy(), np.sort(gates, -1)[..., ::-1][..., :K2])
    np.save(tmp_path / "gates.npy", gates.astype(np.float32))
    arr = open_trace(tmp_path / "gates.npy")
    assert torch.equal(arr.topk_ids, trace.topk_ids)
    rows = path.read_text().splitlines()
    rows[3] = rows[3].rsplit(",", 1)[0] + ",0.5"  # a third non-zero gate
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(InputError, match=r"gates.csv:4: 3 non-zero gates, the rows before have 2"):
        open_trace(path)


@pytest.mark.parametrize("write", [
    lambda p, c: p.with_suffix(".json").write_text(json.dumps(
        {"model": MODEL, "num_layers": 2, "num_experts": 24, "logical_count": c[0].tolist()})),
    lambda p, c: p.with_suffix(".json").write_text(json.dumps(c.tolist())),
    lambda p, c: np.save(p.with_suffix(".npy"), c[0]),
    lambda p, c: np.savez(p.with_suffix(".npz"), expert_counts=c.astype(np.float32)),
])
def test_counts_matrices_as_people_save_them_read_as_counts_only(tmp_path, write):
    counts = np.random.default_rng(5).integers(0, 50, (3, 2, 24))  # [S, L, E]
    write(tmp_path / "counts", counts)
    path = next(tmp_path.iterdir())
    trace = open_trace(path)
    assert isinstance(trace, CountsTrace)
    want = counts[:1] if trace.num_steps == 1 else counts
    assert np.array_equal(trace.counts, want) and "counts" in trace.meta["read_as"]


def test_counts_that_contradict_themselves_or_are_shares_are_refused(tmp_path, capsys):
    ids_like = tmp_path / "ids.npy"
    np.save(ids_like, np.array([[3, 1], [0, 2], [5, 4]]))  # [T][K] ids, or [L][E] counts?
    with pytest.raises(InputError, match=r"an integer array \[3\]\[2\] that could be top-k "
                       r"ids or counts: save counts under a key saying so"):
        open_trace(ids_like)
    np.savez(tmp_path / "named.npz", counts=np.array([[3, 1], [0, 2], [5, 4]]))
    assert open_trace(tmp_path / "named.npz").num_layers == 3
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"num_experts": 5, "counts": [[1, 2, 3, 4, 5, 6]]}))
    with pytest.raises(InputError, match="num_experts is 5, but counts holds 6"):
        open_trace(path)
    path.write_text(json.dumps({"counts": [[0.25, 0.75], [0.5, 0.5]]}))
    with pytest.raises(InputError, match=r"holds fractions \(0.25\), not counts"):
        open_trace(path)
    path.write_text(json.dumps({"counts": [[3, 1, 0, 4], [2, 2, 2, 2]]}))
    code, out, err = run(capsys, "run", "--trace", path, "--gpus", "2", "--redundant", "2")
    assert code == 0 and "counts only" in out + err, err
    code, out, _ = run(capsys, "trace", "info", path)
    assert code == 0 and "counts only: steps 1, layers 2, experts 4, 16 pairs" in out


def test_a_log_that_cannot_say_its_layers_is_refused_with_the_flag(tmp_path):
    """Records of one layer call each with no key: `--layers-per-pass`, which only the user
    knows; a per-layer file of such records is a step a record."""
    ids, _ = _routing(seed=6, layers=[0, 1], tokens=[3, 2])
    lines = [{"topk_ids": s[layer].tolist()} for s in ids for layer in (0, 1)]
    log = tmp_path / "calls.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(InputError, match="Give layers_per_pass=L"):
        open_trace(log)
    _check(open_trace(log, layers_per_pass=2), ids, [0, 1])
    for layer in (0, 1):
        (tmp_path / f"layer_{layer}.jsonl").write_text(
            "".join(json.dumps({"topk_ids": s[layer].tolist()}) + "\n" for s in ids))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(open_trace([tmp_path / "layer_0.jsonl", tmp_path / "layer_1.jsonl"]), ids, [0, 1])


def test_a_document_keyed_by_layer_then_step_or_a_list_of_records_reads(tmp_path):
    """`{"layer_0": {"step_0": [[K ids] x T], ...}, ...}` (a level's values the ids
    themselves, layers before steps) and a bare JSON list of per-token records."""
    ids, _ = _routing(seed=7, layers=[0, 1], tokens=[3, 5])
    doc = tmp_path / "by_layer.json"
    doc.write_text(json.dumps({f"layer_{layer}": {f"step_{s}": ids[s][layer].tolist()
                                                  for s in range(2)} for layer in (0, 1)}))
    trace = open_trace(doc)
    _check(trace, ids, [0, 1])
    assert trace.meta["read_as"].startswith("records of one step in one layer")
    listed = tmp_path / "records.json"
    listed.write_text(json.dumps([{"layer": layer, "token_idx": t,
                                   "expert_ids": s[layer][t].tolist()}
                                  for s in ids for t in range(s[0].shape[0]) for layer in (0, 1)]))
    _check(open_trace(listed), ids, [0, 1])


def test_every_command_that_reads_a_trace_takes_a_folder_or_several_files(tmp_path, capsys):
    ids, gates = _routing(seed=8, tokens=[6, 6, 6, 6])
    files = _hook_files(tmp_path / "logs", ids, gates)
    _, counts = _expected(ids)
    code, out, err = run(capsys, "solve", "--counts", *files, "--gpus", "4", "--redundant", "4",
                         "--json")
    assert code == 0 and json.loads(out)["layers"] == LAYERS, err
    code, out, err = run(capsys, "trace", "convert", tmp_path / "logs", "--out",
                         tmp_path / "joined.npz")
    assert code == 0 and "4 steps, 24 tokens, 5 layers" in out, err
    assert np.array_equal(open_trace(tmp_path / "joined.npz").counts().sum(0).numpy(), counts)
    code, out, err = run(capsys, "review", "ordinal", "--trace", *files, "--gpus", "4",
                         "--redundant", "4", "--seeds", "1", "--windows", "1", "--json")
    assert code in (0, 1, 3) and json.loads(out)["verdict"], err
    assert_input_error(capsys, "run", "--trace", *files, "--where", "model=x",
                       match="where applies to a single file, not to several read as one log")


def test_a_request_log_with_ragged_layers_drops_its_lost_tokens(tmp_path):
    """Per-layer records with other field names and a request id, one token lost in one layer:
    refused by default, dropped with `incomplete="drop"`; the requests' ids and per-layer counts
    are the log's, less the dropped token."""
    from eplbsim.traces.formats import open_requests
    ids, _ = _routing(seed=9, layers=[0, 1], tokens=[4, 5])
    lines = [{"type": "meta", "model_id": MODEL}]
    lines += [{"rid": f"r{r}", "pos": t, "layer_idx": layer, "experts": s[layer][t].tolist()}
              for r, s in enumerate(ids) for t in range(s[0].shape[0]) for layer in (0, 1)
              if (r, t, layer) != (1, 2, 1)]
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(InputError, match="token 2 of request 'r1' .* lacks layer"):
        open_requests(log, request_key="rid")
    with pytest.warns(Warning, match="1 of the log's 9 tokens lack some layer"):
        got = open_requests(log, request_key="rid", incomplete="drop")
    kept = [np.stack([ids[0][0], ids[0][1]], 1),
            np.delete(np.stack([ids[1][0], ids[1][1]], 1), 2, axis=0)]
    assert [r.id for r in got.requests] == ["r0", "r1"]
    for request, want in zip(got.requests, kept):
        assert np.array_equal(request.ids, want)
    counts = sum(np.stack([np.bincount(k[:, j].ravel(), minlength=E) for j in (0, 1)])
                 for k in kept)
    total = sum(np.stack([np.bincount(r.ids[:, j].ravel(), minlength=E) for j in (0, 1)])
                for r in got.requests)
    assert np.array_equal(total, counts) and got.meta["read_as"].startswith(
        'records of one token in one layer, ids from "experts"')


def test_gating_weights_are_found_by_name_or_shape_and_two_candidates_keep_none(tmp_path):
    """A probability per expert under a weight's usual name is gathered at the ids; two
    unnamed fields of fractions in the ids' shape keep none, with a warning naming both."""
    rng = np.random.default_rng(10)
    ids = [rng.choice(8, 2, replace=False) for _ in range(4)]
    probs = rng.dirichlet(np.ones(8), 4)
    log = tmp_path / "probs.jsonl"
    log.write_text("".join(json.dumps({"token_idx": t, "layer": 0, "topk_ids": ids[t].tolist(),
                                       "gating_probs": probs[t].tolist()}) + "\n"
                           for t in range(4)))
    trace = open_trace(log)
    assert np.allclose(trace.topk_weights[:, 0].numpy(),
                       np.take_along_axis(probs, np.array(ids), 1))
    log.write_text("".join(json.dumps({"token_idx": t, "layer": 0, "topk_ids": ids[t].tolist(),
                                       "a": [0.5, 0.5], "b": [0.25, 0.75]}) + "\n"
                           for t in range(4)))
    with pytest.warns(Warning, match="the fields 'a', 'b' could each be the gating weights; "
                      "none is kept"):
        assert open_trace(log).topk_weights is None


def _hook_log(path, ids, record):
    """A vLLM routing hook's log: a header holding a list (`layers_logged: [0]`, which could
    pass for ids) and the model, then `record(step, rows)`'s records for each step's layer-0
    ids `rows` (`[T_s, K]`)."""
    lines = [{"type": "meta", "model": MODEL, "layers_logged": [0]}]
    lines += [r for s, step_ids in enumerate(ids) for r in record(s, step_ids[0])]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _call(s, rows):
    return [{"layer": 0, "topk_ids": rows.tolist()}]


def _stamped_call(s, rows):  # role-less records bearing text, as a header does
    return [{"ts": f"2026-01-0{s + 1}", "topk_ids": rows.tolist()}]


def _tokens(s, rows):
    return [{"token": t, "layer": 0, "topk_ids": row.tolist()} for t, row in enumerate(rows)]


CALLS = "records of one layer call each, in execution order"


@pytest.mark.parametrize("record,options,form", [
    (_call, {"layers_per_pass": 1}, CALLS),
    (_stamped_call, {"layers_per_pass": 1}, CALLS),
    (_tokens, {}, "records of one token in one layer"),
], ids=["calls", "stamped-calls", "tokens"])
def test_a_header_is_a_header_by_the_ids_it_lacks_whatever_lists_it_carries(
        tmp_path, capsys, record, options, form):
    """The header's `layers_logged` list is no candidate for the ids: the record lacks the
    field every other record holds. Its model reaches the trace, `read as` names the list it
    passed over, and the log reads as `--skip-type meta` reads it."""
    ids, _ = _routing(seed=11, layers=[0])
    log = _hook_log(tmp_path / "routes.jsonl", ids, record)
    trace = open_trace(log, **options)
    _check(trace, ids, [0])
    assert trace.tokens_per_step.tolist() == TOKENS and trace.meta["model"] == MODEL
    assert trace.meta["read_as"].startswith(form + ', ids from "topk_ids"')
    assert trace.meta["read_as"].endswith(
        f'header: {MODEL} (without "topk_ids": "layers_logged" not ids)')
    assert torch.equal(open_trace(log, skip_type="meta", **options).topk_ids, trace.topk_ids)
    flags = ["--layers-per-pass", "1"] if options else []
    code, out, err = run(capsys, "trace", "info", log, *flags)
    assert code == 0 and f"  read as: {trace.meta['read_as']}" in out.splitlines(), err


def test_a_data_record_without_its_ids_is_no_header_and_two_id_fields_are_refused(tmp_path):
    """A record with a layer or token field, or ids that are no top-k, is data: one that lacks
    its ids mid-log is an error naming its line, not a header. A header does not settle which
    of two fields every other record holds."""
    ids, _ = _routing(seed=12, layers=[0])
    log = _hook_log(tmp_path / "routes.jsonl", ids, _tokens)
    lines = log.read_text().splitlines()
    for bad in ({"token": 2, "layer": 0}, {"token": 2, "layer": 0, "topk_ids": [4, 4, 1, 2]}):
        log.write_text("\n".join([*lines[:7], json.dumps(bad), *lines[7:]]) + "\n")
        with pytest.raises(InputError, match=r"routes.jsonl:8: no list of distinct expert ids "
                           r".* under 'topk_ids', which 15 of the 16 records of data looked at "
                           r"hold; this record has token, layer"):
            open_trace(log)
    twice = [json.loads(line) for line in lines]
    twice[1:] = [dict(r, backup=r["topk_ids"][::-1]) for r in twice[1:]]
    log.write_text("".join(json.dumps(r) + "\n" for r in twice))
    with pytest.raises(InputError, match="the fields 'topk_ids', 'backup' could each hold the "
                       r"top-k ids: choose with ids_key=\.\.\."):
        open_trace(log)
    chosen = open_trace(log, ids_key="backup")
    assert chosen.meta["model"] == MODEL and torch.equal(
        chosen.topk_ids, open_trace(log, ids_key="topk_ids").topk_ids.flip(-1))


# Stages and draft (MTP) layers as the logs say them (traces.stages, traces.draft)

def _steps(tokens, seed=0, layers=3, experts=8, k=2):
    """`[T, L, K]` ids a step, distinct ids a row."""
    rng = np.random.default_rng(seed)
    return [np.argsort(rng.random((t, layers, experts)), -1)[..., :k] for t in tokens]


def test_a_step_logs_is_prefill_gives_its_stage(tmp_path):
    from log_writers import write_step_log
    from eplbsim.traces.stages import CODES, describe_stages, step_stages
    steps = _steps([6, 2, 2, 5])
    path = write_step_log(tmp_path / "v.jsonl", steps, "pddp")
    trace = open_trace(path)
    assert trace.meta["stages"] == "pddp" and trace.meta["stages_from"] == ["is_prefill"]
    assert 'stages from "is_prefill"' in trace.meta["read_as"]
    # the log says it, not the tokens: a 2-token step the log calls prefill stays prefill
    path = write_step_log(tmp_path / "w.jsonl", steps, "dpdd")
    mark = {CODES["prefill"]: "p", CODES["decode"]: "d"}
    assert "".join(mark[c] for c in step_stages(open_trace(path))) == "dpdd"
    assert "as the log marks them" in describe_stages(open_trace(path))
    assert open_trace(path, select_steps="1:").meta["stages"] == "dpdd"  # the log's marks


def test_records_of_a_step_that_disagree_make_it_prefill(tmp_path):
    from log_writers import write_jsonl
    steps = _steps([3, 3])
    records = [{"step": s, "layer": layer, "stage": stage, "topk_ids": ids[:, layer].tolist()}
               for s, ids in enumerate(steps) for layer, stage in
               zip(range(3), (["decode", "prefill", "decode"], ["decode"] * 3)[s])]
    trace = open_trace(write_jsonl(tmp_path / "mixed.jsonl", records))
    assert trace.meta["stages"] == "pd"
    # a "stage" that is no serving stage (Megatron's point of capture) says nothing
    for rec in records:
        rec["stage"] = "pre_dispatch"
    assert "stages" not in open_trace(write_jsonl(tmp_path / "none.jsonl", records)).meta
    records[0]["is_prefill"] = "yes"
    with pytest.raises(InputError, match=r"none2?\.jsonl:1: is_prefill must be true or false"):
        open_trace(write_jsonl(tmp_path / "none2.jsonl", records))


def test_sglang_per_token_records_say_the_stage_by_forward_mode(tmp_path):
    from log_writers import write_sglang_token_log
    steps = _steps([4, 1, 2, 3])
    path = write_sglang_token_log(tmp_path / "s.jsonl", steps, [1, 2, 2, 3])
    trace = open_trace(path)
    assert trace.num_steps == 4 and trace.tokens_per_step.tolist() == [4, 1, 2, 3]
    assert trace.meta["stages"] == "pddp"  # MIXED holds prefill rows
    assert trace.meta["stages_from"] == ["forward_mode"] and trace.draft is None


def test_a_positional_logs_stages_are_its_passes(tmp_path):
    from log_writers import write_jsonl
    steps = _steps([3, 1])
    records = [{"phase": "context" if s == 0 else "generation",
                "topk_ids": ids[:, layer].tolist()}
               for s, ids in enumerate(steps) for layer in range(3)]
    trace = open_trace(write_jsonl(tmp_path / "p.jsonl", records), layers_per_pass=3)
    assert trace.meta["stages"] == "pd"


def test_parts_of_one_log_join_their_stages_and_drafts(tmp_path):
    from log_writers import write_step_log
    steps = _steps([3, 2, 2, 4])
    draft = [d[:, 0] for d in _steps([2, 1, 1, 3], seed=1, layers=1, experts=6)]
    header = {"type": "meta", "model": "m", "num_hidden_layers": 3}
    a = write_step_log(tmp_path / "a.jsonl", steps[:2], "pd", header, draft[:2], 3)
    b = write_step_log(tmp_path / "b.jsonl", steps[2:], "dp", header, draft[2:], 3)
    trace = open_trace([a, b])
    assert trace.num_steps == 4 and trace.meta["stages"] == "pddp"
    assert trace.draft.tokens_per_step.tolist() == [2, 1, 1, 3]
    assert torch.equal(trace.draft.step(3)[:, 0], torch.from_numpy(draft[3]).int())
    c = write_step_log(tmp_path / "c.jsonl", steps[2:], "dp", header)
    with pytest.raises(InputError, match="c.jsonl holds no draft"):
        open_trace([a, c])


def test_a_layer_at_num_hidden_layers_is_the_draft(tmp_path):
    from log_writers import write_step_log
    steps = _steps([4, 2, 2])
    draft = [d[:, 0] for d in _steps([3, 1, 2], seed=1, layers=1, experts=12)]  # 12 experts
    header = {"type": "meta", "model": "deepseek-ai/DeepSeek-V3", "num_hidden_layers": 3,
              "draft_experts": 16}
    path = write_step_log(tmp_path / "v.jsonl", steps, "pdd", header, draft, 3)
    trace = open_trace(path)
    assert trace.num_layers == 3 and trace.num_experts == 8  # the target's own
    assert torch.equal(trace.step(1), torch.from_numpy(steps[1]).int())
    d = trace.draft
    assert d.num_layers == 1 and d.num_experts == 16 and d.meta["model_layers"] == [3]
    assert d.tokens_per_step.tolist() == [3, 1, 2]
    for s in range(3):
        assert torch.equal(d.step(s)[:, 0], torch.from_numpy(draft[s]).int())
    assert "draft (MTP) layers [3] (layers from num_hidden_layers 3)" in trace.meta["read_as"]
    # the largest id + 1 when the log does not say the draft's experts
    del header["draft_experts"]
    path = write_step_log(tmp_path / "w.jsonl", steps, "pdd", header, draft, 3)
    assert open_trace(path).draft.num_experts == int(np.concatenate(draft).max()) + 1
    # a step with no draft pass has no draft rows; the draft survives an .npz
    gaps = [draft[0], None, draft[2]]
    trace = open_trace(write_step_log(tmp_path / "g.jsonl", steps, "pdd", header, gaps, 3))
    assert trace.draft.tokens_per_step.tolist() == [3, 0, 2]
    from eplbsim.traces import load_trace, save_trace
    save_trace(trace, tmp_path / "g.npz")
    assert torch.equal(load_trace(tmp_path / "g.npz").draft.topk_ids, trace.draft.topk_ids)
    # without the header, layer 3 is one more target layer
    path = write_step_log(tmp_path / "x.jsonl", steps, "pdd", None, [draft[0][:4]] * 3, 3)
    with pytest.raises(InputError, match="has 3 tokens|has 4 tokens"):
        open_trace(path)


def test_a_draft_that_runs_its_own_rows_beside_a_marked_record(tmp_path):
    from log_writers import write_jsonl
    steps = _steps([2, 2])
    draft = _steps([5, 5], seed=2, layers=1, experts=4, k=1)
    records = []
    for s in range(2):
        records += [{"step": s, "layer": layer, "topk_ids": steps[s][:, layer].tolist()}
                    for layer in range(3)]
        records.append({"step": s, "layer": 0, "block": "mtp",
                        "topk_ids": draft[s][:, 0].tolist()})
    trace = open_trace(write_jsonl(tmp_path / "m.jsonl", records))
    assert trace.draft.top_k == 1 and trace.draft.num_steps == 2 and trace.top_k == 2
    assert trace.draft.meta["draft_from"] == 'records "block": "mtp"'
    records[3]["is_draft"] = 3
    with pytest.raises(InputError, match=r"m2\.jsonl:4: is_draft must be true or false"):
        open_trace(write_jsonl(tmp_path / "m2.jsonl", records))


def test_an_sglang_token_logs_draft_records(tmp_path):
    from log_writers import write_sglang_token_log
    steps = _steps([3, 1, 2])
    draft = _steps([3, 1, 2], seed=3, layers=1, experts=10)
    trace = open_trace(write_sglang_token_log(tmp_path / "s.jsonl", steps, [1, 2, 2], draft))
    assert trace.meta["stages"] == "pdd" and trace.num_layers == 3
    assert trace.draft.num_steps == 3 and trace.draft.num_layers == 1
    for s in range(3):
        assert torch.equal(trace.step(s), torch.from_numpy(steps[s]).int())
        assert torch.equal(trace.draft.step(s), torch.from_numpy(draft[s]).int())
    assert 'records "is_draft": true' in trace.meta["read_as"]


def test_a_positional_logs_draft_calls_follow_their_pass(tmp_path):
    from log_writers import write_jsonl
    steps = _steps([3, 1])
    draft = _steps([2, 4], seed=4, layers=1, experts=5)
    records = []
    for s in range(2):
        records += [{"topk_ids": steps[s][:, layer].tolist()} for layer in range(3)]
        records.append({"mtp": True, "topk_ids": draft[s][:, 0].tolist()})
    trace = open_trace(write_jsonl(tmp_path / "p.jsonl", records), layers_per_pass=3)
    assert trace.num_steps == 2 and trace.draft.tokens_per_step.tolist() == [2, 4]
    assert torch.equal(trace.draft.step(1), torch.from_numpy(draft[1]).int())
    with pytest.raises(InputError, match="before any of the target's"):
        open_trace(write_jsonl(tmp_path / "q.jsonl", records[3:]), layers_per_pass=3)
