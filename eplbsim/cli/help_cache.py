"""`eplbsim COMMAND --help` answered without building the parser, from a cache of every
command's help.

A command's help lists the run schema's flags, whose values name the registries (policies,
solvers, views, ...), so building the parser imports torch and every registry: seconds. The
first help asked for after eplbsim or its environment changed builds the whole parser once and
writes every command's help text to one file under the user's cache folder
(`$XDG_CACHE_HOME/eplbsim`, else `~/.cache/eplbsim`), named by a fingerprint of what the text
depends on (`fingerprint`); later ones print that text, importing nothing more of eplbsim's. A
cache that cannot be read or written is passed over: the help is built as without one.

Only a request for help alone is answered here (`asked`: command words, then `-h` or
`--help`); any other command line, `--help` among other flags included, goes to argparse.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..base.errors import InputError
from ..base.files import atomic_file

HELP_FLAGS = ("-h", "--help")
PACKAGE = Path(__file__).resolve().parents[1]  # eplbsim/


def asked(argv: Sequence[str]) -> tuple[str, ...] | None:
    """The command path of a request for help alone (`["run", "--help"]` -> `("run",)`,
    `["--help"]` -> `()`), else None."""
    if not argv or argv[-1] not in HELP_FLAGS:
        return None
    words = tuple(argv[:-1])
    return None if any(w.startswith("-") for w in words) else words


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """`(command path, parser)` of `parser` and of every subcommand under it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,))


def fingerprint() -> str:
    """What the help text depends on, hashed: every source file of the package (its path, size
    and modification time), the interpreter and its import paths with their modification times
    (a package installed or removed changes them), and the terminal's width (argparse wraps
    the help to it)."""
    parts: list[Any] = [sys.executable, shutil.get_terminal_size().columns]
    for entry in sys.path:
        try:
            parts.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            parts.append((entry, None))
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                stat = os.stat(os.path.join(root, name))
                parts.append((os.path.join(root, name), stat.st_size, stat.st_mtime_ns))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def cache_dir() -> Path:
    """The folder of the cache: `$XDG_CACHE_HOME/eplbsim`, else `~/.cache/eplbsim`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eplbsim"


def help_text(argv: Sequence[str], build_parser: Callable[[], Any]) -> str | None:
    """The help `argv` asks for alone (`asked`), from the cache, or built with
    `build_parser()` and cached with every other command's; None when `argv` asks for more
    than help, or for a command that does not exist (argparse says so)."""
    path = asked(argv)
    if path is None:
        return None
    file = cache_dir() / f"help-{fingerprint()}.json"
    try:
        texts = json.loads(file.read_text())
    except (OSError, ValueError):
        texts = None
    if not isinstance(texts, dict):
        texts = {" ".join(p): parser.format_help() for p, parser in commands(build_parser())}
        _write(file, texts)
    return texts.get(" ".join(path))


def _write(file: Path, texts: dict[str, str]) -> None:
    """`texts` written to `file` whole (`files.atomic_file`), the older help files beside it
    removed; nothing when the folder cannot be written."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        for old in file.parent.glob("help-*.json"):
            old.unlink(missing_ok=True)
        with atomic_file(file) as part:
            part.write_text(json.dumps(texts))
    except (OSError, InputError):
        return
