"""Lookup in the plain-dict registries (`SOLVERS`, `POLICIES`, `SCENARIOS`, `VIEWS`)."""

from __future__ import annotations

from typing import Callable, TypeVar

from .errors import InputError

F = TypeVar("F", bound=Callable)


def lookup(registry: dict[str, F], key: str | F, kind: str) -> F:
    """The entry named `key`, or `key` itself when it is a callable (an unregistered
    prototype); InputError listing the choices for an unknown name."""
    if callable(key):
        return key
    if key not in registry:
        raise InputError(f"unknown {kind} {key!r}; choose one of {', '.join(registry)}")
    return registry[key]


def name_of(entry: str | Callable) -> str:
    """The name to report for a registry entry given by name or as a callable."""
    return entry if isinstance(entry, str) else getattr(entry, "__name__", repr(entry))
