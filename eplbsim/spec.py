"""The run schema: every setting of a run, declared once.

A run is described by small frozen parts (`PARTS`, in order): `source` (which trace a command
reads: a file, or a scenario with its sizes and options), `dispatch`, `solver`, `schedule` and
`topology`. :class:`RunSpec` holds the last four (`replay` takes the trace itself). Each field
is declared with :func:`knob`: its default, help text, value type (which parses command-line
text and checks any value, with one message wherever the value came from) and the commands it
can be set from. The flags of `run` and `ranks` (`add_flags`, `from_args`), the keys of a sweep
spec (`sweep_keys`, `sweep_value`), the labels of every result row (`RunSpec.labels`) and the
checks are all generated from these declarations, so a new setting is one field, and a new part
one class and one line in `PARTS`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from itertools import product
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from .cost import COST_MODELS, DEVICES, MODELS, DeviceProfile, ModelShape
from .cost.shapes import DEFAULT_MODEL
from .cost import check_options as check_cost_options
from .cost import describe as describe_cost
from .dispatch import POLICIES, DispatchPolicy, FilePolicies, resolve_policy
from .engines import ENGINE_POLICIES, ENGINE_SOLVERS, as_sources, resolve_solver
from .engines.sglang_runtime import flags as engine_flags
from .errors import InputError
from .limits import (MAX_BATCH, MAX_EXPERT_BYTES, MAX_EXPERTS, MAX_GPUS, MAX_HIDDEN, MAX_LAYERS,
                     MAX_SEED, MAX_SLOTS, MAX_TOP_K, check_at_most)
from .placement import VIEWS, Placement
from .ranks import MODES, RNG_RELATIONS
from .registry import Joined, name_of, unknown
from .schedule.predictors import PREDICTORS
from .schedule.switch import REBALANCE_MODES
from .solvers import SOLVERS, check_options, find_solver
from .solvers.lplb import TOPOLOGIES as LPLB_TOPOLOGIES
from .topology import Topology
from .traces.counts import parse_where
from .traces.formats import is_request_input, open_requests, open_trace
from .traces.request_synth import REQUEST_SCENARIOS, request_options, synthesize_requests
from .traces.requests import RequestSet
from .traces.workload import (ARRIVALS, DEFAULT_GRAPH_SIZES, DP_ASSIGN, DP_LAYOUTS, ORDERS,
                              PADDING, Workload, batch)
from .traces.steps import OUTLIER_FACTOR, parse_steps, select
from .traces.synth import (DEFAULT_SCENARIO, DEFAULT_SIZES, SCENARIOS, scenario_options,
                            synthesize)

KNOB = "eplbsim.knob"  # the metadata key of a declared field
COMMANDS = frozenset({"run", "ranks", "sweep", "review"})
SYNTH = COMMANDS | {"synth"}  # what `trace synth` also takes: the scenario's sizes and seed
READS = COMMANDS | {"info", "convert", "solve", "export", "figures"}  # commands reading a trace
NODE_GPUS = 8  # GPUs a node by default, as H100/H200/B200 boxes have
MIN_REDUNDANT = 16  # the fewest redundant slots by default


# ----------------------------------------------------------------------------- value types
# Each parses command-line text (`parse`) and checks a value from anywhere (`check`): it returns
# the value as stored, or raises InputError whose message says what is wrong (without naming
# the setting: the caller prefixes the flag, the sweep key or the field).

@dataclass(frozen=True)
class Integer:
    """An integer >= `least` (and <= `most`, a cap of `eplbsim.limits`); None too when
    `optional`."""

    least: int = 0
    optional: bool = False
    most: int | None = None

    def parse(self, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise InputError(f"must be an integer, got {text!r}") from None

    def check(self, value: Any) -> int | None:
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < self.least or (
                self.most is not None and value > self.most):
            bound = (f">= {self.least}" if self.most is None
                     else f"in [{self.least}, {self.most}]")
            raise InputError(f"must be an integer {bound}, got {value!r}")
        return int(value)


@dataclass(frozen=True)
class Number:
    """A finite number in `[least, most]` (stored as float); None too when `optional`."""

    least: float = -math.inf
    most: float = math.inf
    optional: bool = False

    def parse(self, text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise InputError(f"must be a number, got {text!r}") from None

    def check(self, value: Any) -> float | None:
        if value is None and self.optional:
            return None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or not self.least <= value <= self.most:
            got = f"{value:g}" if number else repr(value)  # 2 and 2.0 read the same
            raise InputError(f"must be a number in [{self.least:g}, {self.most:g}], got {got}")
        return float(value)


@dataclass(frozen=True)
class Switch:
    """True or False, 1 or 0 read as such (a `--flag / --no-flag` pair on the command line);
    None too when `optional` (neither given: the setting's automatic choice)."""

    optional: bool = False

    def parse(self, text: str) -> bool:
        raise AssertionError("switches are parsed by argparse")

    def check(self, value: Any) -> bool | None:
        if value is None and self.optional:
            return None
        if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
            raise InputError(f"must be true or false (or 1 or 0), got {value!r}")
        return bool(value)


@dataclass(frozen=True)
class Name:
    """A name in `registry` (a dict or a sequence of names, read when checking, so entries
    registered later count); when `callables`, also a callable or an `entry` object (e.g. a
    `DispatchPolicy`) given directly; None too when `optional`."""

    registry: Any
    kind: str
    callables: bool = False
    entry: type | None = None
    optional: bool = False

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if self.callables and (callable(value) or (self.entry is not None
                                                   and isinstance(value, self.entry))):
            return value
        if not isinstance(value, str) or value not in self.registry:
            raise unknown(self.kind, value, self.registry)
        return value


@dataclass(frozen=True)
class File:
    """A path to an existing file or directory; None when absent (`absent` on the command
    line: e.g. `--initial trivial`); a Placement object too when `placement`."""

    what: str
    placement: bool = False
    absent: str | None = None

    def parse(self, text: str) -> str | None:
        return None if text == self.absent else text

    def check(self, value: Any) -> Any:
        if value is None or value == self.absent:
            return None
        if self.placement and isinstance(value, Placement):
            return value
        if not isinstance(value, (str, os.PathLike)):
            raise InputError(f"must be a path to {self.what}, got {value!r}")
        if not Path(value).exists():
            raise InputError(f"{value}: no such file")
        return str(value)


@dataclass(frozen=True)
class Options:
    """Named options `{KEY: number, text or boolean}`; `KEY=VALUE` on the command line (VALUE
    read as JSON when it can be: numbers, true/false), `PREFIX.KEY` in a sweep spec."""

    prefix: str

    def parse(self, text: str) -> tuple[str, Any]:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise InputError(f"expected KEY=VALUE, got {text!r}")
        try:
            return key, json.loads(value)
        except ValueError:
            return key, value

    def check(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise InputError(f"must be a mapping of option names to values, got {value!r}")
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, (str, int, float, bool)):
                raise InputError(f"option {key!r} must be a number, text or boolean, "
                                 f"got {item!r}")
        return dict(value)


@dataclass(frozen=True)
class EngineSources(Options):
    """Engine sources `{ENGINE: PATH or "=VERSION"}`: `ENGINE=PATH` or `ENGINE==VERSION` on the
    command line, comma-separated or repeated. Several sources of one engine make several runs
    (`sets`), side by side."""

    def sets(self, texts: Sequence[str]) -> list[dict[str, Any]]:
        """The source sets `texts` (flag values, each comma-separated) name: every combination
        of each engine's sources, in the order given (one set when each engine has one)."""
        given: dict[str, list[str]] = {}
        for text in texts:
            for item in (t.strip() for t in text.split(",") if t.strip()):
                engine, value = self.parse(item)
                if str(value) not in given.setdefault(engine, []):
                    given[engine].append(str(value))
        return [dict(zip(given, chosen)) for chosen in product(*given.values())] or [{}]


@dataclass(frozen=True)
class Device:
    """`cpu`, `cuda`, `cuda:N` or `auto` (CUDA when torch sees a device, else the CPU)."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str:
        ok = isinstance(value, str) and (value in ("cpu", "cuda", "auto") or (
            value.startswith("cuda:") and value[5:].isdigit()))
        if not ok:
            raise unknown("device", value, ("cpu", "cuda", "auto"), ("cuda:N",))
        return value


@dataclass(frozen=True)
class Sizes:
    """Increasing integers >= 1 (CUDA-graph sizes): comma-separated on the command line,
    `default` for the engines' default sizes, `none` for none."""

    def parse(self, text: str) -> tuple[int, ...]:
        if text in ("default", "none"):
            return DEFAULT_GRAPH_SIZES if text == "default" else ()
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise InputError(f"must be comma-separated integers, default or none, got "
                             f"{text!r}") from None

    def check(self, value: Any) -> tuple[int, ...]:
        if isinstance(value, str):  # a sweep's text, as on the command line
            value = self.parse(value)
        if not isinstance(value, (list, tuple)) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value) \
                or list(value) != sorted(set(value)):
            shown = list(value) if isinstance(value, (list, tuple)) else repr(value)
            raise InputError(f"must be increasing integers >= 1, got {shown}")
        if value:
            check_at_most(value[-1], MAX_BATCH, "the largest size")
        return tuple(value)


