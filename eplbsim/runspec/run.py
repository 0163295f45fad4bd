"""`RunSpec`, a run's settings (its parts, `PARTS`), with the flat-name constructors and
replacements a notebook uses, the labels of a result row, and the knob listings the flags and
sweep keys are generated from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Sequence

from ..base.errors import InputError
from ..base.options import option
from ..base.registry import name_of
from ..dispatch import POLICIES, resolve_policy
from ..placement import Placement
from .knobs import KNOB, Knob, Part, default_value
from .parts import CostPart, DispatchPart, SchedulePart, SolverPart, StepsPart, TopologyPart
from .source import Source, python_keywords
from .values import Name


PARTS: dict[str, type] = {"source": Source, "dispatch": DispatchPart, "solver": SolverPart,
                          "schedule": SchedulePart, "topology": TopologyPart, "cost": CostPart,
                          "steps": StepsPart}


RUN_PARTS = ("dispatch", "solver", "schedule", "topology", "cost", "steps")


def _part(name: str) -> Callable[[], Part]:
    return lambda: PARTS[name]()


@dataclass(frozen=True)
class RunSpec:
    """One simulated configuration: the dispatch, solver, schedule, topology, cost and steps
    parts.

    Build one with `RunSpec.of(gpus=8, policy="row", ...)` (flat field names, routed to their
    part) and vary it with `spec.replace(mode="a2a", ...)`. The parts check their fields on
    construction; `placement` (serve one given placement) excludes a rebalance schedule. The
    steps part (`select_steps`, `drop_warmup`, `drop_dummy`, `drop_outliers`,
    `max_batched_tokens`) shapes the trace `replay` and `compare` are given before they plan
    (`replay.shaped`).
    """

    dispatch: DispatchPart = field(default_factory=_part("dispatch"))
    solver: SolverPart = field(default_factory=_part("solver"))
    schedule: SchedulePart = field(default_factory=_part("schedule"))
    topology: TopologyPart = field(default_factory=_part("topology"))
    cost: CostPart = field(default_factory=_part("cost"))
    steps: StepsPart = field(default_factory=_part("steps"))

    def __post_init__(self) -> None:
        if self.topology.gpus % self.dispatch.tp:
            raise InputError(f"tp {self.dispatch.tp} does not divide the {self.topology.gpus} "
                             f"GPUs (EP ranks = DP groups x tp)")
        if self.solver.placement is not None and self.schedule.rebalance_every is not None:
            raise InputError("placement serves every step; it cannot be combined with "
                             "rebalance_every (use initial for the placement before the first "
                             "rebalance)")
        if self.solver.solve_from != "all" and (self.solver.placement is not None or
                                                self.schedule.rebalance_every is not None):
            raise InputError(f"solve_from {self.solver.solve_from} solves one placement from "
                             f"that stage's steps; it cannot be combined with a given "
                             f"placement or rebalance_every")
        redundant = self.topology.redundant
        if redundant is not None and redundant < 0 and not (
                isinstance(self.solver.placement, Placement) and self.solver.placement.partial):
            raise InputError(f"redundant must be >= 0, got {redundant}: fewer slots than "
                             f"experts is a state only the survivors of dead ranks reach "
                             f"({option('fail_ranks')})")

    @classmethod
    def of(cls, **values: Any) -> "RunSpec":
        """A spec from flat field names (`gpus=8, policy="row"`); the rest default."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> "RunSpec":
        """A copy with the named fields changed (flat names, routed to their parts)."""
        owners = {name: part for part, name, _ in run_knobs()}
        unknown = sorted(set(values) - set(owners))
        reading = [n for n in unknown if python_keywords(n)]
        if reading:  # the command line's, of what it reads: made before `replay` takes it
            raise InputError(f"{', '.join(reading)} belong{'s' if len(reading) == 1 else ''} "
                             f"to the trace, not the run: give "
                             f"{'; '.join(' or '.join(python_keywords(n)) for n in reading)}, "
                             f"then replay(trace, spec)")
        if unknown:
            raise InputError(f"unknown setting {', '.join(unknown)}; the settings are "
                             f"{', '.join(owners)}")
        parts = {}
        for part in RUN_PARTS:
            mine = {k: v for k, v in values.items() if owners[k] == part}
            current = getattr(self, part)
            parts[part] = type(current)(**{**_values(current), **mine}) if mine else current
        return RunSpec(**parts)

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights, to price migrations: `expert_bytes` when given, else
        the model shape's routed expert (`ModelShape.expert_weight_bytes`)."""
        given = self.schedule.expert_bytes
        return self.cost.profiles()[0].expert_weight_bytes if given is None else given

    def fit(self, num_experts: int, slots: int | None = None, file: Any = None) -> "RunSpec":
        """This spec with `redundant` decided for `num_experts` experts (`TopologyPart.fit`:
        a served placement's `slots`, else the given value, else the default)."""
        redundant = self.topology.fit(num_experts, slots, file)
        return self if redundant == self.topology.redundant else self.replace(redundant=redundant)

    def shared_work(self) -> float:
        """Each token's shared-expert work in a layer, in routed pairs (`CostPart.shared_work`
        of the dispatch part's `shared_experts` and policy)."""
        return self.cost.shared_work(self.dispatch.shared_experts,
                                     resolve_policy(self.dispatch.policy)[1].places_shared)

    def spills(self) -> bool:
        """Whether the run's policy spills pairs to GPUs that fetch their weights
        (`DispatchPolicy.spill`)."""
        return resolve_policy(self.dispatch.policy)[1].spill is not None

    def spill_gathers(self) -> bool:
        """Whether the run's ranks all-gather their counts every layer for a spill policy's
        plan: "a2a", a rule planning from every rank's counts (not the naive port)."""
        rule = resolve_policy(self.dispatch.policy)[1].spill
        return rule is not None and not rule.local and self.dispatch.mode == "a2a"

    def sharing(self, policies: Sequence[Any]) -> "RunSpec":
        """This spec for a comparison of `policies`: with `shared_experts` unset and some
        policy placing the shared expert, every row counts the model's shared experts, so the
        rows compare the same work."""
        if self.dispatch.shared_experts is not None or not any(
                resolve_policy(p)[1].places_shared for p in policies):
            return self
        return self.replace(shared_experts=self.cost.model_shared_experts())

    def get(self, name: str) -> Any:
        """The value of the field `name`, whichever part holds it."""
        for part in RUN_PARTS:
            if name in {f.name for f in fields(getattr(self, part))}:
                return getattr(getattr(self, part), name)
        raise KeyError(name)

    def labels(self) -> dict[str, Any]:
        """Every field as a plain JSON value, in schema order: names for registry entries and
        callables, "given" for a Placement object, the path for a file."""
        out = {name: label(getattr(getattr(self, part), name), knob)
               for part, name, knob in run_knobs()}
        out["gpus_per_node"] = self.topology.topology().gpus_per_node  # the default resolved
        return out


