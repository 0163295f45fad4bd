"""Real ranks on torch.distributed (gloo, 127.0.0.1): every metric of the real processes equals
the in-process simulation's, and a group that cannot finish stops cleanly with one message.

Each launch costs seconds (process start-up), so the configurations share launches.
Dimensions: `S` steps, `T` tokens, `L` layers, `E` experts, `K` top-k, `G` ranks.
"""

import functools
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


from eplbsim.replay import replay
from eplbsim.replay.distributed import RANK_HOOK, GroupFailure, compare_metrics, launch
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize

from cli_helpers import run
from faults import FAULT

SOURCE = functools.partial(synthesize, "template", steps=4, tokens=40, layers=2, experts=16,
                           top_k=4, seed=1)
POLICIES = [("static", "independent"), ("random", "independent"), ("random", "shared"),
            ("random", "drift"), ("row", "independent"), ("ordinal", "independent")]


def _configs(world_size, **extra):
    base = RunSpec.of(gpus=world_size, redundant=8, drift_p=0.5, **extra)
    return [base.replace(policy=p, rng=r, mode=m) for m in ("none", "a2a") for p, r in POLICIES]


def _check_rows(rows, configs):
    assert [(r["policy"], r["mode"], r["rng"]) for r in rows] == [
        (c.dispatch.policy, c.dispatch.mode, c.dispatch.rng) for c in configs]
    for row in rows:
        wrong = {k: v for k, v in row["metrics"].items() if not v["match"]}
        assert row["match"] and not wrong, (row["policy"], row["mode"], row["rng"], wrong)


def _no_children_left():
    deadline = time.time() + 5
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


def test_two_ranks_equal_the_simulation_for_every_policy_and_mode():
    configs = _configs(2)
    rows = launch(SOURCE, configs, 2, timeout=60)
    _check_rows(rows, configs)
    by = {(r["policy"], r["mode"], r["rng"]): r["metrics"] for r in rows}
    # the comparison has teeth: rank-variant dispatch really disagrees on real processes
    for key in [("static", "none", "independent"), ("random", "none", "independent")]:
        assert by[key]["rank_agreement"]["real"] < 1
        assert by[key]["output_rel_error"]["real"] > 1e-3
    assert by[("row", "none", "independent")]["output_rel_error"]["real"] == 0.0
    trace = SOURCE()
    drift = replay(trace, configs[3].replace(device="cpu")).counters.drifted
    assert drift.any() and not drift.all()  # drift happened on some ranks and steps


def test_real_ranks_place_the_shared_expert_as_the_simulation_does():
    # 128 tokens a rank: above Waterfill's minimum; the dynamic mode all-reduces the counts
    source = functools.partial(synthesize, "skewed", steps=2, tokens=256, layers=2,
                               experts=16, top_k=4, seed=2)
    base = RunSpec.of(gpus=2, redundant=8, mode="a2a", shared_experts=1)
    configs = [base.replace(policy=p) for p in ("row", "waterfill", "waterfill-dynamic")]
    rows = launch(source, configs, 2, timeout=60)
    _check_rows(rows, configs)
    imbalance = [r["metrics"]["gpu_imbalance_with_shared"]["real"] for r in rows]
    assert imbalance[1] < imbalance[0] and imbalance[2] < imbalance[0]


def test_four_ranks_with_rebalancing_nodes_and_the_nearest_view():
    configs = _configs(4, gpus_per_node=2, rebalance_every=2)
    configs += [configs[4].replace(view="sglang-0.5.14"), configs[5].replace(predictor="oracle")]
    configs += [configs[i].replace(rebalance_mode="async", switch_delay=1) for i in (4, 10)]
    # fan-out, counted with a cost model: each process marks its ranks' GPUs (rank-variant
    # static in "none") or its tokens' (a2a), the sets united over the four processes
    configs += [configs[i].replace(cost="roofline") for i in (0, 11)]
    rows = launch(SOURCE, configs, 4, timeout=60)
    _check_rows(rows, configs)
    nearest = rows[-6]["metrics"]
    assert nearest["rank_agreement"]["real"] < 1  # per-rank views break even `row`
    assert rows[-5]["metrics"]["rebalances"]["real"] == 1
    # ranks switching at different steps: real ranks corrupt as the simulation counts
    assert rows[-4]["metrics"]["rank_agreement"]["real"] < 1
    assert rows[-3]["metrics"]["wrong_expert_frac"]["real"] > 0
    for row in rows[-2:]:
        assert row["metrics"]["fanout_nodes"]["real"] > 1  # two nodes reached, in both modes
    assert rows[-1]["metrics"]["remote_frac"]["real"] > 0


def test_compare_metrics_flags_a_difference():
    out = compare_metrics({"a": 1.0, "m": {"0": 0.5}}, {"a": 1.0, "m": {"0": 0.25}})
    assert out["a"]["match"] and not out["m"]["match"]


@pytest.mark.parametrize("kind, match", [
    ("raise", "rank 1 failed: RuntimeError: injected fault on rank 1 at step 1"),
    ("die", "rank 1 was killed by signal SIGKILL; the group was stopped"),
    ("hang", "rank 1 stopped responding: rank 0's collective timed out after 3 s"),
])
def test_a_failing_rank_stops_the_group_with_one_message(kind, match, monkeypatch):
    configs = _configs(2)[4:5]
    monkeypatch.setenv(RANK_HOOK, "faults:install")
    monkeypatch.setenv(FAULT, f"1:{kind}:1")
    start = time.time()
    with pytest.raises(GroupFailure) as info:
        launch(SOURCE, configs, 2, timeout=3)
    message = str(info.value)
    assert match in message and "\n" not in message, message
    assert time.time() - start < 120
    _no_children_left()


def test_a_port_in_use_is_reported_before_anything_starts(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(GroupFailure, match=f"port {port} on 127.0.0.1 is in use"):
            launch(SOURCE, _configs(2)[:1], 2, port=port)
        code, out, err = run(capsys, "ranks", "--world-size", "2", "--port", port,
                             "--steps", "2", "--tokens", "8")
    assert code == 1 and err.strip().startswith("eplbsim: error: port") and out == ""
    _no_children_left()


def test_ranks_command_reports_every_configuration(capsys):
    code, out, err = run(capsys, "ranks", "--world-size", "2", "--scenario", "skewed",
                         "--steps", "3", "--tokens", "24", "--layers", "2", "--experts", "16",
                         "--top-k", "4", "--redundant", "4", "--policies", "static,ordinal",
                         "--mode", "none")
    assert code == 0, err
    assert "2 of 2 configurations" in out and "gloo" in out


def test_ranks_bad_input_fails_before_spawning(capsys):
    code, _, err = run(capsys, "ranks", "--steps", "2")
    assert code == 2 and "--world-size is required" in err
    code, _, err = run(capsys, "ranks", "--world-size", "2", "--policies", "nope")
    assert code == 2 and "unknown policy 'nope'" in err


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this Python")
def test_torchrun_joins_the_launched_group(tmp_path):
    """The multi-host form, on one host: torchrun starts the ranks, each joins via env://."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "eplbsim.cli", "ranks", "--steps", "2", "--tokens",
         "16", "--layers", "1", "--experts", "8", "--top-k", "2", "--redundant", "2",
         "--policies", "random,row", "--mode", "none", "--json"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count('"match": true') >= 2 and '"world_size": 2' in done.stdout
