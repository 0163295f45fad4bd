"""Importing vLLM's per-request routed experts (responses and arrays written in vLLM's layouts)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.traces.formats.vllm import (is_vllm_arrays, is_vllm_json, read_vllm_arrays,
                                         read_vllm_json)
from eplbsim.traces.requests import RequestSet
from log_writers import vllm_split as _split

L, K, E = 3, 2, 8


def _ids(seed: int, n: int) -> np.ndarray:
    """`[n, L, K]` int16 ids, K distinct experts per (token, layer), as vLLM returns them."""
    rng = np.random.default_rng(seed)
    return np.array([[rng.choice(E - 1, K, replace=False) for _ in range(L)]
                     for _ in range(n)], dtype=np.int16).reshape(n, L, K)


def _npy64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _combined(rid: str, prompt_len: int, generated: int, seed: int, token_ids=True) -> dict:
    """A vLLM main completion: one base64 .npy of prompt + generated - 1 rows per choice."""
    rows = _ids(seed, prompt_len + generated - 1)
    choice = {"index": 0, "text": "x", "finish_reason": "length",
              "token_ids": list(range(generated)) if token_ids else None,
              "routed_experts": _npy64(rows)}
    return {"id": rid, "object": "text_completion", "created": 1700000003, "model": "m",
            "choices": [choice], "usage": {"prompt_tokens": prompt_len,
                                           "completion_tokens": generated,
                                           "total_tokens": prompt_len + generated}}


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path


def test_split_layout_makes_one_request_per_choice(tmp_path):
    prompt, outs = _ids(0, 4), [_ids(1, 3), _ids(2, 2)]
    path = _write(tmp_path / "resp.json", _split("chatcmpl-a", prompt, outs))
    assert is_vllm_json(path)
    rs = read_vllm_json(path)
    assert isinstance(rs, RequestSet)
    assert [r.id for r in rs.requests] == ["chatcmpl-a/0", "chatcmpl-a/1"]
    for r, out in zip(rs.requests, outs):
        assert r.prompt_len == 4 and r.output_len == len(out) and r.arrival is None
        assert np.array_equal(r.ids, np.concatenate([prompt, out]))
    assert rs.num_layers == L and rs.top_k == K
    assert rs.num_experts == max(int(a.max()) for a in [prompt, *outs]) + 1
    assert rs.meta["source"] == "vllm" and rs.meta["created"] == [1700000000] * 2
    assert rs.meta["model"] == "m"  # the served model, as the responses name it


def test_the_served_model_reaches_the_batched_trace(tmp_path):
    from eplbsim.traces.workload import Workload, batch
    response = _split("chatcmpl-a", _ids(0, 4), [_ids(1, 3)])
    response["model"] = "Qwen/Qwen1.5-MoE-A2.7B-Chat"
    rs = read_vllm_json(_write(tmp_path / "resp.json", response))
    assert batch(rs, Workload()).trace.meta["model"] == "Qwen/Qwen1.5-MoE-A2.7B-Chat"


def test_either_field_may_be_a_base64_npy(tmp_path):
    prompt, out = _ids(7, 3), _ids(8, 2)
    response = _split("chatcmpl-b", prompt, [out])
    response["prompt_routed_experts"] = _npy64(prompt)
    rs = read_vllm_json(_write(tmp_path / "r.json", response))
    assert rs.requests[0].id == "chatcmpl-b" and rs.requests[0].prompt_len == 3
    assert np.array_equal(rs.requests[0].ids, np.concatenate([prompt, out]))


def test_combined_layout_splits_rows_by_generated_tokens(tmp_path):
    records = [_combined("cmpl-1", 5, 3, seed=1), _combined("cmpl-2", 2, 1, seed=2),
               _combined("cmpl-3", 3, 4, seed=3, token_ids=False)]  # usage decides
    path = _write(tmp_path / "list.json", records)
    rs = read_vllm_json(path, experts=16)
    assert rs.num_experts == 16
    assert [(r.id, r.prompt_len, r.output_len) for r in rs.requests] == \
        [("cmpl-1", 5, 2), ("cmpl-2", 2, 0), ("cmpl-3", 3, 3)]
    assert np.array_equal(rs.requests[0].ids, _ids(1, 7))


def test_jsonl_and_batch_output_lines(tmp_path):
    prompt, out = _ids(4, 2), _ids(5, 2)
    batch = {"id": "vllm-b1", "custom_id": "q7", "error": None,
             "response": {"status_code": 200, "request_id": "vllm-b1",
                          "body": _split("chatcmpl-z", prompt, [out])}}
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(_combined("cmpl-9", 2, 2, seed=6)) + "\n\n" +
                    json.dumps(batch) + "\n")
    rs = read_vllm_json(path)
    assert [r.id for r in rs.requests] == ["cmpl-9", "q7"]
    assert np.array_equal(rs.requests[1].ids, np.concatenate([prompt, out]))
    assert rs.meta["created"] == [1700000003, 1700000000]


def test_detection_is_by_content(tmp_path):
    log = _write(tmp_path / "log.jsonl", {"step": 0, "layer": 0, "topk_ids": []})
    assert not is_vllm_json(log) and not is_vllm_json(_write(tmp_path / "o.json", {"a": 1}))
    assert not is_vllm_json(tmp_path) and not is_vllm_arrays(log)


def _bad(obj, tmp_path, name="bad.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.mark.parametrize("make, match", [
    (lambda: "[1, 2]", r"bad.json: record 0: a response must be a JSON object"),
    (lambda: json.dumps(_combined("c", 2, 2, 0)) + "\n{oops\n", r"bad.json:2: not valid JSON"),
    (lambda: "{oops", r"bad.json: not valid JSON or JSONL"),
    (lambda: {"id": "c", "choices": []}, r"bad.json: choices must be a non-empty list"),
    (lambda: {"choices": [{"routed_experts": []}]}, r"bad.json: the response has no id"),
    (lambda: {"id": "c", "choices": [{"index": 0, "routed_experts": None}]},
     r"bad.json: choice 0 has no routed_experts \(was the server started"),
    (lambda: {"id": "c", "prompt_routed_experts": [[[1, 2]], [[3]]],
              "choices": [{"routed_experts": None}]}, r"bad.json: prompt_routed_experts: ragged"),
    (lambda: {"id": "c", "prompt_routed_experts": [[[1.5, 2.0]]],
              "choices": [{"routed_experts": None}]},
     r"bad.json: prompt_routed_experts: expected integers"),
    (lambda: {"id": "c", "prompt_routed_experts": [[[1, 2]]],
              "choices": [{"routed_experts": [[[1, 2, 3]]]}]},
     r"bad.json: choice 0: routed_experts rows are \[layers, top_k\] = \[1, 3\]"),
    (lambda: {"id": "c", "choices": [{"routed_experts": "not base64!", "token_ids": [1]}]},
     r"bad.json: choice 0 routed_experts: not base64"),
    (lambda: {"id": "c", "choices": [{"routed_experts": _pickled_npy64(), "token_ids": [1]}]},
     r"bad.json: choice 0 routed_experts: not a readable \.npy array \(it holds Python "
     r"objects, which eplbsim never unpickles"),
    (lambda: {"id": "c", "choices": [{"routed_experts": _npy64(_ids(0, 3)),
                                      "token_ids": [1] * 9}]},
     r"bad.json: choice 0: 3 routed rows do not fit 9 generated tokens"),
    (lambda: {"id": "c", "prompt_routed_experts": [[[1, 2]], [[3, 3]]],
              "choices": [{"routed_experts": None}]},
     r"bad.json: prompt_routed_experts: token row 1 routes expert 3 twice in layer 0"),
    (lambda: {"id": "c", "choices": [{"routed_experts": 7, "token_ids": [1]}]},
     r"bad.json: choice 0 routed_experts: expected nested lists or a base64 \.npy string"),
    (lambda: {"id": "c", "choices": [{"routed_experts": _npz64(), "token_ids": [1]}]},
     r"bad.json: choice 0 routed_experts: not a \.npy array \(numpy read a NpzFile\)"),
    (lambda: {"id": "c", "usage": {"prompt_tokens": 1},
              "choices": [{"routed_experts": _npy64(_ids(0, 3)), "token_ids": [1]}]},
     r"bad.json: choice 0: 3 routed rows do not fit 1 generated tokens after a prompt of 1"),
    (lambda: {"id": "c", "choices": [{"routed_experts": _npy64(_ids(0, 3))},
                                     {"routed_experts": _npy64(_ids(0, 3))}]},
     r"bad.json: choice 0: cannot tell prompt rows from output rows"),
    (lambda: [_combined("same", 2, 2, 0), _combined("same", 2, 2, 1)],
     r"bad.json: request id 'same' appears twice"),
    (lambda: {"id": "b", "custom_id": "q", "response": None, "error": {"message": "x"}},
     r"bad.json: batch request 'q' has no response body"),
])
def test_malformed_records_name_the_file_and_record(tmp_path, make, match):
    with pytest.raises(InputError, match=match):
        read_vllm_json(_bad(make(), tmp_path))


def _npz64() -> str:
    buf = io.BytesIO()
    np.savez(buf, routed_experts=_ids(0, 1))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _pickled_npy64() -> str:
    buf = io.BytesIO()
    np.save(buf, np.array([[[1]]], dtype=object), allow_pickle=True)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _claiming(shape: tuple[int, ...]) -> bytes:
    """An .npy whose header claims `shape` of int16 but which holds one row of `[L, K]`."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<i2", "fortran_order": False,
                                                "shape": shape})
    return head.getvalue() + _ids(0, 1).tobytes()


