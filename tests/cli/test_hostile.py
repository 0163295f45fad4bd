"""Careless and hostile input, every command: each case ends with status 2 and one line on
stderr (a short usage line before it for a flag argparse cannot parse), no traceback, within
seconds, and every input file byte-identical afterwards.

`CASES` are the ones found by hand (issue 13), each a function that builds its inputs in a
folder and returns the command line; those that could hang or allocate run in a subprocess
with a timeout. The fuzz tests below mutate valid inputs of every format (truncation, byte
flips, dtype and shape changes, huge declared sizes) and accept only a clean success or a
clean InputError.

Dimensions: `S` steps, `T` tokens, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplbsim.base.errors import InputError
from eplbsim.replay.sweep import read_spec
from eplbsim.traces import Trace, open_trace, save_trace, synthesize
from eplbsim.traces.counts import CountsTrace, save_counts_trace
from eplbsim.traces.directory import save_trace_dir

from cli_helpers import run

SIZES = ["--steps", "2", "--tokens", "16", "--layers", "2", "--experts", "8", "--top-k", "2",
         "--gpus", "4", "--redundant", "4"]
TIME_LIMIT = 10.0  # seconds a refusal may take


def _trace():
    return synthesize("skewed", steps=3, tokens=8, layers=2, experts=8, top_k=2, seed=1)


def _npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def _trace_arrays(**change):
    trace = _trace()
    arrays = {"topk_ids": trace.topk_ids.numpy().astype(np.int16),
              "step_offsets": trace.step_offsets.numpy(),
              "meta": np.array(json.dumps({"num_experts": 8, "top_k": 2, "num_layers": 2}))}
    arrays.update(change)
    return arrays


def _meta(**fields):
    return np.array(json.dumps({"num_experts": 8, "top_k": 2, "num_layers": 2, **fields}))


def _digest(folder: Path) -> dict[str, str]:
    """Every file below `folder` (links followed, FIFOs skipped) -> its SHA-1."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = hashlib.sha1(path.read_bytes()).hexdigest()
        elif path.is_symlink() or path.is_dir():
            out[str(path.relative_to(folder))] = "dir-or-link"
    return out


# ----------------------------------------------------------------------------- the cases

def inputs_destroyed_convert_dir_onto_itself(d):
    save_trace_dir(_trace(), d / "t")
    return ["trace", "convert", d / "t", "--out", d / "t"]


def inputs_destroyed_convert_dir_onto_itself_slash(d):
    save_trace_dir(_trace(), d / "t")
    return ["trace", "convert", d / "t", "--out", f"{d / 't'}/"]


def inputs_destroyed_convert_dir_through_a_link(d):
    save_trace_dir(_trace(), d / "t")
    (d / "link").symlink_to(d / "t")
    return ["trace", "convert", d / "t", "--out", d / "link"]


def inputs_destroyed_convert_dir_into_itself(d):
    save_trace_dir(_trace(), d / "t")
    return ["trace", "convert", d / "t", "--out", d / "t" / "sub"]


def inputs_destroyed_convert_dir_to_a_file_inside(d):
    save_trace_dir(_trace(), d / "t")
    return ["trace", "convert", d / "t", "--out", d / "t" / "topk_ids.jsonl"]


def inputs_destroyed_convert_npz_onto_itself(d):
    save_trace(_trace(), d / "t.npz")
    return ["trace", "convert", d / "t.npz", "--out", d / "t.npz"]


def inputs_destroyed_convert_jsonl_onto_itself(d):
    (d / "t.jsonl").write_text('{"step": 0, "layer": 0, "topk_ids": [[0, 1]]}\n')
    return ["trace", "convert", d / "t.jsonl", "--out", d / "t.jsonl"]


def inputs_destroyed_import_onto_the_dump(d):
    torch.save({"logical_count": torch.ones(1, 2, 4, dtype=torch.int64),
                "average_utilization_rate_over_window": 0.5}, d / "dump.pt")
    return ["trace", "import-sglang", d / "dump.pt", "--out", d / "dump.pt"]


def inputs_destroyed_export_placement_onto_itself(d):
    (d / "p.json").write_text(json.dumps({"phy2log": [[0, 1, 2, 3]]}))
    return ["export", "--format", "sglang", "--placement", d / "p.json", "--out", d / "p.json",
            "--num-model-layers", "1"]


def inputs_destroyed_export_counts_onto_itself(d):
    save_counts_trace(CountsTrace(np.ones((1, 1, 4))), d / "c.npz")
    return ["export", "--format", "sglang", "--counts", d / "c.npz", "--out", d / "c.npz",
            "--num-model-layers", "1"]


def inputs_destroyed_a_failed_convert_keeps_the_old_directory(d):
    save_trace_dir(_trace(), d / "old")
    (d / "bad.jsonl").write_text('{"step": 0, "layer": 0, "topk_ids": [[0, 1]]}\n'
                                 '{"step": 1, "layer": 0, "topk_ids": [[0, "x"]]}\n')
    return ["trace", "convert", d / "bad.jsonl", "--out", d / "old"]


def silent_uint64_ids(d):
    return ["trace", "info", _npz(d / "u.npz", **_trace_arrays(
        topk_ids=np.full((3 * 8, 2, 2), 2**64 - 1, dtype=np.uint64)))]


def silent_ids_beyond_int32(d):
    ids = np.full((3 * 8, 2, 2), -1, dtype=np.int64)
    ids[0, 0, 0] = 2**32 + 3
    return ["trace", "convert", _npz(d / "w.npz", **_trace_arrays(
        topk_ids=ids, meta=_meta(num_experts=2**33))), "--out", d / "out.npz"]


