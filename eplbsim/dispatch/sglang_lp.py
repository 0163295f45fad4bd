"""`sglang-lp`: SGLang's LP dispatch as its code computes it, in float32 (DESIGN.md §10, §11).

Dimensions: `T` tokens, `K` top-k, `E` logical experts, `R` candidates of an expert in the
view, `P` physical slots, `G` GPUs; `S` experts with one replica, `X` with several, `Y` the
slots of those (`X <= Y`).

Per layer and batch, every rank counts the pairs of each expert and solves one LP over the
copies of the replicated experts: variables `[y (Y), slack (G), M, big-M]`, constraints
`C y = counts of the replicated experts / total` (one row an expert) and `B2 y + slack - M =
-(B1 t1)` per GPU, where `t1` is the single-replica experts' share and `B1`, `B2` say which GPU
holds a slot; objective `M + 1000 big-M`. SGLang solves it with 5 barrier steps in float32 (its
kernel; on the CPU its torch reference, which this follows step for step), not to optimality:
the shares can be lopsided where an exact LP splits evenly (`lp` is the exact one). A slot's
probability is its LP share (single-replica slots: `t1`); each pair then draws `u ~ U[0, 1)`
in float32 from the rank's generator and takes the first candidate whose cumulative share
exceeds `u x` the row's sum (uniform over the candidates when the row sums to 0).
"""

from __future__ import annotations

import torch

from ..placement import View
from .streams import torch_generator

IPM_STEPS = 5  # SGLang's barrier iterations
BIG_M = 1000.0  # its objective weight on the auxiliary column


def lp_system(phy2log: torch.Tensor, log2phy: torch.Tensor, num_experts: int, num_gpus: int
              ) -> dict[str, torch.Tensor]:
    """The LP's fixed parts for one layer of a placement, as SGLang's `LPLBSolver` lays them
    out: `phy2log [P]`, the rank's lists `log2phy [E, R]` -> `single`, `single_slot`,
    `replicated`, `replicated_slots` (int64), `B1 [G, S]`, `A [X + G, Y + G + 2]` (float32,
    the last column left for the batch) and `c [Y + G + 2]`. An empty slot (-1) is no
    expert's copy: no variable of the LP (SGLang's placements have none)."""
    P = phy2log.numel()
    filled = phy2log >= 0
    counts = torch.bincount(phy2log[filled], minlength=num_experts)
    single = torch.nonzero(counts == 1).flatten()
    replicated = torch.nonzero(counts > 1).flatten()
    replicated_slots = torch.nonzero(filled & (counts[phy2log.clamp(min=0)] > 1)).flatten()
    owner = torch.arange(P) // (P // num_gpus)  # [P] GPU of each slot
    B = (owner == torch.arange(num_gpus).unsqueeze(1)).to(torch.float32)  # [G, P]
    C = (phy2log[replicated_slots] == replicated.unsqueeze(1)).to(torch.float32)  # [X, Y]
    X, G = replicated.numel(), num_gpus
    top = torch.cat([C, torch.zeros(X, G + 1)], 1)
    bottom = torch.cat([B[:, replicated_slots], torch.eye(G), -torch.ones(G, 1)], 1)
    base = torch.cat([top, bottom], 0)
    c = torch.zeros(base.shape[1] + 1)
    c[-2], c[-1] = 1.0, BIG_M
    return {"single": single, "single_slot": log2phy[single, 0].long(), "replicated": replicated,
            "replicated_slots": replicated_slots, "B1": B[:, log2phy[single, 0].long()],
            "A": torch.cat([base, torch.zeros(base.shape[0], 1)], 1), "base_row_sum":
            base.sum(1), "c": c}


