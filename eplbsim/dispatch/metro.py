"""`metro`: the fewest activated experts a GPU, as METRO routes a batch (arXiv 2512.09277,
"Efficient MoE Serving in the Memory-Bound Regime: Balance Activated Experts, Not Tokens";
written from the paper's description, no code of it read).

Dimensions: `T` tokens, `K` top-k, `E` logical experts, `R` max candidates, `G` GPUs.

In memory-bound decode a GPU's time follows the weights it reads, one expert's for each expert
it runs, not its token count. METRO routes every pair of an expert to one of its replicas so
that the most experts any GPU activates is least. The rule here: the experts the batch routes
to, fewest candidates first (then most pairs, then lowest id), each take the candidate whose
GPU has activated the fewest experts so far (then carries the fewest pairs, then the lowest
slot), and all of the expert's pairs go there. The choice reads the batch's ids and the view
alone, so ranks with equal views choose alike ("none"); in "a2a" each rank routes its own
tokens by the rule, where METRO all-gathers the global top-k first (not modelled here).
"""

from __future__ import annotations

import torch

from ..placement import View
from .policies import DispatchContext


def metro_policy(topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
    """Each routed expert's pairs to one candidate, the fewest activated experts a GPU (module
    doc): `topk_ids [T, K]` -> int64 `[T, K]`, -1 at padding."""
    log2phy = view.log2phy[ctx.layer].cpu()  # [E, R]
    logcnt = view.logcnt[ctx.layer].cpu()  # [E]
    slot_gpu = view.placement.slot_gpu.tolist()  # [P]
    valid = topk_ids >= 0
    ids = topk_ids.long().clamp(min=0)
    pairs = torch.bincount(ids[valid].cpu(), minlength=log2phy.shape[0]).tolist()  # [E]
    activated = [0] * view.placement.topology.num_gpus  # [G]
    carried = [0] * len(activated)  # [G]
    slot_of = torch.full((log2phy.shape[0],), -1, dtype=torch.int64)  # [E]
    routed = sorted((int(logcnt[e]), -n, e) for e, n in enumerate(pairs) if n)
    for count, _, e in routed:
        candidates = log2phy[e, :count].tolist()
        slot = min(candidates, key=lambda p: (activated[slot_gpu[p]], carried[slot_gpu[p]], p))
        activated[slot_gpu[slot]] += 1
        carried[slot_gpu[slot]] += pairs[e]
        slot_of[e] = slot
    return torch.where(valid, slot_of.to(topk_ids.device)[ids], -1)
