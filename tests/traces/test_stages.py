"""Each step's stage, prefill or decode: as the log marks it, else by its tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces.counts import CountsTrace
from eplbsim.traces.formats.sglang import import_sglang
from eplbsim.traces.prefill_chunks import chunk_steps
from eplbsim.traces.request_synth import synthesize_requests
from eplbsim.traces.stages import (CODES, DECODE, PREFILL, describe_stages, forward_mode_mark,
                                   marks_of, recorded_stages, stage_steps, stage_view,
                                   step_stages)
from eplbsim.traces.steps import select
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace
from eplbsim.traces.workload import Workload, batch


def _phases(**kw):
    return synthesize("phases", **{**dict(steps=12, tokens=64, layers=2, experts=16, top_k=2,
                                          seed=0, phase_len=3), **kw})


def test_phases_marks_its_blocks():
    trace = _phases()
    codes = step_stages(trace)
    want = np.where((np.arange(12) // 3) % 2 == 0, PREFILL, DECODE)
    assert codes.tolist() == want.tolist()
    assert describe_stages(trace) == "6 prefill and 6 decode steps (as the log marks them)"


def test_marks_win_over_tokens():
    """A step marked prefill is prefill though it has fewer tokens than the rule's bound."""
    trace = _phases(tokens=64, decode_tokens=4)
    assert (step_stages(trace, decode_tokens=1000) == step_stages(trace)).all()


def test_tokens_decide_unmarked_steps():
    ids = np.zeros((10 + 3 + 300, 1, 1), dtype=np.int32)
    trace = Trace(ids, [0, 10, 13, 313], 4)
    assert step_stages(trace, decode_tokens=10).tolist() == [DECODE, DECODE, PREFILL]
    assert step_stages(trace, decode_tokens=9).tolist() == [PREFILL, DECODE, PREFILL]
    assert step_stages(trace).tolist() == [DECODE, DECODE, PREFILL]  # 300 > 256
    part = Trace(ids, [0, 10, 13, 313], 4, meta={"stages": "p??"})
    assert step_stages(part, decode_tokens=100).tolist() == [PREFILL, DECODE, PREFILL]
    assert "1 as the log marks them" in describe_stages(part, 100)


def test_views_read_their_log_steps_marks():
    trace = _phases(tokens=64, decode_tokens=8)
    codes = step_stages(trace)
    picked = select(trace, "1:7")
    assert step_stages(picked).tolist() == codes[1:7].tolist()
    chunked = chunk_steps(trace, 16)  # a prefill step of 64 rows: 4 chunks, each prefill
    parent = chunked.parent.numpy()
    assert step_stages(chunked).tolist() == codes[parent].tolist()
    assert step_stages(trace.window(4, 9)).tolist() == codes[4:9].tolist()
    decode = stage_view(trace, "decode")
    assert (step_stages(decode) == DECODE).all() and decode.num_steps == 6
    assert torch.equal(decode.counts(), trace.counts()[torch.from_numpy(
        stage_steps(trace, "decode"))])


def test_counts_need_marks():
    counts = CountsTrace(np.ones((3, 1, 4), dtype=np.int64), {"stages": "pdp"})
    assert step_stages(counts).tolist() == [PREFILL, DECODE, PREFILL]
    assert step_stages(select(counts, "1:")).tolist() == [DECODE, PREFILL]
    assert stage_view(counts, "prefill").num_steps == 2
    with pytest.raises(InputError, match="no token rows"):
        step_stages(CountsTrace(np.ones((3, 1, 4), dtype=np.int64)))


@pytest.mark.parametrize("marks", ["pd", "pdx", 3])
def test_bad_marks_are_refused(marks):
    trace = Trace(np.zeros((3, 1, 1), dtype=np.int32), [0, 1, 2, 3], 4, meta={"stages": marks})
    with pytest.raises(InputError, match="meta stages"):
        recorded_stages(trace)


def test_no_steps_of_a_stage_is_an_input_error():
    trace = Trace(np.zeros((3, 1, 1), dtype=np.int32), [0, 1, 2, 3], 4)
    with pytest.raises(InputError, match="no prefill steps"):
        stage_view(trace, "prefill")
    with pytest.raises(InputError, match="unknown stage"):
        stage_steps(trace, "verify")


def test_workload_marks_a_step_with_prefill_rows_prefill():
    reqs = synthesize_requests(layers=2, experts=16, top_k=2, seed=1, num_requests=6,
                               prompt_mean=40, output_mean=8)
    done = batch(reqs, Workload(max_batched_tokens=32, max_running=4))
    codes = step_stages(done.trace)
    rows = np.repeat(np.arange(done.trace.num_steps), done.trace.tokens_per_step.numpy())
    has_prefill = np.bincount(rows, weights=done.kind == 1,
                              minlength=done.trace.num_steps) > 0
    assert codes.tolist() == np.where(has_prefill, PREFILL, DECODE).tolist()
    assert (codes == PREFILL).any() and (codes == DECODE).any()


def test_sglang_forward_modes():
    assert forward_mode_mark([1, 2]) == "p"  # a pass some rank prefills: prefill
    assert forward_mode_mark([2, 4]) == "d"  # decode beside an idle rank
    assert forward_mode_mark([3]) == "p" and forward_mode_mark([5]) == "d"
    assert forward_mode_mark([4, None, 9]) == "?"  # idle, unsaid, a release-specific value
    assert marks_of([PREFILL, DECODE, -1]) == "pd?"
    assert set(CODES) == {"prefill", "decode"}


def test_sglang_dump_forward_mode_gives_stages(tmp_path):
    mapping = torch.tensor([[0, 1, 2, 3]])
    records = []
    for fpid, mode, tokens in ((0, 1, 50), (1, 2, 3), (2, 4, 0), (3, 3, 40)):
        ids = torch.full((1, tokens, 8), -1, dtype=torch.int32)
        ids[0, :, 0] = torch.arange(tokens) % 4
        records.append({"forward_pass_id": fpid, "rank": 0, "topk_ids_of_layer": ids,
                        "forward_mode": mode})
    path = tmp_path / "dump.pt"
    torch.save({"records": records, "last_physical_to_logical_map": mapping}, path)
    trace = import_sglang([path], top_k=1)
    assert trace.meta["stages"] == "pd?p"
    # the idle pass has no tokens: by the rule, decode
    assert step_stages(trace).tolist() == [PREFILL, DECODE, DECODE, PREFILL]


def test_record_mark_reads_each_stage_field():
    from eplbsim.traces.stages import record_mark, step_mark
    assert record_mark("f:1", {"is_prefill": False, "stage": "prefill"}) == ("is_prefill", "d")
    assert record_mark("f:1", {"forward_mode": "ForwardMode.MIXED"}) == ("forward_mode", "p")
    assert record_mark("f:1", {"forward_mode": 2}) == ("forward_mode", "d")
    assert record_mark("f:1", {"phase": "Context"}) == ("phase", "p")
    assert record_mark("f:1", {"stage": "pre_dispatch", "phase": "decode"}) == ("phase", "d")
    assert record_mark("f:1", {"stage": "pre_dispatch"}) is None
    assert step_mark("dpd") == "p" and step_mark("d?") == "d" and step_mark("") == "?"
    with pytest.raises(InputError, match="f:1: is_prefill must be true or false"):
        record_mark("f:1", {"is_prefill": 1})
