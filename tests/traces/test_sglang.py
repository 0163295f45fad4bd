"""Importing SGLang expert-distribution recorder dumps (fabricated in SGLang's layouts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.cli import main
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.counts import CountsTrace, load_counts_trace
from eplbsim.traces.formats.sglang import import_sglang
from eplbsim.traces.trace import Trace, load_trace

from cli_helpers import run

L, E, P, WIDTH, K = 3, 4, 6, 8, 2  # layer 0 is dense; 2 redundant slots
# physical -> logical, redundant slots 4 and 5 (different per layer)
MAP = torch.tensor([[0, 1, 2, 3, 0, 1],
                    [3, 2, 1, 0, 3, 0],
                    [1, 0, 3, 2, 2, 2]], dtype=torch.int64)
PASSES = [7, 3, 5]  # out of order on purpose


def _ids(seed: int, tokens: int) -> torch.Tensor:
    """Physical ids int32 [L, tokens, 8]: layer 0 dense (all -1), K real columns, padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((L, tokens, WIDTH), -1, dtype=torch.int32)
    ids[1:, :, :K] = torch.randint(0, P, (L - 1, tokens, K), generator=g, dtype=torch.int32)
    # a router picks K distinct logical experts: a second pick of the first's expert is padding
    logical = MAP.gather(1, ids[:, :, :K].clamp(min=0).long().flatten(1)).view(L, tokens, K)
    ids[:, :, 1][(logical[:, :, 1] == logical[:, :, 0]) & (ids[:, :, 0] >= 0)] = -1
    if tokens:
        ids[2, 0, 1] = -1  # a padded slot in a routing column
    return ids


def _tokens(rank: int, fpid: int) -> int:
    return 2 + rank + fpid % 3


def _per_token_dump(rank: int, mapping=MAP) -> dict:
    records = []
    for fpid in PASSES:
        T = _tokens(rank, fpid)
        records.append({"forward_pass_id": fpid, "rank": rank,
                        "topk_ids_of_layer": _ids(100 * rank + fpid, T),
                        "input_ids": torch.arange(T), "positions": torch.arange(T),
                        "extend_seq_lens": [T], "forward_mode": 1})
    return {"records": records, "last_physical_to_logical_map": mapping.clone()}


def _phys_counts(rank: int, fpid: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + fpid)
    c = torch.randint(0, 9, (L, P), generator=g)
    c[0] = 0  # dense layer
    return c


def _per_pass_dump(rank: int) -> dict:
    return {"records": [{"forward_pass_id": f, "rank": rank,
                         "global_physical_count": _phys_counts(rank, f)} for f in PASSES],
            "last_physical_to_logical_map": MAP.clone()}


def _save(obj, path):
    torch.save(obj, path)
    return path


@pytest.fixture
def per_token_files(tmp_path):
    return [_save(_per_token_dump(r), tmp_path / f"rank{r}.pt") for r in (1, 0)]


def test_per_token_converts_orders_and_keeps_ranks(per_token_files):
    trace = import_sglang(per_token_files, top_k=K)
    assert isinstance(trace, Trace)
    assert trace.num_steps == 3 and trace.num_layers == L - 1 and trace.top_k == K
    assert trace.num_experts == E
    assert trace.meta["model_layers"] == [1, 2] and trace.meta["num_model_layers"] == L
    assert trace.meta["source"] == "sglang" and trace.meta["mode"] == "per_token"
    assert trace.meta["forward_pass_ids"] == [3, 5, 7]
    assert trace.meta["files"] == ["rank1.pt", "rank0.pt"]
    for s, fpid in enumerate(sorted(PASSES)):
        rows, ranks = [], []
        for rank in (0, 1):
            phys = _ids(100 * rank + fpid, _tokens(rank, fpid))[1:, :, :K]  # [2, T, K]
            logical = torch.full_like(phys, -1, dtype=torch.int64)
            for li, layer in enumerate((1, 2)):
                for t in range(phys.shape[1]):
                    for k in range(K):
                        p = int(phys[li, t, k])
                        logical[li, t, k] = -1 if p < 0 else int(MAP[layer, p])
            rows.append(logical.permute(1, 0, 2))
            ranks += [rank] * phys.shape[1]
        assert torch.equal(trace.step(s).long(), torch.cat(rows))
        assert trace.step_src_rank(s).tolist() == ranks
    assert int((trace.topk_ids == -1).sum()) > 0  # padding stays padding


