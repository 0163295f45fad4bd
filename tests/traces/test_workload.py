"""Requests -> steps (`traces.workload`): step compositions known exactly, row by row.

Every token of the hand-built requests routes (one layer, top-1) to expert `10 r + t` for
request `r` and token `t`, so each row of the batched trace says which token it is.
Dimensions: `R` requests, `T` rows, `L` layers, `K` top-k, `E` experts.
"""

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.requests import load_requests, requests_of, save_requests
from eplbsim.traces.workload import DP_PAD, GRAPH_PAD, Workload, batch

E = 256


def _requests(*shapes, arrivals=None):
    """Requests of `(prompt, output)` lengths, token `t` of request `r` on expert `10 r + t`."""
    ids = [np.array([10 * r + t for t in range(p + o)]).reshape(-1, 1, 1)
           for r, (p, o) in enumerate(shapes)]
    return requests_of(ids, [p for p, _ in shapes], E, arrivals)


def _steps(batched):
    """Each step's rows as `request.token` strings (`pad` for -1 rows, `pad:e` for routed)."""
    t = batched.trace
    out = []
    for s in range(t.num_steps):
        lo, hi = int(t.step_offsets[s]), int(t.step_offsets[s + 1])
        rows = []
        for i in range(lo, hi):
            if batched.request[i] < 0:
                e = int(t.topk_ids[i, 0, 0])
                rows.append("pad" if e < 0 else f"pad:{e}")
            else:
                assert int(t.topk_ids[i, 0, 0]) == 10 * batched.request[i] + batched.token[i]
                rows.append(f"{batched.request[i]}.{batched.token[i]}")
        out.append(rows)
    return out


def test_continuous_batching_admits_chunks_and_decodes_in_engine_order():
    # A (0): prompt 5, output 2; B (1): 2, 1; C (2): 1, 1; at most 4 tokens and 2 requests a
    # step, chunks of 3. C waits until B leaves; a request decodes the step after its prompt.
    reqs = _requests((5, 2), (2, 1), (1, 1))
    w = Workload(max_batched_tokens=4, max_running=2, chunk=3)
    assert _steps(batch(reqs, w)) == [["0.0", "0.1", "0.2", "1.0"], ["0.3", "0.4", "1.1"],
                                      ["0.5", "1.2"], ["0.6", "2.0"], ["2.1"]]
    later = batch(reqs, Workload(max_batched_tokens=4, max_running=2, chunk=3,
                                 order="prefill-first"))
    assert _steps(later)[3] == ["2.0", "0.6"]  # the same work, prefill rows first
    assert later.trace.src_rank is None
    assert later.trace.meta["workload"]["order"] == "prefill-first"


def test_arrivals_wait_idle_steps_are_skipped_and_poisson_is_seeded():
    reqs = _requests((1, 1), (1, 1), arrivals=[0.0, 5.5])
    steps = _steps(batch(reqs, Workload(arrivals="trace")))
    assert steps == [["0.0"], ["0.1"], ["1.0"], ["1.1"]]  # request 1 from step 6; 2..5 idle
    many = _requests(*[(2, 3)] * 20)
    a, b = (batch(many, Workload(arrivals="poisson", rate=0.5, seed=7)) for _ in range(2))
    assert torch.equal(a.trace.topk_ids, b.trace.topk_ids)
    c = batch(many, Workload(arrivals="poisson", rate=0.5, seed=8))
    assert not torch.equal(a.trace.step_offsets, c.trace.step_offsets) or \
        not torch.equal(a.trace.topk_ids, c.trace.topk_ids)


def test_dp_attention_layouts_row_by_row():
    # three requests of prompt 1, output 2; round robin: rank 0 has requests 0 and 2, rank 1
    # has request 1
    reqs = _requests((1, 2), (1, 2), (1, 2))
    summed = batch(reqs, Workload(dp=2, dp_layout="sum"))
    assert _steps(summed) == [["0.0", "2.0", "1.0"], ["0.1", "2.1", "1.1"],
                              ["0.2", "2.2", "1.2"]]
    assert summed.trace.src_rank.tolist() == [0, 0, 1] * 3
    padded = batch(reqs, Workload(dp=2, dp_layout="max"))
    assert _steps(padded) == [["0.0", "2.0", "1.0", "pad"], ["0.1", "2.1", "1.1", "pad"],
                              ["0.2", "2.2", "1.2", "pad"]]
    assert padded.trace.src_rank.tolist() == [0, 0, 1, 1] * 3
    assert (padded.kind == DP_PAD).sum() == 3
    sglang = batch(reqs, Workload(dp=2, dp_layout="sglang"))  # sum at prefill, max at decode
    assert _steps(sglang) == [_steps(summed)[0]] + _steps(padded)[1:]
    least = batch(_requests((4, 1), (1, 1), (1, 1)), Workload(dp=2, dp_assign="least-loaded"))
    assert least.dp_rank[least.request == 2].tolist() == [1, 1]  # rank 1 had fewer tokens


