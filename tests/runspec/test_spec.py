"""The run schema: every field is settable from `run`, from `ranks` where it applies and from a
sweep spec, each bad value gets one message wherever it was given, and the parts check how
their fields go together.

Each field of the schema needs an entry in EXAMPLES (the test fails for a field without one):
the command-line text of a good value, the value it gives, and a bad value with the message
fragment every entry point must say. `context` holds other fields the example needs.
"""

import json
from pathlib import Path

import pytest

from eplbsim.base.errors import InputError
from eplbsim.cli import build_parser
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.replay.sweep import parse_spec
from eplbsim.runspec import (PARTS, RunSpec, Source, Switch, build, default_of, from_args, knobs,
                             run_knobs)
from eplbsim.traces import save_trace, synthesize

REBALANCE = {"rebalance_every": 4}
ASYNC = {**REBALANCE, "rebalance_mode": "async"}
REQUESTS = {"requests": "requests"}
# name: (command-line text, value, bad value or None, message fragment, context)
EXAMPLES = {
    "trace": ("FILE:t.npz", "FILE:t.npz", "missing.npz", "missing.npz: no such file", {}),
    "scenario": ("template", "template", "zipf", "unknown scenario 'zipf'", {}),
    "where": ("model=a", "model=a", "model", "COLUMN=VALUE", {"trace": "FILE:c.csv"}),
    "request_key": ("rid", "rid", "", "must be non-empty text", {"trace": "FILE:t.npz"}),
    "token_key": ("tok", "tok", "", "must be non-empty text", {"trace": "FILE:t.npz"}),
    "layer_key": ("lay", "lay", "", "must be non-empty text", {"trace": "FILE:t.npz"}),
    "ids_key": ("ids", "ids", "", "must be non-empty text", {"trace": "FILE:t.npz"}),
    "step_key": ("it", "it", "", "must be non-empty text", {"trace": "FILE:t.npz"}),
    "prompt_len_key": ("pl", "pl", "", "must be non-empty text", {"trace": "FILE:t.npz"}),
    "skip_type": ("meta", "meta", "", "must be non-empty text", {"trace": "FILE:t.npz"}),
    "prompt_len": ("4", 4, -1, "must be an integer >= 0, got -1", {"trace": "FILE:t.npz"}),
    "select_steps": ("1:", "1:", "1:x", "is not a step", {}),
    "drop_warmup": (True, True, "maybe", "must be true or false", {}),
    "drop_dummy": (True, True, "maybe", "must be true or false", {}),
    "drop_outliers": (True, True, "maybe", "must be true or false", {}),
    "incomplete": ("drop", "drop", "skip", "unknown incomplete 'skip'",
                   {"trace": "FILE:t.npz"}),
    "layers_per_pass": ("48", 48, 0, "must be an integer in [1, 4096], got 0",
                        {"trace": "FILE:t.npz"}),
    "steps": ("5", 5, 0, "must be an integer >= 1, got 0", {}),
    "tokens": ("64", 64, 0, "must be an integer >= 1, got 0", {}),
    "layers": ("2", 2, 0, "must be an integer in [1, 4096], got 0", {}),
    "experts": ("32", 32, 0, "must be an integer in [1, 65536], got 0", {}),
    "top_k": ("4", 4, 0, "must be an integer in [1, 1024], got 0", {}),
    "scenario_options": ("sigma=2", {"sigma": 2}, "nope=1", "has no option nope", {}),
    "policy": ("row", "row", "modulo", "unknown policy 'modulo'", {}),
    "mode": ("a2a", "a2a", "both", "unknown mode 'both'", {}),
    "view": ("sglang-0.5.14", "sglang-0.5.14", "far", "unknown view 'far'", {}),
    "rng": ("shared", "shared", "chaos", "unknown rng relation 'chaos'", {}),
    "drift_p": ("0.5", 0.5, 2, "must be a number in [0, 1], got 2", {}),
    "rank_offset": (True, True, "maybe", "must be true or false", {}),
    "spill_slack": ("0.25", 0.25, -1, "must be a number in [0, 100], got -1", {}),
    "seed": ("3", 3, 2**32, "must be an integer in [0, 4294967295], got 4294967296", {}),
    "device": ("auto", "auto", "tpu", "unknown device 'tpu'", {}),
    "hidden": ("4", 4, 0, "must be an integer in [1, 4096], got 0", {}),
    "tp": ("2", 2, 0, "must be an integer in [1, 65536], got 0", {}),
    "shared_experts": ("2", 2, -1, "must be an integer in [0, 1024], got -1", {}),
    "engine_source": ("sglang=FILE:eng", {"sglang": "FILE:eng"}, "tgi=x",
                      "unknown engine 'tgi'", {}),
    "engine_args": ("--enable-eplb", "--enable-eplb", "--port 1", "'--port' is not one of",
                    {}),
    "solver": ("lpt", "lpt", "greedy", "unknown solver 'greedy'", {}),
    "solver_options": ("anti_colocation=true", {"anti_colocation": True}, "nope=1",
                       "has no option nope", {}),
    "lplb_topology": ("ring", "ring", "star", "unknown redundancy topology 'star'",
                      {"solver": "lplb"}),
    "affinity_slack": ("0.1", 0.1, 2, "must be a number in [0, 1], got 2",
                       {"solver": "affinity"}),
    "solve_from": ("prefill", "prefill", "middle", "unknown stage 'middle'", {}),
    "decode_tokens": ("64", 64, -1, "must be an integer >= 0, got -1", {}),
    "placement": ("FILE:p.json", "FILE:p.json", "missing.json", "missing.json: no such file",
                  {}),
    "rebalance_every": ("4", 4, 0, "must be an integer >= 1, got 0", {}),
    "window": ("3", 3, 0, "must be an integer >= 1, got 0", REBALANCE),
    "predictor": ("ema", "ema", "psychic", "unknown predictor 'psychic'", REBALANCE),
    "decay": ("0.5", 0.5, 2, "must be a number in [0, 1], got 2", REBALANCE),
    "initial": ("FILE:p.json", "FILE:p.json", "missing.json", "missing.json: no such file",
                REBALANCE),
    "skip_above": ("0.9", 0.9, -1, "must be a number in [0, 1], got -1", REBALANCE),
    "migration_aware": (False, False, "maybe", "must be true or false", {}),
    "expert_bytes": ("1000", 1000, -1, "must be an integer in [0, 1099511627776], got -1", {}),
    "rebalance_mode": ("async", "async", "later", "unknown rebalance mode 'later'", REBALANCE),
    "copy_steps": ("2", 2, 0, "must be an integer >= 1, got 0", ASYNC),
    "switch_delay": ("1", 1, -1, "must be an integer >= 0, got -1", ASYNC),
    "migration": ("vllm", "vllm", "deepspeed", "unknown migration 'deepspeed'", REBALANCE),
    "map_lead": ("1", 1, -1, "must be an integer >= 0, got -1", REBALANCE),
    "unmoved": ("2", 2, 3, "must be an integer in [0, 2], got 3", {**REBALANCE, "migration": "vllm"}),
    "gpus": ("4", 4, 0, "must be an integer in [1, 65536], got 0", {}),
    "gpus_per_node": ("2", 2, 0, "must be an integer in [1, 65536], got 0", {}),
    "redundant": ("8", 8, 10**8, "must be an integer in [-262144, 262144], got 100000000",
                  {}),
    "groups": ("4", 4, 0, "must be an integer in [1, 65536], got 0", {}),
    "fail_ranks": ("3,1", (1, 3), "1,1", "must be distinct ranks >= 0, at least one", {}),
    "fail_at": ("2", 2, -1, "must be an integer >= 0, got -1", {"fail_ranks": "1"}),
    "recovery": ("resolve", "resolve", "guess", "unknown recovery 'guess'", {"fail_ranks": "1"}),
    "requests": ("requests", "requests", "nope", "no such file", {}),
    "max_running": ("4", 4, 0, "must be an integer >= 1, got 0", REQUESTS),
    "max_batched_tokens": ("64", 64, 0, "must be an integer >= 1, got 0", {}),
    "chunk": ("16", 16, 0, "must be an integer >= 1, got 0", REQUESTS),
    "batch_order": ("prefill-first", "prefill-first", "random", "unknown batch order 'random'",
                    REQUESTS),
    "arrivals": ("poisson", "poisson", "later", "unknown arrivals 'later'", REQUESTS),
    "arrival_rate": ("2", 2.0, 0, "must be a number in [1e-09, 4.61169e+18], got 0", REQUESTS),
    "dp": ("2", 2, 0, "must be an integer in [1, 65536], got 0", REQUESTS),
    "dp_assign": ("least-loaded", "least-loaded", "random", "unknown dp assignment 'random'",
                  REQUESTS),
    "dp_layout": ("max", "max", "min", "unknown dp layout 'min'", REQUESTS),
    "graph_sizes": ("1,2,4", (1, 2, 4), "4,2", "must be increasing integers >= 1, got [4, 2]",
                    REQUESTS),
    "padding": ("routed", "routed", "zeros", "unknown padding 'zeros'", REQUESTS),
    "cost": ("roofline", "roofline", "guess", "unknown cost model 'guess'", {}),
    "cost_options": ("framework=sglang", {"framework": "sglang"}, "nope=1", "has no option nope",
                     {"cost": "measured"}),
    "model": ("mixtral-8x7b", "mixtral-8x7b", "gpt-9", "unknown model 'gpt-9'", {}),
    "device_profile": ("b200", "b200", "tpu-v9", "unknown device profile 'tpu-v9'", {}),
    "overlap": (True, True, "maybe", "must be true or false", {}),
    "dispatch_buffer_gib": ("32", 32.0, 0, "must be a number in [0.000976562, 1024], got 0", {}),
    "dispatch_cap": ("1840", 1840, 0, "must be an integer >= 1, got 0", {}),
}
ALL = [(part, name, knob) for part, name, knob in knobs()]
BY_NAME = {name: knob for _, name, knob in ALL}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files the examples name: a trace, a counts CSV and a placement JSON."""
    base = tmp_path_factory.mktemp("files")
    save_trace(synthesize("skewed", steps=2, tokens=8, layers=1, experts=8, top_k=2),
               base / "t.npz")
    (base / "c.csv").write_text("model,layer,expert,count\na,0,0,3\na,0,1,1\n")
    (base / "p.json").write_text(json.dumps({"phy2log": [list(range(8))]}))
    (base / "eng" / "sglang").mkdir(parents=True)  # an engine source (a checkout's python/)
    return base


def _text(value, base):
    """`value` with its `FILE:name` placeholders (whole, after `KEY=`, or a mapping's values)
    made paths under `base`."""
    if isinstance(value, dict):
        return {k: _text(v, base) for k, v in value.items()}
    if isinstance(value, str) and "=FILE:" in value:
        key, _, rest = value.partition("=")
        return f"{key}={_text(rest, base)}"
    return str(base / value[5:]) if isinstance(value, str) and value.startswith("FILE:") \
        else value


def _flags(name, text, knob):
    flag = (knob.flags or ("--" + name.replace("_", "-"),))[-1]
    if isinstance(knob.type, Switch):
        return [flag if text else "--no-" + flag[2:]]
    return [flag, str(text)]


def _cli_values(command, name, text, context, base):
    """What `command` makes of `--name text` (with the context's flags)."""
    by_name = {n: k for _, n, k in ALL}
    argv = [command] + (["--world-size", "2"] if command == "ranks" else [])
    for key, value in {**context, name: text}.items():
        argv += _flags(key, _text(value, base), by_name[key])
    args = build_parser().parse_args(argv)
    values, _ = from_args(args, command)
    return build(values)


def _get(source, spec, name):
    return getattr(source, name) if name in {n for _, n, _ in knobs(("source",))} \
        else spec.get(name)


def _sweep_doc(name, value, context, base, in_grid=False):
    doc = {k: _text(v, base) for k, v in context.items()}
    key, entry = name, value
    if name in ("solver_options", "scenario_options", "cost_options", "engine_source"):
        (option, entry), = value.items()
        key = f"{BY_NAME[name].type.prefix}.{option}"
    if not {"trace", "requests"} & set(doc) and name not in ("trace", "scenario", "requests"):
        doc.setdefault("scenario", "skewed")
    table = {key: [entry] if in_grid else entry}
    return {"fixed": doc, "grid": table} if in_grid else {"fixed": {**doc, **table}}


def test_every_field_has_an_example_and_one_name():
    names = [name for _, name, _ in ALL]
    assert len(names) == len(set(names)), "field names must be unique across parts"
    assert set(EXAMPLES) == set(names), "add an EXAMPLES entry for every new field"


@pytest.mark.parametrize("part, name, knob", ALL, ids=[n for _, n, _ in ALL])
def test_every_field_is_settable_from_run_ranks_and_a_sweep(part, name, knob, files):
    text, value, _, _, context = EXAMPLES[name]
    want = _text(value, files)
    assert want != default_of(part, name), "an example must differ from the default"
    for command in ("run", "ranks"):
        if command in knob.commands:
            source, spec = _cli_values(command, name, text, context, files)
            assert _get(source, spec, name) == want, command
    assert "sweep" in knob.commands
    sweep_value = _text(value, files)
    (cell,) = parse_spec(_sweep_doc(name, sweep_value, context, files), files)
    assert cell.values[name] == want
    (cell,) = parse_spec(_sweep_doc(name, sweep_value, context, files, in_grid=True), files)
    assert cell.values[name] == want


@pytest.mark.parametrize("part, name, knob", ALL, ids=[n for _, n, _ in ALL])
def test_a_bad_value_gets_one_message_everywhere(part, name, knob, files):
    _, _, bad, fragment, context = EXAMPLES[name]
    messages = []
    for command in ("run", "ranks"):
        if command in knob.commands and not isinstance(knob.type, Switch):
            with pytest.raises(InputError) as info:
                _cli_values(command, name, bad, context, files)
            messages.append(str(info.value))
    sweep_bad = {bad.partition("=")[0]: 1} if isinstance(EXAMPLES[name][1], dict) else bad
    with pytest.raises(InputError) as info:
        parse_spec(_sweep_doc(name, sweep_bad, context, files), files, "spec.toml")
    messages.append(str(info.value))
    python = {k: _text(v, files) for k, v in {**context, name: sweep_bad}.items()}
    with pytest.raises(InputError) as info:
        if part == "source":
            Source(**python)
        else:
            RunSpec.of(**python)
    messages.append(str(info.value))
    for message in messages:
        assert fragment in message, (fragment, messages)
    if isinstance(EXAMPLES[name][1], dict) or part == "source" and name == "where":
        return
    assert all(m.endswith(messages[0].rpartition(": ")[2]) for m in messages), messages


def test_settings_that_need_a_schedule_or_exclude_one_are_refused():
    with pytest.raises(InputError, match="window, predictor only apply with rebalance_every"):
        RunSpec.of(window=5, predictor="oracle")
    placement = Placement([[0, 1]], 2, Topology(2))
    with pytest.raises(InputError, match="cannot be combined with rebalance_every"):
        RunSpec.of(placement=placement, rebalance_every=2)
    with pytest.raises(InputError, match="steps applies to scenarios only"):
        Source(trace=str(Path(__file__)), steps=3)
    with pytest.raises(InputError, match="give a trace or a scenario, not both"):
        Source(trace=str(Path(__file__)), scenario="skewed")
    with pytest.raises(InputError, match="unknown setting colour"):
        RunSpec.of(colour="red")


def test_replace_routes_flat_names_and_keeps_the_rest():
    spec = RunSpec.of(gpus=4, policy="row")
    other = spec.replace(mode="a2a", redundant=4)
    assert (other.topology.gpus, other.dispatch.policy, other.dispatch.mode,
            other.topology.redundant) == (4, "row", "a2a", 4)
    assert spec.dispatch.mode == "none" and other.solver is spec.solver
    assert list(spec.labels())[:4] == ["policy", "mode", "view", "rng"]
    assert set(PARTS) == {"source", "dispatch", "solver", "schedule", "topology", "cost",
                          "steps"}
    assert [n for _, n, _ in run_knobs()] == list(spec.labels())


def test_defaults_fit_the_cluster_and_the_trace():
    source, spec = _cli_values("run", "tokens", "64", {}, Path("."))
    assert spec.topology.gpus_per_node is None and spec.topology.redundant is None
    assert spec.topology.topology().gpus_per_node == 8  # one box of eight
    assert spec.labels()["gpus_per_node"] == 8
    assert RunSpec.of(gpus=32).topology.topology().num_nodes == 4
    assert RunSpec.of(gpus=12).topology.topology().num_nodes == 1  # 8 does not divide 12
    # one redundant slot a GPU, at least 16, rounded up so the GPUs divide the slots
    assert RunSpec.of(gpus=8).fit(64).topology.redundant == 16
    assert RunSpec.of(gpus=32).fit(60).topology.redundant == 36
    assert RunSpec.of(gpus=32, redundant=4).fit(60).topology.redundant == 4
    with pytest.raises(InputError, match="92 slots do not divide over 32 GPUs; redundant 4 or "
                                         "36 would"):
        RunSpec.of(gpus=32, redundant=32).fit(60)
    with pytest.raises(InputError, match="the placement decides the slots"):
        RunSpec.of(gpus=2, redundant=2).fit(16, slots=20, file="p.json")
    assert RunSpec.of(gpus=2).fit(16, slots=20).topology.redundant == 4
    args = build_parser().parse_args(["run"])
    _, lists = from_args(args, "run")
    assert lists == {"policy": ["static", "random", "row", "ordinal"], "mode": ["none", "a2a"]}


def test_tp_must_divide_the_gpus():
    with pytest.raises(InputError, match="tp 4 does not divide the 6 GPUs"):
        RunSpec.of(gpus=6, tp=4)


@pytest.mark.parametrize("field, solver, option, value, other", [
    ("lplb_topology", "lplb", "redundancy", "ring", "cube"),
    ("affinity_slack", "affinity", "slack", 0.1, 0.2)])
def test_a_solvers_own_flag_is_its_option(field, solver, option, value, other):
    spec = RunSpec.of(solver=solver, **{field: value})
    assert spec.solver.solver_options == {option: value}
    with pytest.raises(InputError, match="the solver is deepseek"):
        RunSpec.of(**{field: value})
    with pytest.raises(InputError, match="disagree"):
        RunSpec.of(solver=solver, solver_options={option: other}, **{field: value})


def test_the_steps_settings_go_to_the_source_and_the_spec_alike():
    """A command reads the trace's steps by them (the source) and the run says them (the spec),
    so `replay` given the trace read applies them once (`replay.shaped`)."""
    for name, text, value in (("max_batched_tokens", "64", 64), ("select_steps", "1:", "1:"),
                              ("drop_dummy", True, True)):
        source, spec = _cli_values("run", name, text, {}, Path("."))
        assert getattr(source, name) == spec.get(name) == spec.labels()[name] == value
