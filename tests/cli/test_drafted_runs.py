"""A trace file with draft (MTP) layers beside the target's, as the commands read it: trace
info shows the draft apart, run replays it on its own placement, --draft-fault shows SGLang
#16044's damage; and the stages trace info tells apart."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cli_helpers import assert_input_error, run
from eplbsim.traces import save_trace, synthesize
from eplbsim.traces.summary import summarize_trace


def _drafted(path, steps=6, draft_experts=8, target_experts=16):
    """An .npz of a 3-layer, `target_experts`-expert target with a 1-layer draft of
    `draft_experts` experts and 20 rows a step of its own, as save_trace writes it."""
    target = synthesize("skewed", steps=steps, tokens=32, layers=3, experts=target_experts,
                        top_k=2, seed=0)
    draft = synthesize("skewed", steps=steps, tokens=20, layers=1, experts=draft_experts,
                       top_k=2, seed=1)
    save_trace(dataclasses.replace(target, draft=draft), path)
    return target, draft


def test_trace_info_shows_the_draft_apart(tmp_path, capsys):
    target, draft = _drafted(tmp_path / "t.npz")
    code, out, err = run(capsys, "trace", "info", tmp_path / "t.npz")
    assert code == 0, err
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("  draft (MTP) layers"))
    assert "layers 1, experts 8, top-k 2; tokens 120 (per step 20..20" in lines[head]
    assert lines[head + 1].split()[:2] == ["draft", "layer"]
    want = summarize_trace(draft)["layer_skew"][0]
    assert lines[head + 2].split() == ["0", f"{want['max_over_mean']:.3f}",
                                       f"{want['per_step_max_over_mean']:.3f}",
                                       str(want["hottest_expert"])]
    target_rows = lines[lines.index(next(x for x in lines if x.strip().startswith("layer "))) + 1:
                        head]
    assert len(target_rows) == 3  # the target's layers alone above the draft's
    code, out, _ = run(capsys, "trace", "info", tmp_path / "t.npz", "--json")
    info = json.loads(out)
    assert info["layers"] == 3 and info["draft"]["layers"] == 1
    assert info["draft"]["experts"] == 8 and info["draft"]["tokens"] == 120


def test_trace_info_of_a_trace_without_a_draft_says_none(tmp_path, capsys):
    save_trace(synthesize("skewed", steps=2, tokens=8, layers=1, experts=8, top_k=2), tmp_path
               / "p.npz")
    code, out, _ = run(capsys, "trace", "info", tmp_path / "p.npz")
    assert code == 0 and "draft" not in out
    assert json.loads(run(capsys, "trace", "info", tmp_path / "p.npz", "--json")[1])["draft"] \
        is None


def test_a_truncated_draft_part_is_refused_by_the_commands(tmp_path, capsys):
    _drafted(tmp_path / "t.npz")
    data = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[:len(data) - 200])
    assert_input_error(capsys, "trace", "info", tmp_path / "cut.npz", match="cut.npz")


def test_convert_keeps_the_draft_of_the_selected_steps(tmp_path, capsys):
    _drafted(tmp_path / "t.npz")
    code, _, err = run(capsys, "trace", "convert", tmp_path / "t.npz", "--out",
                       tmp_path / "some.npz", "--select-steps", "2:4")
    assert code == 0, err
    whole = json.loads(run(capsys, "trace", "info", tmp_path / "t.npz", "--json",
                           "--select-steps", "2:4")[1])
    some = json.loads(run(capsys, "trace", "info", tmp_path / "some.npz", "--json")[1])
    assert some["draft"]["tokens"] == 40 and some["draft"]["layer_skew"] == \
        whole["draft"]["layer_skew"]
    assert_input_error(capsys, "trace", "convert", tmp_path / "t.npz", "--out",
                       tmp_path / "dir", match="only an .npz trace holds both")
