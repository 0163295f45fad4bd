"""What several commands share: comma-separated lists and writing files with a clear error."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import InputError


def split(text: str, what: str) -> list[str]:
    """`"a, b,c"` -> `["a", "b", "c"]`; InputError naming `--what` when nothing is left."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"--{what} needs at least one name")
    return items


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError while writing `path` into InputError("cannot write PATH: why")."""
    try:
        yield
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None


def _at_least(least: int):
    """An argparse type: an integer >= `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value
    return parse


positive, nonnegative = _at_least(1), _at_least(0)
