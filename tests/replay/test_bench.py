"""The benchmark: row keys and positive numbers, the correctness guard, the CLI's JSON."""

import json
import math

import numpy as np
import pytest
import torch

from eplbsim.cli import main
from eplbsim.replay import bench

N = 4096


@pytest.fixture(scope="module")
def rows():
    done = []
    rows = bench.bench_dispatch([N], device="cpu", repeats=1, progress=done.append)
    assert done == [1] * len(rows)  # a bar moves after each row
    return rows


def test_rows_have_the_keys_and_positive_numbers(rows):
    assert [r["policy"] for r in rows] == list(bench.BENCH_POLICIES)
    for row in rows:
        assert set(row) == set(bench.DISPATCH_KEYS)
        assert row["n"] == N and row["device"] == "cpu"
        for key in bench.DISPATCH_KEYS[3:-1]:
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
        assert row["roofline_wrong"] == (row["ours_over_roofline"] * bench.ROOFLINE_SLACK < 1)
        assert row["ours_over_roofline"] == pytest.approx(
            row["ns_per_pair_ours"] / row["ns_per_pair_roofline"])
        assert row["gbps_ours"] == pytest.approx(
            bench.BYTES_PER_PAIR / row["ns_per_pair_ours"])
    assert "lower is better" in bench.format_dispatch_table(rows)


def test_skewed_ids_are_distinct_per_token_seeded_and_skewed():
    ids = bench.skewed_ids(2000, 2, seed=3)
    assert ids.dtype == torch.int32 and ids.shape == (2000, 2, bench.TOP_K)
    assert int(ids.min()) >= 0 and int(ids.max()) < bench.EXPERTS
    sorted_ids = ids.sort(-1).values
    assert bool((sorted_ids[..., 1:] != sorted_ids[..., :-1]).all())  # top-k w/o replacement
    assert torch.equal(ids, bench.skewed_ids(2000, 2, seed=3))
    counts = np.bincount(ids[:, 0].reshape(-1).numpy(), minlength=bench.EXPERTS)
    assert counts.max() > 3 * counts.mean()  # log-normal popularity, not uniform


@pytest.mark.parametrize("policy", bench.BENCH_POLICIES)
def test_guard_passes_for_the_real_kernels(policy):
    bench.check_against_reference(policy, bench.make_problem(N, "cpu"))


@pytest.mark.parametrize("policy", ["row", "random"])
def test_guard_catches_a_wrong_ours(monkeypatch, policy):
    real = bench.dispatch_step

    def off_by_one_replica(pol, ids, view, ctx):
        phys = real(pol, ids, view, ctx).clone()
        phys.view(-1)[7] = (phys.view(-1)[7] + 1) % bench.SLOTS  # one pair on a wrong slot
        return phys

    monkeypatch.setattr(bench, "dispatch_step", off_by_one_replica)
    with pytest.raises(bench.BenchMismatch, match="ours"):
        bench.bench_dispatch([N], [policy], device="cpu", repeats=1)


def test_guard_catches_a_wrong_straightforward(monkeypatch):
    real = bench.straightforward
    monkeypatch.setattr(bench, "straightforward",
                        lambda policy, prob: real(policy, prob).flip(0))
    with pytest.raises(bench.BenchMismatch, match="straightforward"):
        bench.check_against_reference("ordinal", bench.make_problem(N, "cpu"))


def test_best_time_is_the_minimum_after_warmup():
    calls = []
    assert bench.best_time(lambda: calls.append(1), "cpu", repeats=3, warmup=2) >= 0
    assert len(calls) == 5


def test_replay_throughput_rows_put_the_replay_beside_its_kernel_calls():
    done = []
    rows = bench.replay_throughput("cpu", steps=2, tokens=64, layers=2, repeats=1,
                                   progress=done.append)
    assert len(done) == len(rows)
    assert [(r["mode"], r["policy"]) for r in rows] == [
        (m, p) for m in bench.REPLAY_MODES for p in bench.BENCH_POLICIES]
    calls = {(r["mode"], r["policy"]): r["calls_per_step"] for r in rows}
    assert calls[("none", "row")] == calls[("none", "ordinal")] == 1  # one group of 32 ranks
    assert calls[("none", "static")] == calls[("none", "random")] == bench.GPUS
    assert {calls[("a2a", p)] for p in bench.BENCH_POLICIES} == {bench.GPUS}  # one per share
    for row in rows:
        assert row["kind"] == "replay" and row["ranks"] == bench.GPUS
        assert row["pairs"] == 2 * 64 * 2 * bench.TOP_K
        assert row["replay_seconds"] > 0 and row["kernel_seconds"] > 0
        assert row["replay_pairs_per_s"] == pytest.approx(row["pairs"] / row["replay_seconds"])
        assert row["replay_over_kernel"] == pytest.approx(
            row["replay_seconds"] / row["kernel_seconds"])
    table = bench.format_replay_table(rows)
    assert "replay/kernel" in table and len(table.splitlines()) == 3 + len(rows)


