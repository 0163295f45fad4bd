"""Weights that say whose they are (DESIGN.md §14): each simulated rank holds its local slots'
expert tensors in the shapes an engine's updater moves, each slot's content a function of
(layer, logical expert), so that after any move every slot reads back as one expert or as
nothing valid.

Dimensions: `G` ranks, `L` layers, `E` logical experts, `P` physical slots (`P / G` a rank,
`local`), `W` tensors a layer (an expert's matrices and their scales).

A rank's weights are `[L][W]` tensors, tensor `i` of layer `l` float32 `[local, *shapes[i]]`;
every element of slot `s`'s tensor `i` holds `code(l, e, i)` for the expert `e` the slot holds.
Codes are distinct integers below 2**24 (exact in float32), so a slot whose tensors mix experts,
layers or tensor kinds, or hold anything else, reads back as -1 (`held`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..base.errors import InputError

SHAPES = ((4, 8), (8, 2), (2,))  # default per-slot tensor shapes: w13, w2, a scale
Weights = list  # a rank's weights: [L][W] tensors, each float32 [local, *shape]


def code(layer: int, expert: int | torch.Tensor, tensor: int, num_experts: int,
         num_tensors: int) -> int | torch.Tensor:
    """The value every element of tensor `tensor` of `expert` in `layer` holds: 1 + its index
    in (layer, expert, tensor) order (0 is never a code: fresh zeros hold nothing)."""
    return 1 + (layer * num_experts + expert) * num_tensors + tensor


def rank_weights(phy2log: torch.Tensor, num_experts: int, num_gpus: int,
                 shapes: Sequence[Sequence[int]] = SHAPES) -> list[Weights]:
    """Every rank's weights holding the experts `phy2log [L, P]` names (-1: a slot holding
    nothing, zeros), `[G][L][W]` (module doc)."""
    L, P = phy2log.shape
    if P % num_gpus:
        raise InputError(f"{P} slots do not divide over {num_gpus} ranks")
    W = len(shapes)
    if code(L - 1, num_experts - 1, W - 1, num_experts, W) >= 2 ** 24:
        raise InputError(f"{L} layers x {num_experts} experts x {W} tensors are too many codes "
                         f"for float32 (at most 2**24)")
    local = P // num_gpus
    out = []
    for rank in range(num_gpus):
        layers = []
        for layer in range(L):
            ids = phy2log[layer, rank * local:(rank + 1) * local]
            layers.append([_filled(ids, layer, i, num_experts, W, shape)
                           for i, shape in enumerate(shapes)])
        out.append(layers)
    return out


def _filled(ids: torch.Tensor, layer: int, tensor: int, num_experts: int, num_tensors: int,
            shape: Sequence[int]) -> torch.Tensor:
    values = torch.where(ids >= 0, code(layer, ids, tensor, num_experts, num_tensors), 0)
    return values.to(torch.float32).view(-1, *[1] * len(shape)).expand(-1, *shape).clone()


def given_to_engine(weights: Weights, drop: Sequence[int] = ()) -> Weights:
    """A rank's weights `[L][W]` as its engine's updater is handed them: each layer's list
    without the tensors `drop` names (they stay in the slots: a fault, vLLM #47588's shape).
    InputError when nothing would be left to move."""
    out = [[t for i, t in enumerate(layer) if i not in set(drop)] for layer in weights]
    if not out[0]:
        raise InputError("drop leaves the engine no tensor to move")
    return out


def slot_experts(weights: Sequence[Weights], num_experts: int) -> torch.Tensor:
    """The expert each slot holds, int64 `[L, P]` over the ranks' weights `[G][L][W]`: `e`
    when every tensor of the slot holds `code(l, e, i)` throughout, else -1."""
    W = len(weights[0][0])
    rows = []
    for layer in range(len(weights[0])):
        per_rank = []
        for rank_layers in weights:
            tensors = rank_layers[layer]
            local = tensors[0].shape[0]
            first = tensors[0].reshape(local, -1)[:, 0]
            expert = ((first - 1).round().long() // W) - layer * num_experts
            ok = (expert >= 0) & (expert < num_experts)
            for i, t in enumerate(tensors):
                flat = t.reshape(local, -1)
                want = code(layer, expert, i, num_experts, W).to(flat.dtype)
                ok &= (flat == want[:, None]).all(1)
            per_rank.append(torch.where(ok, expert, -1))
        rows.append(torch.cat(per_rank))
    return torch.stack(rows)


def slot_mismatch(holds: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:
    """Per layer, the slots whose weights are not the expert the map `phy2log [L, P]` names
    (a slot the map leaves empty, -1, is not counted), int64 `[L]`."""
    named = phy2log >= 0
    return ((holds != phy2log) & named).sum(1)


def lost_experts(holds: torch.Tensor, num_experts: int) -> list[tuple[int, int]]:
    """`(layer, expert)` of every expert no slot holds after a move."""
    present = torch.zeros(holds.shape[0], num_experts + 1, dtype=torch.bool)
    present.scatter_(1, holds.clamp(min=-1) % (num_experts + 1), True)  # -1 lands on column E
    missing = (~present[:, :num_experts]).nonzero().tolist()
    return [(int(layer), int(expert)) for layer, expert in missing]
