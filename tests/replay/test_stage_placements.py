"""Stage placements: a placement from prefill steps, one from decode steps, one from all, each
judged on both stages; `solve_from` serves one stage's placement to every step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eplbsim import RunSpec
from eplbsim.base.errors import InputError
from eplbsim.replay import replay, stage_placement
from eplbsim.replay.stage_placements import SOURCES, stage_placements
from eplbsim.solvers import solve
from eplbsim.traces.counts import CountsTrace
from eplbsim.traces.stages import STAGES, stage_steps
from eplbsim.traces.synth import synthesize

from cli_helpers import assert_input_error, run

SPEC = RunSpec.of(gpus=8, redundant=8, mode="a2a")


def _phases(seed=0, rho=-0.5):
    """Prefill and decode heat anti-correlated (`rho` < 0), prefill steps 8x the rows."""
    return synthesize("phases", steps=24, tokens=256, layers=2, experts=32, top_k=4, seed=seed,
                      phase_len=4, decode_tokens=32, rho=rho)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_stage_is_served_best_by_its_own_placement(seed):
    found = stage_placements(_phases(seed), SPEC)
    rows = found.rows()
    assert [(r["solved_from"], r["judged_on"]) for r in rows] == \
        [(s, j) for s in SOURCES for j in STAGES]
    for stage in STAGES:
        mine = {r["solved_from"]: r for r in rows if r["judged_on"] == stage}
        own = mine[stage]["gpu_imbalance"]
        assert own < min(r["gpu_imbalance"] for s, r in mine.items() if s != stage)
        assert mine[stage]["best"] and not any(r["best"] for s, r in mine.items() if s != stage)
        assert mine[stage]["placement_imbalance"] < mine["all"]["placement_imbalance"]


def test_cells_judge_the_stage_steps_on_the_named_placement():
    trace = _phases()
    found = stage_placements(trace, SPEC)
    for stage in STAGES:
        steps = torch.from_numpy(stage_steps(trace, stage))
        placed = stage_placement(trace, SPEC.replace(solve_from=stage))
        cell = found.cells[stage, stage]
        assert torch.equal(cell.true_load, trace.counts()[steps])
        assert torch.equal(cell.segments[0].placement.phy2log, placed.phy2log)
        # the stage's placement is the solver's on that stage's loads
        load = trace.counts()[steps].sum(0).to(torch.float64)
        assert torch.equal(placed.phy2log, solve("deepseek", load, 40, SPEC.topology.topology(),
                                                 1).phy2log)
    whole = replay(trace, SPEC)
    assert torch.equal(found.cells["all", "decode"].segments[0].placement.phy2log,
                       whole.segments[0].placement.phy2log)


def test_solve_from_serves_every_step_on_the_stage_placement():
    trace = _phases()
    run_ = replay(trace, SPEC.replace(solve_from="decode"))
    placed = stage_placement(trace, SPEC.replace(solve_from="decode"))
    given = replay(trace, SPEC.replace(placement=placed))
    assert torch.equal(run_.slot_load, given.slot_load)
    assert run_.true_load.shape[0] == trace.num_steps
    assert not torch.equal(run_.segments[0].placement.phy2log,
                           replay(trace, SPEC).segments[0].placement.phy2log)


def test_counts_only_stages_judge_the_promise():
    trace = _phases()
    counts = CountsTrace(trace.counts().numpy(), dict(trace.meta))
    found = stage_placements(counts, SPEC.replace(mode="none"))
    rows = found.rows()
    assert all(r["gpu_imbalance"] is None for r in rows)
    tokens = stage_placements(trace, SPEC)
    for a, b in zip(rows, tokens.rows()):
        assert a["placement_imbalance"] == pytest.approx(b["placement_imbalance"])


def test_settings_that_exclude_stage_placements():
    trace = _phases()
    with pytest.raises(InputError, match="give no placement"):
        stage_placements(trace, SPEC.replace(solve_from="prefill"))
    with pytest.raises(InputError, match="rebalance_every"):
        SPEC.replace(solve_from="prefill", rebalance_every=4)
    one_stage = synthesize("skewed", steps=3, tokens=300, layers=1, experts=8, top_k=2, seed=0)
    with pytest.raises(InputError, match="no decode steps"):  # 300 tokens > 256: prefill
        stage_placements(one_stage, SPEC)
    with pytest.raises(InputError, match="no prefill steps"):  # at most 300: decode
        stage_placements(one_stage, SPEC.replace(decode_tokens=300))


def test_cli_stage_placements(capsys):
    argv = ["run", "--scenario", "phases", "--steps", 16, "--tokens", 256, "--layers", 2,
            "--experts", 32, "--top-k", 4, "-o", "phase_len=4", "-o", "rho=-0.5",
            "--gpus", 8, "--redundant", 8, "--mode", "a2a", "--policies", "ordinal,row",
            "--stage-placements"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    lines = out.splitlines()
    assert "solver deepseek" in lines[0]
    assert lines[1].startswith("stage placements: 8 prefill and 8 decode steps")
    assert lines[2].split()[:6] == ["policy", "mode", "solved_from", "judged_on", "steps",
                                    "best"]
    assert len(lines) == 3 + 2 * 6
    code, out, _ = run(capsys, *argv, "--json")
    rows = json.loads(out)
    assert {(r["policy"], r["solved_from"], r["judged_on"]) for r in rows} == \
        {(p, s, j) for p in ("ordinal", "row") for s in SOURCES for j in STAGES}
    assert_input_error(capsys, *argv, "--solve-from", "prefill", match="give no placement")
    assert_input_error(capsys, *argv[:-1], "--solve-from", "verify", match="unknown stage")