@dataclass(frozen=True)
class RequestInput:
    """A request-level input: a request scenario's name, a path to a request file, or a
    RequestSet given directly; None when absent."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> Any:
        if value is None or isinstance(value, RequestSet) or value in REQUEST_SCENARIOS:
            return value
        if not isinstance(value, (str, os.PathLike)):
            raise InputError(f"must be a request file or one of "
                             f"{', '.join(REQUEST_SCENARIOS)}, got {value!r}")
        if not Path(value).exists():
            raise InputError(f"{value}: no such file, and not a request scenario (one of "
                             f"{', '.join(REQUEST_SCENARIOS)})")
        return str(value)


@dataclass(frozen=True)
class Text:
    """Non-empty text (a record key, a record type); None when absent."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise InputError(f"must be non-empty text, got {value!r}")
        return value


@dataclass(frozen=True)
class EngineFlags(Text):
    """An engine's server flags (`--engine-args`): text whose flags the engine adapter reads
    (`engines.sglang_runtime.flags`)."""

    def check(self, value: Any) -> str | None:
        value = super().check(value)
        if value is not None:
            engine_flags(value)
        return value


@dataclass(frozen=True)
class StepSelection:
    """Steps of a trace: comma-separated steps and ranges (`traces.steps.parse_steps`, checked
    against the trace when it is read); None for all."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        parse_steps(value)
        return value


@dataclass(frozen=True)
class Filter:
    """Column filters of a counts CSV, `COLUMN=VALUE,...`; None when absent."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise InputError(f"must be COLUMN=VALUE pairs separated by commas, got {value!r}")
        parse_where(value)
        return value


# ----------------------------------------------------------------------------- declarations

@dataclass(frozen=True)
class Knob:
    """How one field is set.

    type:     its value type (parse and check)
    help:     the help text of its flag (the default is appended)
    flags:    its command-line flags (default `--name-with-dashes`)
    listed:   on run and ranks, a comma-separated list compared side by side, with this
              default (e.g. the policies)
    commands: where it can be set: run, ranks, sweep, and the commands that read a trace
              file (`READS`) or make a scenario (`SYNTH`)
    metavar:  the flag's value placeholder
    """

    type: Any
    help: str
    flags: tuple[str, ...] = ()
    listed: str | None = None
    commands: frozenset[str] = COMMANDS
    metavar: str | None = None


def knob(default: Any, help: str, type: Any, **how: Any) -> Any:
    """A part's field declared with its default, help text, value type and `Knob` settings."""
    meta = {KNOB: Knob(type, help, **how)}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def checked(name: str, knob: Knob, value: Any, label: str | None = None) -> Any:
    """`value` checked by the knob's type; InputError prefixed by `label` (default `name`)."""
    try:
        return knob.type.check(value)
    except InputError as exc:
        raise InputError(f"{label or name}: {exc}") from None


@dataclass(frozen=True)
class Part:
    """Base of the schema's parts: every field is checked (and normalised) on construction,
    then `relate` checks how the fields of the part go together."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, checked(f.name, f.metadata[KNOB],
                                                     getattr(self, f.name)))
        self.relate()

    def relate(self) -> None:
        """InputError when fields that are each valid do not go together."""


def _default(f: Any) -> Any:
    """A dataclass field's default value."""
    return f.default_factory() if f.default is MISSING else f.default


def _they(names: Sequence[str], verb: str) -> str:
    """`names` and `verb` agreeing with them: "dp applies", "dp, chunk apply", "dp does"."""
    single = {"apply": "applies", "do": "does"}[verb]
    return f"{', '.join(names)} {single if len(names) == 1 else verb}"


def _changed(part: Part, names: tuple[str, ...]) -> list[str]:
    """The fields among `names` whose value differs from their default."""
    defaults = {f.name: _default(f) for f in fields(part)}
    return [n for n in names if getattr(part, n) != defaults[n]]


