"""Every flag of `eplbsim run` has its name in Python (DESIGN.md §7): a run's setting is a
keyword of `RunSpec.of`, the steps' shaping too (`select_steps`, ..., `max_batched_tokens`:
also keywords of `open_trace` and `shape_steps`); what makes the trace it reads is a keyword of
the call that opens or makes that trace (`python_keywords`); the rest is named here, so a flag
added to `run` cannot be forgotten."""

import argparse
import importlib

import pytest

from eplbsim import InputError, RunSpec
from eplbsim.cli import build_parser
from eplbsim.runspec import knobs, run_knobs
from eplbsim.runspec.source import python_keywords
from eplbsim.traces.steps import SHAPING

# run's own flags, about how it runs and what it writes, not what it replays -> the Python
# that does the same ("module:name")
RUN_OWN = {"per_layer": "eplbsim.replay.results:Results",  # Results.time_series(per_layer)
           "baseline": "eplbsim.replay.results:with_speedup",
           "workers": "eplbsim.replay.workers:Workers",
           "executor": "eplbsim.replay.workers:Workers",
           "address": "eplbsim.replay.workers:Workers",
           "json": "eplbsim.replay.results:to_json",
           "out": "eplbsim.replay.results:write_results",
           "stage_placements": "eplbsim.replay.stage_placements:stage_placements",
           "draft_fault": "eplbsim.schedule.draft_fault:draft_fault"}


def _run_flags():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a.dest for a in sub.choices["run"]._actions
            if not isinstance(a, argparse._HelpAction)]


def test_every_flag_of_run_has_its_python_name():
    settings = {name for _, name, _ in run_knobs()}
    source = {name for _, name, _ in knobs(("source",), "run")}
    unnamed = []
    for dest in _run_flags():
        if dest in settings:
            continue
        if dest in source:
            if not python_keywords(dest):
                unnamed.append(dest)
            continue
        if dest not in RUN_OWN:
            unnamed.append(dest)
            continue
        module, name = RUN_OWN[dest].split(":")
        assert hasattr(importlib.import_module(module), name), RUN_OWN[dest]
    assert unnamed == [], "give each its Python name (python_keywords, or RUN_OWN here)"


def test_every_run_setting_is_a_keyword_of_runspec_of():
    for _, name, _ in run_knobs():
        spec = RunSpec.of(**{name: RunSpec().get(name)})
        assert spec.get(name) == RunSpec().get(name)


def test_the_steps_shaping_settings_are_the_run_s_and_open_trace_s_keywords():
    settings = {name: part for part, name, _ in run_knobs()}
    assert {settings[name] for name in SHAPING} == {"steps"}
    assert not set(SHAPING) & {name for _, name, _ in knobs(("source",))}  # listed once
    for name in SHAPING:
        assert {"open_trace(%s=...)" % name, "shape_steps(%s=...)" % name} <= set(
            python_keywords(name))


@pytest.mark.parametrize("name", sorted({n for _, n, _ in knobs(("source",), "run")}))
def test_a_trace_making_name_given_to_runspec_says_where_it_goes(name):
    with pytest.raises(InputError) as err:
        RunSpec.of(**{name: None})
    said = str(err.value)
    assert said.startswith(f"{name} belongs to the trace, not the run: give ")
    assert all(call in said for call in python_keywords(name))
