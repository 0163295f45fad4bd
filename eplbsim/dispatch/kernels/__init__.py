"""Fast step kernels: every layer of a step in one call, bit-identical to the reference
policies of `eplbsim.dispatch.policies` (which stay as the oracle the tests compare against).

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts, `R` max candidates.

A step kernel is `kernel(topk_ids [T, L, K], view, ctx) -> phys [T, L, K]` (int64, -1 at
padding) and must equal `stack([policy(topk_ids[:, l], view, ctx with layer=l) for l])`.
Each `POLICIES` entry names its kernels per device (`DispatchPolicy.kernels`): CPU kernels are
compiled with numba (`cpu.py`); on CUDA `row` and `ordinal` are Triton kernels (`cuda.py` over
`triton_dispatch.py`) and `static`, `random` plain torch (`torch_step.py`). `dispatch_step`
runs the first kernel of the entry that loads on the ids' device, and otherwise the reference
policy layer by layer (`reference_step`), guarded: a policy that raises, modifies its input or
returns something other than `[T, K]` integers is an InputError naming it and the rank, and so
is one whose slots do not hold the pairs' experts (`check_choices`). The kernels named in this
package are trusted (tested bit-identical to their reference); a kernel given as a callable is
checked like a reference policy.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any, Callable

import torch

from ...base.errors import InputError
from ...placement import Placement, View
from ..policies import DispatchContext

StepKernel = Callable[[torch.Tensor, View, DispatchContext], torch.Tensor]
_LOADED: dict[str, StepKernel | None] = {}  # kernel name -> function, None if it cannot load


def _load(kernel: str | StepKernel) -> StepKernel | None:
    """A kernel given by name (`module.function` in this package) or as a callable; None when
    its module cannot be imported here (e.g. Triton absent)."""
    if callable(kernel):
        return kernel
    if kernel not in _LOADED:
        module, _, function = kernel.rpartition(".")
        try:
            _LOADED[kernel] = getattr(importlib.import_module(f"{__name__}.{module}"), function)
        except ImportError:
            _LOADED[kernel] = None
    return _LOADED[kernel]


def step_kernel(policy: Any, device: torch.device | str) -> StepKernel | None:
    """The fast step kernel of the `DispatchPolicy` `policy` on `device`, or None."""
    return _kernel(policy, device)[0]


def window_kernel(policy: Any, device: torch.device | str) -> Callable[..., torch.Tensor] | None:
    """The `DispatchPolicy` `policy`'s kernel for a window of steps on `device`
    (`DispatchPolicy.window_kernels`: `(topk_ids [N, L, K], view, rows [N]) -> phys`), or
    None."""
    return _kernel(policy, device, policy.window_kernels)[0]


def _kernel(policy: Any, device: torch.device | str,
            kernels: Any = None) -> tuple[StepKernel | None, bool]:
    """`(kernel or None, whether it is one of this package's, named)` among `kernels` (default
    the policy's step kernels)."""
    kernels = policy.kernels if kernels is None else kernels
    for kernel in kernels.get(torch.device(device).type, ()):
        loaded = _load(kernel)
        if loaded is not None:
            return loaded, isinstance(kernel, str)
    return None, False


def reference_step(policy: Any, topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
                   name: str | None = None) -> torch.Tensor:
    """The reference: `policy.fn` layer by layer, stacked to `[T, L, K]`. Each layer gets a copy
    of its ids, so a policy cannot modify the caller's; InputError (naming `name` and the rank)
    when it raises, modifies them or returns anything but an integer `[T, K]` tensor."""
    name = name or getattr(policy.fn, "__name__", repr(policy.fn))
    layers = []
    copies = topk_ids.transpose(0, 1).clone(memory_format=torch.contiguous_format)  # [L, T, K]
    for layer in range(topk_ids.shape[1]):
        ids, given = topk_ids[:, layer], copies[layer]  # the policy gets its layer's copy
        try:
            phys = policy.fn(given, view, replace(ctx, layer=layer))
        except InputError:
            raise
        except Exception as exc:  # a prototype's bug, said as such
            raise InputError(f"policy {name} raised {type(exc).__name__} on rank {ctx.rank}: "
                             f"{exc}") from exc
        if not torch.equal(given, ids):
            raise InputError(f"policy {name} modified the topk_ids it was given")
        _check_slots(phys, ids, name)
        layers.append(phys.long())
    return torch.stack(layers, 1) if layers else topk_ids.long().clone()


def dispatch_step(policy: Any, topk_ids: torch.Tensor, view: View, ctx: DispatchContext,
                  name: str | None = None, out: Any = None) -> torch.Tensor:
    """Every layer of a step, `topk_ids [T, L, K]` -> phys int64 `[T, L, K]`, for the
    `DispatchPolicy` `policy`: its fast kernel where one loads on this device, else the guarded
    reference, checked unless the kernel is a named one (`ctx.layer` is ignored; `name` names
    the policy in errors). `out`: an int64 numpy array `[T, L, K]` a named CPU kernel writes
    into (the result is then a view of it); ignored by everything else."""
    kernel, trusted = _kernel(policy, topk_ids.device)
    if trusted:
        if out is not None and topk_ids.device.type == "cpu":
            return kernel(topk_ids, view, ctx, out=out)
        return kernel(topk_ids, view, ctx)
    name = name or getattr(policy.fn, "__name__", repr(policy.fn))
    phys = (reference_step(policy, topk_ids, view, ctx, name) if kernel is None
            else kernel(topk_ids, view, ctx))
    check_choices(phys, topk_ids, view.placement, name, policy.reroutes)
    return phys.long()


def check_choices(phys: torch.Tensor, topk_ids: torch.Tensor, placement: Placement,
                  name: str, reroutes: bool = False) -> None:
    """InputError unless `phys [T, L, K]` holds, for every pair, a slot of its routed expert
    (any slot holding an expert when the policy `reroutes`, `DispatchPolicy`; never an empty
    slot, -1 in `phy2log`), and -1 exactly at padding: a wrong policy must not become a
    silently wrong number."""
    _check_slots(phys, topk_ids, name)
    if phys.device.type == "cpu":  # one compiled pass (kernels.cpu.first_bad_choice)
        from .cpu import first_bad_choice
        found = first_bad_choice(phys, topk_ids, placement.phy2log, reroutes)
    else:
        ids = topk_ids.long()
        valid = ids >= 0
        P = placement.num_slots
        inside = (phys >= 0) & (phys < P)
        held = placement.phy2log.to(phys.device).reshape(-1)[flat_index(phys.clamp(0, P - 1),
                                                                         P)]
        bad = torch.where(valid, ~inside | (held < 0) | ((held != ids) & (not reroutes)),
                          phys != -1)
        found = tuple(bad.nonzero()[0].tolist()) if bool(bad.any()) else None
    if found is not None:
        t, lay, k = found
        p = int(phys[t, lay, k])
        empty = 0 <= p < placement.num_slots and int(placement.phy2log[lay, p]) < 0
        raise InputError(f"policy {name} sent pair (token {t}, slot {k}) of expert "
                         f"{int(topk_ids[t, lay, k])} in layer {lay} to slot {p}, which "
                         f"{'is empty' if empty else 'does not hold that expert'}")


def _check_slots(phys: Any, ids: torch.Tensor, name: str) -> None:
    """InputError unless `phys` is an integer tensor of the shape of `ids`."""
    if (not isinstance(phys, torch.Tensor) or phys.shape != ids.shape
            or phys.dtype not in (torch.int32, torch.int64)):
        got = (f"{phys.dtype} {tuple(phys.shape)}" if isinstance(phys, torch.Tensor)
               else type(phys).__name__)
        raise InputError(f"policy {name} returned {got}, expected integer slots "
                         f"{tuple(ids.shape)}")


def tally(index: torch.Tensor, n: int) -> torch.Tensor:
    """How many entries of `index` (any shape, values in `[0, n]`) hold each value in
    `[0, n)`, int64 `[n]` on its device; the value `n` is a sink, not counted. On a GPU a
    scatter-add: `torch.bincount` reads the index's extremes back to the host first."""
    flat = index.reshape(-1)
    if flat.device.type == "cpu":
        return torch.bincount(flat, minlength=n + 1)[:n]
    out = torch.zeros(n + 1, dtype=torch.int64, device=flat.device)
    return out.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))[:n]


def flat_index(index: torch.Tensor, width: int) -> torch.Tensor:
    """`layer * width + index` of every pair of `index [T, L, K]` (a slot, width `P`, or an
    expert, width `E`): one bincount then counts every layer at once."""
    layer = torch.arange(index.shape[1], device=index.device).view(1, -1, 1)
    return layer * width + index.long()
