"""The command reference in `docs/`: one Markdown page per command and subcommand, generated
from the parser itself (whose run, ranks and reading flags come from the run schema, `spec`),
so a page cannot drift from what the command takes, and `api.md`, the Python API a policy or
solver of your own uses, generated from the docstrings it documents (`api_page`).
`python -m eplbsim.cli.reference [DIR]` rewrites them (default `docs/`); a test checks the
committed pages are current."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

from . import build_parser
from .help_cache import commands

WIDTH = 100  # the usage block's width, fixed so the pages are the same on every terminal
SKIPPED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _flag(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """How a flag is written in the table: its option strings and value placeholder."""
    if not action.option_strings:
        return action.metavar or action.dest
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"{flag} {value}" for flag in action.option_strings)


def page(path: tuple[str, ...], parser: argparse.ArgumentParser) -> str:
    """The Markdown page of one command: what it does, its usage, and a table of its flags
    per help section (one section a title: the positional arguments and the options share
    "arguments")."""
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    lines = [f"# eplbsim {' '.join(path)}", "", parser.description or "", "", "```",
             formatter.format_help().strip(), "```"]
    subcommands = [(name, sub) for a in parser._actions
                   if isinstance(a, argparse._SubParsersAction) for name, sub in a.choices.items()]
    if subcommands:
        lines += ["", "| subcommand | what it does |", "|---|---|"]
        lines += [f"| [`{name}`]({'-'.join(path + (name,))}.md) | {sub.description} |"
                  for name, sub in subcommands]
    sections: dict[str, list[argparse.Action]] = {}  # one a title: argparse's two "arguments"
    for group in parser._action_groups:
        title = "arguments" if group.title in ("positional arguments", "options") else group.title
        sections.setdefault(title, []).extend(a for a in group._group_actions
                                              if not isinstance(a, SKIPPED))
    for title, actions in sections.items():
        if not actions:
            continue
        lines += ["", f"## {title}", "", "| flag | what it does |", "|---|---|"]
        for action in actions:
            text = " ".join(formatter._expand_help(action).split()).replace("|", "\\|")
            flag = _flag(action, formatter).replace("|", "\\|")
            lines.append(f"| `{flag}` | {text} |")
    return "\n".join(lines) + "\n"


API_EXAMPLES = {  # title -> a file a user could write; the tests run each (tests/cli/test_reference)
    "A policy: each expert's pairs in turn over its candidates, rank-invariant": '''\
import torch
from eplbsim.dispatch import candidate_counts, occurrence_index, replica_slots


def spread(topk_ids, view, ctx):
    """Pair j of expert e in the batch takes candidate j % n_e: the same on every rank that
    sees the same batch and view, so it is exact in "none" mode."""
    n = candidate_counts(topk_ids, view, ctx.layer)          # [T, K] candidates of each pair
    replica = occurrence_index(topk_ids) % n                  # [T, K] in [0, n)
    return replica_slots(topk_ids, view, ctx.layer, replica)  # [T, K] slots, -1 at padding
''',
    "A solver: round-robin replicas of the hottest experts": '''\
import numpy as np


def hottest_twice(load, num_slots, topology, num_groups=1):
    """Every expert once, then the hottest ones again, slot by slot: phy2log [L, P]."""
    L, E = load.shape
    extra = np.argsort(-load, axis=1, kind="stable")[:, :num_slots - E]  # [L, P - E]
    return np.concatenate([np.tile(np.arange(E), (L, 1)), extra], axis=1)
''',
}


def _doc(obj: Any) -> str:
    """`obj`'s signature (a function's) and its docstring as a page shows them: the first
    paragraph as text, the rest (field lists aligned in columns) as written."""
    head = ""
    if inspect.isfunction(obj):
        head = f"```python\n{obj.__name__}{inspect.signature(obj)}\n```\n\n"
    first, _, rest = inspect.cleandoc(obj.__doc__ or "").partition("\n\n")
    return head + " ".join(first.split()) + (f"\n\n```text\n{rest}\n```" if rest else "")


def _fields(cls: type) -> str:
    """A table of a dataclass's fields: name, type and default."""
    rows = ["| field | type | default |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = "" if f.default is dataclasses.MISSING else f"`{f.default!r}`"
        rows.append(f"| `{f.name}` | `{f.type}` | {default} |")
    return "\n".join(rows)


def api_page() -> str:
    """`api.md`: what a policy of your own is given (`topk_ids`, the `View`, the
    `DispatchContext`), the helpers it builds on, how it is registered, what a solver is, and
    one example of each (`API_EXAMPLES`), all from the docstrings of the code they document."""
    from .. import dispatch, solvers
    from ..dispatch import policies
    from ..placement import View
    module = inspect.cleandoc(policies.__doc__ or "")
    contract = module.split("\n\n")[2] if module.count("\n\n") >= 2 else module
    lines = ["# Your own policies and solvers: the Python API", "",
             "Generated from the docstrings by `python -m eplbsim.cli.reference` (a test keeps "
             "this page current and runs its examples). A policy in a file is named "
             "`path/to/file.py:function` wherever a policy is (`run --policies`, `ranks`, "
             "`review`, sweeps); from Python, pass the function itself. A solver is passed as a "
             "function to `solve`, `RunSpec.of(solver=...)` and `replay`.", "",
             "## A policy", "", contract, "",
             "### `topk_ids`", "", "int `[T, K]`: the logical expert of each (token, top-k "
             "slot) pair of the batch the rank dispatches in one layer; -1 marks padding.", "",
             "### `view`: `eplbsim.placement.View`", "", _doc(View), "", _fields(View), "",
             "### `ctx`: `eplbsim.dispatch.DispatchContext`", "", _doc(dispatch.DispatchContext),
             "", _fields(dispatch.DispatchContext), "", "## Helpers a policy builds on"]
    for helper in (dispatch.candidate_counts, dispatch.replica_slots, dispatch.occurrence_index):
        lines += ["", f"### `{helper.__name__}`", "", _doc(helper)]
    lines += ["", "## Registering a policy with its properties", "",
              "`eplbsim.POLICIES[name] = DispatchPolicy(fn, rank_invariant=..., ...)` makes "
              "it a name in every command of this process; a function given bare is taken as "
              "rank-variant, nothing claimed.", "", _doc(dispatch.DispatchPolicy), "",
              "## A solver", "", inspect.cleandoc(solvers.__doc__ or "").split("\n\n", 1)[1],
              "", "## Examples"]
    for title, code in API_EXAMPLES.items():
        lines += ["", f"### {title}", "", "```python", code.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """File name -> Markdown of every page: `index.md` (the commands), then one per command
    and subcommand (`run.md`, `trace-info.md`, ...)."""
    out = {}
    rows = []
    for path, parser in commands(build_parser()):
        if not path:
            continue
        name = "-".join(path) + ".md"
        out[name] = page(path, parser)
        rows.append(f"| [`eplbsim {' '.join(path)}`]({name}) | {parser.description} |")
    index = ["# Command reference", "", "Generated from the commands' own parsers by "
             "`python -m eplbsim.cli.reference` (a test keeps these pages current). Every "
             "command also prints its page's flags with `--help`.", "",
             "| command | what it does |", "|---|---|", *rows]
    index += ["", "Your own policies and solvers from Python: [api.md](api.md)."]
    return {"index.md": "\n".join(index) + "\n", "api.md": api_page(), **out}


def main(argv: list[str] | None = None) -> int:
    """Write every page into the folder given (default `docs/`); `-h` or `--help` says so
    instead (it is never taken for a folder)."""
    given = argv if argv is not None else sys.argv[1:]
    if given and given[0] in ("-h", "--help"):
        print("usage: python -m eplbsim.cli.reference [DIR]\n\nWrite the command reference "
              "pages into DIR (default docs/).")
        return 0
    out = Path((given or ["docs"])[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (out / name).write_text(text)
    print(f"wrote {len(pages())} pages to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
