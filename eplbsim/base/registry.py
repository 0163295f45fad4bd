"""Lookup in the plain-dict registries (`SOLVERS`, `POLICIES`, `SCENARIOS`, `VIEWS`, ...), and
the words for a name none of them holds.

A registry may take names it cannot list (a function in a file, `FILE_FORM`): its `forms`
attribute, when it has one, describes them for the error that lists the choices."""

from __future__ import annotations

from difflib import get_close_matches
from typing import Any, Iterable, Iterator, Mapping, Sequence, TypeVar

from .errors import InputError

F = TypeVar("F")
FILE_FORM = "path/to/file.py:function"  # a function in a Python file, where a policy may be one


def lookup(registry: Mapping[str, F], key: Any, kind: str) -> F:
    """The entry named `key`, or `key` itself when it is a callable (an unregistered
    prototype); InputError listing the choices for an unknown name (`unknown`)."""
    if callable(key):
        return key
    if not isinstance(key, str) or key not in registry:
        raise unknown(kind, key, registry)
    return registry[key]


def unknown(kind: str, key: Any, names: Iterable[str], forms: Sequence[str] = ()) -> InputError:
    """The InputError for `key`, which is no `kind` among `names` (a registry, or any names):
    the closest names as "did you mean ..." (`difflib`), then every name and the other forms a
    name may take (`forms`, and the registry's own `forms`). A `.py` file named where
    `FILE_FORM` is taken is told that form instead."""
    forms = (*getattr(names, "forms", ()), *forms)
    names = list(names)
    if FILE_FORM in forms and isinstance(key, str) and key.endswith(".py"):
        return InputError(f"{kind} {key!r} names a file but no function in it: write "
                          f"{key}:FUNCTION (a {kind} in a file is {FILE_FORM})")
    close = get_close_matches(key, names, n=3) if isinstance(key, str) else []
    guess = f" (did you mean {' or '.join(close)}?)" if close else ""
    other = "".join(f", or a function in a file, {f}" if f == FILE_FORM else f", or {f}"
                    for f in forms)
    return InputError(f"unknown {kind} {key!r}{guess}; choose one of {', '.join(names)}{other}")


def name_of(entry: Any, registry: Mapping[str, Any] | None = None) -> str:
    """The name to report for a registry entry given by name, as an entry object (its key in
    `registry` when registered there) or as a callable (its `__name__`; an entry with a
    function `fn`, that function's)."""
    if isinstance(entry, str):
        return entry
    for key, value in (registry or {}).items():
        if value is entry:
            return key
    fn = getattr(entry, "fn", entry)
    return getattr(fn, "__name__", repr(entry))


def first_sentence(text: str | None) -> str:
    """The first sentence of a docstring's first paragraph, on one line (what a listing of a
    registry shows of each entry)."""
    paragraph = " ".join((text or "").strip().split("\n\n")[0].split())
    head, dot, _ = paragraph.partition(". ")
    return head + ("." if dot else "")


class Joined(Mapping):
    """Several registries read as one, in order (each read when used, so entries registered
    later count): what a name check accepts and lists."""

    def __init__(self, *registries: Mapping[str, Any]) -> None:
        self.registries = registries

    def __getitem__(self, key: str) -> Any:
        for registry in self.registries:
            if key in registry:
                return registry[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        for registry in self.registries:
            yield from registry

    def __len__(self) -> int:
        return sum(len(r) for r in self.registries)

    @property
    def forms(self) -> tuple[str, ...]:
        """The forms the registries take beyond their names (`unknown`)."""
        return tuple(f for r in self.registries for f in getattr(r, "forms", ()))
