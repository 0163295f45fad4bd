"""Stage placements (DESIGN.md §16): a placement solved from the prefill steps, one from the
decode steps and one from every step, each judged on the prefill steps and on the decode steps.

Dimensions: `S` steps, `L` layers, `E` logical experts, `P` physical slots.

Expert heat differs between prefill and decode (vllm-ascend #10647 collects the load of one
stage only), so a placement solved from one stage's loads may serve the other badly. Each
placement is the run's solver on its steps' loads (`replay.stage_placement`; a step's stage as
`traces.stages` tells it: as the log marks it, else by `decode_tokens`); each cell replays one
stage's steps on it with the run's dispatch (a counts-only trace: the placement's even-split
promise). Six replays a (policy, mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..base.errors import InputError
from ..runspec import RunSpec
from ..traces import RunTrace
from ..traces.stages import STAGES, describe_stages, stage_view
from . import (replay_quiet, routed_loads, schedule_of, shaped, spec_for_trace, stage_placement,
               warned)
from .results import Results, format_table

SOURCES = STAGES + ("all",)  # the steps each placement is solved from
# the columns of a stage table: its labels, then the metrics a cell reports (`Results.row`)
LABELS = ("policy", "mode", "solved_from", "judged_on", "steps")
METRICS = ("gpu_imbalance", "balancedness", "placement_imbalance", "moe_ms")


@dataclass(frozen=True, eq=False)
class StagePlacements:
    """The six cells of one run's stage placements.

    cells:    `(solved_from, judged_on) -> Results`, `solved_from` in `SOURCES`, `judged_on`
              in `STAGES`: the judged stage's steps replayed on the placement solved from the
              other's (or every step's)
    stages:   how the trace's steps were told apart (`traces.stages.describe_stages`)
    warnings: what the run warns of (`results.run_warnings`)
    """

    cells: dict[tuple[str, str], Results]
    stages: str
    warnings: tuple[str, ...] = ()

    def rows(self) -> list[dict[str, Any]]:
        """One row a cell, in `SOURCES` then `STAGES` order: the cell's run row
        (`Results.row`, settings then metrics) with `solved_from`, `judged_on`, `steps` (the
        judged steps) and `best` (True for the placement with the lowest GPU imbalance on the
        judged stage, the promise's on counts only; ties all True)."""
        rows = []
        for (source, stage), result in self.cells.items():
            rows.append({**result.row(), "solved_from": source, "judged_on": stage,
                         "steps": int(result.true_load.shape[0])})
        for stage in STAGES:
            mine = [r for r in rows if r["judged_on"] == stage]
            key = "gpu_imbalance" if mine[0].get("gpu_imbalance") is not None else \
                "placement_imbalance"
            least = min(r[key] for r in mine)
            for r in mine:
                r["best"] = r[key] == least
        return rows

    def __repr__(self) -> str:
        return stage_table(self.rows(), self.stages, self.warnings)


def stage_table(rows: Sequence[dict[str, Any]], stages: str = "",
                warnings: Sequence[str] = ()) -> str:
    """Stage placement rows (`StagePlacements.rows`, of one or more runs) as a text table, the
    best placement of each judged stage starred, a metric's column only where some row has
    it; `stages` and `warnings` said above it."""
    shown = [k for k in LABELS if k not in ("policy", "mode") or
             len({(r["policy"], r["mode"]) for r in rows}) > 1]
    columns = [(k, k, None) for k in shown] + [("best", "star", None)]
    columns += [(name, key, None) for key, name in (
        ("gpu_imbalance", "gpu_imb"), ("balancedness", "balanced"),
        ("placement_imbalance", "promise"), ("moe_ms", "moe_ms"))
        if any(r.get(key) is not None for r in rows)]
    marked = [dict(r, star="*" if r["best"] else "") for r in rows]
    lines = [f"warning: {w}" for w in warnings]
    lines += [f"stage placements: {stages}"] if stages else []
    return "\n".join(lines + [format_table(marked, tuple(columns), len(shown) + 1)])


def stage_placements(trace: RunTrace, spec: RunSpec | None = None) -> StagePlacements:
    """The stage placements of one run (module doc).

    trace: as `replay`'s (a counts-only trace needs its stages marked: `traces.stages`)
    spec:  the run's settings (default `RunSpec()`): its solver, topology, dispatch policy,
           mode and cost; `decode_tokens` tells unmarked steps apart; the trace's steps shaped
           by it first, as `replay`'s (`shaped`). No given placement, rebalance schedule or
           `solve_from` (each placement here is solved from its steps)
    Returns the `StagePlacements`; what the run warns of is warned at the caller's line too.
    InputError when the trace lacks prefill or decode steps.
    """
    trace, asked = shaped(trace, RunSpec() if spec is None else spec)
    if asked.solver.placement is not None or asked.schedule.rebalance_every is not None \
            or asked.solver.solve_from != "all":
        raise InputError("stage placements solve one placement from each stage's steps and "
                         "one from all: give no placement, rebalance_every or solve_from")
    spec = spec_for_trace(trace, asked)
    views = {stage: stage_view(trace, stage, spec.solver.decode_tokens) for stage in STAGES}
    placements = {source: stage_placement(trace, spec.replace(solve_from=source))
                  for source in STAGES}
    placements["all"] = schedule_of(trace, spec, routed_loads(trace))[0].placement
    cells = {(source, stage): replay_quiet(views[stage],
                                           spec.replace(placement=placements[source]))
             for source in SOURCES for stage in STAGES}
    said = warned(trace, spec, asked)
    return StagePlacements(cells, describe_stages(trace, spec.solver.decode_tokens), said)
