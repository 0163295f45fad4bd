"""Draft (MTP) layers replayed apart from the target's (DESIGN.md §16): each on its own
placement, solved from its own loads (its own recorder), with the run's policies and modes.

Dimensions: `S` steps, `L`/`Ld` target/draft MoE layers, `E`/`Ed` target/draft experts, `P`/`Pd`
their physical slots, `G` GPUs.

A drafted run (`traces.draft.Drafted`, or a trace whose file holds a draft part: `Trace.draft`)
replays the target as any run does, then the draft with the same settings but its own: its
placement is the run's solver (and schedule) on the draft's loads; its redundant slots are the
target's (one setting serves both, as SGLang's `ep_num_redundant_experts`: InputError when the
draft's experts do not divide over the GPUs with them, `schedule.draft_fault.check_shared`). What
belongs to the target alone is left out of the draft's: a given or initial placement (the
target's map), expert groups, and the cost model and dispatch buffer (priced for the target's
model, not the draft's layers): the draft's results hold balance and agreement, no time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..runspec import RunSpec, StepsPart
from ..schedule.draft_fault import DraftFault, check_shared, draft_fault
from ..traces.draft import Drafted
from .results import Comparison, Results, describe, format_table, table_notes

DRAFT_PART = {"part": "draft"}  # what tags a draft's row among a run's rows
TARGET_PART = {"part": "target"}
# the target's own settings, left out of the draft's (module doc): each with its unset value
TARGET_ONLY = {"placement": None, "initial": None, "groups": None, "cost": None,
               "dispatch_buffer_gib": None, "dispatch_cap": None}


@dataclass(frozen=True, eq=False)
class DraftedResults:
    """A drafted run's two results (`replay` of a drafted trace): `target` (`Results` of the
    target's layers, as `replay` gives for any trace) and `draft` (the draft's, on its own
    placement, `draft_settings`)."""

    target: Results
    draft: Results

    def rows(self) -> list[dict[str, Any]]:
        """The target's row and the draft's, each tagged with its `part`."""
        return [{**TARGET_PART, **self.target.row()}, {**DRAFT_PART, **self.draft.row()}]

    def __repr__(self) -> str:
        return "\n".join([repr(self.target), "", "draft (MTP) layers, on their own placement:",
                          format_table([self.draft.row()])])


def draft_settings(asked: RunSpec, decided: RunSpec, drafted: Drafted) -> RunSpec:
    """The draft's settings (module doc): `asked` (the run's, as given) less `TARGET_ONLY`,
    with the redundant slots of `decided` (the target's spec decided for its trace), and no
    steps' settings (`StepsPart`: the draft's steps are those of the target's, shaped before
    the parts are split); InputError when the target's and the draft's experts do not both
    take them on the GPUs."""
    redundant, gpus = decided.topology.redundant, decided.topology.gpus
    check_shared(drafted.target.num_experts, drafted.draft.num_experts, redundant, gpus)
    return asked.replace(**TARGET_ONLY, **StepsPart().shaping(), redundant=redundant)


def part_rows(rows: Sequence[dict[str, Any]], draft: Comparison,
              fault: DraftFault | None = None) -> list[dict[str, Any]]:
    """A drafted run's rows as `--json` and `--out` give them: the target's `rows` and the
    draft's, each tagged with its `part`, and the fault's (`part` "draft_fault",
    `DraftFault.row`) when one was simulated."""
    return ([{**TARGET_PART, **r} for r in rows] + [{**DRAFT_PART, **r} for r in draft.rows()]
            + ([] if fault is None else [{"part": "draft_fault", **fault.row()}]))


def run_fault(drafted: Drafted, decided: RunSpec) -> DraftFault:
    """SGLang #16044's fault on `drafted` (`schedule.draft_fault.draft_fault`) with the run's
    topology, redundant slots and solver (`decided`: the target's spec decided for its
    trace)."""
    topo = decided.topology
    return draft_fault(drafted, topo.topology(), topo.redundant, decided.solver.solver)


def draft_words(drafted: Drafted, draft: Comparison, fault: DraftFault | None,
                policies: Sequence[Any], asked: RunSpec, decided: RunSpec) -> str:
    """What `eplbsim run` prints of a drafted run's draft, apart from the target's tables: a
    line of the draft's sizes and placement (`results.describe`; `asked` and `decided` as
    `draft_settings` takes them), what it warns of, its table, and the damage of SGLang
    #16044's fault when simulated (`fault_words`)."""
    rows = draft.rows()
    lines = ["draft (MTP) layers, on their own placement solved from their own loads (no cost "
             "model: it prices the target's): "
             + describe(drafted.draft, draft[0].spec, draft_settings(asked, decided, drafted),
                        policies)]
    lines += [f"warning: {w}" for w in draft.warnings]
    lines += [format_table(rows)] + table_notes(rows)
    return "\n".join(lines + ([] if fault is None else ["", fault_words(fault)]))


def fault_words(fault: DraftFault) -> str:
    """The damage of SGLang #16044's two mistakes (`DraftFault`), in words."""
    return "\n".join([
        "SGLang #16044's fault: the draft records into the target's layers and dispatches "
        "through the target's map",
        f"  wrong pairs: {fault.wrong_pairs} of the draft's {fault.pairs} "
        f"({fault.wrong_frac:.2%}) reach a slot holding another expert's weights, or none, "
        f"in the draft; through its own map {fault.own_wrong_pairs}",
        f"  misrecorded: {fault.misrecorded} draft pairs counted into the target's statistics"
        + (f", {fault.dropped} more of experts the target lacks dropped" if fault.dropped
           else ""),
        f"  the target's balance (even-split GPU imbalance on its own loads): "
        f"{fault.promise:.4f} solved from clean loads, {fault.recorded_promise:.4f} from the "
        f"misrecorded"])
