"""The command reference in `docs/`: one Markdown page per command and subcommand, generated
from the parser itself (whose run, ranks and reading flags come from the run schema, `spec`),
so a page cannot drift from what the command takes. `python -m eplbsim.cli.reference [DIR]`
rewrites them (default `docs/`); a test checks the committed pages are current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

from . import build_parser

WIDTH = 100  # the usage block's width, fixed so the pages are the same on every terminal
SKIPPED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """`(command path, parser)` of `parser` and of every subcommand under it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,))


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
    return {"index.md": "\n".join(index) + "\n", **out}


def main(argv: list[str] | None = None) -> int:
    """Write every page into the folder given (default `docs/`)."""
    out = Path((argv if argv is not None else sys.argv[1:] or ["docs"])[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (out / name).write_text(text)
    print(f"wrote {len(pages())} pages to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
