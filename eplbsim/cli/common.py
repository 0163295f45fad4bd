"""What several commands share: comma-separated lists, argparse integer types, logs named by
one path or several, and output directories checked against the inputs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Iterable

from ..base.errors import InputError
from ..base.files import check_output
from ..base.limits import MAX_SEED


def log_paths(paths: list[Path]) -> Any:
    """The paths of a log given as several words (`nargs="+"`): one as a string, several as a
    tuple (read as one log: `traces.formats.open_trace`)."""
    return str(paths[0]) if len(paths) == 1 else tuple(str(p) for p in paths)


def shown_paths(paths: list[Path]) -> str:
    """`paths` as a line names them: the first, and how many more."""
    more = len(paths) - 1
    return str(paths[0]) + (f" (and {more} more file{'s' if more > 1 else ''})" if more else "")


def split(text: str, what: str) -> list[str]:
    """`"a, b,c"` -> `["a", "b", "c"]`; InputError naming `--what` when nothing is left."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"--{what} needs at least one name")
    return items


def check_out_dir(out: Path, inputs: Iterable[Any], names: Iterable[str]) -> Path:
    """`out`, created, if a directory of output files `names` written there cannot touch an
    input (paths among `inputs`; anything else, such as a Placement object, is not a file);
    InputError otherwise (`files.check_output`), or when `out` cannot be created."""
    paths = [p for p in inputs if isinstance(p, (str, os.PathLike))]
    check_output(out, paths, is_dir=True)
    for name in names:
        check_output(out / name, paths)
    try:  # before the work, so an unwritable place is said at once
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot write into {out}: {exc.strerror or exc}") from None
    return out


def _at_least(least: int, most: int | None = None):
    """An argparse type: an integer >= `least` and <= `most` (the run schema's `Integer`,
    whose cap defaults to `limits.MAX_COUNT`)."""
    from ..runspec.values import Integer
    value = Integer(least, most=most)

    def parse(text: str) -> int:
        try:
            return value.check(value.parse(text))
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


positive, nonnegative, seed = _at_least(1), _at_least(0), _at_least(0, MAX_SEED)


def registered(names: Iterable[str], kind: str):
    """An argparse type: a name among `names` (a registry), else argparse's error with
    "did you mean ..." and every name (`registry.unknown`), as the run schema's names give."""
    from ..base.registry import unknown

    def parse(text: str) -> str:
        if text in names:
            return text
        raise argparse.ArgumentTypeError(str(unknown(kind, text, names)))
    parse.__name__ = kind
    return parse