def silent_sglang_logical_id_at_int64_max(d):
    mapping = torch.tensor([[0, 1, 2, 2**63 - 1]])
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "topk_ids_of_layer":
                             torch.tensor([[[0, 3]]], dtype=torch.int32)}],
                "last_physical_to_logical_map": mapping}, d / "dump.pt")
    return ["trace", "import-sglang", d / "dump.pt", "--out", d / "out.npz"]


def silent_solve_loads_of_1e308(d):
    (d / "load.json").write_text(json.dumps([[1e308] * 8]))
    return ["solve", "--load", d / "load.json", "--gpus", "4"]


def silent_counts_of_1e300(d):
    _npz(d / "c.npz", counts=np.full((1, 2, 8), 1e300), meta=np.array("{}"))
    return ["run", "--trace", d / "c.npz"]


def silent_zero_steps(d):
    return ["run", "--trace", _npz(d / "z.npz", **_trace_arrays(
        topk_ids=np.zeros((0, 2, 2), np.int16), step_offsets=np.array([0])))]


def silent_zero_steps_converted(d):
    return ["trace", "convert", _npz(d / "z.npz", **_trace_arrays(
        topk_ids=np.zeros((0, 2, 2), np.int16), step_offsets=np.array([0]))),
        "--out", d / "out.npz"]


def silent_loads_as_strings(d):
    (d / "load.json").write_text(json.dumps([["1", "2", "3", "4"]]))
    return ["solve", "--load", d / "load.json", "--gpus", "2"]


def silent_loads_as_booleans(d):
    (d / "load.json").write_text(json.dumps([[True, 2, 3, 4]]))
    return ["solve", "--load", d / "load.json", "--gpus", "2"]


def silent_option_maybe(d):
    (d / "load.json").write_text(json.dumps([[1, 2, 3, 4]]))
    return ["solve", "--load", d / "load.json", "--gpus", "2", "-o", "anti_colocation=maybe"]


def silent_negative_migration_tolerance(d):
    (d / "load.json").write_text(json.dumps([[1, 2, 3, 4]]))
    return ["solve", "--load", d / "load.json", "--gpus", "2", "-o", "migration_tolerance=-1"]


def silent_sigma_infinite(d):
    return ["run", *SIZES, "-o", "sigma=1e400"]


def silent_drift_too_large(d):
    return ["run", *SIZES, "-o", "drift=2"]


def silent_decode_tokens_above_tokens(d):
    return ["run", *SIZES, "--scenario", "phases", "-o", "decode_tokens=64"]


def silent_duplicate_topk_ids(d):
    ids = _trace().topk_ids.numpy().astype(np.int16)
    ids[3, 1] = [5, 5]
    return ["trace", "info", _npz(d / "dup.npz", **_trace_arrays(topk_ids=ids))]


def silent_experts_with_a_trace(d):
    save_trace(_trace(), d / "t.npz")
    return ["run", "--trace", d / "t.npz", "--experts", "16"]


def hangs_fifo_as_npz(d):
    os.mkfifo(d / "f.npz")
    return ["trace", "info", d / "f.npz"]


def hangs_fifo_as_meta_json(d):
    save_trace_dir(_trace(), d / "t")
    (d / "t" / "meta.json").unlink()
    os.mkfifo(d / "t" / "meta.json")
    return ["trace", "info", d / "t"]


def hangs_ten_million_experts(d):
    return ["trace", "info", _npz(d / "e.npz", **_trace_arrays(meta=_meta(num_experts=10**7)))]


def hangs_ten_million_slots(d):
    (d / "load.json").write_text(json.dumps([[1, 2, 3, 4]]))
    return ["solve", "--load", d / "load.json", "--gpus", "2", "--slots", "10000000"]


def hangs_redundant_1e8(d):
    return ["run", *SIZES, "--redundant", "100000000"]


def hangs_steps_1e8(d):
    return ["run", "--steps", "100000000"]


def hangs_layers_1e8(d):
    return ["run", "--layers", "100000000"]


def hangs_model_layers_1e8(d):
    save_counts_trace(CountsTrace(np.ones((1, 1, 4))), d / "c.npz")
    return ["export", "--format", "sglang", "--counts", d / "c.npz", "--out", d / "o.json",
            "--num-model-layers", "100000000"]


def hangs_jsonl_layer_1e9(d):
    (d / "t.jsonl").write_text('{"step": 0, "layer": 1000000000, "topk_ids": [[0, 1]]}\n')
    return ["trace", "convert", d / "t.jsonl", "--out", d / "out"]


def hangs_huge_sweep_grid(d):
    (d / "s.toml").write_text("[grid]\nscenario = ['skewed']\nseed = " + str(list(range(1000)))
                              + "\nredundant = " + str(list(range(0, 8000, 8))) + "\n")
    return ["sweep", d / "s.toml", "--out", d / "out"]


def traceback_a_billion_experts(d):
    return ["run", "--trace", _npz(d / "e.npz", **_trace_arrays(meta=_meta(num_experts=10**9)))]


def traceback_npy_header_of_2_62_rows(d):
    save_trace_dir(_trace(), d / "t")
    ids = d / "t" / "topk_ids.npy"
    offset = np.load(ids, mmap_mode="r").offset
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i2", "fortran_order": False,
                                                  "shape": (2**62, 2, 2)})
    ids.write_bytes(header.getvalue() + ids.read_bytes()[offset:])
    return ["trace", "info", d / "t"]


def traceback_counts_csv_expert_1e9(d):
    (d / "c.csv").write_text("layer,expert,count\n0,1000000000,3\n")
    return ["solve", "--counts", d / "c.csv", "--gpus", "2"]


