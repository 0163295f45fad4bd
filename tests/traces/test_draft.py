"""A draft's trace beside its target's, and what a recorder shared with the target counts."""

from __future__ import annotations

import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces.draft import Drafted, draft_positions, misrecorded_loads
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
