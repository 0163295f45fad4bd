"""`open_trace` is the command line's reading of a trace, in Python: every option of a file's
reading and its steps is a keyword named in its docstring, each gives the numbers `eplbsim run`
gives with its flag, an error names the keyword (the command line the flag), and a warning
points at the caller's line."""

import inspect
import json
import re
import warnings

import numpy as np
import pytest

from eplbsim import (InputError, RunSpec, Trace, compare, open_trace, replay, shape_steps,
                     synthesize)
from eplbsim.base.errors import InputWarning, RunWarning
from eplbsim.cli import main
from eplbsim.replay.results import to_json
from eplbsim.runspec import READER_OPTIONS
from eplbsim.traces import save_trace
from eplbsim.traces.formats import FORMATS, reading_options
from eplbsim.traces.steps import SHAPING

E, K, L = 8, 2, 2


def _shaped_npz(tmp_path):
    """A trace of every kind of step `shape_steps` tells apart, as an .npz: a warm-up pass (6
    rows routed alike), real steps of 12 rows, a dummy batch of 4 rows run twice, and a 200-row
    size outlier."""
    real = synthesize("skewed", steps=5, tokens=12, layers=L, experts=E, top_k=K, seed=3)
    big = synthesize("skewed", steps=1, tokens=200, layers=L, experts=E, top_k=K, seed=4)
    dummy = real.step(4)[:4].numpy()
    steps = [np.repeat(real.step(0)[:1].numpy(), 6, 0), real.step(1).numpy(), dummy,
             real.step(2).numpy(), dummy, real.step(3).numpy(), big.step(0).numpy()]
    path = tmp_path / "shaped.npz"
    save_trace(Trace.from_arrays(np.concatenate(steps), tokens_per_step=[len(s) for s in steps],
                                 num_experts=E), path)
    return str(path)


def _token_log(tmp_path, lose_one=False):
    """A per-token log with its own key names (`pos`, `blk`, `ids`, `it`) and a header record of
    type "hdr"; `lose_one`: one token's layer-1 record left out."""
    trace = synthesize("skewed", steps=3, tokens=10, layers=L, experts=E, top_k=K, seed=5)
    lines = [{"type": "hdr", "note": "x"}]
    for s in range(trace.num_steps):
        for layer in range(L):
            lines += [{"type": "r", "it": s, "blk": layer, "pos": t, "ids": row[layer]}
                      for t, row in enumerate(trace.step(s).tolist())
                      if not (lose_one and (s, layer, t) == (1, 1, 3))]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _positional_log(tmp_path):
    """One record per MoE layer call in execution order: no step, layer or token key."""
    trace = synthesize("skewed", steps=3, tokens=7, layers=3, experts=E, top_k=K, seed=6)
    lines = [{"topk_ids": trace.step(s)[:, layer].tolist()}
             for s in range(trace.num_steps) for layer in range(3)]
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


KEYS = {"token_key": "pos", "layer_key": "blk", "ids_key": "ids", "step_key": "it"}
KEY_FLAGS = [f for k, v in KEYS.items() for f in ("--" + k.replace("_", "-"), v)]
# setting -> (the file it is tried on, its flags, its keywords): each is one flag of `eplbsim
# run` and one keyword of `open_trace`, given alone or with what it needs
CASES = {
    "select_steps": (_shaped_npz, ["--select-steps", "1:4,5"], {"select_steps": "1:4,5"}),
    "drop_warmup": (_shaped_npz, ["--drop-warmup"], {"drop_warmup": True}),
    "drop_dummy": (_shaped_npz, ["--drop-dummy"], {"drop_dummy": True}),
    "drop_outliers": (_shaped_npz, ["--drop-outliers"], {"drop_outliers": True}),
    "max_batched_tokens": (_shaped_npz, ["--max-batched-tokens", "5"],
                           {"max_batched_tokens": 5}),
    "layers_per_pass": (_positional_log, ["--layers-per-pass", "3"], {"layers_per_pass": 3}),
    "incomplete": (lambda p: _token_log(p, lose_one=True),
                   ["--skip-type", "hdr", "--incomplete", "drop", *KEY_FLAGS],
                   {"skip_type": "hdr", "incomplete": "drop", **KEYS}),
    "experts": (_positional_log, ["--layers-per-pass", "3", "--experts", "12"],
                {"layers_per_pass": 3, "experts": 12}),
}
for _name in ("skip_type", *KEYS):  # the log's header and its keys (not all found alone)
    CASES[_name] = (_token_log, ["--skip-type", "hdr", *KEY_FLAGS], {"skip_type": "hdr", **KEYS})


