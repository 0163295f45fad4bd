"""The `eplbsim` command: one module per command, each with its arguments beside its handler.

`COMMANDS` maps a command name to `(help, add_arguments, handle)`: `add_arguments(parser)`
declares its flags (the run schema's, `spec.add_flags`, where it runs replays) and
`handle(args) -> exit status` runs it. Errors in the user's input end with one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import InputError
from . import bench, export, figures, ranks, run, solve, sweep, trace

COMMANDS = {
    "run": (run.HELP, run.add_arguments, run.handle),
    "ranks": (ranks.HELP, ranks.add_arguments, ranks.handle),
    "trace": (trace.HELP, trace.add_arguments, None),
    "solve": (solve.HELP, solve.add_arguments, solve.handle),
    "bench": (bench.HELP, bench.add_arguments, bench.handle),
    "sweep": (sweep.HELP, sweep.add_arguments, sweep.handle),
    "figures": (figures.HELP, figures.add_arguments, figures.handle),
    "export": (export.HELP, export.add_arguments, export.handle),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (a command with subcommands sets their handlers itself)."""
    parser = argparse.ArgumentParser(
        prog="eplbsim", description="Replay MoE routing traces through expert placement "
        "solvers and dispatch policies; measure load skew and rank agreement.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add_arguments, handle) in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        add_arguments(command)
        if handle is not None:
            command.set_defaults(handler=handle)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except InputError as exc:
        print(f"eplbsim: error: {exc}", file=sys.stderr)
        return 2