def test_cuda_graph_padding_masked_or_routed():
    reqs = _requests((1, 3), (1, 3), (1, 3))  # decode steps of 3 rows -> graph size 4
    sizes = (1, 2, 4, 8)
    masked = batch(reqs, Workload(graph_sizes=sizes))
    assert _steps(masked) == [["0.0", "1.0", "2.0"]] + [
        [f"{r}.{t}" for r in range(3)] + ["pad"] for t in (1, 2, 3)]
    assert (masked.kind == GRAPH_PAD).sum() == 3
    routed = batch(reqs, Workload(graph_sizes=sizes, padding="routed", seed=3))
    phantom = {row[-1] for row in _steps(routed)[1:]}
    assert len(phantom) == 1 and phantom.pop().startswith("pad:")  # one fixed set, every step
    again = batch(reqs, Workload(graph_sizes=sizes, padding="routed", seed=3))
    assert torch.equal(routed.trace.topk_ids, again.trace.topk_ids)
    eager = batch(_requests(*[(1, 2)] * 9), Workload(graph_sizes=sizes))  # 9 > 8: no graph
    assert (eager.kind == GRAPH_PAD).sum() == 0
    dp = batch(reqs, Workload(dp=2, dp_layout="max", graph_sizes=sizes))
    # decode steps: rank 0 has 2 rows, rank 1 one; both padded to the graph size of 2
    assert _steps(dp)[1] == ["0.1", "2.1", "1.1", "pad"]
    assert dp.kind[dp.request < 0].tolist().count(GRAPH_PAD) == 3


def _hot_requests(n, prompt, output, seed=0):
    """Requests on 16 experts, top-2 over 2 layers, expert 0 in every token."""
    rng = np.random.default_rng(seed)
    ids = []
    for _ in range(n):
        other = rng.integers(1, 16, (prompt + output, 2, 1))
        ids.append(np.concatenate([np.zeros_like(other), other], -1))
    return requests_of(ids, [prompt] * n, 16)


def test_routed_padding_heats_phantom_experts_and_masked_padding_changes_no_load():
    # 3 requests decoding together pad to the captured size 8: 5 padded rows a decode step
    rng = np.random.default_rng(0)
    ids = [np.stack([[rng.permutation(16)[:2] for _ in range(2)] for _ in range(10)])
           for _ in range(3)]
    reqs = requests_of(ids, [2] * 3, 16)
    plain = batch(reqs, Workload()).trace
    masked = batch(reqs, Workload(graph_sizes=(8,))).trace
    routed = batch(reqs, Workload(graph_sizes=(8,), padding="routed", seed=1)).trace
    assert torch.equal(plain.counts().sum(0), masked.counts().sum(0))
    load = routed.counts().sum(0)  # [L, E]
    added = load - plain.counts().sum(0)
    assert (added.sum(-1) == 5 * 2 * 8).all()  # 5 padded rows x top-2 x 8 decode steps
    phantom = added.topk(2, -1).indices  # the fixed set of each layer
    assert set(load.topk(2, -1).indices.flatten().tolist()) == \
        set(phantom.flatten().tolist())  # the hottest experts are the phantom ones
    spec = RunSpec.of(gpus=4, redundant=0, solver="trivial", policy="ordinal")
    imbalance = {name: replay(t, spec).metrics["gpu_imbalance"]
                 for name, t in (("plain", plain), ("masked", masked), ("routed", routed))}
    assert imbalance["masked"] == imbalance["plain"] < imbalance["routed"]


def test_dp_max_layout_moves_row_dispatch_and_not_ordinal():
    # 3 DP ranks, round robin over 4 requests: rank 0 decodes 2 rows a step, ranks 1 and 2 one
    # each. The hot expert (in every token) has 2 replicas. The sum layout gathers rows 0..3,
    # which `row` splits 2:2; the max layout pads each rank to 2 rows, so rank 2's row moves to
    # 4 and the split becomes 3:1 every decode step. `ordinal` stays within one pair of even.
    reqs = _hot_requests(4, 1, 8, seed=2)
    slots = [0, 1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2, 3]
    placement = Placement(torch.tensor([slots, slots]), 16, Topology(4))
    spec = RunSpec.of(gpus=4, redundant=4, placement=placement)
    hot = placement.log2phy[0, 0, :2]
    split, skew = {}, {}
    for layout in ("sum", "max"):
        trace = batch(reqs, Workload(dp=3, dp_layout=layout)).trace
        row, ordinal = (replay(trace, spec.replace(policy=p)) for p in ("row", "ordinal"))
        split[layout] = row.slot_load[1:, 0, hot].sort(-1).values.unique(dim=0).tolist()
        skew[layout] = row.metrics["replica_skew_mean"]
        even = ordinal.slot_load[:, 0, hot]
        assert (even.amax(-1) - even.amin(-1) <= 1).all(), layout
    assert split == {"sum": [[2, 2]], "max": [[1, 3]]}  # every decode step
    assert skew["max"] > skew["sum"] + 0.05, skew