def _cli_rows(capsys, args):
    assert main(["run", *args, "--json", "--policies", "row,ordinal", "--mode", "none",
                 "--gpus", "4"]) == 0
    return json.loads(capsys.readouterr().out)


def _python_rows(trace):
    return json.loads(to_json([r.row() for r in compare(trace, ["row", "ordinal"], ["none"],
                                                         RunSpec.of(gpus=4))]))


@pytest.mark.parametrize("setting", sorted(CASES))
def test_each_setting_gives_the_numbers_its_flag_gives(tmp_path, capsys, setting):
    write, flags, keywords = CASES[setting]
    path = write(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InputWarning)
        trace = open_trace(path, **keywords)
        plain = open_trace(path, **{k: v for k, v in keywords.items() if k != setting}) \
            if setting in SHAPING else None
    cli = _cli_rows(capsys, ["--trace", path, *flags])
    assert cli == _python_rows(trace)
    if plain is not None:  # the setting changes what is replayed
        assert trace.num_steps != plain.num_steps or trace.num_tokens != plain.num_tokens
        assert _python_rows(plain) != cli


def test_the_cases_try_every_reading_option_of_the_command_line():
    assert set(CASES) >= set(SHAPING) | set(READER_OPTIONS) - {
        "where",  # a counts CSV: tests/traces/test_counts, and test_a_counts_csv_... below
        "request_key", "prompt_len_key", "prompt_len"}  # requests: test_requests_... below


def test_a_counts_csv_filtered_gives_the_promise_its_flags_give(tmp_path, capsys):
    path = tmp_path / "c.csv"
    rows = [f"{m},{layer},{e},{(e + 1) * (3 if m == 'a' else 1)}"
            for m in "ab" for layer in (0, 1) for e in range(E)]
    path.write_text("m,layer,expert,count\n" + "\n".join(rows) + "\n")
    assert main(["run", "--trace", str(path), "--where", "m=a", "--experts", "12", "--json",
                 "--gpus", "4"]) == 0
    cli = json.loads(capsys.readouterr().out)
    counts = open_trace(path, where="m=a", experts=12)
    assert counts.num_experts == 12
    assert cli == json.loads(to_json([replay(counts, RunSpec.of(gpus=4)).row()]))


def test_requests_read_and_batched_give_what_their_flags_give(tmp_path, capsys):
    from eplbsim.traces.formats import open_requests
    from eplbsim.traces.workload import Workload, batch
    log = _token_log(tmp_path)
    text = [json.loads(line) for line in open(log)]
    for i, rec in enumerate(text):
        if rec["type"] == "r":
            rec.update(req=f"q{rec['it']}", plen=4)
    (tmp_path / "req.jsonl").write_text("".join(json.dumps(x) + "\n" for x in text))
    read = dict(request_key="req", prompt_len_key="plen", skip_type="hdr", ids_key="ids",
                token_key="pos", layer_key="blk")
    flags = [f for k, v in read.items() for f in ("--" + k.replace("_", "-"), v)]
    assert main(["run", "--requests", str(tmp_path / "req.jsonl"), *flags, "--max-batched-tokens",
                 "6", "--dp", "2", "--json", "--policies", "row", "--mode", "none",
                 "--gpus", "4"]) == 0
    cli = json.loads(capsys.readouterr().out)
    steps = batch(open_requests(str(tmp_path / "req.jsonl"), **read),
                  Workload(max_batched_tokens=6, dp=2, seed=0)).trace
    assert max(steps.tokens_per_step.tolist()) > 6  # two DP ranks' batches of 6, gathered
    assert cli == json.loads(to_json([r.row() for r in compare(  # its budget: no step cut
        steps, ["row"], ["none"], RunSpec.of(gpus=4, max_batched_tokens=6))]))
    with pytest.raises(InputError, match=r"batched from requests with max_batched_tokens 6"):
        compare(steps, ["row"], ["none"], RunSpec.of(gpus=4, max_batched_tokens=4))


def test_every_keyword_of_open_trace_is_in_its_docstring_and_every_reader_s_option_is_one():
    params = inspect.signature(open_trace).parameters
    keywords = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    doc = open_trace.__doc__
    assert [n for n in keywords if not re.search(rf"\b{n}\b", doc)] == []
    assert set(keywords) == reading_options(FORMATS) | set(SHAPING)
    assert set(inspect.signature(shape_steps).parameters) - {"trace"} == set(SHAPING)