def _values(part: Part) -> dict[str, Any]:
    return {f.name: getattr(part, f.name) for f in fields(part)}


def label(value: Any, knob: Knob | None = None) -> Any:
    """A field's value as a row shows it (`RunSpec.labels`): "given" for a Placement object, a
    registry entry's name for a callable (`knob` a `Name` field's), else the value."""
    if isinstance(value, Placement):
        return "given"
    if knob is not None and isinstance(knob.type, Name) and value is not None \
            and not isinstance(value, str):
        return name_of(value, POLICIES if knob.type.kind == "policy" else None)
    return value


def knobs(parts: tuple[str, ...] | None = None,
          command: str | None = None) -> Iterator[tuple[str, str, Knob]]:
    """`(part, field name, Knob)` of every field, in schema order; only those of `parts` and
    settable from `command` when given. A field a part takes from another part it extends (the
    source's steps, `StepsPart`) is that part's, listed once."""
    for part, cls in PARTS.items():
        if parts is not None and part not in parts:
            continue
        extended = {f.name for other in PARTS.values() if other is not cls
                    and issubclass(cls, other) for f in fields(other)}
        for f in fields(cls):
            knob = f.metadata[KNOB]
            if f.name not in extended and (command is None or command in knob.commands):
                yield part, f.name, knob


def run_knobs() -> Iterator[tuple[str, str, Knob]]:
    """The fields of a RunSpec (`knobs` without the source)."""
    return knobs(RUN_PARTS)


def default_of(part: str, name: str) -> Any:
    """A field's default."""
    return default_value(next(f for f in fields(PARTS[part]) if f.name == name))
