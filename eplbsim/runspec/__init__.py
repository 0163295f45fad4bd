"""The run schema: every setting of a run, declared once.

Holds the value types, the knobs, which trace a command reads, the parts, `RunSpec`
and the flags generated from them. Takes in keywords, flags or sweep keys; gives out a
`RunSpec`. Imports `base`, `placement`, `traces`, `cost`, `solvers`, `dispatch`, `ranks`,
`schedule`, `engines` and `migration` (the registries its values name).

A run is described by small frozen parts (`PARTS`, in order): `source` (which trace a command
reads: a file, or a scenario with its sizes and options), `dispatch`, `solver`, `schedule`,
`topology`, `cost` and `steps` (which of the trace's steps are replayed, and how long ones are
cut). :class:`RunSpec` holds all but the source (`replay` takes the trace itself, and shapes
its steps by the spec's `steps`); the source extends `steps`, so a command reads by them too.
Each field is declared with :func:`knob`: its default, help text, value type (which parses
command-line text and checks any value, with one message wherever the value came from) and the
commands it can be set from. The flags of `run` and `ranks` (`add_flags`, `from_args`), the keys of a sweep
spec (`sweep_keys`, `sweep_value`), the labels of every result row (`RunSpec.labels`) and the
checks are all generated from these declarations, so a new setting is one field, and a new part
one class and one line in `PARTS`.

By concern: `values` (the value types), `knobs` (declaring a setting, `Part`), `source` (which
trace a command reads), `parts` (the run parts), `run` (`RunSpec` and the knob listings),
`flags` (the command line and sweep specs generated from them). Everything is importable from
here. (The package was `eplbsim.spec`, a name that still imports it: `eplbsim.base.moved`.)
"""

from __future__ import annotations

from .flags import (GROUPS, add_flags, build, flags_of, from_args, group_title, sweep_keys,
                    sweep_value)
from .knobs import COMMANDS, KNOB, READS, SYNTH, WITH_INFO, Knob, Part, checked, knob
from .parts import (MIN_REDUNDANT, NODE_GPUS, CostPart, DispatchPart, SchedulePart, SolverPart,
                    StepsPart, TopologyPart)
from .run import PARTS, RUN_PARTS, RunSpec, default_of, knobs, label, run_knobs
from .source import BATCHING, READER_OPTIONS, Source, workload_of
from .values import (Device, EngineFlags, EngineSources, File, Filter, Integer, Name, Number,
                     Options, RequestInput, Sizes, StepSelection, Switch, Text)

__all__ = ["BATCHING", "COMMANDS", "GROUPS", "KNOB", "MIN_REDUNDANT", "NODE_GPUS", "PARTS",
           "READER_OPTIONS", "READS", "RUN_PARTS", "SYNTH", "WITH_INFO", "CostPart",
           "Device", "DispatchPart", "EngineFlags", "EngineSources", "File", "Filter",
           "Integer", "Knob", "Name", "Number", "Options", "Part", "RequestInput", "RunSpec",
           "SchedulePart", "Sizes", "SolverPart", "Source", "StepSelection", "StepsPart", "Switch",
           "Text", "TopologyPart", "add_flags", "build", "checked", "default_of", "flags_of",
           "from_args", "group_title", "knob", "knobs", "label", "run_knobs", "sweep_keys",
           "sweep_value", "workload_of"]