@pytest.mark.parametrize("call,python,flags", [
    (lambda p: open_trace(_token_log(p, lose_one=True), skip_type="hdr", **KEYS,
                          incomplete="error"),
     'incomplete="drop" leaves them out', ["--skip-type", "hdr", *KEY_FLAGS, "--incomplete",
                                           "error"]),
    (lambda p: open_trace(_positional_log(p)), "Give layers_per_pass=L", []),
    (lambda p: open_trace(_shaped_npz(p), max_batched_tokens=0),
     "max_batched_tokens=... must be an integer >= 1", None),
    (lambda p: open_trace(_shaped_npz(p), drop_dummy="yes"), "drop_dummy=... is True or False",
     None),
    (lambda p: open_trace(_shaped_npz(p), where="m=a"), "where=... applies to a counts CSV", None),
])
def test_an_error_in_python_names_the_keyword_and_on_the_command_line_the_flag(
        tmp_path, capsys, call, python, flags):
    with pytest.raises(InputError) as err:
        call(tmp_path)
    assert python in str(err.value) and "--" not in str(err.value)
    if flags is None:
        return
    path = (_token_log(tmp_path, lose_one=True) if flags else _positional_log(tmp_path))
    assert main(["run", "--trace", path, *flags, "--policies", "row", "--gpus", "4"]) == 2
    said = capsys.readouterr().err
    assert ("--incomplete drop leaves them out" if flags else "Give --layers-per-pass L") in said
    assert python not in said


def test_a_warning_of_reading_points_at_the_caller_s_line(tmp_path):
    path = _token_log(tmp_path, lose_one=True)
    with pytest.warns(InputWarning, match='incomplete="drop" left them out') as caught:
        line = inspect.currentframe().f_lineno + 1
        open_trace(path, skip_type="hdr", **KEYS, incomplete="drop")
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


@pytest.mark.parametrize("setting", SHAPING)
def test_each_steps_setting_of_the_run_spec_gives_the_numbers_its_flag_gives(tmp_path, capsys,
                                                                             setting):
    write, flags, keywords = CASES[setting]
    path = write(tmp_path)
    cli = _cli_rows(capsys, ["--trace", path, *flags])
    spec = RunSpec.of(gpus=4, **keywords)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        rows = json.loads(to_json([r.row() for r in compare(open_trace(path), ["row", "ordinal"],
                                                             ["none"], spec)]))
        one = json.loads(to_json([replay(open_trace(path), spec.replace(policy="row")).row()]))
        plain = _python_rows(open_trace(path))
    assert rows == cli and one == cli[:1]
    assert [r[setting] for r in rows] == [keywords[setting]] * 2
    assert [r["gpu_imbalance"] for r in plain] != [r["gpu_imbalance"] for r in cli]


def test_a_steps_setting_given_to_open_trace_and_the_spec_is_applied_once(tmp_path, capsys):
    path = _shaped_npz(tmp_path)
    cli = _cli_rows(capsys, ["--trace", path, "--select-steps", "1:4,5"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        once = open_trace(path, select_steps="1:4,5")
        both = compare(once, ["row", "ordinal"], ["none"],
                       RunSpec.of(gpus=4, select_steps="1:4,5"))
    assert json.loads(to_json(both.rows())) == cli
    assert both[0].true_load.shape[0] == once.num_steps == 4  # not 1:4,5 of its 4 steps
    with pytest.raises(InputError, match=r"shaped already \(select_steps='1:4,5': by open_trace"
                                         r" or shape_steps\), and the spec would shape them "
                                         r"again \(max_batched_tokens=5\)"):
        replay(once, RunSpec.of(gpus=4, max_batched_tokens=5))
    with pytest.raises(InputError, match="unknown setting nonsense"):
        RunSpec.of(nonsense=1)


def test_shape_steps_shapes_a_trace_already_open_as_open_trace_does(tmp_path):
    path = _shaped_npz(tmp_path)
    shaped = shape_steps(open_trace(path), drop_warmup=True, drop_dummy=True,
                         max_batched_tokens=5)
    opened = open_trace(path, drop_warmup=True, drop_dummy=True, max_batched_tokens=5)
    assert shaped.tokens_per_step.tolist() == opened.tokens_per_step.tolist()
    assert max(shaped.tokens_per_step.tolist()) == 5
    assert (shaped.counts() == opened.counts()).all()
