"""eplbsim: a trace-driven simulator for MoE expert placement, load balance and rank-invariant
dispatch.

What a notebook reaches for, importable from here: `replay`, `compare` and their settings
`RunSpec`; traces (`open_trace`, `load_trace`, `synthesize`); the registries `POLICIES`,
`SOLVERS`, `SCENARIOS`, `VIEWS`, `PREDICTORS`, `MODES` and `METRICS`; `review` (a verdict on a
dispatch change, a `Report`). The modules hold the rest
(DESIGN.md §6).

The run schema is `eplbsim.runspec`; its old name `eplbsim.spec` (and `eplbsim.spec.parts`,
..., `from eplbsim.spec.runspec import ...` for what is now `runspec.run`) still imports, as
the same modules (`OLD_NAMES`), so a notebook written against it keeps working.
"""

import sys
from importlib import import_module

from .dispatch import POLICIES, DispatchPolicy
from .errors import InputError
from .metrics import METRICS, Metric
from .placement import VIEWS, Placement
from .ranks import MODES
from .replay import compare, replay
from .results import Results
from .review import Report, review
from .schedule.predictors import PREDICTORS
from . import runspec
from .runspec import RunSpec
from .solvers import SOLVERS, solve
from .topology import Topology
from .traces import SCENARIOS, load_trace, open_trace, synthesize

__all__ = ["METRICS", "MODES", "POLICIES", "PREDICTORS", "SCENARIOS", "SOLVERS", "VIEWS",
           "DispatchPolicy", "InputError", "Metric", "Placement", "Report", "Results", "RunSpec",
           "Topology", "compare", "load_trace", "open_trace", "replay", "review", "solve",
           "synthesize"]

# Old module name -> the module it names now (the run schema was `eplbsim/spec/` until issue 43).
OLD_NAMES = {"spec": "runspec", "spec.flags": "runspec.flags", "spec.knobs": "runspec.knobs",
             "spec.parts": "runspec.parts", "spec.runspec": "runspec.run",
             "spec.source": "runspec.source", "spec.values": "runspec.values"}
for _old, _new in OLD_NAMES.items():
    sys.modules.setdefault(f"{__name__}.{_old}", import_module(f"{__name__}.{_new}"))
spec = runspec  # `eplbsim.spec.X` after `import eplbsim.spec` (the import finds it in sys.modules)
del _old, _new