# The Source fields that say how requests are batched into steps (`Source.workload`).
BATCHING = ("max_running", "max_batched_tokens", "chunk", "batch_order", "arrivals",
            "arrival_rate", "dp", "dp_assign", "dp_layout", "graph_sizes", "padding")
WITH_INFO = COMMANDS | {"info"}  # `trace info` reports the steps a workload makes of requests


def workload_of(values: Mapping[str, Any], seed: int) -> Workload:
    """The Workload of `BATCHING` field values (the rest default), seeded by `seed`."""
    renamed = {"batch_order": "order", "arrival_rate": "rate"}
    return Workload(seed=seed, **{renamed.get(k, k): v for k, v in values.items()
                                  if k in BATCHING})


@dataclass(frozen=True)
class Source(Part):
    """Which trace a command reads: a file (`trace`), or a seeded scenario with its sizes."""

    trace: str | None = knob(
        None, "a trace in any form: an .npz trace, a trace directory (see trace convert), a "
        ".jsonl router log or per-token log (see --token-key and the other reading flags), a "
        "Megatron router trace, TensorRT-LLM expert statistics, FLAME-MoE parquet, a "
        "counts-only .npz or a counts CSV (layer,expert,count; see --where): counts give the "
        "placement's even-split promise only",
        File("a trace"), metavar="FILE")
    scenario: Any = knob(None, f"a synthetic scenario (default {DEFAULT_SCENARIO})",
                         Name(SCENARIOS, "scenario", callables=True, optional=True))
    where: str | None = knob(None, "filters for a counts CSV --trace, e.g. model=olmoe,"
                             "domain=arxiv", Filter(), commands=READS, metavar="COL=VAL,..")
    request_key: str | None = knob(None, "per-token log: the key of the request id (the log "
                                   "is then read as requests)", Text(), metavar="KEY",
                                   commands=READS)
    token_key: str | None = knob(None, "per-token log: the key of the token index (default "
                                 "token_idx)", Text(), metavar="KEY", commands=READS)
    layer_key: str | None = knob(None, "per-token log: the key of the layer (default layer)",
                                 Text(), metavar="KEY", commands=READS)
    ids_key: str | None = knob(None, "per-token log: the key of the top-k ids (default "
                               "topk_ids)", Text(), metavar="KEY", commands=READS)
    step_key: str | None = knob(None, "per-token log: the key of the step (default: a new step "
                                "when token indices restart)", Text(), metavar="KEY",
                                commands=READS)
    prompt_len_key: str | None = knob(None, "per-token log: the key of a request's prompt "
                                      "length (with --request-key)", Text(), metavar="KEY",
                                      commands=READS)
    skip_type: str | None = knob(None, "per-token log: skip records whose \"type\" is TYPE (a "
                                 "header)", Text(), metavar="TYPE", commands=READS)
    prompt_len: int | None = knob(None, "vLLM routed-expert arrays: the prompt rows of every "
                                  ".npy file (an .npz names its own)",
                                  Integer(0, optional=True), metavar="N", commands=READS)
    select_steps: str | None = knob(
        None, "replay only these steps of the trace: steps and ranges of its own numbering, "
        "e.g. 2:, 0:100,150 or :-1 (trace info numbers them)", StepSelection(),
        metavar="STEPS", commands=READS)
    drop_warmup: bool = knob(False, "leave out warm-up steps: two or more rows all routed "
                             "alike, as an engine's start-up profiling pass (trace info flags "
                             "them)", Switch(), commands=READS)
    drop_outliers: bool = knob(False, f"leave out steps of more than {OUTLIER_FACTOR}x the "
                               f"median tokens (trace info flags them)", Switch(),
                               commands=READS)
    steps: int | None = knob(
        None, f"steps of the scenario ({DEFAULT_SIZES['steps']}; with --rebalance-every N: "
        f"max({DEFAULT_SIZES['steps']}, window + 4N), for four rebalances)",
        Integer(1, optional=True), commands=SYNTH)
    tokens: int = knob(DEFAULT_SIZES["tokens"], "tokens per step", Integer(1), commands=SYNTH)
    layers: int = knob(DEFAULT_SIZES["layers"], "MoE layers",
                       Integer(1, most=MAX_LAYERS), commands=SYNTH)
    experts: int | None = knob(
        None, f"logical experts: a scenario's (default {DEFAULT_SIZES['experts']}), or a log's "
        f"whose ids do not say (default: the largest id + 1)",
        Integer(1, optional=True, most=MAX_EXPERTS), commands=SYNTH | READS)
    top_k: int = knob(DEFAULT_SIZES["top_k"], "experts per token",
                      Integer(1, most=MAX_TOP_K), commands=SYNTH)
    scenario_options: dict = knob({}, "scenario option, e.g. sigma=2 or noise=0.1 (repeat "
                                  "for several)", Options("option"), flags=("-o", "--option"),
                                  metavar="KEY=VALUE", commands=SYNTH)
    requests: Any = knob(None, "requests batched into steps as a serving engine does "
                         "(continuous batching, chunked prefill, DP attention, CUDA graphs): a "
                         "request file (.npz), vLLM's routed experts (JSON or arrays), a "
                         "per-token log with --request-key, or the requests scenario (its "
                         "options by -o, e.g. num_requests=128)", RequestInput(),
                         metavar="FILE|SCENARIO")
    max_running: int = knob(256, "requests: at most N running at once", Integer(1),
                            metavar="N", commands=WITH_INFO)
    max_batched_tokens: int = knob(8192, "requests: tokens a step (decode rows and prefill "
                                   "chunks)", Integer(1), metavar="N", commands=WITH_INFO)
    chunk: int | None = knob(None, "requests: prefill chunk (default max_batched_tokens)",
                             Integer(1, optional=True), metavar="N", commands=WITH_INFO)
    batch_order: str = knob("decode-first", "requests: the rows' order in a step",
                            Name(ORDERS, "batch order"), commands=WITH_INFO)
    arrivals: str = knob("all", "requests: all at step 0, poisson at --arrival-rate, or "
                         "the file's times (trace)", Name(ARRIVALS, "arrivals"),
                         commands=WITH_INFO)
    arrival_rate: float = knob(1.0, "requests: poisson arrivals a step", Number(1e-9),
                               commands=WITH_INFO)
    dp: int = knob(1, "requests: DP attention ranks (each batches its own requests)",
                   Integer(1, most=MAX_GPUS), metavar="D", commands=WITH_INFO)
    dp_assign: str = knob("round-robin", "requests: how requests go to DP ranks",
                          Name(DP_ASSIGN, "dp assignment"), commands=WITH_INFO)
    dp_layout: str = knob("sum", "requests: the gathered MoE batch, sum (no padding), max "
                          "(every DP rank padded to the largest) or sglang (sum at prefill, "
                          "max at decode and under CUDA graphs)",
                          Name(DP_LAYOUTS, "dp layout"), commands=WITH_INFO)
    graph_sizes: tuple = knob((), "requests: captured CUDA-graph sizes a decode-only step is "
                              "padded to (comma-separated, default for 1,2,4,8..256, or none)",
                              Sizes(), metavar="N,..", commands=WITH_INFO)
    padding: str = knob("masked", "requests: CUDA-graph padding rows masked (-1) or routed "
                        "(one fixed seeded top-k set)", Name(PADDING, "padding"),
                        commands=WITH_INFO)

    def workload(self, seed: int) -> Workload:
        """The batching of `requests` (`traces.workload.Workload`), seeded by `seed`."""
        return workload_of({name: getattr(self, name) for name in BATCHING}, seed)

    def reader_options(self) -> dict[str, Any]:
        """The options given for reading a file (`READER_OPTIONS`, for `open_trace` and
        `open_requests`: each form takes its own and refuses the others)."""
        return {k: getattr(self, k) for k in READER_OPTIONS if getattr(self, k) is not None}

    @property
    def file(self) -> str | None:
        """The file read: the trace's, or the request file's (not a request scenario's)."""
        if self.trace is not None:
            return self.trace
        named = isinstance(self.requests, str) and self.requests not in REQUEST_SCENARIOS
        return self.requests if named else None

    def relate(self) -> None:
        scenario_sizes = ("steps", "tokens", "layers", "top_k", "scenario_options")
        if self.file is None:
            unused = _changed(self, tuple(k for k in READER_OPTIONS if k != "experts"))
            if unused:
                raise InputError(f"{_they(unused, 'apply')} to reading a file (a trace or "
                                 f"requests), not to a scenario")
        if self.requests is not None:
            if self.trace is not None or self.scenario is not None:
                raise InputError("give requests, a trace or a scenario, not two of them")
            extra = _changed(self, ("steps", "tokens"))
            if extra:
                raise InputError(f"{_they(extra, 'do')} not apply to requests (the workload "
                                 f"makes the steps)")
            if self.file is None and not isinstance(self.requests, RequestSet):
                unknown = sorted(set(self.scenario_options)
                                 - set(request_options(self.requests)))
                if unknown:
                    raise InputError(f"request scenario {self.requests} has no option "
                                     f"{', '.join(unknown)}; its options are: "
                                     f"{', '.join(request_options(self.requests))}")
            elif _changed(self, ("layers", "top_k", "scenario_options")):
                raise InputError("layers, top_k and scenario options apply to a request "
                                 "scenario, not to a request file")
            return
        unused = _changed(self, BATCHING)
        if unused:
            raise InputError(f"{_they(unused, 'apply')} to requests only (--requests)")
        if self.trace is not None:
            if is_request_input(self.trace, **self.reader_options()):
                raise InputError(f"{self.trace} holds requests, not steps: give it as requests "
                                 f"(--requests), which batches them as an engine does")
            if self.scenario is not None:
                raise InputError("give a trace or a scenario, not both")
            extra = _changed(self, scenario_sizes)
            if extra:
                raise InputError(f"{_they(extra, 'apply')} to scenarios only, not to a trace")
            return
        if self.top_k > self.scenario_experts:
            raise InputError(f"top_k={self.top_k} must not exceed experts="
                             f"{self.scenario_experts} (top-k ids are distinct experts)")
        scenario_options(self.scenario or DEFAULT_SCENARIO, self.scenario_options)

    @property
    def scenario_experts(self) -> int:
        """The experts of a scenario: `experts`, else the scenarios' default."""
        return DEFAULT_SIZES["experts"] if self.experts is None else self.experts

    def request_set(self, seed: int) -> RequestSet:
        """The requests: the file read (`open_requests`), or the scenario drawn with `seed`."""
        if isinstance(self.requests, RequestSet):
            return self.requests
        if self.requests in REQUEST_SCENARIOS:
            return synthesize_requests(self.requests, layers=self.layers,
                                       experts=self.scenario_experts, top_k=self.top_k,
                                       seed=seed, **self.scenario_options)
        return open_requests(self.requests, **self.reader_options())

    def open(self, seed: int, schedule: "SchedulePart") -> Any:
        """The trace a run replays: `read`, then the steps selected (`select`)."""
        return self.select(self.read(seed, schedule))

    def read(self, seed: int, schedule: "SchedulePart") -> Any:
        """Every step: the requests batched (`traces.workload.batch`), the file opened
        (`open_trace`), or the scenario synthesized with `seed` (`steps` defaulting to what
        `schedule` needs: `SchedulePart.steps`)."""
        if self.requests is not None:
            return batch(self.request_set(seed), self.workload(seed)).trace
        if self.trace is not None:
            return open_trace(self.trace, **self.reader_options())
        return synthesize(self.scenario or DEFAULT_SCENARIO, steps=self.steps or schedule.steps(),
                          tokens=self.tokens, layers=self.layers, experts=self.scenario_experts,
                          top_k=self.top_k, seed=seed, **self.scenario_options)

    @property
    def selects(self) -> bool:
        """Whether some steps are selected or dropped (else `select` keeps every step)."""
        return self.select_steps is not None or self.drop_warmup or self.drop_outliers

    def select(self, trace: Any) -> Any:
        """`trace`'s selected steps (`select_steps`, less the flagged kinds dropped:
        `traces.steps.select`)."""
        drop = [kind for kind, on in (("warmup", self.drop_warmup),
                                      ("outlier", self.drop_outliers)) if on]
        return select(trace, self.select_steps, drop)