def traceback_counts_csv_layer_2_70(d):
    (d / "c.csv").write_text(f"layer,expert,count\n{2**70},1,3\n")
    return ["solve", "--counts", d / "c.csv", "--gpus", "2"]


def traceback_empty_trace(d):
    return ["trace", "info", _npz(d / "empty.npz", **_trace_arrays(
        topk_ids=np.zeros((0, 2, 2), np.int16), step_offsets=np.array([0, 0])))]


def traceback_empty_loads(d):
    (d / "load.json").write_text("[[]]")
    return ["solve", "--load", d / "load.json", "--gpus", "2"]


def _zip_member_flags(path, flag=None, method=None):
    """Rewrite the first member's general-purpose flag bits or compression method in place."""
    data = bytearray(path.read_bytes())
    local = data.index(b"PK\x03\x04")
    central = data.index(b"PK\x01\x02")
    for offset in (local + 6, central + 8):  # flag bits, then the method, in each header
        if flag is not None:
            data[offset:offset + 2] = flag.to_bytes(2, "little")
        if method is not None:
            data[offset + 2:offset + 4] = method.to_bytes(2, "little")
    path.write_bytes(bytes(data))


def traceback_unsupported_compression(d):
    path = _npz(d / "c.npz", **_trace_arrays())
    _zip_member_flags(path, method=99)
    return ["trace", "info", path]


def traceback_encrypted_member(d):
    path = _npz(d / "e.npz", **_trace_arrays())
    _zip_member_flags(path, flag=1)
    return ["trace", "info", path]


def traceback_counts_meta_of_the_wrong_type(d):
    _npz(d / "c.npz", counts=np.ones((1, 2, 4)), meta=np.array(json.dumps(
        {"model_layers": "abc"})))
    return ["run", "--trace", d / "c.npz"]


def traceback_json_nested_too_deep(d):
    (d / "p.json").write_text("[" * 100000 + "]" * 100000)
    return ["run", *SIZES, "--rebalance-every", "1", "--initial", d / "p.json"]


def traceback_seed_above_2_63(d):
    return ["run", *SIZES, "--seed", str(2**63 + 1)]


def traceback_previous_with_strings(d):
    (d / "load.json").write_text(json.dumps([[1, 2, 3, 4]]))
    (d / "prev.json").write_text(json.dumps([["a", "b", "c", "d"]]))
    return ["solve", "--load", d / "load.json", "--gpus", "2", "--previous", d / "prev.json"]


def traceback_previous_ragged(d):
    (d / "load.json").write_text(json.dumps([[1, 2, 3, 4]]))
    (d / "prev.json").write_text(json.dumps([[0, 1, 2], [3]]))
    return ["solve", "--load", d / "load.json", "--gpus", "2", "--previous", d / "prev.json"]


def traceback_npy_shorter_than_its_header(d):
    save_trace_dir(_trace(), d / "t")
    ids = d / "t" / "topk_ids.npy"
    ids.write_bytes(ids.read_bytes()[:-10])
    return ["trace", "info", d / "t"]


def late_ranks_timeout_zero(d):
    return ["ranks", "--world-size", "2", "--timeout", "0"]


def late_ranks_timeout_nan(d):
    return ["ranks", "--world-size", "2", "--timeout", "nan"]


def late_ranks_timeout_negative(d):
    return ["ranks", "--world-size", "2", "--timeout=-1"]


def late_run_out_in_an_unwritable_place(d):
    return ["run", *SIZES, "--out", "/proc/eplbsim-cannot-write-here"]


def late_ranks_timeout_inf(d):
    return ["ranks", "--world-size", "2", "--timeout", "inf"]


def late_ranks_world_not_dividing_the_slots(d):
    return ["ranks", "--world-size", "3", "--redundant", "16"]


def late_ranks_world_of_64(d):
    return ["ranks", "--world-size", "64", "--redundant", "64"]


def late_run_out_names_a_file(d):
    (d / "file").write_text("keep me")
    return ["run", *SIZES, "--out", d / "file"]


def late_run_out_under_a_file(d):
    (d / "file").write_text("keep me")
    return ["run", *SIZES, "--out", d / "file" / "sub"]


def late_figures_out_names_a_file(d):
    (d / "file").write_text("keep me")
    return ["figures", "--only", "solver_gap", "--out", d / "file"]


def late_device_meta(d):
    return ["run", *SIZES, "--device", "meta"]


def late_bench_device_meta(d):
    return ["bench", "--device", "meta"]


def late_text_file_as_npz(d):
    (d / "t.npz").write_text("not an archive at all\n")
    return ["trace", "info", d / "t.npz"]


def late_unparsable_flag(d):
    return ["run", "--redundant"]


def _wrapping_counts(d):
    """2048 steps of 2**53 pairs on one expert: int64 sums wrap to 0."""
    counts = np.zeros((2048, 1, 4), dtype=np.int64)
    counts[:, 0, 0] = 2**53
    save_counts_trace(CountsTrace(counts[:1]), d / "c.npz")  # one step: valid; then widened
    _npz(d / "c.npz", counts=counts, meta=np.array("{}"))
    return d / "c.npz"


def silent_counts_summing_past_2_53_solve(d):
    return ["solve", "--counts", _wrapping_counts(d), "--gpus", "2", "--redundant", "2"]


def silent_counts_summing_past_2_53_export(d):
    return ["export", "--format", "sglang", "--counts", _wrapping_counts(d),
            "--num-model-layers", "1", "--out", d / "o.json"]


def _request_file(d, **change):
    """A valid request file with `change`d arrays."""
    from eplbsim.traces.request_synth import synthesize_requests
    from eplbsim.traces.requests import save_requests
    save_requests(synthesize_requests("requests", layers=2, experts=8, top_k=2, seed=0,
                                      num_requests=3), d / "r.npz")
    arrays = dict(np.load(d / "r.npz"))
    arrays.update(change)
    return _npz(d / "r.npz", **arrays)