def test_a_payload_claiming_a_huge_shape_is_refused_before_it_is_allocated(tmp_path):
    huge = (2**40, L, K)
    payload = base64.b64encode(_claiming(huge)).decode("ascii")
    path = _write(tmp_path / "r.json", {"id": "c", "prompt_routed_experts": payload,
                                        "choices": [{"routed_experts": None}]})
    with pytest.raises(InputError, match=r"r.json: prompt_routed_experts: its \.npy header "
                                         r"declares shape \[1099511627776, 3, 2\], 12\.0 TiB, "
                                         r"but 12 B follow it"):
        read_vllm_json(path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "0.npy").write_bytes(_claiming(huge))
    with pytest.raises(InputError, match=r"0.npy: its \.npy header declares shape "
                                         r"\[1099511627776, 3, 2\]"):
        read_vllm_arrays(tmp_path / "a", prompt_len=1)


def test_ids_beyond_experts_are_refused(tmp_path):
    path = _write(tmp_path / "r.json", _split("c", _ids(0, 2), [_ids(1, 2)]))
    with pytest.raises(InputError, match=r"r.json: prompt_routed_experts: expert id \d outside "
                                         r"\[-1, 2\)"):
        read_vllm_json(path, experts=2)


# -- arrays -------------------------------------------------------------------------------------

