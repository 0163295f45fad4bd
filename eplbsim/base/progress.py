"""Progress bars for long work: a tqdm bar on stderr, shown only when stderr is a terminal, so
stdout (tables, `--json`) stays clean and logs and pipes get no control characters.

Library functions take `progress`, a callable given the number of units just done (a bar's
`update`), or None; the command-line apps make the bars.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from tqdm import tqdm

Progress = Callable[[int], Any]  # called with the units just done


def bar(total: int | None, desc: str, unit: str = "step", initial: int = 0,
        show: bool | None = None) -> tqdm:
    """A bar over `total` units (`initial` done already) on stderr; shown when `show`, by
    default when stderr is a terminal, else a silent no-op. Use as a context manager; pass its
    `update` as `progress`."""
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                leave=False, dynamic_ncols=True,
                disable=not (sys.stderr.isatty() if show is None else show))


def run_label(spec: Any) -> str:
    """A bar's name for one replay of a `RunSpec`: its policy and mode."""
    return f"{spec.labels()['policy']} {spec.dispatch.mode}"