def silent_request_prompt_len_fraction(d):
    return ["trace", "info", _request_file(d, prompt_len=np.array([2.7, 3.0, 4.0]))]


def silent_request_prompt_len_boolean(d):
    return ["trace", "info", _request_file(d, prompt_len=np.array([True, True, True]))]


def silent_request_experts_fraction(d):
    return ["trace", "info", _request_file(d, num_experts=np.array(8.7))]


def silent_request_arrival_1e19(d):
    return ["trace", "info", _request_file(d, arrival=np.array([1e19, 0.0, 0.0]))]


def traceback_request_offsets_as_floats(d):
    with np.load(_request_file(d)) as valid:
        offsets = valid["offsets"].astype(np.float64)
    return ["trace", "info", _request_file(d, offsets=offsets)]


def traceback_request_arrival_as_text(d):
    return ["trace", "info", _request_file(d, arrival=np.array(["a", "b", "c"]))]


def silent_loads_mixing_booleans_and_floats(d):
    (d / "load.json").write_text(json.dumps([[1.5, True, 3, 4]]))  # numpy reads them as floats
    return ["solve", "--load", d / "load.json", "--gpus", "2"]


def silent_expert_bytes_1e20(d):
    return ["run", *SIZES, "--rebalance-every", "1", "--expert-bytes", str(10**20)]


def traceback_bench_replay_of_2_40_steps_and_tokens(d):
    return ["bench", "--n", "1e3", "--no-end-to-end", "--replay-steps", str(2**40),
            "--replay-tokens", str(2**40)]


def silent_vllm_true_as_an_id(d):
    (d / "v.json").write_text(json.dumps({
        "id": "r", "object": "chat.completion", "prompt_routed_experts": [[[0, True]]],
        "choices": [{"index": 0, "routed_experts": [[[1, 2]]]}]}))
    return ["trace", "info", d / "v.json"]


def silent_csv_id_with_an_underscore(d):
    (d / "c.csv").write_text("layer,expert,count\n0,1_0,5\n0,0,1\n")
    return ["solve", "--counts", d / "c.csv", "--gpus", "1"]


def hangs_fifo_named_like_a_log(d):
    os.mkfifo(d / "routes")
    return ["trace", "info", d / "routes"]


def _vllm_arrays(d):
    """A folder of per-request vLLM routing arrays."""
    (d / "reqs").mkdir()
    for i in range(2):
        np.save(d / "reqs" / f"{i}.npy", _trace().step(i).numpy().astype(np.int16))
    return d / "reqs"


def inputs_destroyed_run_out_into_a_request_folder(d):
    folder = _vllm_arrays(d)
    return ["run", "--requests", folder, "--gpus", "2", "--out", folder]


def inputs_destroyed_sweep_out_into_its_request_folder(d):
    _vllm_arrays(d)
    (d / "s.toml").write_text('[fixed]\nrequests = "reqs"\ngpus = 2\n')
    return ["sweep", d / "s.toml", "--out", d / "reqs"]


def traceback_template_of_1e21_rows(d):
    return ["run", "--scenario", "template", "-o", "template_len=1000000000000000000000"]


def traceback_requests_scenario_of_1e21_requests(d):
    return ["run", "--requests", "requests", "-o", "num_requests=1000000000000000000000"]


def traceback_requests_scenario_of_1e300_tokens(d):
    return ["run", "--requests", "requests", "-o", "prompt_mean=1e300"]


def silent_flag_abbreviation(d):  # --gpus is not --gpus-per-node
    return ["ranks", "--world-size", "2", "--gpus", "2"]


def silent_efficiency_above_one(d):
    return ["run", *SIZES, "--cost", "roofline", "--cost-option", "eta_compute=2"]


def silent_dp_on_a_step_trace(d):
    save_trace(_trace(), d / "t.npz")
    return ["trace", "info", d / "t.npz", "--dp", "2"]


def silent_log_key_on_an_npz(d):
    save_trace(_trace(), d / "t.npz")
    return ["run", "--trace", d / "t.npz", "--token-key", "t"]


def traceback_bench_n_1e20(d):
    return ["bench", "--n", "1e20", "--no-replay"]


def traceback_bench_seed_2_64(d):
    return ["bench", "--seed", str(2**64), "--n", "1e3", "--no-replay"]


def traceback_graph_size_1e20(d):
    return ["run", "--requests", "requests", "--graph-sizes", "1,100000000000000000000"]


DIGITS_310 = "9" * 310  # a count no float holds: the checks refuse it, naming the flag


def traceback_steps_of_310_digits(d):
    return ["run", "--steps", DIGITS_310]


def traceback_window_of_310_digits(d):
    return ["run", "--rebalance-every", "4", "--window", DIGITS_310]


def traceback_scenario_option_of_310_digits(d):
    return ["run", "--scenario", "drift", "-o", f"period={DIGITS_310}"]


def traceback_workers_of_310_digits(d):
    return ["run", *SIZES, "--workers", DIGITS_310]


def traceback_arrival_rate_beyond_a_float(d):
    return ["run", "--requests", "requests", "--arrival-rate", DIGITS_310]


def traceback_file_name_too_long(d):
    return ["run", "--trace", d / ("a" * 300 + ".npz")]


def inputs_destroyed_convert_over_a_users_folder(d):
    save_trace(_trace(), d / "t.npz")
    (d / "mine").mkdir()
    (d / "mine" / "notes.txt").write_text("the user's")
    return ["trace", "convert", d / "t.npz", "--out", d / "mine"]


