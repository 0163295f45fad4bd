"""What a run reads: routing traces (in memory, as directories larger than memory, counts
only), synthetic scenarios, and every foreign form through `open_trace`."""

from .counts import CountsTrace
from .directory import DirTrace
from .formats import FORMATS, open_trace
from .summary import summarize_trace
from .synth import SCENARIOS, synthesize
from .trace import Trace, load_trace, save_trace

__all__ = ["FORMATS", "SCENARIOS", "CountsTrace", "DirTrace", "Trace", "load_trace", "open_trace",
           "save_trace", "summarize_trace", "synthesize"]