# What reading a file takes (`Source.reader_options`): a log's experts, a counts CSV's filter,
# a per-token log's keys.
READER_OPTIONS = ("experts", "where", "request_key", "token_key", "layer_key", "ids_key",
                  "step_key", "prompt_len_key", "skip_type", "prompt_len")


@dataclass(frozen=True)
class DispatchPart(Part):
    """How the ranks choose replicas: the policy, the mode, what each rank knows, its
    generator, and the run's seed and device."""

    policy: Any = knob("ordinal", "dispatch policies (one of your own: "
                       "path/to/file.py:function, see docs/api.md)",
                       Name(Joined(POLICIES, ENGINE_POLICIES, FilePolicies()), "policy",
                            callables=True, entry=DispatchPolicy),
                       flags=("--policies",), listed="static,random,row,ordinal",
                       commands=COMMANDS - {"review"},  # a review names its CANDIDATE
                       metavar="NAME,..")
    mode: str = knob("none", "none (every rank dispatches every token) or a2a (each token "
                     "once, by its owner)", Name(MODES, "mode"), listed="none,a2a",
                     metavar="MODE,..")
    view: Any = knob("full", "what each rank knows of the placement",
                     Name(VIEWS, "view", callables=True))
    rng: str = knob("independent", "how the ranks' random streams relate (random, lp)",
                    Name(RNG_RELATIONS, "rng relation"))
    drift_p: float = knob(0.05, "per-step drift probability for --rng drift", Number(0, 1))
    rank_offset: bool | None = knob(
        None, "add the rank to the policy's offset (default: ordinal in a2a mode, where it "
        "balances best, and never trtllm); --rank-offset: trtllm too, in every mode (its "
        "offset_by_ep_rank, rank-variant in none); --no-rank-offset: neither",
        Switch(optional=True))
    seed: int = knob(0, "seeds every random choice: the scenario, the rank streams, "
                     "static's tables, the toy MoE layer", Integer(0, most=MAX_SEED),
                     commands=SYNTH)
    device: str = knob("cpu", "where dispatch runs: cpu, cuda or auto", Device())
    hidden: int = knob(8, "hidden size of the toy MoE layer that measures output error",
                       Integer(1, most=MAX_HIDDEN))
    tp: int = knob(1, "attention tensor-parallel size: EP rank r is TP rank r % tp of DP "
                   "group r // tp (ascend-fixed reads it)", Integer(1, most=MAX_GPUS))
    shared_experts: int | None = knob(
        None, "shared experts every token runs in each layer, counted as GPU work (each the "
        "size of the model's shared expert, --model, else of a routed one; on the token's own "
        "rank in a2a unless the policy sends it, split over the GPUs in none); default: the "
        "model's when a policy dispatches them (waterfill), else none",
        Integer(0, optional=True, most=MAX_TOP_K))
    engine_source: dict = knob({}, "run an engine's own code, for sglang:* and vllm:* policies "
                               "and solvers, from this release (fetched on first use) or "
                               "folder (a checkout's package parent: SGLang's python/, or the "
                               "repository root) instead of the pinned release; several, "
                               "comma-separated, run side by side",
                               EngineSources("engine_source"), flags=("--engine-source",),
                               metavar="ENGINE==VERSION|ENGINE=PATH")
    engine_args: str | None = knob(None, "SGLang server flags for sglang:auto, which "
                                   "dispatches with whatever the release's own settings logic "
                                   "picks for them, e.g. '--enable-eplb --moe-a2a-backend none'",
                                   EngineFlags(), metavar="'FLAGS'")

    def relate(self) -> None:
        object.__setattr__(self, "engine_source", dict(as_sources(self.engine_source)))
        name, entry = resolve_policy(self.policy)
        if self.mode not in entry.modes:
            raise InputError(f"policy {name} runs only in {' or '.join(entry.modes)} mode: "
                             f"{entry.summary or 'see eplbsim policies'}")


