"""What a run reads: routing traces (in memory, as directories larger than memory, counts
only), synthetic scenarios, and every foreign form through `open_trace`.

Holds `Trace` (`trace`), its directory and counts-only forms, the step selection and summaries,
co-activation, requests and workloads (requests -> steps), the synthetic `SCENARIOS` and the
readers of every foreign form (`formats/`). Takes in files, arrays or a scenario's name; gives
out a trace: `topk_ids [N, L, K]` with `step_offsets [S + 1]` and `meta`, or counts
`[S, L, E]`. Imports `base` and `placement` (the load reductions of a summary).
"""

from typing import Any, Union

from ..base.errors import InputError
from .counts import CountsTrace
from .directory import DirTrace
from .formats import FORMATS, open_trace
from .steps import shape_steps
from .summary import summarize_trace
from .synth import SCENARIOS, synthesize
from .trace import Trace, TraceShape, load_trace, save_trace

# Every form with token rows (`Trace`, `DirTrace`, `steps.StepView`, `prefill_chunks.ChunkView`,
# `repeated.Repeated`): what `TraceShape` defines (`num_steps`, `num_layers`, `num_experts`,
# `top_k`, `meta`, `load_dtype`, `tokens_per_step`, `step(s) -> [T_s, L, K]`, `counts() ->
# [S, L, E]`, ...), the forms a dispatch reads.
TokenTrace = TraceShape
# What a run reads: token rows, or counts only (`CountsTrace`: placement, no dispatch).
RunTrace = Union[TraceShape, CountsTrace]


def check_run_trace(trace: Any, what: str = "a run") -> None:
    """InputError unless `trace` is a trace a run reads (`RunTrace`), naming what it is."""
    if not isinstance(trace, (TraceShape, CountsTrace)):
        raise InputError(f"{what} reads a trace (Trace, DirTrace or CountsTrace: load_trace, "
                         f"open_trace or synthesize make one), not {type(trace).__name__}")


__all__ = ["FORMATS", "SCENARIOS", "CountsTrace", "DirTrace", "RunTrace", "TokenTrace", "Trace",
           "check_run_trace", "load_trace", "open_trace", "save_trace", "shape_steps",
           "summarize_trace", "synthesize"]