def test_cli_bench_json(capsys):
    code = main(["bench", "--n", "4096", "--no-replay", "--no-end-to-end", "--json",
                 "--device", "cpu", "--repeats", "1", "--policies", "row,ordinal"])
    out, _ = capsys.readouterr()
    assert code == 0
    rows = json.loads(out)
    assert [(r["policy"], r["n"]) for r in rows] == [("row", 4096), ("ordinal", 4096)]
    assert all(set(r) == set(bench.DISPATCH_KEYS) for r in rows)


def test_cli_bench_table(capsys):
    code = main(["bench", "--n", "4096", "--device", "cpu", "--repeats", "1", "--policies",
                 "static", "--replay-steps", "1", "--replay-tokens", "16", "--replay-layers", "1",
                 "--no-end-to-end"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "ours/roof" in out and "replay/kernel" in out
    lines = [line.split() for line in out.splitlines()]
    assert [line[:2] for line in lines if line[:1] in (["none"], ["a2a"])] == [
        ["none", "static"], ["a2a", "static"]]


@pytest.mark.parametrize("argv, match", [
    (["--n", "1e6x"], "--n"), (["--n", "0"], "--n"), (["--n", "1.5"], "--n"),
    (["--policies", "flat"], "bench policy"), (["--replay-modes", "ep"], "unknown mode"),
])
def test_cli_bench_bad_input(capsys, argv, match):
    code = main(["bench", "--no-replay", "--device", "cpu", *argv])
    _, err = capsys.readouterr()
    assert code == 2 and match in err and err.startswith("eplbsim: error:")


def test_a_roofline_beaten_by_more_than_ten_percent_is_called_wrong(rows):
    fast = dict(rows[0], ours_over_roofline=0.5, roofline_wrong=True)
    slow = dict(rows[0], ours_over_roofline=1.2, roofline_wrong=False)
    lines = bench.format_dispatch_table([fast, slow]).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    start = lines[header].index("ours/str") + len("ours/str")  # the last column's cells
    assert [line[start:].strip() for line in lines[header + 1:header + 3]] == [
        "roofline wrong", "1.20"]
    assert lines[header + 3].startswith("roofline wrong: ")


def test_the_cpu_roofline_copies_the_bytes_dispatch_moves():
    prob = bench.make_problem(4096, "cpu")
    copies = bench.roofline(prob)
    assert len(copies) == 2
    for copy in copies:
        copy()
    src = torch.arange(10, dtype=torch.uint8).numpy()
    dst = torch.zeros(10, dtype=torch.uint8).numpy()
    bench._stream_copy(src, dst, 3)
    assert dst.tolist() == list(range(10))


@pytest.mark.parametrize("form", ["npz", "dir"])
def test_end_to_end_times_the_whole_run_at_two_lengths(tmp_path, form):
    row = bench.end_to_end(steps=(1, 3), tokens=64, layers=2, repeats=1, folder=tmp_path,
                           form=form, warmups=0)  # the test's numba warm-up filled the cache
    assert row["pairs"] == [1 * 64 * 2 * bench.TOP_K, 3 * 64 * 2 * bench.TOP_K]
    assert all(s > 0 for s in row["seconds"]) and row["form"] == form
    text = bench.format_end_to_end(row)
    if row["seconds"][1] > row["seconds"][0]:
        assert math.isfinite(row["e2e_pairs_per_s"]) and row["e2e_pairs_per_s"] == pytest.approx(
            (row["pairs"][1] - row["pairs"][0]) / (row["seconds"][1] - row["seconds"][0]))
        assert "M trace pairs/s" in text
    else:  # sizes this small are within the noise of a process's start-up
        assert row["e2e_pairs_per_s"] is None and "lost in the noise" in text
    assert not list(tmp_path.iterdir())  # its trace files are gone
