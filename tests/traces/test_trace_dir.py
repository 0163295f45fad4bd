"""Tests of eplbsim.traces.directory: the directory form round-trips, replays exactly like the
in-memory trace, rejects every broken file with the file's name, and replays in bounded memory.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.cli import main
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces import directory as TD
from eplbsim.traces import open_trace
from eplbsim.traces.directory import DirTrace, load_trace_dir, save_trace_dir
from eplbsim.traces.trace import Trace, load_trace, save_trace

from id_helpers import distinct


def _trace(steps=(5, 0, 3, 7, 4), L=2, K=2, E=8, src=True, seed=0):
    rng = np.random.default_rng(seed)
    T = sum(steps)
    ids = distinct(rng.integers(-1, E, size=(T, L, K)))
    offsets = np.concatenate([[0], np.cumsum(steps)])
    return Trace(ids, offsets, E, np.arange(T) % 4 if src else None,
                 {"source": "test", "num_groups": 2})


def _same(a, b):
    assert (a.num_steps, a.num_tokens, a.num_layers, a.top_k, a.num_experts, a.num_groups) == \
        (b.num_steps, b.num_tokens, b.num_layers, b.top_k, b.num_experts, b.num_groups)
    assert torch.equal(a.tokens_per_step, b.tokens_per_step)
    assert torch.equal(a.counts(), b.counts())
    for s in range(a.num_steps):
        assert torch.equal(a.step(s), b.step(s))
        ra, rb = a.step_src_rank(s), b.step_src_rank(s)
        assert (ra is None) == (rb is None)
        if ra is not None:
            assert torch.equal(ra.long(), rb.long())


@pytest.mark.parametrize("src", [True, False])
def test_round_trip_npz_dir_npz(tmp_path, src):
    tr = _trace(src=src)
    save_trace(tr, tmp_path / "a.npz")
    assert main(["trace", "convert", str(tmp_path / "a.npz"), "--out", str(tmp_path / "d")]) == 0
    d = load_trace_dir(tmp_path / "d")
    assert d.step(0).dtype == torch.int32
    assert np.load(tmp_path / "d" / "topk_ids.npy").dtype == np.int16
    _same(tr, d)
    assert d.meta["source"] == "test"
    assert main(["trace", "convert", str(tmp_path / "d"), "--out", str(tmp_path / "b.npz")]) == 0
    _same(tr, load_trace(tmp_path / "b.npz"))
    assert isinstance(open_trace(tmp_path / "d"), DirTrace)
    assert isinstance(open_trace(tmp_path / "b.npz"), Trace)


def test_counts_chunked_equal(tmp_path, monkeypatch):
    tr = _trace(steps=(9, 1, 0, 6, 2, 8), L=3, K=2, E=6)
    monkeypatch.setattr(TD, "CHUNK_ELEMENTS", 20)  # several steps per chunk, chunks of rows
    d = save_trace_dir(tr, tmp_path / "d", chunk_steps=2)
    _same(tr, d)


@pytest.mark.parametrize("policy", ["row", "random"])
@pytest.mark.parametrize("mode", ["none", "a2a"])
def test_replay_matches_in_memory(tmp_path, policy, mode):
    tr = _trace(steps=(6, 9, 4, 8), L=3, K=2, E=8)
    d = save_trace_dir(tr, tmp_path / "d")
    cfg = RunSpec.of(policy=policy, mode=mode, gpus=4, gpus_per_node=2,
                       redundant=4, seed=3)
    for c in (cfg, cfg.replace(rebalance_every=2)):
        a, b = replay(tr, c), replay(d, c)
        assert a.metrics == b.metrics
        assert torch.equal(a.slot_load, b.slot_load)
        assert torch.equal(a.counters.agreed, b.counters.agreed)


def test_cli_run_and_info_on_directory(tmp_path, capsys):
    d = tmp_path / "d"
    save_trace_dir(_trace(), d)
    save_trace(_trace(), tmp_path / "a.npz")
    assert main(["trace", "info", str(d), "--json"]) == 0
    info_d = json.loads(capsys.readouterr().out)
    assert main(["trace", "info", str(tmp_path / "a.npz"), "--json"]) == 0
    info_n = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in info_d.items() if k != "meta"} == \
        {k: v for k, v in info_n.items() if k != "meta"}
    args = ["run", "--policies", "row,random", "--mode", "none,a2a", "--gpus", "4",
            "--gpus-per-node", "2", "--redundant", "4", "--json", "--trace"]
    assert main(args + [str(d)]) == 0
    rows_d = json.loads(capsys.readouterr().out)
    assert main(args + [str(tmp_path / "a.npz")]) == 0
    assert rows_d == json.loads(capsys.readouterr().out)


def _broken(tmp_path, edit):
    d = tmp_path / "d"
    save_trace_dir(_trace(steps=(3, 4, 5)), d)
    edit(d)
    return d


def _save(path, arr):
    np.save(path, arr, allow_pickle=False)


@pytest.mark.parametrize("edit, file, words", [
    (lambda d: (d / "meta.json").unlink(), "meta.json", "missing"),
    (lambda d: (d / "topk_ids.npy").unlink(), "topk_ids.npy", "missing"),
    (lambda d: (d / "step_offsets.npy").unlink(), "step_offsets.npy", "missing"),
    (lambda d: (d / "meta.json").write_text("{oops"), "meta.json", "not a JSON"),
    (lambda d: (d / "meta.json").write_text('{"num_experts": 8, "top_k": 2}'), "meta.json",
     "num_layers"),
    (lambda d: (d / "meta.json").write_text(
        '{"num_experts": 8, "top_k": 2, "num_layers": 3}'), "topk_ids.npy", "num_layers=3"),
    (lambda d: (d / "topk_ids.npy").write_bytes((d / "topk_ids.npy").read_bytes()[:150]),
     "topk_ids.npy", "truncated"),
    (lambda d: (d / "topk_ids.npy").write_bytes(b"garbage" * 40), "topk_ids.npy", "corrupt"),
    (lambda d: _save(d / "topk_ids.npy", np.zeros((12, 2, 2), np.float32)), "topk_ids.npy",
     "integers"),
    (lambda d: _save(d / "topk_ids.npy", np.zeros((12, 2), np.int16)), "topk_ids.npy", "3-D"),
    (lambda d: _save(d / "step_offsets.npy", np.array([0, 3, 7, 11])), "step_offsets.npy",
     "end at"),
    (lambda d: _save(d / "step_offsets.npy", np.array([0, 8, 7, 12])), "step_offsets.npy",
     "non-decreasing"),
    (lambda d: _save(d / "step_offsets.npy", np.array([[0, 12]])), "step_offsets.npy", "1-D"),
    (lambda d: _save(d / "src_rank.npy", np.zeros(11, np.int16)), "src_rank.npy", "12"),
    (lambda d: _save(d / "src_rank.npy", -np.ones(12, np.int16)), "src_rank.npy",
     "rank -1; ranks must lie in"),
    (lambda d: _save(d / "step_offsets.npy", np.array([b"x"])), "step_offsets.npy", ""),
])
def test_broken_directories_name_the_file(tmp_path, edit, file, words):
    d = _broken(tmp_path, edit)
    with pytest.raises(InputError, match=file) as err:
        DirTrace(d)
    assert words in str(err.value)
    assert main(["trace", "info", str(d)]) == 2


def test_pickled_arrays_are_refused(tmp_path):
    d = _broken(tmp_path, lambda d: np.save(d / "step_offsets.npy",
                                            np.array([0, {"x": 1}], dtype=object)))
    with pytest.raises(InputError, match="step_offsets.npy"):
        DirTrace(d)


def test_id_out_of_range_in_a_later_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(TD, "CHUNK_ELEMENTS", 8)  # two token rows per chunk
    tr = _trace(steps=(3, 4, 5), L=2, K=2, E=8)
    d = tmp_path / "d"
    save_trace_dir(tr, d)
    ids = np.load(d / "topk_ids.npy")
    ids[10, 1, 0] = 8
    _save(d / "topk_ids.npy", ids)
    with pytest.raises(InputError, match=r"topk_ids.npy: expert id 8 at token row 10 \(step 2\)"):
        DirTrace(d)
    ids[10, 1, 0] = -2
    _save(d / "topk_ids.npy", ids)
    with pytest.raises(InputError, match="expert id -2"):
        DirTrace(d)


def test_not_a_directory(tmp_path):
    with pytest.raises(InputError, match="not a trace directory"):
        DirTrace(tmp_path / "nope")
    assert main(["trace", "info", str(tmp_path / "nope")]) == 2


def test_int32_ids_for_many_experts(tmp_path):
    tr = _trace(E=40000)
    d = save_trace_dir(tr, tmp_path / "d")
    assert np.load(tmp_path / "d" / "topk_ids.npy").dtype == np.int32
    for s in range(tr.num_steps):
        assert torch.equal(d.step(s), tr.step(s))


# A ~200 MB trace written from a generator of steps, replayed with `row` on 4 ranks in "none"
# mode in a subprocess. Bound: peak RSS < (peak RSS of the same script on an 8-step, 16 MB
# trace) + 25% of the file size + 64 MiB slack, i.e. about base + 112 MiB; an implementation that
# held the ids (or their pages) in memory would need at least the file size more.
_SCRIPT = textwrap.dedent("""
    import resource, sys, numpy as np, torch
    from eplbsim.traces.directory import save_trace_dir, load_trace_dir
    from eplbsim.replay import replay
    from eplbsim.runspec import RunSpec

    class Steps:  # a trace-like source that makes each step on demand
        num_layers, top_k, num_experts, meta = 2, 8, 64, {"source": "generated"}
        def __init__(self, steps, tokens):
            self.num_steps, self.tokens = steps, tokens
        def step(self, s):
            g = np.random.default_rng(s)  # 8 distinct experts a row, some padding
            ids = (g.integers(0, 64, (self.tokens, 2, 1)) + 8 * np.arange(8)) % 64
            return torch.from_numpy(np.where(g.random(ids.shape) < 0.1, -1, ids)
                                    .astype(np.int32))
        def step_src_rank(self, s):
            return None

    path, steps, tokens, phase = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if phase == "write":
        save_trace_dir(Steps(steps, tokens), path, chunk_steps=2)
    else:
        t = load_trace_dir(path)
        r = replay(t, RunSpec.of(policy="row", mode="none", gpus=4, gpus_per_node=4,
                                   redundant=4, hidden=4))
        assert int(r.slot_load.sum()) == int(r.true_load.sum())
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
""")


def _peak_kib(*args) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, *map(str, args)], check=True,
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB on Linux")
def test_replay_in_bounded_memory(tmp_path):
    steps, tokens = 64, 1 << 16  # 64 x 65536 tokens x 2 layers x 8 slots x int16 = 134 MB:
    # a replay holding the file would pass the bound below (a quarter of it + 64 MiB)
    big, small = tmp_path / "big", tmp_path / "small"
    _peak_kib(small, 8, tokens, "write")  # 8 steps: counts() reads one full chunk too
    write_kib = _peak_kib(big, steps, tokens, "write")
    size_kib = (big / "topk_ids.npy").stat().st_size // 1024
    assert size_kib > 125 * 1024
    base_kib = _peak_kib(small, 8, tokens, "replay")
    replay_kib = _peak_kib(big, steps, tokens, "replay")
    bound = base_kib + size_kib // 4 + 64 * 1024
    print(f"file {size_kib // 1024} MiB; peak RSS: write {write_kib // 1024} MiB, replay "
          f"{replay_kib // 1024} MiB (8-step replay {base_kib // 1024} MiB, bound "
          f"{bound // 1024} MiB)")
    assert replay_kib < bound
    assert write_kib < bound


def test_a_file_cut_short_after_its_checks_is_an_input_error(tmp_path):
    tr = _trace(steps=(3, 4, 5))
    d = save_trace_dir(tr, tmp_path / "d")
    path = tmp_path / "d" / "topk_ids.npy"
    path.write_bytes(path.read_bytes()[:-4])  # the last row's last pairs gone
    assert torch.equal(d.step(0), tr.step(0))
    with pytest.raises(InputError, match=r"topk_ids.npy: ended 4 bytes short of rows 7:12"):
        d.step(2)


def test_a_weighted_trace_written_as_a_directory_says_its_weights_are_not_kept(tmp_path):
    from eplbsim.base.errors import InputWarning
    from eplbsim.traces.directory import to_memory
    from eplbsim.traces.steps import select
    from eplbsim.traces.trace import Trace
    ids = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]]], dtype=torch.int32)
    weights = torch.tensor([[[0.5, 0.5]], [[1.0, 0.0]], [[0.25, 0.75]]])
    trace = Trace(ids, torch.tensor([0, 1, 3]), 4, None, {}, weights)
    with pytest.warns(InputWarning, match="holds no gating weights"):
        written = save_trace_dir(trace, tmp_path / "d")
    assert written.step_weights(0) is None
    view = select(trace, "1")
    assert torch.equal(to_memory(view).topk_weights, weights[1:])