def lp_inputs(system: dict[str, torch.Tensor], counts: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's `(A [NC, NV], b [NC], t1 [S])` from its pair counts `[E]` (float32): shares
    of the total (at least 1), `b`'s GPU rows minus the single-replica load each GPU already
    has, and `A`'s last column `b - (row sums of the rest)`."""
    counts = counts.to(torch.float32)
    t1 = counts[system["single"]]
    b_rep = counts[system["replicated"]]
    inv_total = 1.0 / torch.clamp(t1.sum() + b_rep.sum(), min=1.0)
    t1, b_rep = t1 * inv_total, b_rep * inv_total
    b = torch.cat([b_rep, -(system["B1"] @ t1)])
    A = system["A"].clone()
    A[:, -1] = b - system["base_row_sum"]
    return A, b, t1


def barrier(A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
            steps: int = IPM_STEPS) -> torch.Tensor:
    """`steps` affine-scaling barrier steps from `x = 1` for `min c x, A x = b, x >= 0` in
    float32: each solves `(A X^2 A^T + 1e-12 I) d = A X^2 c`, takes `r = A^T d`,
    `dx = x (c - r)` and scales `x` by `1 - 0.999 dx / max(dx)` (by `1 - dx` when
    `max(dx) <= 1e-9`). Returns `x [NV]`, or 0.5 everywhere unless it converged: last step's
    `max(dx) < 0.1`, `0 <= big-M < 1e-4`, `|A x - b| < 0.05`. A singular system (which the
    kernel's clamped pivots get through but `torch.linalg.solve` refuses) counts as not
    converged (`solve_or_none`)."""
    nc, nv = A.shape
    x = torch.ones(nv, dtype=torch.float32)
    d_max = torch.tensor(0.0)
    for _ in range(steps):
        ax2 = A * (x * x).unsqueeze(0)
        kkt = ax2 @ A.t() + 1e-12 * torch.eye(nc, dtype=torch.float32)
        delta = solve_or_none(kkt, ax2 @ c)
        if delta is None:
            return torch.full((nv,), 0.5, dtype=torch.float32)
        d = x * (c - A.t() @ delta)
        d_max = d.max()
        alpha = 0.999 / d_max if d_max > 1e-9 else torch.tensor(1.0)
        x = x * (1.0 - alpha * d)
    residual = (A @ x - b).abs().max()
    if not ((d_max < 0.1) and (0 <= x[-1] < 1e-4) and (residual < 0.05)):
        return torch.full((nv,), 0.5, dtype=torch.float32)
    return x


def solve_or_none(matrix: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor | None:
    """`torch.linalg.solve(matrix, rhs)`, None when the matrix is singular."""
    try:
        return torch.linalg.solve(matrix, rhs)
    except torch.linalg.LinAlgError:
        return None


def slot_shares(system: dict[str, torch.Tensor], x: torch.Tensor, t1: torch.Tensor,
                log2phy: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Each candidate's share, float32 `[E, R]`: a replicated slot's LP value (at least 0), a
    single-replica slot's `t1`, 0 for padding."""
    share = torch.zeros(num_slots + 1, dtype=torch.float32)
    Y = system["replicated_slots"].numel()
    share[system["replicated_slots"]] = torch.clamp(x[:Y], min=0.0)
    share[system["single_slot"]] = t1
    return share[torch.where(log2phy < 0, num_slots, log2phy)]


def pick(topk_ids: torch.Tensor, shares: torch.Tensor, log2phy: torch.Tensor,
         u: torch.Tensor) -> torch.Tensor:
    """Each pair's slot from its expert's shares `[E, R]` and its draw `u [T*K]` in [0, 1):
    the first candidate whose cumulative share exceeds `u x` the row's sum (uniform over the
    valid candidates when the row sums to 0). -> `[T, K]` (padding -1)."""
    ids = topk_ids.reshape(-1).long()
    safe = ids.clamp(min=0)
    probs, maps = shares[safe], log2phy[safe]  # [N, R]
    row = probs.sum(-1, keepdim=True)
    probs = torch.where(row > 0, probs, (maps >= 0).to(probs.dtype))
    cum = probs.cumsum(-1)
    chosen = (cum <= (u * probs.sum(-1)).unsqueeze(-1)).sum(-1).clamp(max=maps.shape[1] - 1)
    slot = maps.gather(1, chosen.unsqueeze(-1)).squeeze(-1)
    return torch.where(ids >= 0, slot, -1).view(topk_ids.shape)


def layer_shares(topk_ids: torch.Tensor, view: View, layer: int) -> torch.Tensor:
    """The batch's SGLang LP shares of every candidate of `view`'s layer, float32 `[E, R]`."""
    placement = view.placement
    lists = view.log2phy[layer].cpu()
    system = lp_system(placement.phy2log[layer], lists, placement.num_experts,
                       placement.topology.num_gpus)
    ids = topk_ids.reshape(-1).long().cpu()
    counts = torch.bincount(ids[ids >= 0], minlength=placement.num_experts)
    A, b, t1 = lp_inputs(system, counts)
    return slot_shares(system, barrier(A, b, system["c"]), t1, lists, placement.num_slots)


def sglang_lp_policy(topk_ids: torch.Tensor, view: View, ctx: "object") -> torch.Tensor:
    """SGLang's LP dispatch (module doc): the batch's float32 barrier shares, one float32
    `torch.rand` per pair of the flattened `[T, K]` batch from the rank's generator."""
    generator = torch_generator(ctx.generator, ctx.stream, ctx.layer, topk_ids.device,
                                "sglang-lp")
    shares = layer_shares(topk_ids, view, ctx.layer)
    u = torch.rand(topk_ids.numel(), generator=generator, dtype=torch.float32,
                   device=topk_ids.device).cpu()
    return pick(topk_ids.cpu(), shares, view.log2phy[ctx.layer].cpu(), u).to(topk_ids.device)
