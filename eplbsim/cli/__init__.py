"""The `eplbsim` command: one module per command, each with its arguments beside its handler.

Holds one module a command. Takes in the command line; gives out tables, JSON and files.
Imports every package: it is the top, and nothing imports it.

`COMMANDS` maps a command name to its module, whose `add_arguments(parser)` declares its flags
(the run schema's, `runspec.add_flags`, where it runs replays) and whose handler
`handle(args) -> exit status` runs it; the modules are imported when the parser is built, so
`import eplbsim.cli` imports no command's dependencies, and `eplbsim COMMAND --help` is read
from a cache after its first time (`help_cache`).

Errors in the user's input end with one line on stderr and exit status 2 (a flag argparse
cannot parse: a short usage line, then that line). Out of memory, too deep a nesting or an
overflow on the user's data is said the same way; anything else is a bug, reported in one
line as an internal error (with the traceback under `EPLBSIM_DEBUG=1`) and exit status 1. An InputWarning (input used with a part left out) is one
line on stderr, `eplbsim: warning: ...`; what a run warns of (a `RunWarning`) its header says,
once. An error or warning naming an option (of reading a trace, of a run) names its flag
(`base.options`), where the Python API names its keyword.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import warnings
import zipfile
import zlib
from importlib import metadata
from typing import Any, Sequence

from ..base.errors import (EXIT_INTERNAL, EXIT_INTERRUPTED, InputError, InputWarning,
                           RunWarning)
from ..base.files import available_memory, size_text
from . import help_cache

# name -> (its module below eplbsim.cli, the names there of its help text and its handler, or
# None where its subcommands set theirs); a module is imported when the parser is built, and
# its EPILOG, if any, is what the command's --help says after its options
COMMANDS = {
    "run": ("run", "HELP", "handle"),
    "ranks": ("ranks", "HELP", "handle"),
    "trace": ("trace", "HELP", None),
    "solve": ("solve", "HELP", "handle"),
    "bench": ("bench", "HELP", "handle"),
    "sweep": ("sweep", "HELP", "handle"),
    "figures": ("figures", "HELP", "handle"),
    "export": ("export", "HELP", "handle"),
    "policies": ("registries", "POLICIES_HELP", "handle_policies"),
    "solvers": ("registries", "SOLVERS_HELP", "handle_solvers"),
    "models": ("registries", "MODELS_HELP", "handle_models"),
    "engines": ("engines", "HELP", None),
    "review": ("review", "HELP", "handle"),
}
DEBUG = "EPLBSIM_DEBUG"
TORCH_OUT_OF_MEMORY = "can't allocate memory"  # torch's CPU allocator's words (a RuntimeError)


FLAG_VALUED = ("--engine-args",)  # options whose value is itself flags: `--engine-args --x`


def _joined(argv: Sequence[str]) -> list[str]:
    """`argv` with each `FLAG_VALUED` option joined to its value (`--engine-args=--x`), which
    argparse would otherwise take for an option of its own."""
    out = list(argv)
    for i in range(len(out) - 2, -1, -1):
        if out[i] in FLAG_VALUED:
            out[i:i + 2] = [f"{out[i]}={out[i + 1]}"]
    return out


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a short usage line and the error, not the whole
    usage text, which takes a flag only as written (no prefix matching: `--gpus` is never
    taken for `--gpus-per-node`) and the value of a `FLAG_VALUED` option even when it looks
    like a flag. Subcommands' parsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        return super().parse_known_args(_joined(sys.argv[1:] if args is None else args),
                                        namespace)

    def error(self, message: str) -> None:
        self.exit(2, f"usage: {self.prog} ... (see {self.prog} --help)\n"
                     f"eplbsim: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (a command with subcommands sets their handlers itself)."""
    parser = Parser(
        prog="eplbsim", description="Replay MoE routing traces through expert placement "
        "solvers and dispatch policies; measure load skew and rank agreement.")
    parser.add_argument("--version", action="version", version=f"eplbsim {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, text, handle) in COMMANDS.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        command = sub.add_parser(name, help=getattr(module, text),
                                 description=getattr(module, text),
                                 epilog=getattr(module, "EPILOG", None))
        module.add_arguments(command)
        if handle is not None:
            command.set_defaults(handler=getattr(module, handle))
    return parser


def version() -> str:
    """The installed package's version ("unknown" when run from a tree that is not installed)."""
    try:
        return metadata.version("eplbsim")
    except metadata.PackageNotFoundError:
        return "unknown"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _out_of_memory(command: str) -> int:
    """Say that `command` ran out of memory, in one line; the exit status 2."""
    print(f"eplbsim: error: out of memory: eplbsim {command} asks for more than the "
          f"{size_text(available_memory())} this machine has; give it fewer steps "
          f"(--select-steps, --steps), tokens, layers or slots, or a smaller grid",
          file=sys.stderr)
    return 2


def _warning_line(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    """Show a warning as one line on stderr: `eplbsim: warning: MESSAGE`."""
    print(f"eplbsim: warning: {' '.join(str(message).split())}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status: the command's (0 when it did what it was asked;
    `review`'s verdict), `EXIT_INPUT` (2) for bad input, `EXIT_INTERNAL` (4) for an internal
    error, `EXIT_INTERRUPTED` (130) when interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # what the parser would print, without building it
        print(f"eplbsim {version()}")
        return 0
    text = help_cache.help_text(argv, build_parser)
    if text is not None:  # `eplbsim COMMAND --help`, from the cache after its first time
        sys.stdout.write(text)
        return 0
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a flag argparse could not parse (its message is out)
        return exc.code if isinstance(exc.code, int) else 2
    import numpy as np  # the command's own imports have brought these in

    from ..base.options import flags_named
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"), flags_named():
            warnings.simplefilter("ignore", RuntimeWarning)
            warnings.simplefilter("default", InputWarning)  # each one once
            warnings.simplefilter("ignore", RunWarning)  # a run's header prints them
            warnings.showwarning = _warning_line
            return args.handler(args)
    except InputError as exc:
        print(f"eplbsim: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except MemoryError:
        return _out_of_memory(args.command)
    except (RecursionError, OverflowError, zipfile.BadZipFile, zlib.error) as exc:
        print(f"eplbsim: error: the input cannot be read ({_one_line(exc)})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eplbsim: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader stopped early (`| head`): nothing more to say
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the interpreter flushes it at exit)
        return 0
    except OSError as exc:  # a path the user gave: too long, not permitted, disk full, ...
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"eplbsim: error: {where}{exc.strerror or _one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: one line, the traceback only when asked for
        if isinstance(exc, RuntimeError) and TORCH_OUT_OF_MEMORY in str(exc):
            return _out_of_memory(args.command)
        if os.environ.get(DEBUG):
            traceback.print_exc()
        print(f"eplbsim: internal error, please report it ({_one_line(exc)}); "
              f"{DEBUG}=1 shows the traceback", file=sys.stderr)
        return EXIT_INTERNAL
