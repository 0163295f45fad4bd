"""Tests of eplbsim.traces.trace: validation messages, no aliasing, counts/window/from_steps, and the
`.npz` format (round trip and every way a file can be unusable).

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from eplbsim.base.errors import InputError
from eplbsim.traces.trace import Trace, TraceShape, load_trace, save_trace

from id_helpers import distinct


def _ids(T=4, L=2, K=2, E=8, seed=0):
    return distinct(np.random.default_rng(seed).integers(-1, E, size=(T, L, K), dtype=np.int64))


def _trace(E=8, src=True, steps=(3, 0, 2, 4), L=2, K=2, seed=0, meta=None):
    T = sum(steps)
    ids = _ids(T, L, K, E, seed)
    offsets = np.concatenate([[0], np.cumsum(steps)])
    src_rank = np.arange(T) % 3 if src else None
    return Trace(ids, offsets, E, src_rank, meta if meta is not None else {"source": "test"})


def _brute_counts(ids: np.ndarray, offsets, E: int) -> np.ndarray:
    S = len(offsets) - 1
    L = ids.shape[1]
    out = np.zeros((S, L, E), dtype=np.int64)
    for s in range(S):
        for t in range(offsets[s], offsets[s + 1]):
            for layer in range(L):
                for e in ids[t, layer]:
                    if e >= 0:
                        out[s, layer, e] += 1
    return out


# ---------------------------------------------------------------- construction and validation


def test_ids_are_stored_in_the_narrowest_dtype_that_holds_them():
    for experts, dtype in ((2 ** 15, torch.int16), (2 ** 15 + 1, torch.int32)):
        ids = np.array([[[experts - 1, -1]]])
        tr = Trace(ids, np.array([0, 1]), experts)
        assert tr.topk_ids.dtype == dtype and tr.step(0).tolist() == ids.tolist()


def test_loads_are_int32_unless_a_step_could_overflow_it():
    class Shape(TraceShape):
        def __init__(self, offsets):
            self.step_offsets, self.meta = torch.tensor(offsets), {}

    assert Shape([0, 2 ** 31 - 1, 2 ** 32 - 2]).load_dtype == torch.int32
    assert Shape([0, 5, 5 + 2 ** 31]).load_dtype == torch.int64


def test_basic_properties():
    tr = _trace()
    assert tr.num_steps == 4
    assert tr.num_tokens == 9
    assert tr.num_layers == 2 and tr.top_k == 2 and tr.num_experts == 8
    assert tr.topk_ids.dtype == torch.int16  # stored narrow, widened one step at a time
    assert tr.step(0).dtype == torch.int32
    assert tr.step_offsets.dtype == torch.int64
    assert tr.src_rank.dtype == torch.int64
    assert tr.tokens_per_step.tolist() == [3, 0, 2, 4]
    assert tr.step(1).shape == (0, 2, 2)
    assert torch.equal(tr.step(2), tr.topk_ids[3:5])
    assert tr.step_src_rank(3).tolist() == [(5 + i) % 3 for i in range(4)]
    assert _trace(src=False).step_src_rank(0) is None
    assert tr.num_groups is None
    assert _trace(meta={"num_groups": 4}).num_groups == 4


def test_expert_id_too_large_names_it():
    ids = np.zeros((2, 1, 2), dtype=np.int64)
    ids[1, 0, 1] = 300
    with pytest.raises(InputError, match=re.escape(
            "topk_ids has expert id 300 but the trace declares 256 experts")):
        Trace(ids, [0, 2], 256)


def test_expert_id_below_minus_one():
    ids = np.zeros((2, 1, 2), dtype=np.int64)
    ids[0, 0, 0] = -2
    with pytest.raises(InputError, match=r"expert id -2"):
        Trace(ids, [0, 2], 4)


def test_minus_one_padding_is_allowed():
    tr = Trace(np.full((3, 1, 2), -1), [0, 3], 4)
    assert tr.counts().sum() == 0


@pytest.mark.parametrize("shape", [(4,), (4, 2), (4, 2, 2, 1)])
def test_topk_ids_wrong_ndim(shape):
    with pytest.raises(InputError, match=r"topk_ids must have shape \[tokens, layers, top_k\]"):
        Trace(np.zeros(shape, dtype=np.int64), [0, 4], 4)


@pytest.mark.parametrize("shape", [(4, 0, 2), (4, 2, 0)])
def test_topk_ids_empty_layers_or_k(shape):
    with pytest.raises(InputError, match="at least one layer and top_k >= 1"):
        Trace(np.zeros(shape, dtype=np.int64), [0, 4], 4)


@pytest.mark.parametrize("E", [0, -3, 2.0, "8", None])
def test_bad_num_experts(E):
    with pytest.raises(InputError, match="num_experts must be a positive integer"):
        Trace(np.zeros((1, 1, 1), dtype=np.int64), [0, 1], E)


def test_numpy_integer_num_experts_accepted():
    tr = Trace(np.zeros((1, 1, 1), dtype=np.int64), [0, 1], np.int64(4))
    assert tr.num_experts == 4 and type(tr.num_experts) is int


@pytest.mark.parametrize("offsets, pattern", [
    ([1, 4], r"must start at 0 and end at the number of token rows \(4\), got 1 \.\.\. 4"),
    ([0, 3], r"must start at 0 and end at the number of token rows \(4\), got 0 \.\.\. 3"),
    ([0, 2, 5], r"must start at 0 and end at the number of token rows \(4\)"),
    ([0, 3, 1, 4], r"step_offsets must be non-decreasing"),
    ([], r"step_offsets must be 1-D with S \+ 1 >= 2 entries"),
    ([[0, 4]], r"step_offsets must be 1-D with S \+ 1 >= 2 entries"),
])
def test_bad_step_offsets(offsets, pattern):
    with pytest.raises(InputError, match=pattern):
        Trace(np.zeros((4, 1, 1), dtype=np.int64), np.asarray(offsets, dtype=np.int64), 4)


@pytest.mark.parametrize("src", [np.zeros(3, dtype=np.int64), np.zeros(5, dtype=np.int64),
                                 np.zeros((4, 1), dtype=np.int64)])
def test_src_rank_wrong_length(src):
    with pytest.raises(InputError, match=r"src_rank must have one entry per token row \(4\)"):
        Trace(np.zeros((4, 1, 1), dtype=np.int64), [0, 4], 4, src)


def test_src_rank_negative():
    with pytest.raises(InputError, match=r"src_rank has rank -1; ranks must lie in \[0, "):
        Trace(np.zeros((2, 1, 1), dtype=np.int64), [0, 2], 4, [0, -1])


@pytest.mark.parametrize("field", ["topk_ids", "step_offsets", "src_rank"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_non_integer_arrays_rejected(field, dtype):
    args = {"topk_ids": np.zeros((2, 1, 1), dtype=np.int64),
            "step_offsets": np.array([0, 2]), "src_rank": np.zeros(2, dtype=np.int64)}
    args[field] = args[field].astype(dtype)
    with pytest.raises(InputError, match=rf"{field} must hold integers"):
        Trace(args["topk_ids"], args["step_offsets"], 4, args["src_rank"])


def test_float_torch_ids_rejected():
    with pytest.raises(InputError, match="topk_ids must hold integers"):
        Trace(torch.zeros(2, 1, 1), [0, 2], 4)


def test_non_numeric_ids_rejected():
    with pytest.raises(InputError, match="topk_ids"):
        Trace(np.array([[["a"]]]), [0, 1], 4)


@pytest.mark.parametrize("groups", [0, 3, -1, "2", 2.0])
def test_bad_num_groups(groups):
    with pytest.raises(InputError, match="num_groups"):
        Trace(np.zeros((1, 1, 1), dtype=np.int64), [0, 1], 8, meta={"num_groups": groups})


# ---------------------------------------------------------------- no aliasing


@pytest.mark.parametrize("kind", ["numpy64", "numpy32", "torch64", "torch32"])
def test_trace_never_aliases_inputs(kind):
    ids = _ids(5, 2, 2, 8, seed=1)
    offsets = np.array([0, 2, 5])
    src = np.array([0, 1, 2, 3, 0])
    if kind == "numpy32":
        ids, offsets, src = ids.astype(np.int32), offsets.astype(np.int32), src.astype(np.int32)
    elif kind == "torch64":
        ids, offsets, src = torch.from_numpy(ids), torch.from_numpy(offsets), torch.from_numpy(src)
    elif kind == "torch32":
        ids, offsets, src = (torch.from_numpy(a).to(torch.int32) for a in (ids, offsets, src))
    meta = {"source": "orig"}
    tr = Trace(ids, offsets, 8, src, meta)
    before = (tr.topk_ids.clone(), tr.step_offsets.clone(), tr.src_rank.clone())
    ids[:] = 7
    offsets[1] = 3
    src[:] = 9
    meta["source"] = "changed"
    meta["num_groups"] = 3
    assert torch.equal(tr.topk_ids, before[0])
    assert torch.equal(tr.step_offsets, before[1])
    assert torch.equal(tr.src_rank, before[2])
    assert tr.meta == {"source": "orig"}


def test_from_steps_does_not_alias():
    steps = [torch.tensor([[[0, 1]], [[0, 1]]], dtype=torch.int32),
             torch.tensor([[[2, 3]]], dtype=torch.int32)]
    tr = Trace.from_steps(steps, 4)
    steps[0][:] = 3
    assert tr.topk_ids[:2].eq(torch.tensor([0, 1], dtype=torch.int32)).all()


# ---------------------------------------------------------------- counts, window, from_steps


@st.composite
def ragged_traces(draw):
    L = draw(st.integers(1, 3))
    K = draw(st.integers(1, 3))
    E = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(0, 5), min_size=1, max_size=5).filter(sum))
    steps = [distinct(draw(hnp.arrays(np.int64, (T, L, K), elements=st.integers(-1, E - 1))))
             for T in sizes]
    src = [draw(hnp.arrays(np.int64, (T,), elements=st.integers(0, 3))) for T in sizes]
    return steps, src, E


@settings(max_examples=60, deadline=None)
@given(ragged_traces())
def test_counts_match_brute_force(case):
    steps, src, E = case
    tr = Trace.from_steps(steps, E, src)
    ids = np.concatenate(steps)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in steps])])
    expected = _brute_counts(ids, offsets, E)
    counts = tr.counts()
    assert counts.dtype == torch.int32 == tr.load_dtype  # a count is at most its step's tokens
    assert counts.shape == (len(steps), tr.num_layers, E)
    np.testing.assert_array_equal(counts.numpy(), expected)
    # padding never counted: the total is the number of non-negative ids
    assert int(counts.sum()) == int((ids >= 0).sum())
    # from_steps is the same as the flat constructor
    flat = Trace(ids, offsets, E, np.concatenate(src))
    assert torch.equal(flat.topk_ids, tr.topk_ids)
    assert torch.equal(flat.step_offsets, tr.step_offsets)
    assert torch.equal(flat.src_rank, tr.src_rank)
    for s, step in enumerate(steps):
        np.testing.assert_array_equal(tr.step(s).numpy(), step)
        np.testing.assert_array_equal(tr.step_src_rank(s).numpy(), src[s])


@settings(max_examples=60, deadline=None)
@given(ragged_traces(), st.data())
def test_window_is_a_slice_of_steps(case, data):
    steps, src, E = case
    tr = Trace.from_steps(steps, E, src, meta={"source": "w"})
    S = len(steps)
    start = data.draw(st.integers(0, S - 1))
    stop = data.draw(st.integers(start + 1, S))
    if sum(len(s) for s in steps[start:stop]) == 0:
        with pytest.raises(InputError, match="holds no token rows"):
            tr.window(start, stop)
        return
    win = tr.window(start, stop)
    assert win.num_steps == stop - start
    assert win.meta == tr.meta and win.num_experts == E
    assert int(win.step_offsets[0]) == 0
    assert torch.equal(win.counts(), tr.counts()[start:stop])
    for i, s in enumerate(range(start, stop)):
        assert torch.equal(win.step(i), tr.step(s))
        assert torch.equal(win.step_src_rank(i), tr.step_src_rank(s))


def test_window_slice_semantics():
    tr = _trace()
    assert torch.equal(tr.window(-2, None).counts(), tr.counts()[2:])
    assert torch.equal(tr.window(0, 100).counts(), tr.counts())
    assert _trace(src=False).window(1, 3).src_rank is None


@pytest.mark.parametrize("start, stop", [(2, 2), (3, 1), (4, 6), (10, 20)])
def test_empty_window_rejected(start, stop):
    with pytest.raises(InputError, match=rf"window {start}:{stop} selects no steps of a 4-step"):
        _trace().window(start, stop)


def test_from_steps_rejects_no_steps_and_mismatched_shapes():
    with pytest.raises(InputError, match="at least one step"):
        Trace.from_steps([], 4)
    with pytest.raises(InputError, match="same L and K"):
        Trace.from_steps([np.zeros((2, 1, 2), dtype=np.int64),
                          np.zeros((2, 2, 2), dtype=np.int64)], 4)
    with pytest.raises(InputError, match="same L and K"):
        Trace.from_steps([np.zeros((2, 1), dtype=np.int64)], 4)


def test_counts_hand_example():
    steps = [np.array([[[0, 1]], [[1, -1]]]), np.zeros((0, 1, 2), dtype=np.int64),
             np.array([[[2, 0]]])]
    tr = Trace.from_steps(steps, 3)
    assert tr.counts().tolist() == [[[1, 2, 0]], [[0, 0, 0]], [[1, 0, 1]]]


# ---------------------------------------------------------------- save / load round trip


def _assert_same(a: Trace, b: Trace):
    assert torch.equal(a.topk_ids, b.topk_ids)
    assert torch.equal(a.step_offsets, b.step_offsets)
    assert a.num_experts == b.num_experts
    if a.src_rank is None:
        assert b.src_rank is None
    else:
        assert torch.equal(a.src_rank, b.src_rank)


@pytest.mark.parametrize("src", [True, False])
def test_round_trip(tmp_path, src):
    tr = _trace(src=src, meta={"source": "unit", "num_groups": 2, "note": [1, "x"]})
    path = tmp_path / "t.npz"
    save_trace(tr, path)
    back = load_trace(path)
    _assert_same(tr, back)
    assert back.tokens_per_step.tolist() == [3, 0, 2, 4]
    assert back.meta["source"] == "unit" and back.meta["note"] == [1, "x"]
    assert back.meta["num_experts"] == 8 and back.meta["top_k"] == 2
    assert back.meta["num_layers"] == 2 and back.num_groups == 2
    with np.load(path, allow_pickle=False) as npz:
        assert npz["topk_ids"].dtype in (np.int16, np.int32)
        assert npz["step_offsets"].dtype == np.int64
        assert json.loads(str(npz["meta"][()]))["num_experts"] == 8
        assert ("src_rank" in npz.files) == src


def test_round_trip_many_experts(tmp_path):
    """Ids beyond int16 survive (the file must widen its dtype)."""
    E = 40000
    ids = np.array([[[39999, 0]], [[32768, -1]]])
    tr = Trace(ids, [0, 1, 2], E)
    save_trace(tr, tmp_path / "big.npz")
    _assert_same(tr, load_trace(tmp_path / "big.npz"))


def test_round_trip_str_path(tmp_path):
    tr = _trace()
    save_trace(tr, str(tmp_path / "s.npz"))
    _assert_same(tr, load_trace(str(tmp_path / "s.npz")))


# ---------------------------------------------------------------- unusable files


def _raises_naming(path, pattern=""):
    with pytest.raises(InputError) as info:
        load_trace(path)
    msg = str(info.value)
    assert str(path) in msg
    assert re.search(pattern, msg), msg
    return msg


def _write_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _good_arrays(meta=None):
    meta = {"num_experts": 4, "top_k": 2, "num_layers": 1} if meta is None else meta
    return {"topk_ids": np.zeros((3, 1, 2), dtype=np.int16),
            "step_offsets": np.array([0, 3], dtype=np.int64),
            "meta": np.array(json.dumps(meta))}


def test_load_missing_file(tmp_path):
    _raises_naming(tmp_path / "nope.npz", "no such file")


def test_load_directory(tmp_path):
    _raises_naming(tmp_path)


def test_load_truncated(tmp_path):
    path = tmp_path / "cut.npz"
    save_trace(_trace(steps=(50, 60)), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _raises_naming(path, "truncated or corrupt")


def test_load_empty_file(tmp_path):
    path = tmp_path / "empty.npz"
    path.write_bytes(b"")
    _raises_naming(path)


def test_load_non_trace_npz(tmp_path):
    path = tmp_path / "other.npz"
    _write_npz(path, weights=np.ones(3), bias=np.zeros(2))
    _raises_naming(path, r"not an eplbsim trace \(missing topk_ids, step_offsets, meta")


def test_load_non_zip(tmp_path):
    path = tmp_path / "text.npz"
    path.write_text("this is not a zip file\n" * 10)
    _raises_naming(path)


def test_load_bare_npy(tmp_path):
    path = tmp_path / "array.npy"
    np.save(path, np.arange(6))
    _raises_naming(path, "not an eplbsim trace")


def test_load_meta_not_json(tmp_path):
    path = tmp_path / "meta.npz"
    arrays = _good_arrays()
    arrays["meta"] = np.array("{num_experts: 4")
    _write_npz(path, **arrays)
    _raises_naming(path, "meta is not a JSON string")


def test_load_meta_not_object(tmp_path):
    path = tmp_path / "meta.npz"
    arrays = _good_arrays()
    arrays["meta"] = np.array("[1, 2]")
    _write_npz(path, **arrays)
    _raises_naming(path, "meta must be a JSON object")


@pytest.mark.parametrize("key", ["num_experts", "top_k", "num_layers"])
def test_load_meta_missing_field(tmp_path, key):
    meta = {"num_experts": 4, "top_k": 2, "num_layers": 1}
    meta[key] = "4"
    path = tmp_path / "meta.npz"
    _write_npz(path, **_good_arrays(meta))
    _raises_naming(path, rf"meta lacks the integer field '{key}'")


_UNPICKLED: list[str] = []


def _record_unpickle():
    _UNPICKLED.append("unpickled")
    return "boom"


class _Boom:
    def __reduce__(self):
        return (_record_unpickle, ())


@pytest.mark.parametrize("key", ["meta", "topk_ids", "extra"])
def test_load_object_array_is_not_unpickled(tmp_path, key):
    path = tmp_path / "pickle.npz"
    arrays = _good_arrays()
    arrays[key] = np.array([_Boom(), 1], dtype=object)
    _write_npz(path, **arrays)
    _UNPICKLED.clear()
    _raises_naming(path)
    assert _UNPICKLED == []


@pytest.mark.parametrize("meta, pattern", [
    ({"num_experts": 4, "top_k": 2, "num_layers": 3}, r"meta declares num_layers=3, top_k=2"),
    ({"num_experts": 4, "top_k": 5, "num_layers": 1}, r"meta declares num_layers=1, top_k=5"),
    ({"num_experts": 2, "top_k": 2, "num_layers": 1},
     r"topk_ids has expert id 3 but the trace declares 2 experts"),
])
def test_load_meta_shape_mismatch(tmp_path, meta, pattern):
    path = tmp_path / "mismatch.npz"
    arrays = _good_arrays(meta)
    arrays["topk_ids"] = np.array([[[0, 3]], [[1, 2]], [[-1, 0]]], dtype=np.int16)
    _write_npz(path, **arrays)
    _raises_naming(path, pattern)


def test_load_bad_offsets_names_file(tmp_path):
    path = tmp_path / "offsets.npz"
    arrays = _good_arrays()
    arrays["step_offsets"] = np.array([0, 2], dtype=np.int64)
    _write_npz(path, **arrays)
    _raises_naming(path, "step_offsets must start at 0")


def test_load_float_ids_names_file(tmp_path):
    path = tmp_path / "float.npz"
    arrays = _good_arrays()
    arrays["topk_ids"] = arrays["topk_ids"].astype(np.float32)
    _write_npz(path, **arrays)
    _raises_naming(path, "topk_ids must hold integers")


# ---------------------------------------------------------------- gating weights


def _weights(T, L=2, K=2, seed=1):
    return np.random.default_rng(seed).random((T, L, K)).astype(np.float32)


def test_gating_weights_are_kept_per_step_windowed_and_round_tripped(tmp_path):
    tr = _trace(src=False)
    w = _weights(tr.num_tokens)
    weighted = Trace(tr.topk_ids, tr.step_offsets, 8, None, tr.meta, w)
    assert tr.step_weights(0) is None
    assert np.array_equal(weighted.step_weights(2).numpy(), w[3:5])
    assert np.array_equal(weighted.window(2, 4).step_weights(1).numpy(), w[5:9])
    w[0] = 9  # a private copy
    assert weighted.topk_weights[0, 0, 0] != 9
    save_trace(weighted, tmp_path / "w.npz")
    back = load_trace(tmp_path / "w.npz")
    assert torch.equal(back.topk_weights, weighted.topk_weights)
    stepped = Trace.from_steps([weighted.step(s) for s in range(4)], 8, None, {},
                               [weighted.step_weights(s) for s in range(4)])
    assert torch.equal(stepped.topk_weights, weighted.topk_weights)


@pytest.mark.parametrize("change, pattern", [
    (lambda w: w[:, :1], "shape of topk_ids"),
    (lambda w: np.where(np.arange(w.size).reshape(w.shape) == 5, np.nan, w),
     "row 1, layer 0, slot 1"),
    (lambda w: -w, "finite and >= 0"),
    (lambda w: np.full(w.shape, "x"), "not a numeric array"),
])
def test_bad_gating_weights_are_named(change, pattern):
    tr = _trace(src=False)
    with pytest.raises(InputError, match=pattern):
        Trace(tr.topk_ids, tr.step_offsets, 8, None, {}, change(_weights(tr.num_tokens)))


def test_a_trace_from_arrays_is_checked_as_a_file_and_runs_every_command(tmp_path):
    """Five lines of Python for a log no reader takes: the arrays, steps by their sizes, a
    model name; then replay, compare, review and save_trace on it."""
    from eplbsim import RunSpec, compare, replay, review
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((40, 2, 16)), -1)[..., :4]  # [N, L, K] distinct a row
    weights = rng.random(ids.shape).astype(np.float32)
    trace = Trace.from_arrays(ids, tokens_per_step=[10, 10, 20], weights=weights, num_experts=60,
                              model="Qwen/Qwen1.5-MoE-A2.7B-Chat", layers=[3, 7])
    assert trace.tokens_per_step.tolist() == [10, 10, 20] and trace.num_experts == 60
    assert trace.meta["model_layers"] == [3, 7] and np.array_equal(trace.topk_ids.numpy(), ids)
    assert Trace.from_arrays(torch.from_numpy(ids), step_offsets=[0, 10, 20, 40]).num_experts == 16
    assert Trace.from_arrays(ids[:, 0]).num_layers == 1 and trace.num_steps == 3
    spec = RunSpec.of(gpus=4, redundant=4, cost="roofline")
    assert replay(trace, spec).spec.cost.model == "qwen1.5-moe-a2.7b"
    assert len(compare(trace, ["row", "ordinal"], ["none"], spec)) == 2
    assert review(trace, "ordinal", spec=spec, seeds=1, windows=1).verdict
    save_trace(trace, tmp_path / "t.npz")
    assert torch.equal(load_trace(tmp_path / "t.npz").topk_ids, trace.topk_ids)
    bad = ids.copy()
    bad[3, 1, 2] = bad[3, 1, 0]
    for args, kwargs, match in [((bad,), {}, "token row 3 routes expert"),
                                ((ids,), {"num_experts": 8}, "expert id 15"),
                                ((ids,), {"tokens_per_step": [10, 10]}, "end at the number"),
                                ((ids.astype(float),), {}, "must hold integers"),
                                ((ids,), {"layers": [1]}, "layers names 1 layers")]:
        with pytest.raises(InputError, match=match):
            Trace.from_arrays(*args, **kwargs)