def test_array_directory_in_natural_order(tmp_path):
    p2, o2 = _ids(2, 3), _ids(3, 2)
    np.savez(tmp_path / "req2.npz", prompt_routed_experts=p2, routed_experts=o2)
    whole = _ids(10, 6)
    np.savez(tmp_path / "req10.npz", routed_experts=whole, prompt_len=np.array(4))
    np.save(tmp_path / "req3.npy", _ids(30, 5))
    (tmp_path / "notes.txt").write_text("ignored")
    assert is_vllm_arrays(tmp_path)
    rs = read_vllm_arrays(tmp_path, prompt_len=1)
    assert [r.id for r in rs.requests] == ["req2", "req3", "req10"]
    assert [(r.prompt_len, r.output_len) for r in rs.requests] == [(3, 2), (1, 4), (4, 2)]
    assert np.array_equal(rs.requests[0].ids, np.concatenate([p2, o2]))
    assert np.array_equal(rs.requests[2].ids, whole)
    assert rs.meta["files"] == ["req2.npz", "req3.npy", "req10.npz"]


def test_prompt_only_npz(tmp_path):
    np.savez(tmp_path / "a.npz", prompt_routed_experts=_ids(0, 3))
    rs = read_vllm_arrays(tmp_path, experts=E)
    assert rs.requests[0].prompt_len == 3 and rs.requests[0].output_len == 0


