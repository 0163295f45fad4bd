"""A draft's trace beside its target's, and what a recorder shared with the target counts."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces import load_trace, open_trace, save_trace
from eplbsim.traces.draft import (Drafted, draft_of, draft_positions, drafted_of,
                                  misrecorded_loads)
from eplbsim.traces.synth import synthesize


def _trace(steps=4, layers=3, experts=16, seed=0):
    return synthesize("skewed", steps=steps, tokens=32, layers=layers, experts=experts, top_k=2,
                      seed=seed)


def test_drafted_needs_the_same_steps():
    Drafted(_trace(), _trace(layers=1, experts=8, seed=1))
    with pytest.raises(InputError, match="3 steps, the target's 4"):
        Drafted(_trace(), _trace(steps=3, layers=1))


def test_misrecorded_loads_add_the_draft_at_its_positions():
    target, draft = _trace(), _trace(layers=2, experts=20, seed=1)  # 4 experts the target lacks
    got = misrecorded_loads(target.counts(), draft.counts(), [2, 0])
    d = draft.counts().to(torch.int64)
    want = target.counts().to(torch.int64).clone()
    want[:, 2] += d[:, 0, :16]
    want[:, 0] += d[:, 1, :16]
    assert torch.equal(got.recorded, want)
    assert got.pairs == int(d[:, :, :16].sum()) and got.dropped == int(d[:, :, 16:].sum())
    assert got.pairs + got.dropped == int(d.sum()) and got.dropped > 0
    assert torch.equal(got.recorded[:, 1], target.counts()[:, 1].to(torch.int64))


def test_draft_positions():
    assert draft_positions(2, 5) == [0, 1]
    for bad in ([5], [0, 0, 1], [-1]):
        with pytest.raises(InputError, match="into must name"):
            draft_positions(1 if len(bad) == 1 else 2, 5, bad)


def _drafted_trace(steps=6):
    """A target trace of 3 layers and 16 experts carrying a draft of 1 layer and 8 experts with
    rows of its own (20 a step against the target's 32)."""
    target = _trace(steps=steps)
    draft = synthesize("skewed", steps=steps, tokens=20, layers=1, experts=8, top_k=2, seed=1)
    return dataclasses.replace(target, draft=draft)


def test_a_trace_file_keeps_its_draft_part(tmp_path):
    trace = _drafted_trace()
    save_trace(trace, tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    assert torch.equal(back.topk_ids, trace.topk_ids) and "draft" not in back.meta
    assert torch.equal(back.draft.topk_ids, trace.draft.topk_ids)
    assert torch.equal(back.draft.step_offsets, trace.draft.step_offsets)
    assert (back.draft.num_experts, back.draft.num_layers, back.draft.top_k) == (8, 1, 2)
    assert back.draft.meta["source"] == trace.draft.meta["source"]
    plain = _trace()
    save_trace(plain, tmp_path / "plain.npz")
    assert load_trace(tmp_path / "plain.npz").draft is None
    assert draft_of(load_trace(tmp_path / "plain.npz")) is None


def _rewrite(path, out, change):
    """The .npz at `path` written to `out` with `change(arrays, meta)` applied."""
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(str(arrays["meta"][()]))
    change(arrays, meta)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(out, **arrays)
    return out


@pytest.mark.parametrize("change,match", [
    (lambda a, m: a.pop("draft_step_offsets"), "found only draft_topk_ids, meta draft"),
    (lambda a, m: m.pop("draft"), "found only draft_topk_ids, draft_step_offsets"),
    (lambda a, m: m["draft"].update(num_experts=4), "draft part: topk_ids has expert id"),
    (lambda a, m: m["draft"].pop("top_k"), "draft part: meta lacks the integer field 'top_k'"),
    (lambda a, m: a.update(draft_step_offsets=a["draft_step_offsets"][:-1]),
     "draft part: step_offsets must start at 0 and end"),
    (lambda a, m: a.update(draft_step_offsets=a["draft_step_offsets"][:3] * 0 +
                           np.array([0, 60, 120])), "draft must be a Trace of the same 6 steps"),
    (lambda a, m: m.update(draft=[1]), "draft part: meta's draft must be a JSON object"),
])
def test_a_bad_draft_part_is_named(tmp_path, change, match):
    save_trace(_drafted_trace(), tmp_path / "t.npz")
    bad = _rewrite(tmp_path / "t.npz", tmp_path / "bad.npz", change)
    with pytest.raises(InputError, match=re.escape(match)):
        load_trace(bad)


def test_a_truncated_draft_part_is_an_input_error(tmp_path):
    save_trace(_drafted_trace(), tmp_path / "t.npz")
    data = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[:len(data) * 2 // 3])
    with pytest.raises(InputError, match="cut.npz"):
        load_trace(tmp_path / "cut.npz")


def test_a_view_reads_the_same_steps_of_the_draft(tmp_path):
    save_trace(_drafted_trace(), tmp_path / "t.npz")
    whole = open_trace(tmp_path / "t.npz")
    view = open_trace(tmp_path / "t.npz", select_steps="1,4:")
    draft = draft_of(view)
    assert draft.num_steps == view.num_steps == 3
    for i, s in enumerate([1, 4, 5]):
        assert torch.equal(draft.step(i), whole.draft.step(s))
    pair = drafted_of(view)
    assert pair.target is view and drafted_of(pair) is pair
    assert torch.equal(pair.draft.counts(), draft.counts())
    assert torch.equal(load_trace(tmp_path / "t.npz").window(2, 4).draft.topk_ids,
                       whole.draft.topk_ids[40:80])
    with pytest.raises(InputError, match="replay a drafted trace unchunked"):
        draft_of(open_trace(tmp_path / "t.npz", max_batched_tokens=16))
