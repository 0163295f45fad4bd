"""What a trace holds, in numbers: sizes, padding and each layer's expert-load skew.

Dimensions: `S` steps, `L` layers, `E` logical experts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..base.files import check_memory
from ..placement.loads import max_over_mean, nanmean_or_none
from .layer_kinds import KINDS


def summarize_trace(trace: Any, hash_layers: Sequence[int] = ()) -> dict[str, Any]:
    """Sizes, tokens per step, padding, `src_rank` presence and, per layer, the max / mean
    expert load over the whole trace and per step (mean over steps), the hottest expert and
    its kind ("hash" for the `hash_layers`, routed by token id: `traces.layer_kinds`; else
    "learned"), of a Trace or DirTrace, each layer by the model's number for it
    (`meta["model_layers"]`, else its index); `hash_layers` (trace layer indices) and, when
    there are some, `kind_skew`: each kind's mean per-step max / mean (None for a kind with no
    layer); `meta` as stored."""
    S, L, E = trace.num_steps, trace.num_layers, trace.num_experts
    check_memory(32 * S * L * E, f"summarizing {S} steps x {L} layers x {E} experts",
                 "summarize a window of the trace")
    counts = trace.counts().to(torch.float64)  # [S, L, E]
    whole_skew = max_over_mean(counts.sum(0))  # [L]
    step_skew = max_over_mean(counts)  # [S, L]
    tps = trace.tokens_per_step
    pairs = trace.num_tokens * trace.num_layers * trace.top_k
    padding = pairs - int(counts.sum())
    has_src = trace.num_steps > 0 and trace.step_src_rank(0) is not None
    numbers = trace.meta.get("model_layers") or list(range(L))
    hashed = set(hash_layers)
    kinds = [KINDS[0] if layer in hashed else KINDS[1] for layer in range(L)]  # [L]
    return {
        "steps": trace.num_steps, "tokens": trace.num_tokens,
        "tokens_per_step": {"min": int(tps.min()), "mean": float(tps.double().mean()),
                            "max": int(tps.max())},
        "layers": trace.num_layers, "experts": trace.num_experts, "top_k": trace.top_k,
        "groups": trace.num_groups, "src_rank": has_src,
        "padding_frac": padding / max(pairs, 1),
        "layer_skew": [{"layer": numbers[layer],
                        "max_over_mean": nanmean_or_none(whole_skew[layer:layer + 1]),
                        "per_step_max_over_mean": nanmean_or_none(step_skew[:, layer]),
                        "hottest_expert": int(counts[:, layer].sum(0).argmax()),
                        "kind": kinds[layer]}
                       for layer in range(trace.num_layers)],
        "hash_layers": sorted(hashed),
        "kind_skew": {kind: nanmean_or_none(step_skew[:, torch.tensor([k == kind for k in kinds])])
                      for kind in KINDS} if hashed else None,
        "meta": trace.meta,
    }
