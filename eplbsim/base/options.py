"""How an error or a warning names an option (of reading a trace, of a run): as its caller
writes it.

From Python, the keyword of `open_trace` (`incomplete="drop"`, `layers_per_pass=L`,
`drop_warmup=True`); from the command line, the flag (`--incomplete drop`,
`--layers-per-pass L`, `--drop-warmup`): the `eplbsim` command runs inside `flags_named()`.
An option's flag is its keyword with dashes (`ids_key` -> `--ids-key`), as the run schema
declares every reading option (`runspec.Source`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

_FLAGS = contextvars.ContextVar("eplbsim_flags_named", default=False)


@contextlib.contextmanager
def flags_named() -> Iterator[None]:
    """Within the block, `option` names options by their command-line flags."""
    token = _FLAGS.set(True)
    try:
        yield
    finally:
        _FLAGS.reset(token)


def option(name: str, value: Any = None) -> str:
    """Option `name` (a keyword, `ids_key`) given `value`, as the caller writes it: None names
    the option alone (`ids_key=...` / `--ids-key`), True a switch turned on (`drop_warmup=True` /
    `--drop-warmup`), a placeholder in capitals a value to fill in (`layers_per_pass=L` /
    `--layers-per-pass L`), other text a value (`incomplete="drop"` / `--incomplete drop`),
    a number itself (`layers_per_pass=48` / `--layers-per-pass 48`)."""
    if _FLAGS.get():
        flag = "--" + name.replace("_", "-")
        return flag if value is None or value is True else f"{flag} {value}"
    if value is None:
        return f"{name}=..."
    placeholder = isinstance(value, str) and value.isupper()
    shown = f'"{value}"' if isinstance(value, str) and not placeholder else value
    return f"{name}={shown}"
