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


def _rows(capsys, *argv):
    code, out, err = run(capsys, "run", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_run_replays_the_draft_on_its_own_placement(tmp_path, capsys):
    target, draft = _drafted(tmp_path / "t.npz")
    save_trace(target, tmp_path / "target.npz")
    save_trace(draft, tmp_path / "draft.npz")
    flags = ("--gpus", "4", "--policies", "row,ordinal", "--mode", "none,a2a")
    rows = _rows(capsys, "--trace", tmp_path / "t.npz", *flags)
    assert [r["part"] for r in rows] == ["target"] * 4 + ["draft"] * 4
    alone = _rows(capsys, "--trace", tmp_path / "target.npz", *flags)
    # the draft alone, with the target's redundancy (16: one setting serves both)
    own = _rows(capsys, "--trace", tmp_path / "draft.npz", *flags, "--redundant", "16")
    for got, want in zip(rows, alone + own):
        for key in ("policy", "mode", "gpu_imbalance", "replica_skew_max", "rank_agreement",
                    "placement_imbalance"):
            assert got[key] == want[key], key
    assert rows[4]["gpu_imbalance"] != rows[0]["gpu_imbalance"]
    code, out, err = run(capsys, "run", "--trace", tmp_path / "t.npz", *flags)
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("draft (MTP) layers"))
    assert "6 steps x 20 tokens, 1 layer, E=8, K=2 | 4 GPUs (4/node), P=24 slots" in lines[head]
    assert [x.split()[:2] for x in lines[head + 2:head + 6]] == \
        [["row", "none"], ["ordinal", "none"], ["row", "a2a"], ["ordinal", "a2a"]]
    assert not any("draft" in x for x in lines[:head])


def test_run_refuses_a_redundancy_the_draft_does_not_take(tmp_path, capsys):
    _drafted(tmp_path / "t.npz", draft_experts=12)
    assert_input_error(capsys, "run", "--trace", tmp_path / "t.npz", "--gpus", "8",
                       "--policies", "row", match="no redundancy does (8 does not divide 16 - 12)")
    # where the GPUs divide 16 - 12, the redundancy the target takes the draft takes too
    rows = _rows(capsys, "--trace", tmp_path / "t.npz", "--gpus", "4", "--redundant", "4",
                 "--policies", "row", "--mode", "none")
    assert [r["num_slots"] if "num_slots" in r else r["redundant"] for r in rows] == [4, 4]


def test_draft_fault_prints_the_damage_of_sglang_16044(tmp_path, capsys):
    from eplbsim.placement.topology import Topology
    from eplbsim.schedule.draft_fault import draft_fault
    from eplbsim.traces import load_trace
    from eplbsim.traces.draft import drafted_of
    _drafted(tmp_path / "t.npz")
    flags = ("--trace", tmp_path / "t.npz", "--gpus", "4", "--policies", "row", "--mode",
             "none", "--draft-fault")
    want = draft_fault(drafted_of(load_trace(tmp_path / "t.npz")), Topology(4, 4), 16)
    assert want.wrong_pairs > 0 and want.own_wrong_pairs == 0 and want.misrecorded == 240
    fault = _rows(capsys, *flags)[-1]
    assert fault["part"] == "draft_fault" and fault == {"part": "draft_fault", **want.row()}
    code, out, err = run(capsys, "run", *flags)
    assert code == 0, err
    assert (f"wrong pairs: {want.wrong_pairs} of the draft's 240 ({want.wrong_frac:.2%})"
            in out and "through its own map 0" in out)
    assert "misrecorded: 240 draft pairs counted into the target's statistics" in out
    assert (f"{want.promise:.4f} solved from clean loads, {want.recorded_promise:.4f} from the "
            f"misrecorded") in out


def test_draft_fault_needs_a_draft(tmp_path, capsys):
    save_trace(synthesize("skewed", steps=2, tokens=8, layers=1, experts=8, top_k=2),
               tmp_path / "p.npz")
    assert_input_error(capsys, "run", "--trace", tmp_path / "p.npz", "--draft-fault",
                       match="the trace holds no draft layers")


def test_out_writes_both_parts(tmp_path, capsys):
    _drafted(tmp_path / "t.npz")
    code, _, err = run(capsys, "run", "--trace", tmp_path / "t.npz", "--gpus", "4",
                       "--policies", "row", "--mode", "none", "--out", tmp_path / "out")
    assert code == 0, err
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["part"] for r in written] == ["target", "draft"]
    assert "part" in (tmp_path / "out" / "results.csv").read_text().splitlines()[0]
