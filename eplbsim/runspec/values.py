"""The value types of the knobs: each parses command-line text (`parse`) and checks any value
(`check`) with one message wherever the value came from (a flag, a sweep spec, Python).
"""

from __future__ import annotations

import json
import math
import os
from itertools import product
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..base.errors import InputError
from ..base.limits import MAX_BATCH, MAX_COUNT, check_at_most, shown
from ..base.registry import unknown
from ..cost.catalog import model_shape
from ..cost.shapes import ModelShape
from ..engines.sglang_runtime import flags as engine_flags
from ..placement import Placement
from ..traces.counts import parse_where
from ..traces.request_synth import REQUEST_SCENARIOS
from ..traces.requests import RequestSet
from ..traces.steps import parse_steps
from ..traces.workload import DEFAULT_GRAPH_SIZES


# Each parses command-line text (`parse`) and checks a value from anywhere (`check`): it returns
# the value as stored, or raises InputError whose message says what is wrong (without naming
# the setting: the caller prefixes the flag, the sweep key or the field).

@dataclass(frozen=True)
class Integer:
    """An integer >= `least` and <= `most`, a cap of `eplbsim.base.limits` (`MAX_COUNT` when not
    given: every count a run can hold); None too when `optional`."""

    least: int = 0
    optional: bool = False
    most: int | None = None

    def parse(self, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise InputError(f"must be an integer, got {_quoted(text)}") from None

    def check(self, value: Any) -> int | None:
        if value is None and self.optional:
            return None
        most = MAX_COUNT if self.most is None else self.most
        if isinstance(value, bool) or not isinstance(value, int) or not \
                self.least <= value <= most:
            bound = (f"in [{self.least}, {self.most}]" if self.most is not None else
                     f">= {self.least} and at most 2**62" if isinstance(value, int)
                     and value > most else f">= {self.least}")
            raise InputError(f"must be an integer {bound}, got {shown(value)}")
        return int(value)


def _finite_float(value: int | float) -> bool:
    """Whether `value` reads as a finite float (an integer of 310 digits does not)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _quoted(text: str) -> str:
    """`text` quoted, or its length when it is too long to be worth echoing."""
    return repr(text) if len(text) <= 40 else f"{len(text)} characters ({text[:12]!r}...)"


@dataclass(frozen=True)
class Number:
    """A finite number in `[least, most]`, both within `MAX_COUNT` of 0 (stored as float); None
    too when `optional`."""

    least: float = -math.inf
    most: float = math.inf
    optional: bool = False

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise InputError(f"must be a number, got {_quoted(text)}") from None
        if math.isinf(value) and "inf" not in text.lower():
            raise InputError(f"must be a number, got {_quoted(text)}, beyond a float's range")
        return value

    def check(self, value: Any) -> float | None:
        if value is None and self.optional:
            return None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        least, most = max(self.least, -MAX_COUNT), min(self.most, MAX_COUNT)
        if not number or not math.isfinite(value) or not least <= value <= most:
            got = (f"{value:g}" if number and abs(value) <= MAX_COUNT  # 2 and 2.0 read alike
                   else shown(value))
            raise InputError(f"must be a number in [{least:g}, {most:g}], got {got}")
        return float(value)


@dataclass(frozen=True)
class Switch:
    """True or False, 1 or 0 read as such (a `--flag / --no-flag` pair on the command line);
    None too when `optional` (neither given: the setting's automatic choice)."""

    optional: bool = False

    def parse(self, text: str) -> bool:
        raise AssertionError("switches are parsed by argparse")

    def check(self, value: Any) -> bool | None:
        if value is None and self.optional:
            return None
        if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
            raise InputError(f"must be true or false (or 1 or 0), got {value!r}")
        return bool(value)


@dataclass(frozen=True)
class Name:
    """A name in `registry` (a dict or a sequence of names, read when checking, so entries
    registered later count); when `callables`, also a callable or an `entry` object (e.g. a
    `DispatchPolicy`) given directly; None too when `optional`."""

    registry: Any
    kind: str
    callables: bool = False
    entry: type | None = None
    optional: bool = False

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if self.callables and (callable(value) or (self.entry is not None
                                                   and isinstance(value, self.entry))):
            return value
        if not isinstance(value, str) or value not in self.registry:
            raise unknown(self.kind, value, self.registry)
        return value


@dataclass(frozen=True)
class File:
    """A path to an existing file or directory; None when absent (`absent` on the command
    line: e.g. `--initial trivial`); a Placement object too when `placement`."""

    what: str
    placement: bool = False
    absent: str | None = None

    def parse(self, text: str) -> str | None:
        return None if text == self.absent else text

    def check(self, value: Any) -> Any:
        if value is None or value == self.absent:
            return None
        if self.placement and isinstance(value, Placement):
            return value
        if not isinstance(value, (str, os.PathLike)):
            raise InputError(f"must be a path to {self.what}, got {value!r}")
        if not Path(value).exists():
            raise InputError(f"{value}: no such file")
        return str(value)


@dataclass(frozen=True)
class Files(File):
    """A path to an existing file or folder, or several (a list or tuple; from the command
    line, every word after the flag) read as one log: one as a string, several as a tuple of
    strings."""

    def parse(self, text: Any) -> Any:
        if isinstance(text, (list, tuple)):
            return tuple(text) if len(text) > 1 else text[0]
        return text

    def check(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            if not value:
                raise InputError(f"must name {self.what}, got no path")
            paths = tuple(super(Files, self).check(v) for v in value)
            return paths if len(paths) > 1 else paths[0]
        return super().check(value)


@dataclass(frozen=True)
class Model:
    """A model to price (`cost.catalog.model_shape`): a known name, the path of a Hugging Face
    `config.json` (or of a folder holding one), or a `ModelShape`; None too (the trace's or
    the default model, decided per trace)."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> Any:
        if value is None or isinstance(value, ModelShape):
            return value
        if isinstance(value, os.PathLike):
            value = str(value)
        if not isinstance(value, str):
            raise InputError(f"must be a model name or a config.json path, got {value!r}")
        model_shape(value)  # an unknown name or a bad config says so now
        return value


@dataclass(frozen=True)
class Options:
    """Named options `{KEY: number, text or boolean}`; `KEY=VALUE` on the command line (VALUE
    read as JSON when it can be: numbers, true/false), `PREFIX.KEY` in a sweep spec."""

    prefix: str

    def parse(self, text: str) -> tuple[str, Any]:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise InputError(f"expected KEY=VALUE, got {_quoted(text)}")
        try:
            return key, json.loads(value)
        except ValueError:
            if value.lstrip("+-").isdigit():  # digits beyond what Python reads as a number
                raise InputError(f"option {key!r} must be a finite number within a float's "
                                 f"range, got a {len(value)}-digit number") from None
            return key, value

    def check(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise InputError(f"must be a mapping of option names to values, got {value!r}")
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, (str, int, float, bool)):
                raise InputError(f"option {key!r} must be a number, text or boolean, "
                                 f"got {shown(item)}")
            if isinstance(item, (int, float)) and not _finite_float(item):
                raise InputError(f"option {key!r} must be a finite number within a float's "
                                 f"range, got {shown(item)}")
        return dict(value)


@dataclass(frozen=True)
class EngineSources(Options):
    """Engine sources `{ENGINE: PATH or "=VERSION"}`: `ENGINE=PATH` or `ENGINE==VERSION` on the
    command line, comma-separated or repeated. Several sources of one engine make several runs
    (`sets`), side by side."""

    def sets(self, texts: Sequence[str]) -> list[dict[str, Any]]:
        """The source sets `texts` (flag values, each comma-separated) name: every combination
        of each engine's sources, in the order given (one set when each engine has one)."""
        given: dict[str, list[str]] = {}
        for text in texts:
            for item in (t.strip() for t in text.split(",") if t.strip()):
                engine, value = self.parse(item)
                if str(value) not in given.setdefault(engine, []):
                    given[engine].append(str(value))
        return [dict(zip(given, chosen)) for chosen in product(*given.values())] or [{}]


@dataclass(frozen=True)
class Device:
    """`cpu`, `cuda`, `cuda:N` or `auto` (CUDA when torch sees a device, else the CPU)."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str:
        ok = isinstance(value, str) and (value in ("cpu", "cuda", "auto") or (
            value.startswith("cuda:") and value[5:].isdigit()))
        if not ok:
            raise unknown("device", value, ("cpu", "cuda", "auto"), ("cuda:N",))
        return value


@dataclass(frozen=True)
class Sizes:
    """Increasing integers >= 1 (CUDA-graph sizes): comma-separated on the command line,
    `default` for the engines' default sizes, `none` for none."""

    def parse(self, text: str) -> tuple[int, ...]:
        if text in ("default", "none"):
            return DEFAULT_GRAPH_SIZES if text == "default" else ()
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise InputError(f"must be comma-separated integers, default or none, got "
                             f"{text!r}") from None

    def check(self, value: Any) -> tuple[int, ...]:
        if isinstance(value, str):  # a sweep's text, as on the command line
            value = self.parse(value)
        if not isinstance(value, (list, tuple)) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value) \
                or list(value) != sorted(set(value)):
            shown = list(value) if isinstance(value, (list, tuple)) else repr(value)
            raise InputError(f"must be increasing integers >= 1, got {shown}")
        if value:
            check_at_most(value[-1], MAX_BATCH, "the largest size")
        return tuple(value)


@dataclass(frozen=True)
class Ranks:
    """Distinct EP ranks, each an integer >= 0 (comma-separated on the command line), kept in
    ascending order; None when absent."""

    def parse(self, text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise InputError(f"must be comma-separated ranks, got {_quoted(text)}") from None

    def check(self, value: Any) -> tuple[int, ...] | None:
        if value is None:
            return None
        if isinstance(value, str):  # a sweep's text, as on the command line
            value = self.parse(value)
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value,)
        if not isinstance(value, (list, tuple)) or not value or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value) \
                or len(set(value)) != len(value):
            raise InputError(f"must be distinct ranks >= 0, at least one, got {shown(value)}")
        return tuple(sorted(value))


@dataclass(frozen=True)
class RequestInput:
    """A request-level input: a request scenario's name, a path to a request file, or a
    RequestSet given directly; None when absent."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> Any:
        if value is None or isinstance(value, RequestSet) or value in REQUEST_SCENARIOS:
            return value
        if not isinstance(value, (str, os.PathLike)):
            raise InputError(f"must be a request file or one of "
                             f"{', '.join(REQUEST_SCENARIOS)}, got {value!r}")
        if not Path(value).exists():
            raise InputError(f"{value}: no such file, and not a request scenario (one of "
                             f"{', '.join(REQUEST_SCENARIOS)})")
        return str(value)


@dataclass(frozen=True)
class Text:
    """Non-empty text (a record key, a record type); None when absent."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise InputError(f"must be non-empty text, got {value!r}")
        return value


@dataclass(frozen=True)
class EngineFlags(Text):
    """An engine's server flags (`--engine-args`): text whose flags the engine adapter reads
    (`engines.sglang_runtime.flags`)."""

    def check(self, value: Any) -> str | None:
        value = super().check(value)
        if value is not None:
            engine_flags(value)
        return value


@dataclass(frozen=True)
class StepSelection:
    """Steps of a trace: comma-separated steps and ranges (`traces.steps.parse_steps`, checked
    against the trace when it is read); None for all."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        parse_steps(value)
        return value


@dataclass(frozen=True)
class Filter:
    """Column filters of a counts CSV, `COLUMN=VALUE,...`; None when absent."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise InputError(f"must be COLUMN=VALUE pairs separated by commas, got {value!r}")
        parse_where(value)
        return value
