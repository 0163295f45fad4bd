"""A review's correctness finding (`review` module doc): the rank-invariance class the
candidate claims against what it does. In "none" a search dispatches small adversarial batches
on every rank (one token, odd counts, repeated rows, padding rows, then whole steps), each rank
with its own view and random stream, and keeps the smallest batch on which ranks choose
differently (`checks.rank_invariance` reproduces it); failing that, the first step and layer
where the scored replay disagreed (as when ranks switch to a rebalance at different steps).

Dimensions: `T` tokens, `L` layers, `K` top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch import USER, resolve_policy
from ..engines import is_engine_name
from ..placement import Placement
from ..ranks.checks import observed_sharing, rank_invariance
from ..replay.results import Results
from ..runspec import RunSpec
from ..traces import RunTrace

SEARCH_ROWS = (1, 2, 3, 5, 7)  # the small batches the invariance search tries first


def _claimed(policy: Any, sources: Any, placement: Placement, spec: RunSpec,
             top_k: int) -> str:
    """The rank-invariance class the candidate claims: its registry entry's, else unknown;
    for an engine's code, how its calls were observed in "none" (`dispatch.observe`)."""
    name, entry = resolve_policy(policy, sources)
    if not (entry.source.startswith(USER) or is_engine_name(name)):
        return entry.invariance()
    unknown = "unknown (not registered: nothing is claimed)"
    d = spec.dispatch
    if entry.observed is None or d.mode != "none":
        return unknown
    return f"{unknown}; observed: " + observed_sharing(policy, placement, d.view, d.rng,
                                                       d.seed, top_k, sources)


def _place(place: int, num_slots: int) -> int | str:
    """A rank's choice as a counterexample names it: the slot, or for a spill policy's place
    past the slots the GPU that runs the pair with fetched weights (`dispatch.spill`)."""
    return place if place < num_slots else f"GPU {place - num_slots} (fetched)"


def invariance_findings(policy: Any, name: str, test: RunTrace, placement: Placement, spec: RunSpec,
                        results: Results) -> dict[str, Any]:
    """Claimed class against observed: in "none" the smallest adversarial batch on which ranks
    choose differently (module doc), and the output error on the scored steps. A step is named
    as the log names it (`log_steps`: `step`); a counterexample's `scored_step` is its index
    among the scored steps, the `step` `checks.rank_invariance` reproduces it with."""
    d = spec.dispatch
    out: dict[str, Any] = {"claimed": _claimed(policy, d.engine_source, placement, spec,
                                               test.top_k), "observed": None,
                           "counterexample": None, "searched": 0,
                           "output_rel_error": results.metrics.get("output_rel_error"),
                           "rank_agreement": results.metrics.get("rank_agreement"),
                           "moved": _moved(results)}
    if d.mode != "none":
        out["observed"] = "not needed in a2a (each token is dispatched once, by its owner)"
        return out
    log = test.log_steps()
    for step, ids in _search_batches(test):
        out["searched"] += 1
        found = rank_invariance(policy, ids, placement, view=d.view, rng=d.rng, seed=d.seed,
                                step=step, sources=d.engine_source)
        if found.first is not None:
            (t, layer, k), choices = found.first
            out["counterexample"] = {
                "step": log[step], "scored_step": step, "layer": layer, "token": t,
                "expert": int(ids[t, layer, k]), "rows": int(ids.shape[0]),
                "choices": {r: _place(c, placement.num_slots) for r, c in enumerate(choices)},
                "batch": ids.tolist() if ids.shape[0] <= max(SEARCH_ROWS) else None}
            break
    if out["counterexample"] is None:  # the replay may still disagree: across a switch
        out["replay_disagrees"] = _first_disagreement(results, log)
    agreed = results.metrics.get("rank_agreement")
    corrupt = out["counterexample"] is not None or (agreed is not None and agreed < 1)
    out["observed"] = "variant" if corrupt else "invariant (none found)"
    return out


def _moved(results: Results) -> dict[str, Any] | None:
    """With `--migration sglang|vllm`: what the engine's updater left (`Results.engine_moves`
    totals) and the engine's name; None otherwise."""
    moves = results.engine_moves()
    if moves is None:
        return None
    return {**moves["totals"], "engine": results.spec.schedule.migration}


def _first_disagreement(results: Results, log: list[str]) -> dict[str, Any] | None:
    """The first (step, layer) of the scored replay on which ranks disagreed, the step named
    as the log names the scored steps (`log`), and whether the ranks were then serving
    different placements (a rebalance they switch to at different steps); None when they
    always agreed."""
    c = results.counters
    split = (c.agreed < c.valid).nonzero()
    if not len(split):
        return None
    step, layer = split[0].tolist()
    switching = any(seg.switch is not None and bool((seg.switch > step).any())
                    and seg.start <= step for seg in results.segments)
    return {"step": log[step], "layer": layer, "pairs": int(c.valid[step, layer]),
            "agreed": int(c.agreed[step, layer]), "during_switch": switching}


def _search_batches(test: RunTrace) -> list[tuple[int, torch.Tensor]]:
    """`(step, ids [T, L, K])` batches in the order the search tries them: the first rows of the
    first scored step (1, 2, 3, 5, 7), one row repeated, a padding row inside, then every
    scored step whole."""
    first = test.step(0).long()  # [T, L, K]
    valid = first[(first >= 0).any(-1).any(-1)]
    out: list[tuple[int, torch.Tensor]] = []
    for rows in SEARCH_ROWS:
        if rows <= len(valid):
            out.append((0, valid[:rows]))
    if len(valid):
        out.append((0, valid[:1].expand(4, -1, -1).clone()))
        pad = torch.full_like(valid[:1], -1)
        out.append((0, torch.cat([valid[:2], pad, valid[2:3]])))
    out += [(s, test.step(s).long()) for s in range(test.num_steps)]
    return out
