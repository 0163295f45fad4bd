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
  the `phases` scenario, and SGLang's recorder dumps (`forward_mode` of each record,
  `forward_mode_mark`).
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


def forward_mode_mark(modes: list[Any]) -> str:
    """The mark (`STAGE_MARKS`) of one forward pass whose ranks' records say `modes` (SGLang's
    `forward_mode` values, `SGLANG_FORWARD_MODES`; None where a record has none): prefill when
    any rank runs prefill rows, else decode when any decodes, else `?`."""
    marks = {SGLANG_FORWARD_MODES.get(m, "?") if isinstance(m, int) and not isinstance(m, bool)
             else "?" for m in modes}
    return "p" if "p" in marks else "d" if "d" in marks else "?"


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
