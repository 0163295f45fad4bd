"""How a setting is declared: `knob(default, help, type, ...)` makes a dataclass field carrying
its `Knob` (help, value type, flags, the commands that take it), and `Part` is a frozen group of
such fields that checks them (`checked`) and relates them (`Part.relate`). `COMMANDS`, `SYNTH`,
`READS` and `WITH_INFO` name the commands a knob can be set from.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Sequence

from ..base.errors import InputError


KNOB = "eplbsim.knob"  # the metadata key of a declared field
COMMANDS = frozenset({"run", "ranks", "sweep", "review"})
SYNTH = COMMANDS | {"synth"}  # what `trace synth` also takes: the scenario's sizes and seed
READS = COMMANDS | {"info", "convert", "solve", "export", "figures"}  # commands reading a trace
WITH_INFO = COMMANDS | {"info"}  # `trace info` reports the steps a workload makes of requests


@dataclass(frozen=True)
class Knob:
    """How one field is set.

    type:     its value type (parse and check)
    help:     the help text of its flag (the default is appended)
    flags:    its command-line flags (default `--name-with-dashes`)
    listed:   on run and ranks, a comma-separated list compared side by side, with this
              default (e.g. the policies)
    commands: where it can be set: run, ranks, sweep, and the commands that read a trace
              file (`READS`) or make a scenario (`SYNTH`)
    metavar:  the flag's value placeholder
    """

    type: Any
    help: str
    flags: tuple[str, ...] = ()
    listed: str | None = None
    commands: frozenset[str] = COMMANDS
    metavar: str | None = None


def knob(default: Any, help: str, type: Any, **how: Any) -> Any:
    """A part's field declared with its default, help text, value type and `Knob` settings."""
    meta = {KNOB: Knob(type, help, **how)}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def checked(name: str, knob: Knob, value: Any, label: str | None = None) -> Any:
    """`value` checked by the knob's type; InputError prefixed by `label` (default `name`)."""
    try:
        return knob.type.check(value)
    except InputError as exc:
        raise InputError(f"{label or name}: {exc}") from None


@dataclass(frozen=True)
class Part:
    """Base of the schema's parts: every field is checked (and normalised) on construction,
    then `relate` checks how the fields of the part go together."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, checked(f.name, f.metadata[KNOB],
                                                     getattr(self, f.name)))
        self.relate()

    def relate(self) -> None:
        """InputError when fields that are each valid do not go together."""


def default_value(f: Any) -> Any:
    """A dataclass field's default value."""
    return f.default_factory() if f.default is MISSING else f.default


def they(names: Sequence[str], verb: str) -> str:
    """`names` and `verb` agreeing with them: "dp applies", "dp, chunk apply", "dp does"."""
    single = {"apply": "applies", "do": "does"}[verb]
    return f"{', '.join(names)} {single if len(names) == 1 else verb}"


def changed_fields(part: Part, names: tuple[str, ...]) -> list[str]:
    """The fields among `names` whose value differs from their default."""
    defaults = {f.name: default_value(f) for f in fields(part)}
    return [n for n in names if getattr(part, n) != defaults[n]]