def test_a_trace_directory_is_not_vllm_arrays(tmp_path):
    np.save(tmp_path / "topk_ids.npy", _ids(0, 2))
    assert not is_vllm_arrays(tmp_path)


def _unbalanced_header(path):
    """An .npy whose header's shape tuple is left open (`(2, 3, 2,` for `(2, 3, 2)`)."""
    buffer = io.BytesIO()
    np.save(buffer, _ids(0, 2))
    data = bytearray(buffer.getvalue())
    data[data.index(b"(2, 3, 2)") + 8] = ord(",")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("write, options, match", [
    (lambda d: np.save(d / "a.npy", _ids(0, 2)), {},
     r"a.npy: an \.npy holds a request's prompt and output rows together, and nothing says "
     r"where its prompt ends: give the prompt's rows with prompt_len=N, or write"),
    (lambda d: np.save(d / "a.npy", _ids(0, 2)), {"prompt_len": 3},
     r"a.npy: prompt_len=3 exceeds its 2 rows"),
    (lambda d: np.save(d / "a.npy", np.zeros((2, 3))), {"prompt_len": 1},
     r"a.npy: expected integers \[tokens, layers, top_k\], got dtype float64"),
    (lambda d: np.save(d / "a.npy", np.array([[[1]]], dtype=object), allow_pickle=True),
     {"prompt_len": 0}, r"a.npy: not a readable \.npy array \(it holds Python objects, which eplbsim never unpickles"),
    (lambda d: np.savez(d / "a.npz", other=np.ones(2)), {}, r"a.npz: holds neither"),
    (lambda d: np.savez(d / "a.npz", routed_experts=_ids(0, 2), prompt_len=np.array([1, 2])),
     {}, r"a.npz: prompt_len must be a 0-d integer in \[0, 2\]"),
    (lambda d: np.savez(d / "a.npz", routed_experts=_ids(0, 2), prompt_len=np.array(1),
                        prompt_routed_experts=_ids(1, 1)), {},
     r"a.npz: prompt_len goes with routed_experts alone"),
    (lambda d: np.savez(d / "a.npz", prompt_routed_experts=_ids(0, 2),
                        routed_experts=np.full((1, L, K + 1), -1, dtype=np.int16)), {},
     r"a.npz: prompt_routed_experts rows are \[3, 2\] but routed_experts rows \[3, 3\]"),
    (lambda d: np.savez(d / "a.npz", routed_experts=np.zeros((0, L, K), dtype=np.int16)), {},
     r"a.npz: holds no routed rows"),
    (lambda d: (d / "a.npz").write_bytes(b"PK\x03\x04 truncated"), {},
     r"a.npz: not a readable \.npz archive"),
    (lambda d: _unbalanced_header(d / "a.npy"), {"prompt_len": 1},
     r"a.npy: not a readable \.npy array"),  # numpy's header tokenizer raises TokenError
    (lambda d: np.savez(d / "a.npz", routed_experts=np.full((1, L, K), 9, dtype=np.int16),
                        prompt_len=np.array(0)), {"experts": 4},
     r"a.npz: routed_experts: expert id 9 outside \[-1, 4\)"),
])
def test_malformed_array_files_name_the_file(tmp_path, write, options, match):
    write(tmp_path)
    with pytest.raises(InputError, match=match):
        read_vllm_arrays(tmp_path, **options)


def test_a_response_is_detected_however_long_its_prompt_routing(tmp_path):
    response = _split("long", _ids(0, 3000), [_ids(1, 2)])  # ~100 KiB of ids before choices
    ordered = {k: response[k] for k in ("id", "prompt_routed_experts")}
    ordered.update(response)
    path = _write(tmp_path / "long.json", ordered)
    assert path.read_bytes().index(b'"choices"') > 1 << 16
    assert is_vllm_json(path)
    requests = read_vllm_json(path)
    assert requests.requests[0].prompt_len == 3000
