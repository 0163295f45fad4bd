"""The tokens each rank dispatches a step (eplbsim/ranks/dispatched.py) and the buffer metrics
they feed (`dispatch_cap`, `dispatch_peak_tokens`, `buffer_overflow_steps`)."""

import pytest
import torch

from eplbsim import RunSpec, replay
from eplbsim.base.errors import InputError
from eplbsim.cost.buffers import BUFFER_LIMIT_BYTES, GIB, dispatch_cap
from eplbsim.ranks.dispatched import rank_tokens
from eplbsim.ranks.traffic import token_owners
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace


def _trace(sizes, src_rank=None):
    ids = torch.tensor([[[0, 1]]]).expand(sum(sizes), 1, 2)
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    return Trace(ids, offsets, 8, None if src_rank is None else torch.tensor(src_rank))


def test_contiguous_shares():
    tokens = rank_tokens(_trace([10, 3, 0]), 4)
    assert tokens.tolist() == [[3, 3, 2, 2], [1, 1, 1, 0], [0, 0, 0, 0]]


def test_the_traces_own_src_rank():
    src = [0, 0, 0, 1, 2, 2, 2, 2]
    tokens = rank_tokens(_trace([5, 3], src), 3)
    assert tokens.tolist() == [[3, 1, 1], [0, 0, 3]]
    assert torch.equal(tokens[0], torch.bincount(token_owners(5, 3, torch.tensor(src[:5])),
                                                 minlength=3))


def test_a_run_flags_the_steps_over_the_cap():
    trace = synthesize("uniform", steps=3, tokens=64, layers=1, experts=8, top_k=2)
    cap = 64 // 4 - 1  # every step's busiest rank holds 16
    row = replay(trace, RunSpec.of(gpus=4, redundant=4, mode="a2a", dispatch_cap=cap)).row()
    assert row["dispatch_cap_tokens"] == cap and row["dispatch_peak_tokens"] == 16
    assert row["buffer_overflow_steps"] == 3
    row = replay(trace, RunSpec.of(gpus=4, redundant=4, mode="a2a", dispatch_cap=16)).row()
    assert row["buffer_overflow_steps"] == 0


def test_the_cap_derived_from_the_buffer_counts_the_physical_experts():
    trace = synthesize("uniform", steps=1, tokens=32, layers=1, experts=8, top_k=2)
    spec = RunSpec.of(gpus=4, redundant=8, mode="a2a", dispatch_buffer_gib=32,
                      model="deepseek-v3")
    row = replay(trace, spec).row()
    assert row["dispatch_cap_tokens"] == dispatch_cap(BUFFER_LIMIT_BYTES, 7168, 16)
    assert spec.cost.buffer_cap(16) > spec.cost.buffer_cap(16 + 64)
    assert RunSpec.of(dispatch_buffer_gib=0.5).cost.buffer_cap(16) == \
        dispatch_cap(GIB // 2, 7168, 16)


def test_none_mode_and_no_buffer_have_no_figures():
    """"none" has no dispatch buffer, and a run naming none counts no rank's tokens."""
    trace = synthesize("uniform", steps=1, tokens=32, layers=1, experts=8, top_k=2)
    row = replay(trace, RunSpec.of(gpus=4, redundant=8, mode="none", dispatch_cap=4)).row()
    assert row["buffer_overflow_steps"] is None and row["dispatch_cap_tokens"] is None
    row = replay(trace, RunSpec.of(gpus=4, redundant=8, mode="a2a")).row()
    assert row["buffer_overflow_steps"] is None and row["dispatch_peak_tokens"] is None
    row = replay(trace, RunSpec.of(gpus=4, redundant=8, mode="a2a", dispatch_cap=4)).row()
    assert row["buffer_overflow_steps"] == 1 and row["dispatch_peak_tokens"] == 8


def test_one_way_to_the_cap():
    with pytest.raises(InputError, match="not both"):
        RunSpec.of(dispatch_cap=10, dispatch_buffer_gib=32)
    with pytest.raises(InputError, match="dispatch_buffer_gib"):
        RunSpec.of(dispatch_buffer_gib=0)
