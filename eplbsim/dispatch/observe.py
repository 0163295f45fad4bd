"""Sharing the work of a policy whose rank invariance is observed, not declared: an engine's own
dispatch code (DESIGN.md §11).

Dimensions: `G` ranks, `L` layers, `E` logical experts, `K` top-k.

In "none" every rank dispatches every token. A policy declared rank-invariant
(`DispatchPolicy.rank_invariant`) runs once per group of ranks with equal views
(`ranks.rank_groups`). An engine's function is not ours to declare anything of, but two facts
about one call can be checked: what it reads (`DispatchPolicy.observed(view, ctx)`: the
rank's inputs beyond the ids and the layer, such as its dispatch info tensors) and whether it
draws (`draws_nothing`: the states of every generator it could read, before and after: torch's
default CPU generator, CUDA's when initialised, Python's `random`, numpy's global one, and the
generator the call is handed, which an engine function takes as torch's default while it runs).
A function of equal inputs that leaves every generator as it was returns equal outputs, so the
ranks whose inputs are equal (`same`) share one call when a probe of every layer on a batch
that routes every expert draws nothing (`observed_groups`); a policy that draws keeps one
computation a rank, each with the rank's own generator.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

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


def draws_nothing(fn: Callable, topk_ids: torch.Tensor, view: Any, ctx: Any,
                  num_layers: int) -> bool:
    """Whether `fn(topk_ids [T, K], view, ctx)` at every layer `0..L-1` leaves every generator
    it could read as it was (module doc); `ctx` is handed a generator of its own for the
    probe, so a draw from it shows."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    for layer in range(num_layers):
        probe = dataclasses.replace(ctx, layer=layer, generator=generator)
        before = _states(generator)
        fn(topk_ids, view, probe)
        if not _unchanged(before, _states(generator)):
            return False
    return True


def observed_groups(views: Sequence[Any], contexts: Sequence[Any], policy: Any,
                    top_k: int) -> tuple[tuple[int, ...], ...]:
    """Positions of `views` (and their ranks' `contexts`, at a step) that share one call of
    `policy` (module doc): ranks whose `policy.observed(view, ctx)` are `same`, each group
    kept whole when its first rank's calls draw nothing on `probe_ids` of the placement's
    experts and `top_k`, else split into one rank a group."""
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
    for group in groups:
        view = views[group[0]]
        ids = probe_ids(view.placement.num_experts, top_k).to(view.log2phy.device)
        if len(group) > 1 and draws_nothing(policy.fn, ids, view, contexts[group[0]],
                                            view.placement.num_layers):
            out.append(tuple(group))
        else:
            out.extend((i,) for i in group)
    return tuple(sorted(out))
