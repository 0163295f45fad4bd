"""Attributes set for the length of a block: what the simulated ranks put in place of
torch.distributed's calls (`migration.simdist`) and of the accelerator (`engines.vllm_async`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence


@contextmanager
def patched(targets: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each `(owner, name, value)` of `targets` set as `owner.name` during the block, and
    what was there put back after."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, value in targets:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
