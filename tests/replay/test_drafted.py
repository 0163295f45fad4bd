"""replay on a drafted run: the target's results and the draft's, each on its own placement."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from eplbsim.base.errors import InputError, RunWarning
from eplbsim.cli import main
from eplbsim.replay import replay
from eplbsim.replay.drafted import DraftedResults
from eplbsim.replay.results import to_json
from eplbsim.runspec import RunSpec
from eplbsim.traces import load_trace, save_trace, synthesize
from eplbsim.traces.draft import Drafted


def _parts(draft_experts=8):
    target = synthesize("skewed", steps=5, tokens=32, layers=2, experts=16, top_k=2, seed=0)
    draft = synthesize("burst", steps=5, tokens=24, layers=1, experts=draft_experts, top_k=2,
                       seed=3)
    return target, draft


def test_replay_of_a_drafted_run_gives_both_results(tmp_path):
    target, draft = _parts()
    spec = RunSpec.of(gpus=4, policy="row", mode="a2a")
    save_trace(dataclasses.replace(target, draft=draft), tmp_path / "t.npz")
    for given in (Drafted(target, draft), load_trace(tmp_path / "t.npz")):
        got = replay(given, spec)
        assert isinstance(got, DraftedResults)
        alone = replay(target, spec)
        own = replay(draft, spec.replace(redundant=alone.spec.topology.redundant))
        assert torch.equal(got.target.slot_load, alone.slot_load)
        assert torch.equal(got.draft.slot_load, own.slot_load)
        assert got.draft.slot_load.shape == (5, 1, 8 + 16)
        assert [r["part"] for r in got.rows()] == ["target", "draft"]
        assert got.rows()[1]["gpu_imbalance"] == own.row()["gpu_imbalance"]
        assert "draft (MTP) layers, on their own placement" in repr(got)


def test_the_draft_leaves_the_targets_own_settings_out(tmp_path):
    target, draft = _parts()
    with pytest.warns(RunWarning, match="its loads are priced as that model's"):
        got = replay(Drafted(target, draft), RunSpec.of(gpus=4, cost="roofline"))
    assert got.target.row()["moe_ms"] is not None and got.draft.spec.cost.cost is None


def test_a_draft_the_gpus_cannot_take_with_the_target_is_refused():
    target, draft = _parts(draft_experts=10)
    with pytest.raises(InputError, match="4 does not divide 16 - 10"):
        replay(Drafted(target, draft), RunSpec.of(gpus=4))


def test_the_spec_s_steps_select_the_draft_s_steps_once_as_run_does(tmp_path, capsys):
    target, draft = _parts()
    save_trace(dataclasses.replace(target, draft=draft), tmp_path / "t.npz")
    got = replay(load_trace(tmp_path / "t.npz"),
                 RunSpec.of(gpus=4, policy="row", select_steps="2:"))
    assert got.target.true_load.shape[0] == got.draft.true_load.shape[0] == 3  # 2: of 5
    own = replay(draft, RunSpec.of(gpus=4, policy="row", select_steps="2:",
                                   redundant=got.target.spec.topology.redundant))
    assert torch.equal(got.draft.slot_load, own.slot_load)
    assert main(["run", "--trace", str(tmp_path / "t.npz"), "--select-steps", "2:", "--json",
                 "--policies", "row", "--mode", "none", "--gpus", "4"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(to_json(got.rows()))
    with pytest.raises(InputError, match="shapes the steps .* of a Drafted pair"):
        replay(Drafted(target, draft), RunSpec.of(gpus=4, select_steps="2:"))