def inputs_destroyed_convert_over_a_users_file(d):
    save_trace(_trace(), d / "t.npz")
    _npz(d / "weights.npz", w=np.ones(3))
    return ["trace", "convert", d / "t.npz", "--out", d / "weights.npz"]


def inputs_destroyed_run_out_onto_a_request_file(d):
    (d / "results.json").write_text(json.dumps({
        "id": "r", "object": "chat.completion", "prompt_routed_experts": [[[0, 1]], [[2, 3]]],
        "choices": [{"index": 0, "routed_experts": [[[1, 2]]]}]}))
    return ["run", "--requests", d / "results.json", "--gpus", "2", "--out", d]


CASES = [fn for name, fn in sorted(globals().items()) if name.split("_")[0] in
         ("inputs", "silent", "hangs", "traceback", "late")]
# cases that could block or allocate without the checks: run apart, under a timeout
SUBPROCESS = {"hangs"}


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_each_case_is_refused_in_one_line(case, tmp_path, capsys):
    argv = [str(a) for a in case(tmp_path)]
    before = _digest(tmp_path)
    start = time.monotonic()
    if case.__name__.split("_")[0] in SUBPROCESS:
        done = subprocess.run([sys.executable, "-m", "eplbsim.cli", *argv], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        code, err = done.returncode, done.stderr
        limit = TIME_LIMIT + 20  # the interpreter and torch start first
    else:
        code, _, err = run(capsys, *argv)
        limit = TIME_LIMIT
    seconds = time.monotonic() - start
    lines = err.strip().splitlines()
    assert code == 2, (case.__name__, code, err[-2000:])
    assert "Traceback" not in err and "internal error" not in err, err
    usage = lines[0].startswith("usage:") and len(lines) == 2
    assert len(lines) == 1 or usage, lines
    assert lines[-1].startswith("eplbsim: error:"), lines
    assert "pickle" not in err and "weights_only" not in err, "never advise an unsafe load"
    assert seconds < limit, f"{case.__name__} took {seconds:.1f} s"
    assert _digest(tmp_path) == before, "an input changed"


# ----------------------------------------------------------------------------- accepted inputs

def test_large_source_ranks_survive_a_round_trip(tmp_path):
    trace = _trace()
    src = np.full(trace.num_tokens, 40000)
    wide = Trace(trace.topk_ids, trace.step_offsets, 8, src, {})
    save_trace(wide, tmp_path / "w.npz")
    assert int(open_trace(tmp_path / "w.npz").src_rank.max()) == 40000
    save_trace_dir(wide, tmp_path / "w")
    assert int(open_trace(tmp_path / "w").step_src_rank(0).max()) == 40000


def test_big_endian_ids_are_read_as_their_values(tmp_path, capsys):
    trace = _trace()
    arrays = _trace_arrays(topk_ids=trace.topk_ids.numpy().astype(">i2"),
                           step_offsets=trace.step_offsets.numpy().astype(">i8"))
    swapped = open_trace(_npz(tmp_path / "be.npz", **arrays))
    assert np.array_equal(swapped.topk_ids.numpy(), trace.topk_ids.numpy())
    save_trace_dir(trace, tmp_path / "d")
    ids = np.load(tmp_path / "d" / "topk_ids.npy")
    np.save(tmp_path / "d" / "topk_ids.npy", ids.astype(">i2"))
    args = ["--policies", "row", "--mode", "none", "--gpus", "4", "--json"]
    code, native, _ = run(capsys, "run", "--trace", _npz(tmp_path / "n.npz", **_trace_arrays()),
                          *args)
    assert code == 0
    for path in (tmp_path / "be.npz", tmp_path / "d"):
        code, out, err = run(capsys, "run", "--trace", path, *args)
        assert code == 0 and json.loads(out)[0]["gpu_imbalance"] == \
            json.loads(native)[0]["gpu_imbalance"], err


def test_a_sweeps_request_file_is_read_beside_the_spec(tmp_path, monkeypatch):
    from eplbsim.traces.request_synth import synthesize_requests
    from eplbsim.traces.requests import save_requests
    (tmp_path / "spec").mkdir()
    save_requests(synthesize_requests("requests", layers=2, experts=8, top_k=2, seed=0,
                                      num_requests=4), tmp_path / "spec" / "r.npz")
    (tmp_path / "spec" / "s.toml").write_text('[fixed]\nrequests = "r.npz"\n')
    monkeypatch.chdir(tmp_path)  # a working folder without r.npz
    cell, = read_spec(tmp_path / "spec" / "s.toml").cells
    assert cell.values["requests"] == str(tmp_path / "spec" / "r.npz")


def test_convert_replaces_what_it_wrote_and_anything_with_force(tmp_path, capsys):
    save_trace(_trace(), tmp_path / "t.npz")
    for out in ("d", "d", "o.npz", "o.npz", "o.jsonl", "o.jsonl"):  # each twice: rewritten
        assert run(capsys, "trace", "convert", tmp_path / "t.npz", "--out", tmp_path / out)[0] == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    code, _, err = run(capsys, "trace", "convert", tmp_path / "t.npz", "--out",
                       tmp_path / "mine", "--force")
    assert code == 0 and not (tmp_path / "mine" / "notes.txt").exists(), err


def _npy_with_header(arr, pad):
    """`arr` as .npy bytes (format 2.0) whose header is padded with `pad` spaces: valid."""
    head = repr({"descr": np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": False,
                 "shape": arr.shape}) + " " * pad
    head += " " * ((64 - (len(head) + 13) % 64) % 64) + "\n"
    return (b"\x93NUMPY\x02\x00" + len(head).to_bytes(4, "little") + head.encode("latin1")
            + arr.tobytes())


@pytest.mark.parametrize("pad,ok", [(12_000, True), (1 << 21, False)])
def test_a_long_npy_header_is_read_or_refused_without_pickle_advice(tmp_path, capsys, pad, ok):
    arrays = _trace_arrays()
    path = tmp_path / "long.npz"
    with zipfile.ZipFile(path, "w") as z:
        for name, arr in arrays.items():
            z.writestr(f"{name}.npy", _npy_with_header(arr, pad if name == "topk_ids" else 0))
    code, out, err = run(capsys, "trace", "info", path)
    assert (code == 0) == ok, err
    assert "pickle" not in err and (ok or "header is longer than the 1048576 bytes" in err)


@pytest.mark.parametrize("make,match", [
    (lambda d: (d / "x.json").write_text('{"a": 1}') and d / "x.json",
     "x.json: holds no list of expert ids"),
    (lambda d: (save_trace_dir(_trace(), d / "t"), (d / "t" / "topk_ids.npy").unlink())
     and d / "t", "topk_ids.npy: missing (a trace directory needs"),
])
def test_a_file_of_no_trace_form_is_named_for_what_it_lacks(tmp_path, capsys, make, match):
    path = make(tmp_path)
    code, _, err = run(capsys, "run", "--trace", path)
    assert code == 2 and match in err, err


def test_a_phase_longer_than_the_trace_is_all_prefill(capsys):
    code, out, err = run(capsys, "run", *SIZES, "--scenario", "phases", "-o",
                         "phase_len=1000000000000000000000", "--policies", "row", "--mode",
                         "none")
    assert code == 0 and "2 steps x 16 tokens" in out, err  # both steps prefill-sized


def test_defaults_fit_the_values_given(capsys):
    code, out, err = run(capsys, "run", "--gpus", "2", "--steps", "2", "--tokens", "16",
                         "--policies", "row", "--mode", "none")
    assert code == 0, err  # 8 GPUs per node gives way to 2 GPUs on one node
    code, out, err = run(capsys, "run", "--gpus", "16", "--steps", "2", "--tokens", "16",
                         "--policies", "row", "--mode", "none")
    assert code == 0 and "16 GPUs (8/node)" in out
    code, out, err = run(capsys, "run", "--gpus", "3", "--steps", "2", "--tokens", "16",
                         "--policies", "row", "--mode", "none")
    assert code == 0 and "P=81 slots (redundant 17: the default 16" in out  # 80 would not fit


def test_json_output_is_strict_json(tmp_path, capsys):
    (tmp_path / "load.json").write_text(json.dumps([[0, 0, 0, 0]]))  # nothing to balance
    code, out, err = run(capsys, "solve", "--load", tmp_path / "load.json", "--gpus", "2",
                         "--json")
    strict = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert code == 0 and strict["placement_gap"] is None
    code, out, _ = run(capsys, "solve", "--load", tmp_path / "load.json", "--gpus", "2")
    assert code == 0 and "placement_gap -" in out
    ids = _trace().topk_ids.numpy().astype(np.int16)
    ids[:, 1] = -1  # layer 1 routes nothing: its skew is undefined
    path = _npz(tmp_path / "pad.npz", **_trace_arrays(topk_ids=ids))
    code, out, _ = run(capsys, "trace", "info", path, "--json")
    info = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert code == 0 and info["layer_skew"][1]["max_over_mean"] is None


def test_internal_errors_say_so_in_one_line(monkeypatch, capsys):
    from eplbsim.cli import run as run_command
    monkeypatch.setattr(run_command, "compare", lambda *a, **k: 1 / 0)
    code, _, err = run(capsys, "run", *SIZES)
    assert code == 4 and err.strip().splitlines() == [  # not 1: review's "not recommended"
        "eplbsim: internal error, please report it (ZeroDivisionError: division by zero); "
        "EPLBSIM_DEBUG=1 shows the traceback"]
    monkeypatch.setenv("EPLBSIM_DEBUG", "1")
    assert run(capsys, "run", *SIZES)[2].startswith("Traceback")


def test_torch_running_out_of_memory_is_said_as_out_of_memory(monkeypatch, capsys):
    """An allocation the checks let through and torch's CPU allocator cannot make (a
    RuntimeError, not a MemoryError) reads as out of memory, not as an internal error."""
    from eplbsim.cli import run as run_command
    monkeypatch.setattr(run_command, "compare",
                        lambda *a, **k: torch.empty(2**60, dtype=torch.uint8))
    code, _, err = run(capsys, "run", *SIZES)
    assert code == 2 and err.strip().splitlines() == [err.strip()], err
    assert err.startswith("eplbsim: error: out of memory: eplbsim run asks for more than")


def test_memory_cap_refuses_what_would_not_fit(monkeypatch, capsys):
    monkeypatch.setenv("EPLBSIM_MAX_MEMORY", "1M")
    code, _, err = run(capsys, "run", "--steps", "64", "--tokens", "4096")
    assert code == 2 and "more than the 1.0 MiB available" in err and "fewer steps" in err


# ----------------------------------------------------------------------------- fuzz

def _valid_inputs(folder: Path) -> dict[str, Path]:
    """One valid input of every format in `folder`."""
    trace = _trace()
    save_trace(trace, folder / "t.npz")
    save_trace_dir(trace, folder / "d")
    lines = [json.dumps({"step": s, "layer": layer,
                         "topk_ids": trace.step(s)[:, layer].tolist()})
             for s in range(trace.num_steps) for layer in range(trace.num_layers)]
    (folder / "t.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "c.csv").write_text("model,layer,expert,count\n" + "".join(
        f"a,{layer},{e},{(e * 7 + layer) % 5}\n" for layer in range(2) for e in range(8)))
    save_counts_trace(CountsTrace(trace.counts().numpy()), folder / "c.npz")
    (folder / "p.json").write_text(json.dumps({"phy2log": [list(range(8)) + [0, 1, 2, 3]] * 2}))
    (folder / "s.toml").write_text("[grid]\nscenario = ['skewed']\npolicy = ['row']\n[fixed]\n"
                                   "steps = 2\ntokens = 8\nlayers = 2\nexperts = 8\ntop_k = 2\n"
                                   "gpus = 4\nredundant = 4\n")
    torch.save({"logical_count": trace.counts(),  # [B, L, E] rows of SGLang's ring buffer
                "average_utilization_rate_over_window": 0.5}, folder / "stat.pt")
    return {"pt": folder / "stat.pt", "npz": folder / "t.npz",
            "dir": folder / "d" / "topk_ids.npy", "offsets": folder / "d" / "step_offsets.npy",
            "meta": folder / "d" / "meta.json", "jsonl": folder / "t.jsonl",
            "csv": folder / "c.csv", "counts": folder / "c.npz", "json": folder / "p.json",
            "toml": folder / "s.toml", **_engine_logs(folder, trace)}


