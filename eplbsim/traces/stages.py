"""Each step's serving stage, prefill or decode (DESIGN.md §16: expert heat differs between the
two; vllm-ascend #10647 collects the load of one stage only).

Dimensions: `S` steps of a trace, `S0` steps of the log it reads (its root: a view's `base`).

A step's stage is what its log says, else what its tokens say:
- **Recorded.** `meta["stages"]` is a string of one mark a step of the log (`S0` marks,
  `workload.STAGE_MARKS`: `p` prefill, `d` decode, `?` not said). A view (`steps.StepView`,
  `prefill_chunks.ChunkView`) keeps its root's meta and names its steps as the log does
  (`log_steps`: `"12"`, `"12.3"` for a chunk of step 12), so each step reads the mark of the
  log step it is (part of); a counts-only trace is always its own root. What writes
  marks: a workload batching requests (`workload.batch`: a step with a prefill row is prefill),
  the `phases` scenario, SGLang's recorder dumps (`forward_mode` of each record,
  `forward_mode_mark`), and the record logs read by what they hold (`formats.jsonl`,
  `token_log`, `positional`: a record's `is_prefill`, `forward_mode`, `stage` or `phase`,
  `record_mark`; a step whose records disagree is prefill when any says prefill, as a mixed
  batch is, `StageLog`).
- **By tokens** (a step marked `?`, or a log with no marks): decode when it has at most
  `decode_tokens` tokens, else prefill. A decode step runs one token a running request, and an
  engine runs at most a few hundred requests at once; the default is the largest batch a decode
  step runs as a CUDA graph by default here (`workload.DEFAULT_GRAPH_SIZES`, 256). With
  speculative decoding a decode step runs `1 + draft tokens` a request: raise it.
A counts-only trace has no token rows: its stages are recorded, or it has none (InputError).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..base.errors import InputError
from .counts import CountsTrace
from .steps import StepView
from .workload import DECODE, DEFAULT_GRAPH_SIZES, PREFILL, ROW_KINDS, STAGE_MARKS

STAGES = ("prefill", "decode")  # the stages, in the order tables show them
CODES = {ROW_KINDS[c]: c for c in (PREFILL, DECODE)}  # a stage's code: its workload row kind
DECODE_TOKENS = DEFAULT_GRAPH_SIZES[-1]  # the token rule's default (module doc)

# SGLang's `ForwardMode` (python/sglang/srt/model_executor/forward_batch_info.py, an IntEnum of
# auto() values; read at sgl-project/sglang@003bbaf9ab79c09933e7a17ae6460ac48a756de9), whose
# `.value` its recorder writes into each record (`forward_mode`, expert_distribution.py,
# 0.5.14 to 0.5.23). The first five values are the same in every release read; later ones
# differ between releases (DRAFT_EXTEND, DRAFT_EXTEND_V2, PREBUILT, SPLIT_PREFILL, ...), so they
# are not said. MIXED holds prefill rows (a chunked prefill beside decodes): prefill.
# TARGET_VERIFY checks a draft's tokens for running requests, in the decode stage (a decode
# server runs it), though SGLang's own `is_extend` counts it: decode here.
SGLANG_FORWARD_MODES = {1: "p",  # EXTEND
                        2: "d",  # DECODE
                        3: "p",  # MIXED
                        4: "?",  # IDLE: no rows of its own
                        5: "d"}  # TARGET_VERIFY


# A stage in words, as logs write it (lower case): SGLang's `ForwardMode` names (above;
# `ForwardMode.EXTEND` as Python prints it), vLLM's and others' prefill/decode, TensorRT-LLM's
# context/generation phases. A mixed batch holds prefill rows: prefill.
STAGE_WORDS = {"prefill": "p", "extend": "p", "mixed": "p", "context": "p", "decode": "d",
               "generation": "d", "generate": "d", "target_verify": "d", "idle": "?"}
# The fields a log's records say their step's stage in, in order of precedence: `is_prefill`
# (true or false), SGLang's `forward_mode` (its value or name), `stage` or `phase` (words of
# `STAGE_WORDS`; other words, such as Megatron's `"stage": "pre_dispatch"`, say no stage).
STAGE_FIELDS = ("is_prefill", "forward_mode", "stage", "phase")


def step_mark(marks: Any) -> str:
    """The mark (`STAGE_MARKS`) of one step whose records (or ranks) say `marks` (each `p`, `d`
    or `?`): prefill when any record is, as a mixed batch holds prefill rows; else decode when
    any decodes; else `?`."""
    marks = set(marks)
    return "p" if "p" in marks else "d" if "d" in marks else "?"


def _word_mark(value: Any) -> str | None:
    """The mark of a stage in words (`STAGE_WORDS`, case aside, `ForwardMode.` dropped), or
    None for other words or a value that is not text."""
    if not isinstance(value, str):
        return None
    return STAGE_WORDS.get(value.strip().lower().removeprefix("forwardmode."))


def _mode_mark(mode: Any) -> str:
    """The mark of one SGLang `forward_mode` (its value, `SGLANG_FORWARD_MODES`, or its name);
    `?` for a value not said here or None."""
    if isinstance(mode, int) and not isinstance(mode, bool):
        return SGLANG_FORWARD_MODES.get(mode, "?")
    return _word_mark(mode) or "?"


def forward_mode_mark(modes: list[Any]) -> str:
    """The mark (`STAGE_MARKS`) of one forward pass whose ranks' records say `modes` (SGLang's
    `forward_mode` values or names, `SGLANG_FORWARD_MODES`; None where a record has none):
    `step_mark` of each."""
    return step_mark(_mode_mark(m) for m in modes)


def record_mark(where: str, rec: dict[str, Any]) -> tuple[str, str] | None:
    """`(field, mark)` of the first of `STAGE_FIELDS` that says the stage of the step record
    `rec` belongs to, or None when none does. InputError naming `where` for an `is_prefill`
    that is not true or false."""
    for key in STAGE_FIELDS:
        value = rec.get(key)
        if value is None:
            continue
        if key == "is_prefill":
            if not isinstance(value, bool):
                raise InputError(f"{where}: is_prefill must be true or false, got "
                                 f"{str(value)[:40]!r}")
            return key, "p" if value else "d"
        mark = _mode_mark(value) if key == "forward_mode" else _word_mark(value)
        if mark is not None:
            return key, mark
    return None


class StageLog:
    """Each step's stage as a log's records say it (`record_mark`), gathered record by record
    into `meta["stages"]` (`into`): a step's mark is `step_mark` of its records' (one record
    saying prefill makes the step prefill: a mixed batch), `?` where none says."""

    def __init__(self) -> None:
        self.said: dict[Any, set[str]] = {}  # a step's key -> the marks its records say
        self.fields: dict[str, None] = {}  # the fields that said a stage, in order of finding

    def add(self, step: Any, where: str, rec: dict[str, Any]) -> None:
        """Note what the record `rec` of step `step` (any key) says of its stage."""
        found = record_mark(where, rec)
        if found is not None:
            self.fields.setdefault(found[0])
            self.said.setdefault(step, set()).add(found[1])

    def into(self, meta: dict[str, Any], steps: Any) -> None:
        """Write `meta["stages"]`, a mark for each of `steps` (their keys, in the trace's
        order), and `meta["stages_from"]` (the fields that said them), when some record said
        prefill or decode."""
        marks = "".join(step_mark(self.said.get(step, ())) for step in steps)
        if set(marks) - {"?"}:
            meta["stages"] = marks
            meta["stages_from"] = list(self.fields)


def marks_of(codes: Any) -> str:
    """`meta["stages"]` of per-step stage codes `[S]` (`PREFILL`, `DECODE`, or -1: not said)."""
    return "".join(STAGE_MARKS[c] for c in np.asarray(codes, dtype=np.int64).tolist())


def _root(trace: Any) -> Any:
    """The trace a view reads, through every view (`base`)."""
    while hasattr(trace, "base"):
        trace = trace.base
    return trace


def recorded_stages(trace: Any) -> np.ndarray | None:
    """Each step's recorded stage code, int8 `[S]` (-1 where the log does not say), or None when
    its meta holds no marks. InputError for marks that are not one of `STAGE_MARKS` a log
    step."""
    marks = trace.meta.get("stages")
    if marks is None:
        return None
    root_steps = _root(trace).num_steps
    if not isinstance(marks, str) or len(marks) != root_steps or set(marks) - set(STAGE_MARKS):
        raise InputError(f"meta stages must be a string of one mark a step of the log "
                         f"({root_steps}), each p (prefill), d (decode) or ? (not said), got "
                         f"{str(marks)[:40]!r}")
    codes = np.array([STAGE_MARKS.index(c) for c in marks], dtype=np.int8)
    codes[codes == len(STAGE_MARKS) - 1] = -1  # "?"
    if isinstance(trace, CountsTrace) or not hasattr(trace, "log_steps"):
        return codes
    parent = [int(name.split(".")[0]) for name in trace.log_steps()]  # [S] its log step
    return codes[parent]


def step_stages(trace: Any, decode_tokens: int = DECODE_TOKENS) -> np.ndarray:
    """Each step's stage code, int8 `[S]` of `PREFILL` and `DECODE` (module doc): recorded where the
    log says, else decode for a step of at most `decode_tokens` tokens. InputError for a
    counts-only trace some step of which the log does not mark."""
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) \
            or decode_tokens < 0:
        raise InputError(f"decode_tokens must be an integer >= 0, got {decode_tokens!r}")
    codes = recorded_stages(trace)
    if codes is None:
        codes = np.full(trace.num_steps, -1, dtype=np.int8)
    unsaid = codes < 0
    if not unsaid.any():
        return codes
    if isinstance(trace, CountsTrace):
        raise InputError(f"a counts-only trace has no token rows to tell prefill from decode "
                         f"by, and its log marks {int(unsaid.sum())} of its {len(codes)} steps "
                         f"as neither (meta stages)")
    tokens = trace.tokens_per_step.numpy()  # [S]
    codes[unsaid] = np.where(tokens[unsaid] <= decode_tokens, DECODE, PREFILL)
    return codes


def stage_steps(trace: Any, stage: str, decode_tokens: int = DECODE_TOKENS) -> np.ndarray:
    """The steps of `stage` ("prefill" or "decode"), int64 `[S']` ascending."""
    return np.flatnonzero(step_stages(trace, decode_tokens) == _code(stage)).astype(np.int64)


def stage_view(trace: Any, stage: str, decode_tokens: int = DECODE_TOKENS) -> Any:
    """The steps of `stage` as a trace of the same read interface (a `StepView` of a token
    trace, a `CountsTrace` of the counts), the trace itself when every step is of it.
    InputError when none is."""
    steps = stage_steps(trace, stage, decode_tokens)
    if len(steps) == 0:
        raise InputError(f"the trace has no {stage} steps "
                         f"({describe_stages(trace, decode_tokens)})")
    if len(steps) == trace.num_steps:
        return trace
    if isinstance(trace, CountsTrace):
        marks = marks_of(step_stages(trace, decode_tokens)[steps])
        return CountsTrace(trace.counts[steps], dict(trace.meta, stages=marks))
    return StepView(trace, torch.from_numpy(steps), dict(trace.meta))


def describe_stages(trace: Any, decode_tokens: int = DECODE_TOKENS) -> str:
    """"3 prefill and 29 decode steps (as the log marks them)"-style words: each stage's steps,
    and how they were told apart."""
    codes = step_stages(trace, decode_tokens)
    recorded = recorded_stages(trace)
    said = 0 if recorded is None else int((recorded >= 0).sum())
    how = ("as the log marks them" if said == len(codes) else
           f"decode: at most {decode_tokens} tokens" if said == 0 else
           f"{said} as the log marks them, the rest decode at most {decode_tokens} tokens")
    counts = {stage: int((codes == CODES[stage]).sum()) for stage in STAGES}
    return f"{counts['prefill']} prefill and {counts['decode']} decode steps ({how})"


def _code(stage: str) -> int:
    if stage not in CODES:
        raise InputError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    return CODES[stage]
