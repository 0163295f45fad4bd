"""Every reader behind one `open_trace` / `open_requests` (`traces.formats`): each form is
found from the path (and the options given), and the command line reaches it.

The files are written as each reader's own tests write them (the layouts their modules cite).
"""

import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.traces import CountsTrace
from eplbsim.traces.formats import is_request_input, open_requests, open_trace
from eplbsim.traces.formats.jsonl import write_jsonl
from eplbsim.traces.requests import RequestSet
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace

from cli_helpers import assert_input_error, run


def test_request_inputs_are_told_from_traces(tmp_path, capsys):
    from test_vllm import _combined, _write
    responses = _write(tmp_path / "resp.json", [_combined("a", 5, 3, seed=1),
                                                _combined("b", 2, 4, seed=2)])
    assert is_request_input(responses)
    requests = open_requests(responses, experts=16)
    assert isinstance(requests, RequestSet)
    assert [r.prompt_len for r in requests.requests] == [5, 2]
    E = open_requests(responses).num_experts  # the largest id + 1
    code, out, _ = run(capsys, "run", "--requests", str(responses), "--gpus", "2",
                       "--redundant", str(E % 2), "--policies", "row")
    assert code == 0 and "batched" in out
    assert_input_error(capsys, "run", "--trace", str(responses), match="holds requests")
    steps = tmp_path / "steps.jsonl"
    write_jsonl(synthesize("skewed", steps=2, tokens=4, layers=1, experts=8, top_k=2), steps)
    assert not is_request_input(steps)
    assert isinstance(open_trace(steps), Trace)  # the per-step reader, as before
    with pytest.raises(InputError, match="not a request input"):
        open_requests(steps)


def test_engine_dumps_are_found_by_their_layout(tmp_path):
    from test_flame import _iteration
    from test_megatron import _ids, _rank_file
    from test_trtllm_stats import _dump
    (tmp_path / "trt").mkdir()
    _dump(tmp_path / "trt")
    assert isinstance(open_trace(tmp_path / "trt"), CountsTrace)
    flame = open_trace(_iteration(tmp_path / "flame"), step_tokens=4)
    assert isinstance(flame, Trace) and flame.num_steps > 1
    (tmp_path / "mega").mkdir()
    for rank in (0, 1):
        _rank_file(tmp_path / "mega", rank, [_ids(3, seed=rank), _ids(2, seed=5 + rank)])
    mega = open_trace(tmp_path / "mega")
    assert mega.tokens_per_step.tolist() == [6, 4]
    assert mega.step_src_rank(0).tolist() == [0, 0, 0, 1, 1, 1]


def test_an_option_picks_the_form_that_takes_it(tmp_path):
    log = tmp_path / "t.jsonl"
    log.write_text("\n".join(
        f'{{"s": {s}, "t": {t}, "l": 0, "ids": [{t}, {t + 1}]}}'
        for s in range(2) for t in range(3)) + "\n")
    trace = open_trace(log, token_key="t", layer_key="l", ids_key="ids", step_key="s")
    assert trace.tokens_per_step.tolist() == [3, 3]
    assert np.array_equal(trace.step(1)[:, 0].numpy(), [[0, 1], [1, 2], [2, 3]])
    with pytest.raises(InputError, match=r"where=\.\.\. applies to a counts CSV only, not to a "):
        open_trace(log, where="model=a")