def _engine_logs(folder: Path, trace: Trace) -> dict[str, Path]:
    """One valid input of every engine's log and request form, written by the writers of each
    reader's own tests; the file the fuzz mutates, by kind."""
    from eplbsim.traces.request_synth import synthesize_requests
    from eplbsim.traces.requests import save_requests
    from log_writers import vllm_split as _split
    from log_writers import write_flame_layer as _layer_file
    from log_writers import write_megatron_rank as _rank_file
    from log_writers import write_safetensors as _safetensors
    ids = [trace.step(s).numpy() for s in range(trace.num_steps)]  # [T, L, K] each
    (folder / "v.json").write_text(json.dumps(_split("r", ids[0], [ids[1], ids[2]])))
    records = [{"type": "meta", "model": "m"}] + [
        {"type": "route", "token_idx": t, "topk_ids": row.tolist()}
        for step in ids for t, row in enumerate(step)]
    (folder / "tok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "m").mkdir()
    _rank_file(folder / "m", 0, ids)
    (folder / "tr").mkdir()
    (folder / "tr" / "meta_info.json").write_text(json.dumps({"num_experts": 8,
                                                             "num_experts_per_token": 2}))
    _safetensors(folder / "tr" / "rank0.safetensors",
                 {f"{s}_{layer}": trace.counts()[s, layer].numpy().astype(np.int64)
                  for s in range(trace.num_steps) for layer in range(trace.num_layers)})
    (folder / "fl").mkdir()
    for layer in range(trace.num_layers):
        _layer_file(folder / "fl" / f"layer_{layer:02d}.parquet",
                    np.concatenate(ids)[:, layer].astype(np.int16))
    save_requests(synthesize_requests("requests", layers=2, experts=8, top_k=2, seed=0,
                                      num_requests=3), folder / "r.npz")
    (folder / "sf.toml").write_text('[fixed]\ntrace = "t.npz"\nplacement = "p.json"\n'
                                    '[grid]\npolicy = ["row", "ordinal"]\n')
    (folder / "va").mkdir()
    for i, step in enumerate(ids):  # each .npy: one request's prompt then output rows
        np.save(folder / "va" / f"{i}.npy", step.astype(np.int16))
    return {"vllm": folder / "v.json", "tokens": folder / "tok.jsonl",
            "megatron": folder / "m" / "router_trace_rank0.jsonl",
            "trtllm": folder / "tr" / "rank0.safetensors",
            "trtllm_meta": folder / "tr" / "meta_info.json",
            "flame": folder / "fl" / "layer_01.parquet", "requests": folder / "r.npz",
            "sweep_files": folder / "sf.toml", "vllm_arrays": folder / "va" / "1.npy"}


def _command(kind: str, files: dict[str, Path]) -> list[str]:
    """The command that reads the input of `kind`."""
    if kind in ("npz", "dir", "offsets", "meta", "jsonl"):
        target = files["npz"] if kind == "npz" else files["jsonl"] if kind == "jsonl" else \
            files["dir"].parent
        return ["trace", "info", str(target)]
    if kind in ("vllm", "requests", "megatron", "flame"):
        target = files[kind].parent if kind in ("megatron", "flame") else files[kind]
        return ["trace", "info", str(target)]
    if kind == "tokens":
        return ["trace", "info", str(files[kind]), "--skip-type", "meta"]
    if kind == "vllm_arrays":
        return ["trace", "info", str(files[kind].parent), "--prompt-len", "4"]
    if kind in ("trtllm", "trtllm_meta"):
        return ["solve", "--counts", str(files[kind].parent), "--gpus", "2"]
    if kind == "pt":
        return ["trace", "import-sglang", str(files["pt"]), "--out",
                str(files["pt"].parent / "imported.npz")]
    if kind in ("csv", "counts"):
        return ["solve", "--counts", str(files[kind]), "--gpus", "2", "--redundant", "0"]
    return ["run", "--trace", str(files["npz"]), "--gpus", "4", "--redundant", "4",
            "--policies", "row", "--mode", "none", "--rebalance-every", "1", "--initial",
            str(files["json"])]


KINDS = ["npz", "dir", "offsets", "meta", "jsonl", "csv", "counts", "json", "toml", "pt", "vllm",
         "tokens", "megatron", "trtllm", "trtllm_meta", "flame", "requests", "sweep_files",
         "vllm_arrays"]


def test_every_fuzzed_input_is_read_before_it_is_mutated(tmp_path, capsys):
    files = _valid_inputs(tmp_path)
    for kind in KINDS:
        if kind in ("toml", "sweep_files"):
            assert read_spec(files[kind]).cells, kind
            continue
        code, _, err = run(capsys, *_command(kind, files))
        assert code == 0, (kind, err)


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(KINDS))
    how = draw(st.sampled_from(["truncate", "flip", "flips"]))
    return kind, how, draw(st.floats(0, 1)), draw(st.lists(st.integers(0, 2**31), min_size=1,
                                                           max_size=8))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mutations())