def test_request_files_round_trip_and_bad_requests_are_refused(tmp_path):
    reqs = _requests((2, 1), (1, 3), arrivals=[0.5, None])
    save_requests(reqs, tmp_path / "r.npz")
    back = load_requests(tmp_path / "r.npz")
    assert [r.id for r in back.requests] == ["0", "1"]
    assert [r.arrival for r in back.requests] == [0.5, None]
    assert all(np.array_equal(a.ids, b.ids) and a.prompt_len == b.prompt_len
               for a, b in zip(reqs.requests, back.requests))
    with pytest.raises(InputError, match="ids must lie in"):
        requests_of([np.full((2, 1, 1), 300)], [1], E)
    with pytest.raises(InputError, match="prompt_len must be"):
        requests_of([np.zeros((2, 1, 1), int)], [3], E)
    with pytest.raises(InputError, match="layers, top_k"):
        requests_of([np.zeros((2, 1, 1), int), np.zeros((2, 2, 1), int)], [1, 1], E)
    with pytest.raises(InputError, match="not a request file"):
        np.savez(tmp_path / "x.npz", ids=np.zeros(3))
        load_requests(tmp_path / "x.npz")


@pytest.mark.parametrize("settings, match", [
    ({"max_running": 0}, "max_running must be an integer >= 1"),
    ({"order": "random"}, "unknown order 'random'"),
    ({"graph_sizes": (4, 2)}, "graph sizes must be increasing"),
    ({"rate": 0}, "rate must be a number > 0"),
    ({"dp_layout": "min"}, "unknown dp layout 'min'"),
])
def test_bad_workload_settings_are_refused(settings, match):
    with pytest.raises(InputError, match=match):
        Workload(**settings)


def _token_log(path, with_requests):
    """A per-token log as router-logging patches write it: a header record of another type,
    then one record per (token, layer); the token index restarts at each step (request)."""
    import json
    lines = [{"type": "header", "model": "toy", "layers": 2}]
    for r, n in enumerate((3, 2)):
        for t in range(n):
            for layer in range(2):
                rec = {"type": "route", "tok": t, "layer": layer,
                       "experts": [(r + t + layer) % 8, (r + t + layer + 1) % 8]}
                if with_requests:
                    rec["req"] = f"q{r}"
                    rec["plen"] = n - 1
                lines.append(rec)
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_a_per_token_log_with_a_header_converts_to_steps_or_requests(tmp_path, capsys):
    from cli_helpers import assert_input_error, run
    from eplbsim.traces.formats import open_trace
    log = _token_log(tmp_path / "log.jsonl", with_requests=False)
    assert_input_error(capsys, "trace", "convert", str(log), "--out", str(tmp_path / "x.npz"),
                       match="no field gives the token's index: name it with --token-key")
    keys = ["--token-key", "tok", "--ids-key", "experts", "--skip-type", "header"]
    code, _, _ = run(capsys, "trace", "convert", str(log), "--out", str(tmp_path / "t.npz"),
                     *keys)
    assert code == 0
    trace = open_trace(tmp_path / "t.npz")
    assert trace.tokens_per_step.tolist() == [3, 2]  # steps at the token-index restart
    assert trace.step(1)[1, 1].tolist() == [3, 4]  # request 1, token 1, layer 1
    logged = _token_log(tmp_path / "req.jsonl", with_requests=True)
    code, out, _ = run(capsys, "trace", "convert", str(logged), "--out",
                       str(tmp_path / "r.npz"), *keys, "--request-key", "req",
                       "--prompt-len-key", "plen", "--experts", "8")
    assert code == 0 and "2 requests" in out
    reqs = load_requests(tmp_path / "r.npz")
    assert [(r.id, r.prompt_len, r.output_len) for r in reqs.requests] == [("q0", 2, 1),
                                                                          ("q1", 1, 1)]
    code, out, _ = run(capsys, "trace", "info", str(tmp_path / "r.npz"), "--dp", "2")
    assert code == 0 and "requests 2" in out and "prompt tokens: min 1" in out
    code, out, _ = run(capsys, "run", "--requests", str(tmp_path / "r.npz"), "--policies",
                       "row,ordinal", "--gpus", "2", "--redundant", "0")
    assert code == 0 and "batched" in out
