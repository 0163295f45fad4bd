"""What a run reads: routing traces (in memory, as directories larger than memory, counts
only), synthetic scenarios, and every foreign form through `open_trace`.

Holds `Trace` (`trace`), its directory and counts-only forms, the step selection and summaries,
co-activation, requests and workloads (requests -> steps), the synthetic `SCENARIOS` and the
readers of every foreign form (`formats/`). Takes in files, arrays or a scenario's name; gives
out a trace: `topk_ids [N, L, K]` with `step_offsets [S + 1]` and `meta`, or counts
`[S, L, E]`. Imports `base` and `placement` (the load reductions of a summary).
"""

from .counts import CountsTrace
from .directory import DirTrace
from .formats import FORMATS, open_trace
from .summary import summarize_trace
from .synth import SCENARIOS, synthesize
from .trace import Trace, load_trace, save_trace

__all__ = ["FORMATS", "SCENARIOS", "CountsTrace", "DirTrace", "Trace", "load_trace", "open_trace",
           "save_trace", "summarize_trace", "synthesize"]
