"""Hash-routed layers (DeepSeek-V4, DESIGN.md §16): which layers a trace or model says are, the
synthetic scenario's token ids and tid2eid tables, and what `trace info` shows of them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces.layer_kinds import hash_layers, learned_layers, tid2eid_tables, token_ids
from eplbsim.traces.synth import HASH_STREAM, synthesize
from eplbsim.traces.trace import save_trace

from cli_helpers import run

SIZES = dict(steps=6, tokens=96, layers=5, experts=16, top_k=4, seed=7)


def test_which_layers_are_hash_routed():
    assert hash_layers({"hash_layers": [2, 0]}, 4) == (0, 2)  # the trace's own list first
    assert hash_layers({"hash_layers": [], "num_hash_layers": 3}, 4) == ()
    assert hash_layers({"num_hash_layers": 3}, 4, model_hash_layers=1) == (0, 1, 2)
    assert hash_layers({}, 4, model_hash_layers=3) == (0, 1, 2)
    assert hash_layers({}, 4) == ()
    # a dump that dropped its empty layers keeps the model's numbers: 3 and on are learned
    assert hash_layers({"model_layers": [1, 3, 4]}, 3, model_hash_layers=3) == (0,)
    assert learned_layers(4, (0, 2)) == (1, 3)
    for meta, words in (({"hash_layers": [0, 4]}, r"distinct layer indices in \[0, 4\)"),
                        ({"hash_layers": [1, 1]}, "distinct"),
                        ({"hash_layers": "0"}, "distinct"),
                        ({"num_hash_layers": -1}, "num_hash_layers must be an integer >= 0"),
                        ({"num_hash_layers": True}, "num_hash_layers must be an integer")):
        with pytest.raises(InputError, match=words):
            hash_layers(meta, 4)


def test_the_scenario_routes_hash_layers_by_token_id_through_a_table():
    base = synthesize("skewed", **SIZES)
    trace = synthesize("skewed", **SIZES, hash_layers=2, vocab=300, zipf=1.2)
    assert trace.meta["hash_layers"] == [0, 1]
    assert torch.equal(trace.topk_ids[:, 2:], base.topk_ids[:, 2:])  # learned: the scenario's
    # the hash layers are the tables' rows of each token's id, drawn from the seed's own stream
    rng = np.random.default_rng((SIZES["seed"], HASH_STREAM))
    tokens = token_ids(rng, trace.num_tokens, 300, 1.2)
    tables = tid2eid_tables(rng, 2, 300, SIZES["experts"], SIZES["top_k"])
    for h in range(2):
        assert np.array_equal(trace.topk_ids[:, h].numpy(), tables[h][tokens])
    assert not np.array_equal(tables[0], tables[1])  # each hash layer has its own table
    rows = np.sort(tables.reshape(-1, SIZES["top_k"]), axis=1)
    assert (np.diff(rows, axis=1) > 0).all() and rows.min() >= 0 and rows.max() < 16
    counts = np.bincount(tokens, minlength=300)
    assert counts[:10].sum() > counts[-10:].sum()  # Zipf: low ids are the common tokens
    again = synthesize(trace.meta["scenario"], **trace.meta["params"])
    assert torch.equal(again.topk_ids, trace.topk_ids)
    for options, words in (({"hash_layers": 6}, "hash_layers=6 must not exceed"),
                           ({"hash_layers": 1, "vocab": 0}, "vocab must be >= 1"),
                           ({"hash_layers": 1, "zipf": -1}, "zipf must be a finite number")):
        with pytest.raises(InputError, match=words):
            synthesize("uniform", **SIZES, **options)


def test_trace_info_shows_hash_and_learned_layers_apart(tmp_path, capsys):
    path = tmp_path / "v4.npz"
    code, out, _ = run(capsys, "trace", "synth", "skewed", "--out", path, "--steps", "4",
                       "--tokens", "64", "--layers", "4", "--experts", "16", "--top-k", "4",
                       "-o", "hash_layers=2", "-o", "vocab=500")
    assert code == 0
    code, out, _ = run(capsys, "trace", "info", path)
    assert code == 0 and "hash-routed layers (a token-id table picks their experts): 0-1;" in out
    kinds = [line.split()[-1] for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert kinds == ["hash", "hash", "learned", "learned"]
    code, out, _ = run(capsys, "trace", "info", path, "--json")
    summary = json.loads(out)
    assert summary["hash_layers"] == [0, 1] and set(summary["kind_skew"]) == {"hash", "learned"}
    # a trace whose meta names DeepSeek-V4-Flash: its first 3 layers are the model's hash layers
    plain = synthesize("uniform", steps=2, tokens=16, layers=4, experts=256, top_k=6)
    named = tmp_path / "named.npz"
    logged = {k: v for k, v in plain.meta.items() if k != "hash_layers"}  # as a log says it
    save_trace(type(plain)(plain.topk_ids, plain.step_offsets, 256, None,
                           dict(logged, model="deepseek-ai/DeepSeek-V4-Flash")), named)
    code, out, _ = run(capsys, "trace", "info", named, "--json")
    assert json.loads(out)["hash_layers"] == [0, 1, 2]
