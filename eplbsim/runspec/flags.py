"""The command line and sweep specs generated from the knobs: `add_flags` (a command's
flags, grouped), `from_args` and `build` (their values, and the source and RunSpec they
make), `sweep_keys` and `sweep_value` (a sweep spec's keys, checked as the flags are).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

from ..base.errors import InputError
from ..cost.catalog import config_path
from ..dispatch import resolve_policy
from ..traces.request_synth import REQUEST_SCENARIOS
from .knobs import Knob, checked
from .run import PARTS, RunSpec, default_of, knobs, run_knobs
from .source import BATCHING, READER_OPTIONS, Source
from .values import EngineSources, File, Files, Model, Name, Options, RequestInput, Switch


def flags_of(name: str, knob: Knob) -> tuple[str, ...]:
    return knob.flags or ("--" + name.replace("_", "-"),)


def add_flags(parser: argparse.ArgumentParser, command: str,
              parts: tuple[str, ...] | None = None, helps: dict[str, str] | None = None) -> None:
    """One flag per field settable from `command` (of `parts`, default all), in a group per
    part (`group_title`); `helps` replaces the help of the fields it names (a command whose
    defaults differ says so). Values stay text until `from_args` parses and checks them, so a
    bad one gets the same message as anywhere."""
    groups: dict[str, Any] = {}
    helps = helps or {}
    for part, name, knob in knobs(parts, command):
        title = group_title(part, name)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title]
        if name in helps:
            group.add_argument(*flags_of(name, knob), metavar=knob.metavar, dest=name,
                               help=helps[name].replace("%", "%%"), default=None)
            continue
        default = knob.listed or default_of(part, name)
        text = knob.help + (", comma-separated" if knob.listed else "")
        if isinstance(knob.type, Name):
            text += f"; one of {', '.join(knob.type.registry)}"
        if default not in (None, {}) and "default" not in knob.help:
            text += f" (default {default})"
        common = dict(dest=name, help=text.replace("%", "%%"), default=None)  # argparse formats
        if isinstance(knob.type, Switch):
            group.add_argument(*flags_of(name, knob), action=argparse.BooleanOptionalAction,
                               **common)
        else:
            many = {"nargs": "+"} if isinstance(knob.type, Files) else {}
            group.add_argument(*flags_of(name, knob), metavar=knob.metavar,
                               action="append" if isinstance(knob.type, Options) else "store",
                               **many, **common)


GROUPS = {"source": "what to replay (a trace file, requests or a scenario)",
          "dispatch": "dispatch", "solver": "placement", "schedule": "rebalancing over time",
          "topology": "cluster", "cost": "time (a cost model)",
          "steps": "reading a trace file, and its steps"}


def group_title(part: str, name: str) -> str:
    """The help section of a field's flag: its part's (`GROUPS`), with the source's reading
    options beside the steps' selection, and the batching of requests (`max_batched_tokens`
    too) apart."""
    if part == "source" and name in READER_OPTIONS:
        return GROUPS["steps"]
    if part in ("source", "steps") and name in BATCHING:
        return "requests batched into steps (--requests)"
    return GROUPS[part]


def _split(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"{flag}: needs at least one name")
    return items


def _parsed(knob: Knob, text: str, flag: str) -> Any:
    """Command-line text parsed by the knob's type; InputError naming the flag."""
    try:
        return knob.type.parse(text)
    except InputError as exc:
        raise InputError(f"{flag}: {exc}") from None


def from_args(args: argparse.Namespace, command: str, parts: tuple[str, ...] | None = None
              ) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The flags `add_flags` declared, parsed and checked: `(values, lists)` where `values`
    maps field names to the values given and `lists` the
    listed fields to every value given (their first value is in `values`). InputError naming
    the flag for a bad value."""
    values: dict[str, Any] = {}
    lists: dict[str, list[Any]] = {}
    for part, name, knob in knobs(parts, command):
        raw = getattr(args, name)
        flag = flags_of(name, knob)[-1]
        if raw is None and knob.listed is not None:
            raw = knob.listed
        if raw is None:
            continue
        if knob.listed is not None:
            lists[name] = [checked(name, knob, _parsed(knob, item, flag), flag)
                           for item in _split(raw, flag)]
            values[name] = lists[name][0]
        elif isinstance(knob.type, Switch):
            values[name] = checked(name, knob, raw, flag)
        elif isinstance(knob.type, EngineSources):
            sets = [checked(name, knob, one, flag) for one in knob.type.sets(raw)]
            values[name] = sets[0]
            if len(sets) > 1:
                lists[name] = sets
        elif isinstance(knob.type, Options):
            values[name] = checked(name, knob, dict(_parsed(knob, item, flag) for item in raw),
                                   flag)
        else:
            values[name] = checked(name, knob, _parsed(knob, raw, flag), flag)
    if "policy" in lists and "mode" in lists:  # the base: the first policy in a mode it runs in
        runs = resolve_policy(values["policy"])[1].modes
        values["mode"] = next((m for m in lists["mode"] if m in runs), values["mode"])
    return values, lists


def build(values: Mapping[str, Any]) -> tuple[Source, RunSpec]:
    """The source and the run spec of flat field values (the rest default). The steps' settings
    (`StepsPart`) go to both: the source reads the trace's steps by them, and the spec says
    them, so `replay` and `compare` given that trace apply them once (`replay.shaped`)."""
    source_names = {f.name for f in fields(PARTS["source"])}
    run_names = {name for _, name, _ in run_knobs()}
    source = PARTS["source"](**{k: v for k, v in values.items() if k in source_names})
    return source, RunSpec.of(**{k: v for k, v in values.items()
                                 if k in run_names or k not in source_names})


def sweep_keys() -> dict[str, tuple[str, str, Knob]]:
    """Every key a sweep spec takes -> `(part, field, Knob)`; an options field takes
    `PREFIX.NAME` keys (`option.sigma`, `solver_option.time_limit`) under its prefix."""
    out = {}
    for part, name, knob in knobs(command="sweep"):
        key = knob.type.prefix if isinstance(knob.type, Options) else name
        out[key] = (part, name, knob)
    return out


def sweep_value(key: str, value: Any, where: str, base: Path) -> tuple[str, Any]:
    """`(field name, checked value)` for one sweep key and TOML value; `PREFIX.NAME` keys give
    `(field, (NAME, value))`, and relative paths (of files, request files and model configs)
    are read against `base` (the spec's folder).
    InputError naming `where` and the key."""
    keys = sweep_keys()
    prefix, dot, option = key.partition(".")
    if dot and prefix in keys and isinstance(keys[prefix][2].type, Options):
        part, name, knob = keys[prefix]
        checked(name, knob, {option: value}, f"{where} {key}")
        return name, (option, value)
    if key not in keys or isinstance(keys[key][2].type, Options):
        names = [k + (".NAME" if isinstance(v[2].type, Options) else "") for k, v in keys.items()]
        raise InputError(f"{where} unknown key {key!r}; the keys are {', '.join(names)}")
    part, name, knob = keys[key]
    if isinstance(knob.type, File) and isinstance(value, str):
        value = None if value == knob.type.absent else str(base / value)
    elif isinstance(knob.type, Model) and config_path(value) is not None:  # beside the spec
        value = str(base / value)
    elif isinstance(knob.type, RequestInput) and isinstance(value, str) \
            and value not in REQUEST_SCENARIOS:  # a request file, beside the spec
        value = str(base / value)
    return name, checked(name, knob, value, f"{where} {key}")