@dataclass(frozen=True)
class SolverPart(Part):
    """How placements are solved, or the placement to use instead."""

    solver: Any = knob("deepseek", "placement solver (an engine's own: sglang:deepseek, ...)",
                       Name(Joined(SOLVERS, ENGINE_SOLVERS), "solver", callables=True))
    solver_options: dict = knob({}, "solver option, e.g. time_limit=10 or "
                                "anti_colocation=true (repeat for several)",
                                Options("solver_option"), flags=("--solver-option",),
                                metavar="KEY=VALUE")
    placement: Any = knob(None, "a JSON placement to serve every step instead of solving (a "
                          "`solve --json` output, a bare phy2log [L][P], or an SGLang "
                          "physical_to_logical_map)", File("a JSON placement", placement=True),
                          metavar="FILE")
    lplb_topology: str | None = knob(
        None, "the lplb solver's redundancy topology (default cube; the same as --solver-option "
        "redundancy=...; a torus takes --solver-option torus_rows=M)",
        Name(LPLB_TOPOLOGIES, "redundancy topology", optional=True))

    def relate(self) -> None:
        fn = find_solver(resolve_solver(self.solver))  # an engine's: its options are checked
        options = dict(self.solver_options)
        if self.lplb_topology is not None:
            if fn is not SOLVERS["lplb"]:
                raise InputError(f"lplb_topology (--lplb-topology) is the lplb solver's "
                                 f"(--solver lplb); the solver is {name_of(fn)}")
            if options.get("redundancy", self.lplb_topology) != self.lplb_topology:
                raise InputError(f"lplb_topology {self.lplb_topology} and solver option "
                                 f"redundancy={options['redundancy']} disagree")
            options["redundancy"] = self.lplb_topology
        object.__setattr__(self, "solver_options", check_options(fn, options))


@dataclass(frozen=True)
class SchedulePart(Part):
    """When placements are re-solved and from what forecast (`schedule.plan`)."""

    rebalance_every: int | None = knob(
        None, "re-solve the placement every N steps from predicted loads, the first time "
        "after the first window (default: once, from the whole trace)",
        Integer(1, optional=True), metavar="N")
    window: int | None = knob(None, "steps of history the predictor reads (default N)",
                              Integer(1, optional=True), metavar="W")
    predictor: Any = knob("window", "window: sum of the last W steps; ema: decayed sum; "
                          "oracle: the loads of the steps about to run",
                          Name(PREDICTORS, "predictor", callables=True))
    decay: float | None = knob(None, "ema's per-step factor in [0, 1] (default 1 - 1/W)",
                               Number(0, 1, optional=True))
    initial: Any = knob(None, "the placement before the first rebalance: trivial, or a JSON "
                        "placement (as --placement)",
                        File("a JSON placement", placement=True, absent="trivial"),
                        metavar="trivial|FILE")
    skip_above: float | None = knob(
        None, "skip a rebalance when the placement in service has a balancedness (mean / max "
        "GPU load, mean over layers) above B on the forecast", Number(0, 1, optional=True),
        metavar="B")
    migration_aware: bool = knob(True, "lay each new placement out over the one in service "
                                 "to move fewer experts", Switch())
    expert_bytes: int | None = knob(
        None, "bytes of one expert's weights, to price migrations and their stalls (default: "
        "one routed expert of the model shape, --model)",
        Integer(0, optional=True, most=MAX_EXPERT_BYTES))
    rebalance_mode: str = knob(
        "sync", "sync: serving stalls until a rebalance's copies land; async: the copies go on "
        "in the background while the old placement serves, each rank switching when they land",
        Name(REBALANCE_MODES, "rebalance mode"))
    copy_steps: int = knob(1, "async: steps a rebalance's copies take in the background",
                           Integer(1), metavar="N")
    switch_delay: int = knob(
        0, "async: each rank switches to the new placement up to D steps after the copies "
        "land, a seeded delay per rank and rebalance (0: all together)", Integer(0),
        metavar="D")

    def relate(self) -> None:
        if self.rebalance_every is None:
            unused = _changed(self, ("window", "predictor", "decay", "initial", "skip_above",
                                     "rebalance_mode", "copy_steps", "switch_delay"))
            if unused:
                raise InputError(f"{', '.join(unused)} only apply with rebalance_every (a "
                                 f"rebalance schedule); without it one placement is solved "
                                 f"from the whole trace")
            return
        if self.rebalance_mode == "sync":
            unused = _changed(self, ("copy_steps", "switch_delay"))
            if unused:
                raise InputError(f"{', '.join(unused)} only apply with rebalance_mode async "
                                 f"(sync serves the new placement on every rank at once)")
        elif self.copy_steps + self.switch_delay > self.rebalance_every:
            raise InputError(f"copy_steps + switch_delay ({self.copy_steps} + "
                             f"{self.switch_delay}) must be at most rebalance_every "
                             f"({self.rebalance_every}): every rank serves a placement before "
                             f"the next rebalance")

    def steps(self) -> int:
        """Steps a scenario needs for four rebalances after the first window (the default
        when none is given; the scenario default without a schedule)."""
        base = DEFAULT_SIZES["steps"]
        if self.rebalance_every is None:
            return base
        return max(base, (self.window or self.rebalance_every) + 4 * self.rebalance_every)