def test_per_token_without_top_k_keeps_all_columns(per_token_files):
    trace = import_sglang(per_token_files, num_experts=6)
    assert trace.top_k == WIDTH and trace.num_experts == 6
    assert bool((trace.topk_ids[:, :, K:] == -1).all())


def test_per_token_replays_with_src_rank(per_token_files):
    trace = import_sglang(per_token_files, top_k=K)
    res = replay(trace, RunSpec.of(gpus=2, redundant=2, mode="a2a"))
    assert res is not None
    with pytest.raises(InputError, match="src_rank"):  # rank 1 does not exist on 1 GPU
        replay(trace, RunSpec.of(gpus=1, redundant=2, mode="a2a"))


def test_per_pass_counts(tmp_path):
    files = [_save(_per_pass_dump(r), tmp_path / f"r{r}.pt") for r in (0, 1)]
    ct = import_sglang(files)
    assert isinstance(ct, CountsTrace)
    assert ct.counts.shape == (3, L - 1, E)
    assert ct.meta["model_layers"] == [1, 2] and ct.meta["mode"] == "per_pass"
    for s, fpid in enumerate(sorted(PASSES)):
        phys = _phys_counts(0, fpid) + _phys_counts(1, fpid)
        want = np.zeros((L, E), dtype=np.int64)
        for layer in range(L):
            for p in range(P):
                want[layer, int(MAP[layer, p])] += int(phys[layer, p])
        assert np.array_equal(ct.counts[s], want[1:])


def test_stat_drops_unfilled_rows(tmp_path):
    counts = torch.zeros(5, L, E, dtype=torch.int64)
    counts[1, 1:] = torch.arange(8).view(2, 4)
    counts[3, 2] = torch.tensor([5, 0, 0, 1])
    path = _save({"logical_count": counts, "average_utilization_rate_over_window": 0.75},
                 tmp_path / "stat.pt")
    ct = import_sglang([path])
    assert ct.meta["mode"] == "stat" and ct.meta["filled_rows"] == [1, 3]
    assert ct.meta["model_layers"] == [1, 2] and ct.meta["num_model_layers"] == L
    assert ct.meta["average_utilization_rate_over_window"] == 0.75
    assert np.array_equal(ct.counts, counts[[1, 3]][:, 1:].numpy())
    assert import_sglang([path], num_experts=6).num_experts == 6


def test_cli_writes_loadable_files(tmp_path, per_token_files, capsys):
    out = tmp_path / "t.npz"
    assert main(["trace", "import-sglang", *map(str, per_token_files), "--out", str(out),
                 "--top-k", str(K)]) == 0
    assert "3 steps, 2 layers" in capsys.readouterr().out
    back = load_trace(out)
    direct = import_sglang(per_token_files, top_k=K)
    assert torch.equal(back.topk_ids, direct.topk_ids)
    assert torch.equal(back.src_rank, direct.src_rank)
    assert back.meta["model_layers"] == [1, 2]

    files = [_save(_per_pass_dump(r), tmp_path / f"p{r}.pt") for r in (0, 1)]
    out2 = tmp_path / "c.npz"
    assert main(["trace", "import-sglang", *map(str, files), "--out", str(out2)]) == 0
    assert "counts-only" in capsys.readouterr().out
    assert np.array_equal(load_counts_trace(out2).counts, import_sglang(files).counts)

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    assert main(["trace", "import-sglang", str(bad), "--out", str(tmp_path / "x.npz")]) == 2
    assert "bad.pt" in capsys.readouterr().err


def _expect(paths, match, **kw):
    with pytest.raises(InputError, match=match) as info:
        import_sglang(paths, **kw)
    return str(info.value)


