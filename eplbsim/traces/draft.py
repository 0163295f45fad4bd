"""Draft (MTP) layers beside a target's (DESIGN.md §16): MoE layers of their own, with their own
experts (possibly another count), placement, statistics and map.

Dimensions: `S` steps, `L` target MoE layers, `E` target experts, `Ld` draft MoE layers, `Ed`
draft experts, `K`/`Kd` their top-k.

A trace is `[S, L, E]` with one `E`, so a drafted run is two traces of the same steps
(`Drafted`): the target's and the draft's, each replayed with its own placement and counted by
its own recorder. Step `s` of the draft is the draft's passes of the target's step `s` (its
rows need not be the target's: a draft runs each of its tokens). A trace file holds both: the
target's `Trace` carries the draft's as `Trace.draft` (saved and read with it, `traces.trace`),
and a view of the target's steps reads the same steps of the draft (`draft_of`). The record
logs read by what they hold and Megatron's router trace read a draft's records into it
(`with_draft`): a record marked as a draft's (`"block": "mtp"`, `"is_draft": true`:
`formats.records.draft_mark`), or of a layer at or above the model's `num_hidden_layers` where
the log's header says it (the checkpoints' MTP layer is `model.layers.{num_hidden_layers}`,
deepseek-ai/DeepSeek-V3 issue #19). SGLang's recorder dumps hold no draft counts: its NextN
layer runs inside the recorder's `disable_this_region()` (sgl-project/sglang #19812).

The fault of SGLang #16044 (sgl-project/sglang pull request #16044: with MTP the draft shares
the target's code path while the EPLB metadata is global) is two mistakes: the draft's recorder
writes its statistics into the target's layer positions (`misrecorded_loads`), and after a
rebalance the draft dispatches through the target's logical-to-physical map
(`schedule.draft_fault`). Which target position the draft's layer `j` records into
(`into [Ld]`) is the engine's layer index of the draft: a draft model numbering its layers
from 0 writes into the target's first layers (the default here); a draft given the target's
next layer index (DeepSeek's MTP layer, sgl-project/sglang #7201) into none of its MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from .steps import StepView
from .trace import Trace


@dataclass(frozen=True, eq=False)
class Drafted:
    """A target trace and its draft's, of the same steps (module doc).

    target: the target model's trace (`Trace`, `DirTrace` or a view), `[S, L, E]`
    draft:  the draft's, `[S, Ld, Ed]`
    """

    target: Any
    draft: Any

    def __post_init__(self) -> None:
        if self.target.num_steps != self.draft.num_steps:
            raise InputError(f"the draft's trace has {self.draft.num_steps} steps, the "
                             f"target's {self.target.num_steps}: step s of the draft is the "
                             f"draft's passes of the target's step s")

    def __repr__(self) -> str:
        return (f"Drafted({self.target.num_steps} steps: target L={self.target.num_layers}, "
                f"E={self.target.num_experts}; draft L={self.draft.num_layers}, "
                f"E={self.draft.num_experts})")


def with_draft(target: Trace, steps: Sequence[np.ndarray], experts: int | None,
               meta: dict[str, Any], src_rank: Sequence[np.ndarray] | None = None) -> Trace:
    """`target` carrying the draft (MTP) layers a log holds beside its layers (`formats`: a
    record marked as a draft's, or of a layer at or above the model's `num_hidden_layers`):
    `steps`, one int `[Td_s, Ld, Kd]` array for each of the target's steps (no rows where the
    step ran no draft pass), of `experts` (`Ed`; None: the largest id + 1), with `meta` and
    each row's source rank (`src_rank`, `[Td_s]` a step) where the log says it."""
    top = max((int(a.max()) for a in steps if a.size), default=-1)
    draft = Trace.from_steps(steps, experts or max(top + 1, 1), src_rank, meta)
    return replace(target, draft=draft)


def draft_of(trace: Any) -> Any:
    """The draft's trace of `trace`'s steps, or None when it has none: a `Drafted`'s draft;
    the `Trace.draft` of the trace a view reads (through every `base`), of the same log steps
    (a `steps.StepView` of it when the view keeps some). InputError for a view that cuts the
    target's steps into chunks (`prefill_chunks`): the draft's passes of a step do not cut
    alike."""
    if isinstance(trace, Drafted):
        return trace.draft
    root = trace
    while hasattr(root, "base"):
        root = root.base
    draft = getattr(root, "draft", None)
    if draft is None or root is trace:
        return draft
    names = trace.log_steps()
    if any("." in name for name in names):
        raise InputError("the trace's steps are cut into chunks (max_batched_tokens); its draft "
                         "layers' passes of a step are not: replay a drafted trace unchunked")
    steps = [int(name) for name in names]
    if steps == list(range(draft.num_steps)):
        return draft
    return StepView(draft, torch.tensor(steps, dtype=torch.int64), dict(draft.meta))


def drafted_of(trace: Any) -> Drafted | None:
    """`trace` and its draft as a `Drafted` (`draft_of`), `trace` itself when it is one, None
    when it has no draft."""
    if isinstance(trace, Drafted):
        return trace
    draft = draft_of(trace)
    return None if draft is None else Drafted(trace, draft)


def draft_positions(num_draft_layers: int, num_layers: int,
                    into: Sequence[int] | None = None) -> list[int]:
    """The target layer position each draft layer records into under the fault (module doc):
    `into` checked (`Ld` positions, each in `[0, L)`), default `0 .. Ld-1`."""
    into = list(range(num_draft_layers)) if into is None else [int(i) for i in into]
    if len(into) != num_draft_layers or any(not 0 <= i < num_layers for i in into):
        raise InputError(f"into must name one target layer in [0, {num_layers}) for each of "
                         f"the draft's {num_draft_layers} layers, got {into}")
    return into


@dataclass(frozen=True, eq=False)
class Misrecorded:
    """What a recorder shared with the target counts (`misrecorded_loads`).

    recorded: int64 `[S, L, E]` the target's statistics as recorded: its own pairs plus the
              draft's, at the positions the draft wrote into
    pairs:    draft pairs recorded into a target layer's positions (every draft pair of an
              expert the target also has)
    dropped:  draft pairs of experts `>= E` (no target position to write into)
    """

    recorded: torch.Tensor
    pairs: int
    dropped: int


def misrecorded_loads(target_counts: torch.Tensor, draft_counts: torch.Tensor,
                      into: Sequence[int] | None = None) -> Misrecorded:
    """The first mistake of SGLang #16044: the draft's pairs counted into the target's
    statistics. `target_counts [S, L, E]`, `draft_counts [S, Ld, Ed]` (routed pairs per
    expert); draft layer `j` adds its counts of experts `< E` to target layer `into[j]`
    (`draft_positions`)."""
    S, L, E = target_counts.shape
    if draft_counts.shape[0] != S:
        raise InputError(f"the draft's counts have {draft_counts.shape[0]} steps, the target's "
                         f"{S}")
    into = draft_positions(draft_counts.shape[1], L, into)
    recorded = target_counts.to(torch.int64).clone()
    shared = min(E, draft_counts.shape[2])
    draft = draft_counts.to(torch.int64)
    for j, layer in enumerate(into):
        recorded[:, layer, :shared] += draft[:, j, :shared]
    return Misrecorded(recorded, int(draft[:, :, :shared].sum()),
                       int(draft[:, :, shared:].sum()))