@dataclass(frozen=True)
class TopologyPart(Part):
    """The cluster: EP ranks = GPUs, nodes, redundant slots, expert groups."""

    gpus: int = knob(8, "GPUs = EP ranks", Integer(1, most=MAX_GPUS),
                     commands=frozenset({"run", "sweep", "review"}))
    gpus_per_node: int | None = knob(
        None, f"GPUs per node (default: {NODE_GPUS} when the GPUs are a multiple of "
        f"{NODE_GPUS}, as H100/H200/B200 boxes have, else all on one node; for ranks under "
        f"torchrun: its LOCAL_WORLD_SIZE)", Integer(1, optional=True, most=MAX_GPUS))
    redundant: int | None = knob(
        None, f"redundant physical slots, P = E + redundant (default: one a GPU, at least "
        f"{MIN_REDUNDANT}, rounded up so the GPUs divide the slots; with a placement file, "
        f"the file's)", Integer(0, optional=True, most=MAX_SLOTS))
    groups: int | None = knob(None, "expert groups (default: the trace's, else 1)",
                              Integer(1, optional=True, most=MAX_EXPERTS))

    def relate(self) -> None:
        self.topology()

    def topology(self) -> Topology:
        """The cluster as a Topology (`gpus_per_node` None: `NODE_GPUS` a node when they
        divide the GPUs, else one node)."""
        per_node = self.gpus_per_node
        if per_node is None and self.gpus % NODE_GPUS == 0:
            per_node = NODE_GPUS
        return Topology(self.gpus, per_node)

    def fit(self, num_experts: int, slots: int | None = None, file: Any = None) -> int:
        """The redundant slots for `num_experts` experts: those of a placement of `slots`
        slots (`file` names it) when one is served, else `redundant` when given, else the
        default (one a GPU, at least `MIN_REDUNDANT`, rounded up so the GPUs divide the
        slots). InputError when a given value disagrees with the placement or does not divide
        over the GPUs, naming the nearest values that do."""
        G = self.gpus
        if slots is not None:
            if self.redundant not in (None, slots - num_experts):
                raise InputError(f"the placement {file} has {slots} slots for {num_experts} "
                                 f"experts (redundant {slots - num_experts}), but redundant is "
                                 f"{self.redundant}: the placement decides the slots (leave "
                                 f"redundant out)")
            return slots - num_experts
        if self.redundant is None:
            least = max(MIN_REDUNDANT, G)
            return least + (-(num_experts + least)) % G
        over = (num_experts + self.redundant) % G
        if over:
            near = [r for r in (self.redundant - over, self.redundant + G - over) if r >= 0]
            raise InputError(f"{num_experts} experts + {self.redundant} redundant = "
                             f"{num_experts + self.redundant} slots do not divide over {G} "
                             f"GPUs; redundant {' or '.join(map(str, near))} would (slots a "
                             f"multiple of {G})")
        return self.redundant


@dataclass(frozen=True)
class CostPart(Part):
    """Time (DESIGN.md §8): the cost model that turns counted loads into milliseconds, the
    model shape and the device profile it reads."""

    cost: Any = knob(None, "cost model turning loads into time: roofline, measured "
                     "(aiconfigurator-core's measured kernels: pip install 'eplbsim[cost]'), or "
                     "a callable (default off: no time metrics)",
                     Name(COST_MODELS, "cost model", callables=True, optional=True))
    cost_options: dict = knob({}, "cost model option, e.g. framework=sglang (measured: "
                              "trtllm, sglang or vllm) or eta_compute=0.7 (roofline)",
                              Options("cost_option"), flags=("--cost-option",),
                              metavar="KEY=VALUE")
    model: str | None = knob(None, f"model shape the cost model reads (--cost), and the size "
                             f"of its shared expert (default: the model the trace's meta "
                             f"names, when eplbsim knows it, else {DEFAULT_MODEL})",
                             Name(MODELS, "model", optional=True))
    device_profile: str = knob("h200", "device profile the cost model reads (--cost)",
                               Name(DEVICES, "device profile"))
    overlap: bool = knob(False, "layer time = max(compute, communication) instead of their sum",
                         Switch())

    def relate(self) -> None:
        if self.cost is None:
            unused = _changed(self, ("cost_options",))
            if unused:
                raise InputError("cost_options only apply with a cost model (cost)")
            return
        object.__setattr__(self, "cost_options", check_cost_options(self.cost,
                                                                    self.cost_options))

    def model_shared_experts(self) -> int:
        """The model's shared experts; InputError when it has none (for a policy that places
        them)."""
        count = self.shape.shared_experts
        if not count:
            raise InputError(f"the policy dispatches the shared expert, but model {self.name} "
                             f"has none: give shared_experts (--shared-experts N) or a model "
                             f"with one (--model)")
        return count

    def shared_work(self, shared_experts: int | None, placed: bool) -> float:
        """Each token's shared-expert work in a layer, in routed pairs (0: not counted):
        `shared_experts` (None: the model's when the policy places them, `placed`, or when a
        cost model prices the time, which is the model's whole MoE layer; else 0) times the
        model's shared expert over a routed one (`ModelShape.shared_ratio`)."""
        if shared_experts is None:
            shared_experts = (self.model_shared_experts() if placed else
                              self.shape.shared_experts if self.cost is not None else 0)
        return shared_experts * self.shape.shared_ratio

    def profiles(self) -> tuple[ModelShape, DeviceProfile]:
        """The model shape and device profile the cost model reads."""
        return self.shape, DEVICES[self.device_profile]

    @property
    def name(self) -> str:
        """The model's name: `model`, or `DEFAULT_MODEL` before a trace has decided it
        (`replay.fitted`)."""
        return self.model or DEFAULT_MODEL

    @property
    def shape(self) -> ModelShape:
        """The model's shape (`name`)."""
        return MODELS[self.name]

    def describe(self, num_gpus: int) -> str:
        """What the compute times come from (`cost.describe`; for `measured`, the table, read
        and checked now)."""
        return describe_cost(self.cost, *self.profiles(), num_gpus, self.cost_options)