def test_mutated_files_are_read_or_refused_cleanly(case, tmp_path_factory, capsys):
    kind, how, where, positions = case
    folder = tmp_path_factory.mktemp("fuzz")
    files = _valid_inputs(folder)
    data = bytearray(files[kind].read_bytes())
    if how == "truncate":
        data = data[:int(where * len(data))]
    else:
        for p in positions[:1 if how == "flip" else None]:
            data[p % len(data)] ^= 1 << (p % 8)
    files[kind].write_bytes(bytes(data))
    before = {k: v for k, v in _digest(folder).items() if k != "imported.npz"}
    start = time.monotonic()
    if kind in ("toml", "sweep_files"):  # a sweep would run its cells: read the spec only
        try:
            read_spec(files[kind])
        except InputError as exc:
            assert "\n" not in str(exc)
    else:
        code, _, err = run(capsys, *_command(kind, files))
        assert code in (0, 2), err
        assert code == 0 or (len(err.strip().splitlines()) == 1 and "Traceback" not in err)
    assert time.monotonic() - start < TIME_LIMIT
    assert {k: v for k, v in _digest(folder).items() if k != "imported.npz"} == before


# the options a run takes as KEY=VALUE, with the settings that make each apply
OPTIONS = {"--cost-option": (["eta_compute", "eta_memory", "framework", "version"],
                             ["--cost", "roofline"]),
           "--solver-option": (["z", "depth", "width", "history"],
                               ["--solver", "flashlb-paper"]),  # the paper's FlashLB: all four
           "-o": (["sigma", "drift"], ["--scenario", "skewed"])}
