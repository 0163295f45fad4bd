"""Tests of eplbsim.traces.prefill_chunks: a trace's long steps cut into chunks of at most N
tokens (as a chunked-prefill engine runs a long pass), over an in-memory trace, a selection of
its steps and a trace directory; and `--max-batched-tokens` on a trace from the command line.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.traces.counts import CountsTrace
from eplbsim.traces.directory import save_trace_dir
from eplbsim.traces.prefill_chunks import ChunkView, chunk_steps
from eplbsim.traces.steps import select
from eplbsim.traces.trace import Trace

from cli_helpers import assert_input_error, run
from id_helpers import distinct


def _trace(sizes=(3, 10, 0, 7, 1), L=2, K=2, E=8):
    rng = np.random.default_rng(0)
    steps = [distinct(rng.integers(-1, E, size=(T, L, K))) for T in sizes]
    src = [np.arange(T) % 2 for T in sizes]
    return Trace.from_steps(steps, E, src, {"source": "test"})


@pytest.mark.parametrize("form", ["memory", "directory", "selection"])
def test_chunks_are_the_steps_rows_in_order_and_count_alike(form, tmp_path):
    trace = _trace()
    base = {"memory": lambda: trace, "directory": lambda: save_trace_dir(trace, tmp_path / "d"),
            "selection": lambda: select(trace, "1:")}[form]()
    view = chunk_steps(base, 4)
    assert isinstance(view, ChunkView)
    parts = {"memory": [3, 4, 4, 2, 0, 4, 3, 1], "directory": [3, 4, 4, 2, 0, 4, 3, 1],
             "selection": [4, 4, 2, 0, 4, 3, 1]}[form]
    assert view.tokens_per_step.tolist() == parts and view.num_tokens == base.num_tokens
    assert torch.equal(torch.cat([view.step(s) for s in range(view.num_steps)]),
                       torch.cat([base.step(s) for s in range(base.num_steps)]))
    assert torch.equal(torch.cat([view.step_src_rank(s) for s in range(view.num_steps)]),
                       torch.cat([base.step_src_rank(s) for s in range(base.num_steps)]))
    counts = view.counts()  # [S', L, E]: each chunk's own, summing to its step's
    parent = view.parent
    summed = torch.zeros_like(base.counts()).index_add_(0, parent, counts.to(base.counts().dtype))
    assert torch.equal(summed, base.counts())
    for s in range(view.num_steps):
        ids = view.step(s)
        own = torch.stack([torch.bincount(ids[:, j][ids[:, j] >= 0].flatten(), minlength=8)
                           for j in range(2)])
        assert torch.equal(counts[s].long(), own)
    assert view.meta["chunked"] == {"max_batched_tokens": 4, "cut": 2,
                                    "of": base.num_steps, "into": view.num_steps}
    assert pickle.loads(pickle.dumps(view)).tokens_per_step.tolist() == parts


def test_nothing_to_cut_and_counts_only(tmp_path):
    trace = _trace()
    assert chunk_steps(trace, 10) is trace
    with pytest.raises(InputError, match="counts-only trace has none"):
        chunk_steps(CountsTrace(np.ones((2, 2, 8), dtype=np.int64), {}), 4)


def test_trace_info_and_run_cut_a_traces_long_steps(capsys, tmp_path):
    path = tmp_path / "t.npz"
    from eplbsim.traces import save_trace
    save_trace(_trace(), path)
    code, out, _ = run(capsys, "trace", "info", path, "--max-batched-tokens", "4")
    assert code == 0
    assert "steps 8, tokens 21 (per step 0..4, mean 2.6)" in out
    assert "chunks of at most 4 tokens: 2 steps became 5" in out
    info = json.loads(run(capsys, "trace", "info", path, "--max-batched-tokens", "4",
                          "--select-steps", "1", "--json")[1])
    assert info["steps"] == 3 and info["tokens_per_step"]["max"] == 4
    code, out, _ = run(capsys, "run", "--trace", path, "--max-batched-tokens", "4",
                       "--policies", "row", "--gpus", "2")
    assert code == 0 and "8 steps of 2.62 tokens on average (chunks of at most 4 tokens" in out
    assert_input_error(capsys, "run", "--trace", path, "--chunk", "4",
                       match="chunk applies to requests only")