def test_errors_name_the_file(tmp_path):
    good0 = _save(_per_token_dump(0), tmp_path / "good0.pt")

    bad = tmp_path / "garbage.pt"
    bad.write_bytes(b"\x00garbage")
    assert "garbage.pt" in _expect([bad], "not a readable torch file")
    full = tmp_path / "full.pt"
    torch.save(_per_token_dump(1), full)
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(full.read_bytes()[:200])
    assert "trunc.pt" in _expect([good0, trunc], "not a readable torch file")
    assert "missing.pt" in _expect([tmp_path / "missing.pt"], "no such file")

    d = _per_token_dump(1)
    del d["last_physical_to_logical_map"]
    assert "nomap.pt" in _expect([good0, _save(d, tmp_path / "nomap.pt")],
                                 "last_physical_to_logical_map")
    d = _per_token_dump(1)
    del d["records"][1]["forward_pass_id"]
    assert "nofpid.pt" in _expect([_save(d, tmp_path / "nofpid.pt")], "forward_pass_id")
    assert "nokeys.pt" in _expect([_save({"x": 1}, tmp_path / "nokeys.pt")], "missing records")

    d = _per_token_dump(1)
    d["records"][2]["forward_pass_id"] = d["records"][0]["forward_pass_id"]
    assert "dup.pt" in _expect([good0, _save(d, tmp_path / "dup.pt")], "duplicate forward_pass_id")

    other = MAP.clone()
    other[1, 4] = 1
    assert "map.pt" in _expect([good0, _save(_per_token_dump(1, other), tmp_path / "map.pt")],
                               "disagrees")

    for value in (P, -2):
        d = _per_token_dump(1)
        d["records"][0]["topk_ids_of_layer"][1, 0, 0] = value
        assert "range.pt" in _expect([good0, _save(d, tmp_path / "range.pt")],
                                     r"outside \[-1, 6\)")

    pp = _save(_per_pass_dump(1), tmp_path / "pp.pt")
    assert "pp.pt" in _expect([good0, pp], "mixed modes")

    d = _per_token_dump(1)
    d["records"][0]["topk_ids_of_layer"] = torch.zeros(L + 1, 2, WIDTH, dtype=torch.int32)
    assert "shape.pt" in _expect([good0, _save(d, tmp_path / "shape.pt")], "layers")
    d = _per_pass_dump(1)
    d["records"][0]["global_physical_count"] = torch.zeros(L, P + 1, dtype=torch.int64)
    assert "shape2.pt" in _expect([_save(d, tmp_path / "shape2.pt")], "shape")

    assert "good0.pt" in _expect([good0], "columns beyond top_k", top_k=1)
    assert "good0.pt" in _expect([good0], "experts were given", num_experts=3)

    zero = _save({"logical_count": torch.zeros(3, L, E, dtype=torch.int64),
                  "average_utilization_rate_over_window": None}, tmp_path / "zero.pt")
    assert "zero.pt" in _expect([zero], "no filled rows")
    partial = _save({"logical_count": torch.ones(3, L, E, dtype=torch.int64)},
                    tmp_path / "partial.pt")
    assert "partial.pt" in _expect([partial], "average_utilization_rate_over_window")


class _WritesAFile:
    """Unpickling this object opens (so creates) `marker`: code that runs on load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_never_unpickles_arbitrary_objects(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"records": [_WritesAFile(marker)]}, path)
    message = _expect([path], "refused: it holds Python objects")
    assert "evil.pt" in message and "weights_only" not in message
    code, out, err = run(capsys, "trace", "import-sglang", path, "--out", tmp_path / "out.npz")
    assert code == 2 and "refused" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists(), "the object's code ran"
    assert not (tmp_path / "out.npz").exists()


def test_empty_layers_are_named_warned_of_and_never_priced(tmp_path, per_token_files, capsys):
    """A dump whose layers route nothing (SGLang's DeepSeek-V4 recorder counted 40 of 43
    layers, #25948 / #25961) says which: a warning, `meta["empty_layers"]`, `trace info`; the
    layers are dropped, so the time prices the layers that routed alone."""
    from eplbsim.base.errors import InputWarning
    with pytest.warns(InputWarning, match=r"1 of the dump's 3 layers route nothing \(model "
                                          r"layers 0\).*#25961.*never priced"):
        trace = import_sglang(per_token_files, top_k=K)
    assert trace.meta["empty_layers"] == [0] and trace.num_layers == L - 1
    files = [_save(_per_pass_dump(r), tmp_path / f"p{r}.pt") for r in (0, 1)]
    with pytest.warns(InputWarning, match="model layers 0"):
        assert import_sglang(files).meta["empty_layers"] == [0]
    out = tmp_path / "t.npz"
    assert main(["trace", "import-sglang", *map(str, per_token_files), "--out", str(out),
                 "--top-k", str(K)]) == 0
    assert "route nothing (model layers 0)" in capsys.readouterr().err
    code, text, _ = run(capsys, "trace", "info", out)
    assert code == 0 and "empty layers in the log (no routed pair: dropped, not priced): " \
                         "model layers 0" in text
    priced = replay(load_trace(out), RunSpec.of(gpus=2, redundant=2, cost="roofline"))
    assert priced.true_load.shape[1] == L - 1  # the empty layer is no idle layer of the time