TEXTS = st.one_of(st.integers(-2**70, 2**70).map(str), st.floats().map(repr),
                  st.sampled_from(["true", "false", "null", "nan", "1e400", "-0", "1_0", "0x10",
                                   "[1]", '{"a": 1}', '"text"', ""]),
                  st.text(max_size=6))


@st.composite
def option_values(draw):
    flag = draw(st.sampled_from(sorted(OPTIONS)))
    names, settings_ = OPTIONS[flag]
    return flag, draw(st.sampled_from(names + ["nope"])), draw(TEXTS), settings_


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=option_values())
def test_any_option_value_is_taken_or_refused_in_one_line(case, capsys):
    flag, key, text, needs = case
    start = time.monotonic()
    code, _, err = run(capsys, "run", *SIZES, *needs, "--policies", "row", "--mode", "none",
                       flag, f"{key}={text}")
    assert code in (0, 2), err
    assert code == 0 or (len(err.strip().splitlines()) == 1 and "Traceback" not in err), err
    assert "internal error" not in err
    assert time.monotonic() - start < TIME_LIMIT


@st.composite
def reshaped_arrays(draw):
    """A trace's arrays with one changed in dtype, shape or declared size."""
    field = draw(st.sampled_from(["topk_ids", "step_offsets", "src_rank", "meta"]))
    change = draw(st.sampled_from(["dtype", "shape", "huge"]))
    dtype = draw(st.sampled_from([np.float32, np.uint64, np.int8, np.bool_, np.complex64,
                                  np.uint16]))
    return field, change, dtype, draw(st.integers(1, 4))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=reshaped_arrays())
def test_arrays_of_another_dtype_shape_or_size_are_refused_cleanly(case, tmp_path_factory,
                                                                   capsys):
    field, change, dtype, n = case
    arrays = _trace_arrays(src_rank=np.zeros(24, np.int16))
    if field == "meta":
        big = {"dtype": 8.5, "shape": [8], "huge": 10**(6 + n)}[change]
        arrays["meta"] = _meta(num_experts=big)
    elif change == "dtype":
        arrays[field] = arrays[field].astype(dtype)
    elif change == "shape":
        arrays[field] = arrays[field].reshape(-1)[:arrays[field].size // n * n].reshape(n, -1) \
            if n > 1 else arrays[field][..., None]
    else:
        arrays[field] = np.concatenate([arrays[field].reshape(-1)] * (n + 1))
    path = _npz(tmp_path_factory.mktemp("arrays") / "t.npz", **arrays)
    code, _, err = run(capsys, "trace", "info", path)
    assert code in (0, 2) and "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1


def test_an_object_array_is_never_unpickled(tmp_path, capsys):
    arrays = _trace_arrays()
    arrays["src_rank"] = np.array([{"a": 1}] * 24, dtype=object)
    with open(tmp_path / "o.npz", "wb") as f:
        np.savez(f, **arrays)  # numpy pickles the object array
    code, _, err = run(capsys, "trace", "info", tmp_path / "o.npz")
    assert code == 2 and "never unpickles" in err and "allow_pickle" not in err


@pytest.mark.parametrize("argv,flag", [(["--steps", DIGITS_310], "--steps"),
                                       (["-o", f"sigma={DIGITS_310}"], "'sigma'"),
                                       (["--arrival-rate", DIGITS_310], "--arrival-rate")])
def test_a_number_too_long_to_read_is_named_with_its_flag_not_echoed(argv, flag, capsys):
    needs = ["--requests", "requests"] if flag == "--arrival-rate" else []
    code, _, err = run(capsys, "run", *needs, *argv)
    assert code == 2 and flag in err and DIGITS_310 not in err
    assert "310" in err and "OverflowError" not in err
