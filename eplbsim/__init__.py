"""eplbsim: a trace-driven simulator for MoE expert placement, load balance and rank-invariant
dispatch.

What a notebook reaches for, importable from here: `replay`, `compare` and their settings
`RunSpec`; traces (`open_trace`, `load_trace`, `synthesize`, `Trace.from_arrays`, and
`shape_steps`: a trace's steps selected and cut as `run` does); the registries `POLICIES`,
`SOLVERS`, `SCENARIOS`, `VIEWS`, `PREDICTORS`, `MODES` and `METRICS`; `review` (a verdict on a
dispatch change, a `Report`). The modules hold the rest
(DESIGN.md §6).

Each name is imported from its module when first asked for (`EXPORTS`), so `import eplbsim`
(and every `eplbsim --help`) imports neither torch nor numba, matplotlib or scipy.

A module that moved keeps its old path for one release (`eplbsim.spec`, `eplbsim.errors`, ...:
`base.moved.OLD_NAMES`): importing it gives the same module as the new path.
"""

import importlib
import sys
import types

from .base import moved

moved.install(__name__)

EXPORTS = {  # name -> the module (below eplbsim) it is imported from
    "InputError": "base.errors", "POLICIES": "dispatch", "DispatchPolicy": "dispatch",
    "METRICS": "metrics", "Metric": "metrics", "VIEWS": "placement", "Placement": "placement",
    "Topology": "placement.topology", "MODES": "ranks", "compare": "replay", "replay": "replay",
    "Results": "replay.results", "Report": "review", "review": "review", "RunSpec": "runspec",
    "PREDICTORS": "schedule.predictors", "SOLVERS": "solvers", "solve": "solvers",
    "SCENARIOS": "traces", "Trace": "traces", "load_trace": "traces", "open_trace": "traces",
    "shape_steps": "traces", "synthesize": "traces"}

__all__ = sorted(EXPORTS)


class _Package(types.ModuleType):
    """The package, whose `replay` and `review` stay the functions of those names when their
    modules are imported (as when it imported them eagerly): the import system sets a
    package's attribute to a submodule when that is first imported."""

    def __setattr__(self, name: str, value: object) -> None:
        if EXPORTS.get(name) == name and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    """An exported name (`EXPORTS`), imported from its module on first use; else
    `eplbsim.<old module name>` (`base.moved`): the module that name stands for."""
    if name in EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    return moved.attribute(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))
