"""Sharing the work of a policy whose rank invariance is observed, not declared: an engine's own
dispatch code (DESIGN.md §11).

Dimensions: `G` ranks, `L` layers, `E` logical experts, `K` top-k.

In "none" every rank dispatches every token. A policy declared rank-invariant
(`DispatchPolicy.rank_invariant`) runs once per group of ranks with equal views
(`ranks.rank_groups`). An engine's function is not ours to declare anything of, but two facts
about one call can be checked: what it reads (`DispatchPolicy.observed(view, ctx)`: the
rank's inputs beyond the ids and the layer, such as its dispatch info tensors) and whether it
draws (`probe`: the states of every generator it could read, before and after: torch's
default CPU generator, CUDA's when initialised, Python's `random`, numpy's global one, and the
generator the call is handed, which an engine function takes as torch's default while it runs).
A function of equal inputs that leaves every generator as it was returns equal outputs, so the
ranks whose inputs are equal (`same`) share one call when a probe of every layer on a batch
that routes every expert draws nothing (`observed_groups`); a policy that draws keeps one
computation a rank, each with the rank's own generator.

Equal inputs are not the whole input: the call may also learn its rank, through any channel an
engine's code can read (`engines.identity`: `torch.distributed`, the engine's parallel state,
the environment, the device index), each answering the rank it runs as and noting the read
(`note`, seen by a probe `watching`). So a group of ranks shares one call only when the probe
(`probe`) sees it neither draw nor read its rank on any layer, and when the same call run as
two different ranks of the group (its first and last) on equal inputs and equal generators gives
equal outputs: a channel nobody listed still shows there when it changes the choice.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

PROBE_SEED = 0  # the generator a probe hands the call (its state is what is compared)


def inputs_equal(a: Any, b: Any) -> bool:
    """Whether two inputs are equal: tensors of equal dtype, shape and values; sequences and
    mappings item by item; objects with attributes (an engine's dispatch info) attribute by
    attribute; anything else by `==`."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(inputs_equal(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(inputs_equal(a[k], b[k]) for k in a))
    if hasattr(a, "__dict__") and not callable(a):
        return type(a) is type(b) and inputs_equal(vars(a), vars(b))
    return bool(a == b)


def _states(generator: torch.Generator) -> list[Any]:
    """The state of every generator a call could draw from (module doc)."""
    out = [torch.get_rng_state(), random.getstate(), np.random.get_state(),
           generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out.append(torch.cuda.get_rng_state_all())
    return out


def _unchanged(before: list[Any], after: list[Any]) -> bool:
    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(equal(a, b) for a, b in zip(x, y))
        if isinstance(x, np.ndarray):
            return np.array_equal(x, y)
        return x == y
    return equal(before, after)


def probe_ids(num_experts: int, top_k: int) -> torch.Tensor:
    """A batch that routes every expert: int64 `[E, K]`, row `t` experts `t, t + 1, ...`
    (mod `E`), distinct in a row (`K <= E`)."""
    k = min(top_k, num_experts)
    return (torch.arange(num_experts)[:, None] + torch.arange(k)[None]) % num_experts


_WATCHERS = threading.local()  # .lists: the reads each open `watching` block collects


@contextmanager
def watching() -> Iterator[list[tuple[str, str]]]:
    """Collect, during the block, every rank read this thread's engine calls make (`note`):
    a list of `(channel, where)`, filled as the calls run."""
    lists = getattr(_WATCHERS, "lists", None)
    if lists is None:
        lists = _WATCHERS.lists = []
    reads: list[tuple[str, str]] = []
    lists.append(reads)
    try:
        yield reads
    finally:  # by identity: two open blocks may hold equal reads
        del lists[next(i for i, held in enumerate(lists) if held is reads)]


def note(channel: str, where: str) -> None:
    """A call read its rank through `channel` at `where` (an engine file and line): told to
    every open `watching` block of this thread."""
    for reads in getattr(_WATCHERS, "lists", ()):
        reads.append((channel, where))


@dataclass(frozen=True)
class Probe:
    """What a probe of a call saw (module doc): `draws`, whether it drew from a generator;
    `reads`, the first rank read `(channel, where)` or None; `differs`, the two ranks whose
    outputs differ on equal inputs, or None."""

    draws: bool = False
    reads: tuple[str, str] | None = None
    differs: tuple[int, int] | None = None

    @property
    def shareable(self) -> bool:
        """Whether ranks of equal inputs may share the call."""
        return not self.draws and self.reads is None and self.differs is None

    def says(self) -> str:
        """Why the call runs once a rank, in words ("" when it may be shared)."""
        if self.reads is not None:
            return f"reads its rank through {self.reads[0]} ({self.reads[1]})"
        if self.draws:
            return "draws from a generator"
        if self.differs is not None:
            a, b = self.differs
            return (f"chooses differently as rank {a} and rank {b} on equal inputs (its rank "
                    f"reaches it through a channel eplbsim does not watch)")
        return ""


def probe(fn: Callable, topk_ids: torch.Tensor, view: Any, contexts: Sequence[Any],
          num_layers: int) -> Probe:
    """Probe `fn(topk_ids [T, K], view, ctx)` at every layer `0..L-1` (module doc): run as
    `contexts[0]`'s rank, whether it leaves every generator it could read as it was (each call
    is handed a generator of its own, so a draw from it shows) and reads no rank; then, with
    two or more `contexts`, whether the last one's rank gets the same output from the same
    view and an equal generator."""
    first, last = contexts[0], contexts[-1]
    for layer in range(num_layers):
        generator = torch.Generator().manual_seed(PROBE_SEED)
        ctx = dataclasses.replace(first, layer=layer, generator=generator)
        before = _states(generator)
        with watching() as reads:
            out = fn(topk_ids, view, ctx)
        if reads:
            return Probe(reads=reads[0])
        if not _unchanged(before, _states(generator)):
            return Probe(draws=True)
        if last.rank != first.rank:
            other = dataclasses.replace(last, layer=layer,
                                        generator=torch.Generator().manual_seed(PROBE_SEED))
            if not torch.equal(out.cpu(), fn(topk_ids, view, other).cpu()):
                return Probe(differs=(first.rank, last.rank))
    return Probe()


def observed_groups(views: Sequence[Any], contexts: Sequence[Any], policy: Any,
                    top_k: int) -> tuple[tuple[int, ...], ...]:
    """Positions of `views` (and their ranks' `contexts`, at a step) that share one call of
    `policy` (module doc): ranks whose `policy.observed(view, ctx)` are `same`, each group
    kept whole when a `probe` of its first and last ranks' calls on `probe_ids` of the
    placement's experts and `top_k` finds them shareable, else split into one rank a group."""
    return probed_groups(views, contexts, policy, top_k)[0]


def probed_groups(views: Sequence[Any], contexts: Sequence[Any], policy: Any, top_k: int
                     ) -> tuple[tuple[tuple[int, ...], ...], Probe]:
    """`observed_groups`, and the first probe that kept a group from sharing (`Probe()` when
    none did)."""
    inputs = [policy.observed(v, c) for v, c in zip(views, contexts)]
    groups: list[list[int]] = []
    for i in range(len(views)):
        for group in groups:
            if inputs_equal(inputs[group[0]], inputs[i]):
                group.append(i)
                break
        else:
            groups.append([i])
    out: list[tuple[int, ...]] = []
    found = Probe()
    for group in groups:
        view = views[group[0]]
        ids = probe_ids(view.placement.num_experts, top_k).to(view.log2phy.device)
        seen = probe(policy.fn, ids, view, [contexts[group[0]], contexts[group[-1]]],
                     view.placement.num_layers) if len(group) > 1 else Probe()
        if len(group) > 1 and seen.shareable:
            out.append(tuple(group))
        else:
            out.extend((i,) for i in group)
            found = found if not found.shareable else seen
    return tuple(sorted(out)), found