PARTS: dict[str, type] = {"source": Source, "dispatch": DispatchPart, "solver": SolverPart,
                          "schedule": SchedulePart, "topology": TopologyPart, "cost": CostPart}
RUN_PARTS = ("dispatch", "solver", "schedule", "topology", "cost")


def _part(name: str) -> Callable[[], Part]:
    return lambda: PARTS[name]()


@dataclass(frozen=True)
class RunSpec:
    """One simulated configuration: the dispatch, solver, schedule, topology and cost parts.

    Build one with `RunSpec.of(gpus=8, policy="row", ...)` (flat field names, routed to their
    part) and vary it with `spec.replace(mode="a2a", ...)`. The parts check their fields on
    construction; `placement` (serve one given placement) excludes a rebalance schedule.
    """

    dispatch: DispatchPart = field(default_factory=_part("dispatch"))
    solver: SolverPart = field(default_factory=_part("solver"))
    schedule: SchedulePart = field(default_factory=_part("schedule"))
    topology: TopologyPart = field(default_factory=_part("topology"))
    cost: CostPart = field(default_factory=_part("cost"))

    def __post_init__(self) -> None:
        if self.topology.gpus % self.dispatch.tp:
            raise InputError(f"tp {self.dispatch.tp} does not divide the {self.topology.gpus} "
                             f"GPUs (EP ranks = DP groups x tp)")
        if self.solver.placement is not None and self.schedule.rebalance_every is not None:
            raise InputError("placement serves every step; it cannot be combined with "
                             "rebalance_every (use initial for the placement before the first "
                             "rebalance)")

    @classmethod
    def of(cls, **values: Any) -> "RunSpec":
        """A spec from flat field names (`gpus=8, policy="row"`); the rest default."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> "RunSpec":
        """A copy with the named fields changed (flat names, routed to their parts)."""
        owners = {name: part for part, name, _ in run_knobs()}
        unknown = sorted(set(values) - set(owners))
        if unknown:
            raise InputError(f"unknown setting {', '.join(unknown)}; the settings are "
                             f"{', '.join(owners)}")
        parts = {}
        for part in RUN_PARTS:
            mine = {k: v for k, v in values.items() if owners[k] == part}
            current = getattr(self, part)
            parts[part] = type(current)(**{**_values(current), **mine}) if mine else current
        return RunSpec(**parts)

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights, to price migrations: `expert_bytes` when given, else
        the model shape's routed expert (`ModelShape.expert_weight_bytes`)."""
        given = self.schedule.expert_bytes
        return self.cost.profiles()[0].expert_weight_bytes if given is None else given

    def fit(self, num_experts: int, slots: int | None = None, file: Any = None) -> "RunSpec":
        """This spec with `redundant` decided for `num_experts` experts (`TopologyPart.fit`:
        a served placement's `slots`, else the given value, else the default)."""
        redundant = self.topology.fit(num_experts, slots, file)
        return self if redundant == self.topology.redundant else self.replace(redundant=redundant)

    def shared_work(self) -> float:
        """Each token's shared-expert work in a layer, in routed pairs (`CostPart.shared_work`
        of the dispatch part's `shared_experts` and policy)."""
        return self.cost.shared_work(self.dispatch.shared_experts,
                                     resolve_policy(self.dispatch.policy)[1].places_shared)

    def sharing(self, policies: Sequence[Any]) -> "RunSpec":
        """This spec for a comparison of `policies`: with `shared_experts` unset and some
        policy placing the shared expert, every row counts the model's shared experts, so the
        rows compare the same work."""
        if self.dispatch.shared_experts is not None or not any(
                resolve_policy(p)[1].places_shared for p in policies):
            return self
        return self.replace(shared_experts=self.cost.model_shared_experts())

    def get(self, name: str) -> Any:
        """The value of the field `name`, whichever part holds it."""
        for part in RUN_PARTS:
            if name in {f.name for f in fields(getattr(self, part))}:
                return getattr(getattr(self, part), name)
        raise KeyError(name)

    def labels(self) -> dict[str, Any]:
        """Every field as a plain JSON value, in schema order: names for registry entries and
        callables, "given" for a Placement object, the path for a file."""
        out = {name: label(getattr(getattr(self, part), name), knob)
               for part, name, knob in run_knobs()}
        out["gpus_per_node"] = self.topology.topology().gpus_per_node  # the default resolved
        return out


def _values(part: Part) -> dict[str, Any]:
    return {f.name: getattr(part, f.name) for f in fields(part)}


def label(value: Any, knob: Knob | None = None) -> Any:
    """A field's value as a row shows it (`RunSpec.labels`): "given" for a Placement object, a
    registry entry's name for a callable (`knob` a `Name` field's), else the value."""
    if isinstance(value, Placement):
        return "given"
    if knob is not None and isinstance(knob.type, Name) and value is not None \
            and not isinstance(value, str):
        return name_of(value, POLICIES if knob.type.kind == "policy" else None)
    return value


def knobs(parts: tuple[str, ...] | None = None,
          command: str | None = None) -> Iterator[tuple[str, str, Knob]]:
    """`(part, field name, Knob)` of every field, in schema order; only those of `parts` and
    settable from `command` when given."""
    for part, cls in PARTS.items():
        if parts is not None and part not in parts:
            continue
        for f in fields(cls):
            knob = f.metadata[KNOB]
            if command is None or command in knob.commands:
                yield part, f.name, knob


def run_knobs() -> Iterator[tuple[str, str, Knob]]:
    """The fields of a RunSpec (`knobs` without the source)."""
    return knobs(RUN_PARTS)


