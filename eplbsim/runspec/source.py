"""The `source` part: which trace a command reads (a file with its reading options and step
selection, requests batched as an engine would, or a scenario with its sizes and options), and
opening it (`Source.open`, `read`, `select`). Its steps' settings are the run's `steps` part
(`parts.StepsPart`, which `Source` extends): a command reads by them, a run replays by them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..base.errors import InputError
from ..base.limits import MAX_EXPERTS, MAX_GPUS, MAX_LAYERS, MAX_TOP_K
from ..traces.formats import (REQUEST_FORMATS, is_request_input, open_requests, open_trace,
                              reading_options)
from ..traces.formats.token_log import INCOMPLETE
from ..traces.request_synth import REQUEST_SCENARIOS, request_options, synthesize_requests
from ..traces.requests import RequestSet
from ..traces.steps import SHAPING, shape_steps
from ..traces.synth import (DEFAULT_SCENARIO, DEFAULT_SIZES, SCENARIOS, scenario_options,
                            synthesize)
from ..traces.workload import ARRIVALS, DP_ASSIGN, DP_LAYOUTS, ORDERS, PADDING, Workload, batch
from .knobs import READS, SYNTH, WITH_INFO, changed_fields, they, knob
from .parts import SchedulePart, StepsPart
from .values import (Files, Filter, Integer, Name, Number, Options, RequestInput, Sizes,
                     Text)


# The Source fields that say how requests are batched into steps (`Source.workload`).
BATCHING = ("max_running", "max_batched_tokens", "chunk", "batch_order", "arrivals",
            "arrival_rate", "dp", "dp_assign", "dp_layout", "graph_sizes", "padding")


def workload_of(values: Mapping[str, Any], seed: int) -> Workload:
    """The Workload of `BATCHING` field values (the rest default), seeded by `seed`."""
    renamed = {"batch_order": "order", "arrival_rate": "rate"}
    return Workload(seed=seed, **{renamed.get(k, k): v for k, v in values.items()
                                  if k in BATCHING and v is not None})


@dataclass(frozen=True)
class Source(StepsPart):
    """Which trace a command reads: a file (`trace`), or a seeded scenario with its sizes; and
    which of its steps (the fields of `StepsPart`, listed as the run's `steps` part)."""

    trace: Any = knob(
        None, "a trace in any form, one file, a folder of them or several files read as one "
        "log (a file a layer, or parts of one log): an .npz trace, a trace directory (see trace "
        "convert), a router log of records read by what they hold (.jsonl, a .json document, "
        "nested per-token JSON, a CSV or array of gate rows; its fields are found, see "
        "--ids-key and the other reading flags), a Megatron router trace, TensorRT-LLM expert "
        "statistics, FLAME-MoE parquet, or counts (a counts-only .npz, a counts CSV "
        "layer,expert,count with --where, a [layers][experts] matrix in JSON or .npy): counts "
        "give the placement's even-split promise only",
        Files("a trace"), metavar="FILE")
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
    ids_key: str | None = knob(None, "per-token or positional log: the key of the top-k ids "
                               "(default topk_ids)", Text(), metavar="KEY", commands=READS)
    step_key: str | None = knob(None, "per-token log: the key of the step (default: a new step "
                                "when token indices restart)", Text(), metavar="KEY",
                                commands=READS)
    prompt_len_key: str | None = knob(None, "per-token log: the key of a request's prompt "
                                      "length (with --request-key)", Text(), metavar="KEY",
                                      commands=READS)
    skip_type: str | None = knob(None, "per-token or positional log: skip records whose "
                                 "\"type\" is TYPE (a header)", Text(), metavar="TYPE",
                                 commands=READS)
    incomplete: str | None = knob(
        None, "per-token log: a token missing from some layers is an error, or drop leaves "
        "such tokens out, with one warning saying how many (default error)",
        Name(INCOMPLETE, "incomplete", optional=True), metavar="{error,drop}", commands=READS)
    layers_per_pass: int | None = knob(
        None, "a positional log (one record per MoE layer call in execution order, no step or "
        "layer key): its MoE layers per forward pass; record n is layer n mod L of pass "
        "(step) n // L", Integer(1, optional=True, most=MAX_LAYERS), metavar="L",
        commands=READS)
    prompt_len: int | None = knob(None, "vLLM routed-expert arrays: the prompt rows of every "
                                  ".npy file (an .npz names its own)",
                                  Integer(0, optional=True), metavar="N", commands=READS)
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
    def files(self) -> list[str]:
        """Every file (or folder) read: the trace's paths, or the request file."""
        found = self.file
        return [] if found is None else list(found) if isinstance(found, tuple) else [found]

    @property
    def file(self) -> Any:
        """The file read: the trace's, or the request file's (not a request scenario's)."""
        if self.trace is not None:
            return self.trace
        named = isinstance(self.requests, str) and self.requests not in REQUEST_SCENARIOS
        return self.requests if named else None

    def relate(self) -> None:
        scenario_sizes = ("steps", "tokens", "layers", "top_k", "scenario_options")
        if self.file is None:
            unused = changed_fields(self, tuple(k for k in READER_OPTIONS if k != "experts"))
            if unused:
                raise InputError(f"{they(unused, 'apply')} to reading a file (a trace or "
                                 f"requests), not to a scenario")
        if self.requests is not None:
            if self.trace is not None or self.scenario is not None:
                raise InputError("give requests, a trace or a scenario, not two of them")
            extra = changed_fields(self, ("steps", "tokens"))
            if extra:
                raise InputError(f"{they(extra, 'do')} not apply to requests (the workload "
                                 f"makes the steps)")
            if self.file is None and not isinstance(self.requests, RequestSet):
                unknown = sorted(set(self.scenario_options)
                                 - set(request_options(self.requests)))
                if unknown:
                    raise InputError(f"request scenario {self.requests} has no option "
                                     f"{', '.join(unknown)}; its options are: "
                                     f"{', '.join(request_options(self.requests))}")
            elif changed_fields(self, ("layers", "top_k", "scenario_options")):
                raise InputError("layers, top_k and scenario options apply to a request "
                                 "scenario, not to a request file")
            return
        unused = changed_fields(self, tuple(k for k in BATCHING if k != "max_batched_tokens"))
        if unused:
            raise InputError(f"{they(unused, 'apply')} to requests only (--requests)")
        if self.trace is not None:
            if is_request_input(self.trace, **self.reader_options()):
                raise InputError(f"{self.trace} holds requests, not steps: give it as requests "
                                 f"(--requests), which batches them as an engine does")
            if self.scenario is not None:
                raise InputError("give a trace or a scenario, not both")
            extra = changed_fields(self, scenario_sizes)
            if extra:
                raise InputError(f"{they(extra, 'apply')} to scenarios only, not to a trace")
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
        """The trace a run replays: `read`, then its steps shaped (`shaping`,
        `traces.steps.shape_steps`): a file's as `open_trace` shapes them, requests' batched
        steps as their workload made them (it keeps to `max_batched_tokens`)."""
        return shape_steps(self.read(seed, schedule), **self.shaping())

    def chunked(self, trace: Any) -> Any:
        """`trace` with its long steps cut into chunks (`max_batched_tokens`)."""
        return shape_steps(trace, max_batched_tokens=self.max_batched_tokens)

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

    def select(self, trace: Any) -> Any:
        """`trace`'s selected steps (`shaping` less its chunking)."""
        return shape_steps(trace, **{**self.shaping(), "max_batched_tokens": None})


# The Source fields the Python API spells otherwise: field -> (the call's name, its keyword).
PYTHON_RENAMED = {"trace": ("open_trace", "path"), "requests": ("open_requests", "path"),
                  "scenario_options": ("synthesize", "options"),
                  "batch_order": ("Workload", "order"), "arrival_rate": ("Workload", "rate")}


def python_keywords(name: str) -> list[str]:
    """Where the Python API takes the `Source` field `name` (what a command reads), as
    "call(keyword=...)": the calls that open, shape or make the trace `replay` is given,
    `open_trace`, `shape_steps` (a trace's steps), `open_requests` (`traces.formats`),
    `synthesize` and the requests' `Workload` (`traces.workload.batch` batches them); []
    where none does."""
    calls = {open_trace: set(inspect.signature(open_trace).parameters),
             shape_steps: set(SHAPING),
             open_requests: {"path"} | reading_options(REQUEST_FORMATS),
             synthesize: set(inspect.signature(synthesize).parameters),
             Workload: {f.name for f in fields(Workload)}}
    only, keyword = PYTHON_RENAMED.get(name, (None, name))
    written = "**options" if keyword == "options" else f"{keyword}=..."  # synthesize's own
    return [f"{call.__name__}({written})" for call, taken in calls.items()
            if keyword in taken and only in (None, call.__name__)]


# What reading a file takes (`Source.reader_options`): a log's experts, a counts CSV's filter,
# a per-token log's keys.
READER_OPTIONS = ("experts", "where", "request_key", "token_key", "layer_key", "ids_key",
                  "step_key", "prompt_len_key", "skip_type", "prompt_len", "layers_per_pass",
                  "incomplete")
