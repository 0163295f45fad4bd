"""What a newcomer types first: `--help` of every command and subcommand, `--version`, and the
help text of every flag (present, and surviving argparse's %-formatting)."""

import argparse

import pytest

from eplbsim.cli import build_parser, main


def _parsers(parser, path=()):
    """`(command path, parser)` of `parser` and every subparser under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


PARSERS = list(_parsers(build_parser()))


def test_the_walk_reaches_every_command():
    names = {p for p, _ in PARSERS}
    assert {("run",), ("ranks",), ("trace", "info"), ("trace", "convert"), ("solve",),
            ("sweep",), ("bench",), ("figures",), ("export",), ("policies",)} <= names


@pytest.mark.parametrize("path", [p for p, _ in PARSERS], ids=" ".join)
def test_help_exits_zero(capsys, path):
    assert main([*path, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: eplbsim") and "Traceback" not in out


@pytest.mark.parametrize("path,parser", PARSERS, ids=[" ".join(p) for p, _ in PARSERS])
def test_every_flag_has_help_that_formats(path, parser):
    formatter = parser._get_formatter()
    silent = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                               argparse._SubParsersAction)):
            continue
        if not (action.help and action.help.strip()):
            silent.append(action.option_strings or action.dest)
            continue
        formatter._expand_help(action)  # raises on a stray % (argparse formats help with %)
    assert not silent, f"eplbsim {' '.join(path)}: no help for {silent}"


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("eplbsim ")


def test_figures_list_says_each_figure_in_a_whole_sentence(capsys):
    from eplbsim.plots.figures import FIGURES
    from eplbsim.base.registry import first_sentence
    assert main(["figures", "--list"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, fn in FIGURES.items():
        sentence = first_sentence(fn.__doc__)
        assert sentence.endswith(".") and f"{name} {sentence}" in text
