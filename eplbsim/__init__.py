"""eplbsim: a trace-driven simulator for MoE expert placement, load balance and rank-invariant
dispatch.

What a notebook reaches for, importable from here: `replay`, `compare` and their settings
`RunSpec`; traces (`open_trace`, `load_trace`, `synthesize`, `Trace.from_arrays`); the registries `POLICIES`,
`SOLVERS`, `SCENARIOS`, `VIEWS`, `PREDICTORS`, `MODES` and `METRICS`; `review` (a verdict on a
dispatch change, a `Report`). The modules hold the rest
(DESIGN.md §6).

A module that moved keeps its old path for one release (`eplbsim.spec`, `eplbsim.errors`, ...:
`base.moved.OLD_NAMES`): importing it gives the same module as the new path.
"""

from .base import moved

moved.install(__name__)

from .base.errors import InputError
from .dispatch import POLICIES, DispatchPolicy
from .metrics import METRICS, Metric
from .placement import VIEWS, Placement
from .placement.topology import Topology
from .ranks import MODES
from .replay import compare, replay
from .replay.results import Results
from .review import Report, review
from .runspec import RunSpec
from .schedule.predictors import PREDICTORS
from .solvers import SOLVERS, solve
from .traces import SCENARIOS, Trace, load_trace, open_trace, synthesize

__all__ = ["METRICS", "MODES", "POLICIES", "PREDICTORS", "SCENARIOS", "SOLVERS", "VIEWS",
           "DispatchPolicy", "InputError", "Metric", "Placement", "Report", "Results", "RunSpec",
           "Topology", "Trace", "compare", "load_trace", "open_trace", "replay", "review", "solve",
           "synthesize"]


def __getattr__(name: str):
    """`eplbsim.<old module name>` (`base.moved`): the module that name stands for."""
    return moved.attribute(__name__, name)
