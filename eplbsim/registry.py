"""Lookup in the plain-dict registries (`SOLVERS`, `POLICIES`, `SCENARIOS`, `VIEWS`, ...)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, TypeVar

from .errors import InputError

F = TypeVar("F")


def lookup(registry: Mapping[str, F], key: Any, kind: str) -> F:
    """The entry named `key`, or `key` itself when it is a callable (an unregistered
    prototype); InputError listing the choices for an unknown name."""
    if callable(key):
        return key
    if not isinstance(key, str) or key not in registry:
        raise InputError(f"unknown {kind} {key!r}; choose one of {', '.join(registry)}")
    return registry[key]


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
