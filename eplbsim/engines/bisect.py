"""Which release changed it: a bisect over an engine's releases (`eplbsim engines bisect`).

An engine team's question is often "which release changed this?". `bisect` answers it from the
engine's own code: the releases between GOOD and BAD come from the package index (`releases`);
each one tried is fetched (`engines.fetch_engine`, the EPLB files of its wheel) and measured
(`measure`: one replay of a trace with the policy run from that release, one metric); a binary
search finds the first release whose value differs from GOOD's by more than the tolerance,
assuming the value changes once between them. A release that cannot be fetched or run is left
out of the search, with its reason, and the search goes on around it.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..base.errors import InputError
from . import version_key


@dataclass
class Tried:
    """One release the bisect tried: its `value` (None when it failed), `status` ("good": the
    value GOOD has, "changed", or "failed"), `why` it failed, and `seconds` (fetch and
    replay)."""

    release: str
    value: float | None
    status: str
    why: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def index_versions(engine: str) -> list[str]:
    """Every release of `engine` on the package index (`pip index versions`), oldest first;
    InputError when pip cannot list them."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", engine,
           "--disable-pip-version-check"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("Available versions:")),
                None)
    if done.returncode or line is None:
        last = (done.stderr.strip().splitlines() or ["no versions listed"])[-1]
        raise InputError(f"pip could not list the releases of {engine}: {last}")
    return sorted((v.strip() for v in line.partition(":")[2].split(",") if v.strip()),
                  key=version_key)


def releases(engine: str, good: str, bad: str,
             listed: Callable[[str], list[str]] | None = None) -> list[str]:
    """The releases from `good` to `bad`, both included, oldest first (`listed(engine)`: every
    release, default `index_versions`); InputError naming one the index lacks, or an empty or
    reversed range."""
    every = (listed or index_versions)(engine)
    for version in (good, bad):
        if version not in every:
            near = ", ".join(every[-5:])
            raise InputError(f"{engine} has no release {version} on the package index "
                             f"(the newest: {near})")
    lo, hi = version_key(good), version_key(bad)
    if lo >= hi:
        raise InputError(f"GOOD..BAD: {good} is not older than {bad}")
    return [v for v in every if lo <= version_key(v) <= hi]


def bisect(versions: list[str], measure: Callable[[str], float],
           tolerance: float = 0.0) -> tuple[str | None, list[Tried]]:
    """The first of `versions` (oldest first; the first is GOOD, the last BAD) whose
    `measure(version)` differs from GOOD's by more than `tolerance`, by binary search, and
    every release tried in the order tried. None when BAD's value is GOOD's (nothing changed),
    or when GOOD cannot be measured. InputError from `measure` marks a release failed."""
    tried: list[Tried] = []

    def value(version: str) -> float | None:
        start = time.perf_counter()
        try:
            got = float(measure(version))
            why = ""
        except InputError as exc:
            got, why = None, str(exc)
        tried.append(Tried(version, got, "failed" if got is None else "", why,
                           time.perf_counter() - start))
        return got

    reference = value(versions[0])
    if reference is None:
        return None, tried
    tried[0].status = "good"

    def changed(got: float) -> bool:
        return not (abs(got - reference) <= tolerance or (math.isnan(got)
                                                          and math.isnan(reference)))

    candidates = list(versions)
    lo, hi = 0, len(candidates) - 1
    last = value(candidates[hi])
    while last is None and hi > 1:  # BAD failed: the newest that runs stands for it
        candidates.pop(hi)
        hi -= 1
        last = value(candidates[hi])
    if last is None:
        return None, tried
    if not changed(last):
        tried[-1].status = "good"
        return None, tried
    tried[-1].status = "changed"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = value(candidates[mid])
        if got is None:
            candidates.pop(mid)
            hi -= 1
            continue
        if changed(got):
            tried[-1].status, hi = "changed", mid
        else:
            tried[-1].status, lo = "good", mid
    return candidates[hi], tried


__all__ = ["Tried", "bisect", "index_versions", "releases"]
