"""Tests of eplbsim.traces.steps: the flagged steps (warm-up, dummy, size outlier) and dropping
them, on small traces built to each definition.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import numpy as np
import torch

from eplbsim.traces.steps import flag_steps, select
from eplbsim.traces.trace import Trace

from id_helpers import distinct


def _steps(sizes, seed, L=4, K=2, E=16):
    rng = np.random.default_rng(seed)
    return [distinct(rng.integers(0, E, size=(T, L, K))) for T in sizes]  # [T_s, L, K] each


def test_a_data_parallel_ranks_padding_batches_are_dummy():
    """A start-up request, a first padding batch holding one of its stale rows, the real
    prefill, then the same padding batch again and again: as the Qwen3 vLLM log runs."""
    start, first_pad, prefill, pad = _steps([6, 3, 40, 3], seed=1)
    first_pad[2] = start[5]  # a stale row of the padding buffer
    steps = [start, first_pad, prefill] + [pad] * 5
    flags = flag_steps(Trace.from_steps(steps, 16))
    assert flags == {"warmup": [0], "dummy": [1, 3, 4, 5, 6, 7], "outlier": []}
    trace = select(Trace.from_steps(steps, 16), drop=["dummy", "warmup"])
    assert trace.num_steps == 1 and torch.equal(trace.step(0), torch.from_numpy(prefill).int())
    assert trace.meta["steps"]["dropped"] == {"dummy": [1, 3, 4, 5, 6, 7], "warmup": [0]}


def test_real_traffic_is_not_dummy():
    """Distinct steps, steps of one size, and steps sharing a few rows with a repeated step
    of another size are real traffic; a busy start before idling is not warm-up."""
    steps = _steps([4, 4, 4, 8, 4], seed=2)
    assert flag_steps(Trace.from_steps(steps, 16)) == {"warmup": [], "dummy": [],
                                                       "outlier": []}
    pad = _steps([2], seed=3)[0]
    busy = _steps([5, 5, 5, 9], seed=4)
    busy[3][0] = pad[0]  # shares a row with the padding batch, but is not of its size
    flags = flag_steps(Trace.from_steps(busy[:3] + [pad, pad, busy[3]], 16))
    assert flags == {"warmup": [], "dummy": [3, 4], "outlier": []}  # 3 steps lead: no warm-up


def test_warm_up_and_outliers():
    """A profiling pass routes every row alike; outliers are measured against the median of
    the steps that are neither warm-up nor dummy."""
    real = _steps([4, 5, 4, 6, 50], seed=5)
    profile = np.repeat(_steps([1], seed=6)[0], 64, axis=0)
    pad = _steps([2], seed=7)[0]
    steps = [profile] + real[:4] + [pad] * 6 + [real[4]]
    flags = flag_steps(Trace.from_steps(steps, 16))
    assert flags == {"warmup": [0], "dummy": list(range(5, 11)), "outlier": [0, 11]}


def test_a_step_flagged_twice_is_dropped_and_counted_once():
    """A warm-up pass that is also a size outlier (512 alike rows among 24-row steps): the words
    a run prints add up, kept plus dropped being every step."""
    from eplbsim.traces.steps import describe_selection
    g = torch.Generator().manual_seed(0)
    alike = torch.randperm(16, generator=g)[:4].expand(512, 1, 4).clone()
    steps = [alike] + [torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(24)])
                       .view(24, 1, 4) for _ in range(12)]
    trace = Trace.from_steps(steps, num_experts=16)
    flags = flag_steps(trace)
    assert flags["warmup"] == [0] and flags["outlier"] == [0]
    words = describe_selection(select(trace, None, ("warmup", "outlier")).meta)
    assert words == "steps: 12 of 13 (1 warm-up dropped)"


def test_a_warning_after_a_drop_names_the_logs_own_step_numbers():
    """With the warm-up step 0 dropped, a size outlier at the log's step 3 is warned of as
    step 3, the number `trace info` flags and `--select-steps` takes, not its place (2)."""
    from eplbsim.replay.results import run_warnings
    from eplbsim.runspec import RunSpec
    g = torch.Generator().manual_seed(1)

    def rows(n):
        return torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(n)]).view(n, 1, 4)
    steps = [torch.randperm(16, generator=g)[:4].expand(24, 1, 4).clone()]
    steps += [rows(512 if s == 3 else 24) for s in range(1, 13)]
    trace = Trace.from_steps(steps, num_experts=16)
    assert flag_steps(trace)["warmup"] == [0] and flag_steps(trace)["outlier"] == [3]
    kept = select(trace, None, ("warmup",))
    said = " ".join(run_warnings(kept, RunSpec.of(gpus=4), None))
    assert "1 flagged size-outlier step (3)" in said, said
