"""One trace over many workers: ranges of steps replayed apart equal the one-process run bit
for bit, for every policy, both modes, an async rebalance schedule, on local processes and on a
local Ray cluster; a directory trace read by each worker from its path.

Dimensions: `S` steps, `L` layers, `P` slots.
"""

import json
from dataclasses import fields

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES
from eplbsim.replay import compare, replay
from eplbsim.replay.workers import Workers, step_ranges
from eplbsim.runspec import RunSpec
from eplbsim.traces.directory import save_trace_dir
from eplbsim.traces.repeated import Repeated
from eplbsim.traces.synth import synthesize

from cli_helpers import assert_input_error, run

POLICY_NAMES = sorted(POLICIES)


def _same(ours, theirs):
    assert torch.equal(ours.slot_load, theirs.slot_load)
    for f in fields(ours.counters):
        assert torch.equal(getattr(ours.counters, f.name), getattr(theirs.counters, f.name)), \
            f.name
    assert json.dumps(ours.row(), sort_keys=True) == json.dumps(theirs.row(), sort_keys=True)


@pytest.mark.parametrize("tokens, parts", [([5] * 10, 3), ([1, 100, 1, 1, 100], 2),
                                           ([3, 0, 3], 3), ([7], 4), ([2] * 4, 9)])
def test_step_ranges_are_contiguous_nonempty_and_balanced(tokens, parts):
    ranges = step_ranges(np.array(tokens), parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(tokens)
    assert all(lo < hi for lo, hi in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(ranges) == min(parts, len(tokens))
    if len(set(tokens)) == 1:  # equal steps: sizes differ by at most one
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1


@pytest.fixture(scope="module")
def trace():
    return synthesize("drift", seed=3, steps=14, tokens=48, layers=2, experts=16, top_k=4)


def test_every_policy_in_both_modes_splits_bit_for_bit_on_local_processes(trace):
    """Two processes, an async rebalance schedule (segments and switches cut across the
    ranges), drifting rank streams, shared-expert work and link counts."""
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=4, rebalance_every=4,
                      rebalance_mode="async", copy_steps=2, rng="drift", drift_p=0.3,
                      shared_experts=1, cost="roofline")
    whole = compare(trace, POLICY_NAMES, ["none", "a2a"], spec)
    with Workers(trace, 2) as workers:
        split = compare(trace, POLICY_NAMES, ["none", "a2a"], spec, run=workers.replay_planned)
    assert len(whole) == len(split) > len(POLICY_NAMES)
    for ours, theirs in zip(split, whole):
        _same(ours, theirs)


def test_a_local_ray_cluster_gives_the_same_bits(trace):
    pytest.importorskip("ray")
    spec = RunSpec.of(gpus=4, redundant=4, rebalance_every=5, rebalance_mode="async")
    policies = ["random", "row", "static", "lp"]
    whole = compare(trace, policies, ["none", "a2a"], spec)
    with Workers(trace, 2, "ray") as workers:
        split = compare(trace, policies, ["none", "a2a"], spec, run=workers.replay_planned)
    for ours, theirs in zip(split, whole):
        _same(ours, theirs)


def test_a_directory_trace_is_read_by_each_worker_from_its_path(trace, tmp_path):
    """Read twice over (`Repeated`) as one run: a step is its base step again, and three
    workers each read their own steps (ranges cutting across the repeats)."""
    on_disk = save_trace_dir(trace, tmp_path / "trace")
    spec = RunSpec.of(gpus=4, redundant=4, policy="random")
    twice = Repeated(on_disk, 2)
    assert twice.num_steps == 2 * trace.num_steps and torch.equal(
        twice.counts(), torch.cat([trace.counts()] * 2))
    assert torch.equal(twice.step(trace.num_steps + 3), trace.step(3))
    with Workers(twice, 3) as workers:
        _same(workers.replay(twice, spec), replay(twice, spec))
    with pytest.raises(InputError, match="at least once"):
        Repeated(trace, 0)


def test_bad_requests_are_input_errors(trace):
    with pytest.raises(InputError, match="--address is for --executor ray"):
        Workers(trace, 2, "local", address="1.2.3.4:6379")
    with pytest.raises(InputError, match="unknown executor"):
        Workers(trace, 2, "slurm")
    with pytest.raises(InputError, match="at least 1"):
        Workers(trace, 0)

    def mine(ids, view, ctx):  # a function of this process only
        return POLICIES["row"].fn(ids, view, ctx)

    with Workers(trace, 1) as workers:
        with pytest.raises(InputError, match="file.py:function"):
            workers.replay(trace, RunSpec.of(gpus=4, redundant=4, policy=mine))


def test_the_run_command_gives_the_same_table_with_workers(capsys, monkeypatch):
    args = ["run", "--steps", "6", "--tokens", "64", "--policies", "random,row", "--mode",
            "none,a2a", "--json"]
    code, one, _ = run(capsys, *args)
    assert code == 0
    code, small, _ = run(capsys, *args[:-1], "--workers", "2")  # too little work to split
    assert code == 0 and small.splitlines()[1].startswith("--workers 2: one process ran it (")
    from eplbsim.replay import workers
    started = []
    monkeypatch.setattr(workers, "PAYS_OFF", 0)  # workers for any work
    pool = workers.local_pool
    monkeypatch.setattr(workers, "local_pool",
                        lambda *a: started.append(a[0]) or pool(*a))
    code, two, _ = run(capsys, *args, "--workers", "2")
    assert code == 0 and json.loads(one) == json.loads(two) and started == [2]
    assert_input_error(capsys, *args, "--address", "1.2.3.4:6379",
                       match="--address is for --executor ray")


def test_the_engines_own_code_splits_bit_for_bit_and_is_weighed_by_its_calls(trace):
    """Engine policies over two processes equal one process, the weights moved by SGLang's
    updater with a fault (`--unmoved`, `--map-lead`) too; `dispatch_work` counts an engine's
    calls: shared in "none" when they draw nothing, one a rank in "a2a"."""
    from eplbsim import engines
    from eplbsim.replay.workers import ENGINE_CALL, dispatch_work
    if engines.release("sglang") is None or engines.release("vllm") is None:
        pytest.skip("the pinned releases are not fetched (eplbsim engines fetch)")
    names = ["sglang:dynamic", "sglang:static", "vllm:hash"]
    spec = RunSpec.of(gpus=4, gpus_per_node=2, redundant=4, rebalance_every=4)
    short = trace.window(0, 6)
    moved = spec.replace(migration="sglang", unmoved=1, map_lead=1)
    whole = compare(short, names, ["none", "a2a"], moved)
    with Workers(short, 2) as workers:
        split = compare(short, names, ["none", "a2a"], moved, run=workers.replay_planned)
    for ours, theirs in zip(split, whole):
        _same(ours, theirs)
    work = {(p, m): dispatch_work(trace, [spec.replace(policy=p, mode=m)])
            for p in names for m in ("none", "a2a")}
    batches = trace.num_steps * trace.num_layers
    assert work["sglang:dynamic", "a2a"] > 4 * batches * ENGINE_CALL  # a call a rank
    assert batches * ENGINE_CALL < work["sglang:dynamic", "none"] < 2 * batches * ENGINE_CALL
    assert work["sglang:static", "none"] > work["sglang:dynamic", "none"]
    assert dispatch_work(trace, [spec.replace(policy="row")]) < work["vllm:hash", "none"]