def default_of(part: str, name: str) -> Any:
    """A field's default."""
    return _default(next(f for f in fields(PARTS[part]) if f.name == name))


# ----------------------------------------------------------------------------- the command line

def flags_of(name: str, knob: Knob) -> tuple[str, ...]:
    return knob.flags or ("--" + name.replace("_", "-"),)


def add_flags(parser: argparse.ArgumentParser, command: str,
              parts: tuple[str, ...] | None = None, helps: dict[str, str] | None = None) -> None:
    """One flag per field settable from `command` (of `parts`, default all), in a group per
    part (`group_title`); `helps` replaces the help of the fields it names (a command whose
    defaults differ says so). Values stay text until `from_args` parses and checks them, so a
    bad one gets the same message as anywhere."""
    groups: dict[str, Any] = {}
    helps = helps or {}
    for part, name, knob in knobs(parts, command):
        title = group_title(part, name)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title]
        if name in helps:
            group.add_argument(*flags_of(name, knob), metavar=knob.metavar, dest=name,
                               help=helps[name].replace("%", "%%"), default=None)
            continue
        default = knob.listed or default_of(part, name)
        text = knob.help + (", comma-separated" if knob.listed else "")
        if isinstance(knob.type, Name):
            text += f"; one of {', '.join(knob.type.registry)}"
        if default not in (None, {}) and "default" not in knob.help:
            text += f" (default {default})"
        common = dict(dest=name, help=text.replace("%", "%%"), default=None)  # argparse formats
        if isinstance(knob.type, Switch):
            group.add_argument(*flags_of(name, knob), action=argparse.BooleanOptionalAction,
                               **common)
        else:
            group.add_argument(*flags_of(name, knob), metavar=knob.metavar,
                               action="append" if isinstance(knob.type, Options) else "store",
                               **common)


GROUPS = {"source": "what to replay (a trace file, requests or a scenario)",
          "dispatch": "dispatch", "solver": "placement", "schedule": "rebalancing over time",
          "topology": "cluster", "cost": "time (a cost model)"}
SELECTION = ("select_steps", "drop_warmup", "drop_outliers")


def group_title(part: str, name: str) -> str:
    """The help section of a field's flag: its part's (`GROUPS`), with the source's reading
    options and its batching of requests apart."""
    if part == "source" and (name in READER_OPTIONS or name in SELECTION):
        return "reading a trace file, and its steps"
    if part == "source" and name in BATCHING:
        return "requests batched into steps (--requests)"
    return GROUPS[part]


def _split(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"{flag}: needs at least one name")
    return items


def _parsed(knob: Knob, text: str, flag: str) -> Any:
    """Command-line text parsed by the knob's type; InputError naming the flag."""
    try:
        return knob.type.parse(text)
    except InputError as exc:
        raise InputError(f"{flag}: {exc}") from None


def from_args(args: argparse.Namespace, command: str, parts: tuple[str, ...] | None = None
              ) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The flags `add_flags` declared, parsed and checked: `(values, lists)` where `values`
    maps field names to the values given and `lists` the
    listed fields to every value given (their first value is in `values`). InputError naming
    the flag for a bad value."""
    values: dict[str, Any] = {}
    lists: dict[str, list[Any]] = {}
    for part, name, knob in knobs(parts, command):
        raw = getattr(args, name)
        flag = flags_of(name, knob)[-1]
        if raw is None and knob.listed is not None:
            raw = knob.listed
        if raw is None:
            continue
        if knob.listed is not None:
            lists[name] = [checked(name, knob, _parsed(knob, item, flag), flag)
                           for item in _split(raw, flag)]
            values[name] = lists[name][0]
        elif isinstance(knob.type, Switch):
            values[name] = checked(name, knob, raw, flag)
        elif isinstance(knob.type, EngineSources):
            sets = [checked(name, knob, one, flag) for one in knob.type.sets(raw)]
            values[name] = sets[0]
            if len(sets) > 1:
                lists[name] = sets
        elif isinstance(knob.type, Options):
            values[name] = checked(name, knob, dict(_parsed(knob, item, flag) for item in raw),
                                   flag)
        else:
            values[name] = checked(name, knob, _parsed(knob, raw, flag), flag)
    if "policy" in lists and "mode" in lists:  # the base: the first policy in a mode it runs in
        runs = resolve_policy(values["policy"])[1].modes
        values["mode"] = next((m for m in lists["mode"] if m in runs), values["mode"])
    return values, lists


def build(values: Mapping[str, Any]) -> tuple[Source, RunSpec]:
    """The source and the run spec of flat field values (the rest default)."""
    source_names = {name for _, name, _ in knobs(("source",))}
    source = PARTS["source"](**{k: v for k, v in values.items() if k in source_names})
    return source, RunSpec.of(**{k: v for k, v in values.items() if k not in source_names})


# ----------------------------------------------------------------------------- sweep specs

def sweep_keys() -> dict[str, tuple[str, str, Knob]]:
    """Every key a sweep spec takes -> `(part, field, Knob)`; an options field takes
    `PREFIX.NAME` keys (`option.sigma`, `solver_option.time_limit`) under its prefix."""
    out = {}
    for part, name, knob in knobs(command="sweep"):
        key = knob.type.prefix if isinstance(knob.type, Options) else name
        out[key] = (part, name, knob)
    return out


def sweep_value(key: str, value: Any, where: str, base: Path) -> tuple[str, Any]:
    """`(field name, checked value)` for one sweep key and TOML value; `PREFIX.NAME` keys give
    `(field, (NAME, value))`, and relative paths (of files, and of request files) are read
    against `base` (the spec's folder).
    InputError naming `where` and the key."""
    keys = sweep_keys()
    prefix, dot, option = key.partition(".")
    if dot and prefix in keys and isinstance(keys[prefix][2].type, Options):
        part, name, knob = keys[prefix]
        checked(name, knob, {option: value}, f"{where} {key}")
        return name, (option, value)
    if key not in keys or isinstance(keys[key][2].type, Options):
        names = [k + (".NAME" if isinstance(v[2].type, Options) else "") for k, v in keys.items()]
        raise InputError(f"{where} unknown key {key!r}; the keys are {', '.join(names)}")
    part, name, knob = keys[key]
    if isinstance(knob.type, File) and isinstance(value, str):
        value = None if value == knob.type.absent else str(base / value)
    elif isinstance(knob.type, RequestInput) and isinstance(value, str) \
            and value not in REQUEST_SCENARIOS:  # a request file, beside the spec
        value = str(base / value)
    return name, checked(name, knob, value, f"{where} {key}")
