"""The engines' own EPLB code in the simulator (eplbsim.engines): conformance of every twin,
engine policies equal to their twins through the CLI and Python, a modified branch run through
--engine-source, and one clear line for a missing or old source. The pinned sources come from
`eplbsim engines fetch` (the README's test command runs it)."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from eplbsim import engines
from eplbsim.base.errors import InputError
from eplbsim.cli import main
from eplbsim.engines.conform import conformance
from eplbsim.replay import compare, replay
from eplbsim.replay.workers import Workers
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize

ROOT = Path(__file__).resolve().parents[2]


def _fetched(engine: str, version: str | None = None) -> Path:
    folder = engines.release(engine, version)
    if folder is None:
        pytest.skip(f"{engine} {version or engines.ENGINES[engine].pinned} is not fetched "
                    f"(eplbsim engines fetch)")
    return folder


@pytest.fixture(scope="module")
def sglang_source() -> Path:
    return _fetched("sglang")


def _run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_twin_conforms_to_its_engine_function(sglang_source):
    _fetched("vllm")
    rows = conformance()
    assert all(r.conforms for r in rows), [r.as_dict() for r in rows if not r.conforms]
    covered = {(r.function, r.path) for r in rows}
    for path in ("start-up, none", "start-up, a2a", "rebalance, none", "rebalance, a2a"):
        for function in ("ExpertLocationMetadata lists", "static tables", "dynamic dispatch",
                         "fake dispatch", "lp dispatch"):
            assert (function, path) in covered
    assert {r.twin for r in rows} >= {"waterfill shared rule", "waterfill-dynamic shared rule"}
    assert {r.function for r in rows} >= {
        "compute_logical_maps", "eplb_map_to_physical_and_record (interpreted)",
        "sglang:deepseek solver", "sglang:elasticity_aware solver", "vllm:default solver"}


def test_conform_command_exits_0_and_prints_json(capsys):
    _fetched("vllm")
    rows = _run_json(capsys, ["engines", "conform", "--engine", "vllm"])
    assert rows and all(r["conforms"] for r in rows)
    assert {r["engine"] for r in rows} == {"vllm 0.33.0"}


def test_conform_with_one_engine_fetched_conforms_it_and_names_the_other(tmp_path, capsys,
                                                                          monkeypatch):
    folder = _fetched("vllm")
    shutil.copytree(folder, tmp_path / "engines" / folder.name)  # only vLLM in this cache
    monkeypatch.setenv("EPLBSIM_CACHE", str(tmp_path))
    engines.adapter.cache_clear()
    assert main(["engines", "conform", "--json"]) == 0
    out, err = capsys.readouterr()
    assert {r["engine"] for r in json.loads(out)} == {"vllm 0.33.0"}
    assert err.strip() == (f"sglang {engines.ENGINES['sglang'].pinned} is not fetched (eplbsim "
                           f"engines fetch): not conformed")
    engines.adapter.cache_clear()


TWINS = {"sglang:static": ("static", "static"), "sglang:dynamic": ("row", "random"),
         "sglang:lp": ("sglang-lp", "sglang-lp")}


@pytest.mark.parametrize("trace", ["skewed", "template", "moe_routes_small.jsonl"])
def test_engine_policies_equal_their_twins_row_for_row(sglang_source, trace, capsys, tmp_path):
    source = (["--trace", str(ROOT / "traces" / trace), "--skip-type", "meta",
               "--token-key", "token_idx", "--ids-key", "topk_ids"] if "." in trace else
              ["--scenario", trace, "--steps", "4", "--tokens", "64", "--layers", "2",
               "--experts", "16", "--top-k", "4"])
    common = ["run", *source, "--gpus", "8", "--gpus-per-node", "4", "--view", "sglang"]
    for mode in ("none", "a2a"):
        ours = _run_json(capsys, common + ["--mode", mode, "--policies", ",".join(TWINS)])
        twins = _run_json(capsys, common + ["--mode", mode, "--policies",
                                            ",".join(t[mode == "a2a"] for t in TWINS.values())])
        assert len(ours) == len(twins) == len(TWINS)
        for engine_row, twin_row in zip(ours, twins):
            assert engine_row.pop("engine") == "sglang 0.5.23"
            if engine_row.pop("policy") == "sglang:dynamic" and mode == "a2a":
                _close_in_distribution(engine_row, twin_row)
            else:
                twin_row.pop("policy")
                assert engine_row == twin_row, mode


def _close_in_distribution(engine_row, twin_row):
    """The engine's `randint` draws from torch's generator and `random` from eplbsim's
    counter-based stream (`dispatch.streams`): the same rule on other draws, so a run's
    numbers agree within sampling noise, not bit for bit (the conformance rows compare the
    function given one generator)."""
    assert twin_row.pop("policy") == "random"
    assert engine_row.keys() == twin_row.keys()
    for key, value in engine_row.items():
        if isinstance(value, float):
            assert value == pytest.approx(twin_row[key], rel=0.1, abs=0.02), key
        elif not isinstance(value, dict):
            assert value == twin_row[key], key


def test_python_api_runs_the_engine(sglang_source):
    trace = synthesize("skewed", steps=3, tokens=32, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(gpus=4, policy="sglang:dynamic", mode="none", view="sglang")
    ours = replay(trace, spec)
    twin = replay(trace, spec.replace(policy="row"))  # its dispatch without an a2a backend
    assert ours.metrics == twin.metrics
    assert ours.row()["engine"] == "sglang 0.5.23"


def test_engine_solver_runs_in_a_schedule(sglang_source, capsys):
    rows = _run_json(capsys, ["run", "--scenario", "skewed", "--steps", "6", "--tokens", "32",
                              "--layers", "2", "--experts", "16", "--gpus", "4",
                              "--policies", "row", "--solver", "sglang:deepseek",
                              "--rebalance-every", "2"])
    twin = _run_json(capsys, ["run", "--scenario", "skewed", "--steps", "6", "--tokens", "32",
                              "--layers", "2", "--experts", "16", "--gpus", "4",
                              "--policies", "row", "--solver", "deepseek",
                              "--rebalance-every", "2"])
    assert rows[0]["engine"] == "sglang 0.5.23"
    assert rows[0]["gpu_imbalance"] == pytest.approx(twin[0]["gpu_imbalance"])


def _branch(source: Path, tmp_path: Path) -> Path:
    """A copy of the fetched SGLang whose rank-invariant dispatch line draws at random."""
    branch = tmp_path / "branch"
    shutil.copytree(source, branch)
    file = branch / "sglang/srt/eplb/expert_location_dispatch.py"
    text = file.read_text()
    line = "        chosen_dispatch_index = row_index % num_valid\n"
    assert line in text
    file.write_text(text.replace(line, "        chosen_dispatch_index = (torch.randint(0, 65536, "
                                       "topk_ids.shape, dtype=torch.int32, device=device) "
                                       "% num_valid)\n"))
    return branch


def test_engine_source_runs_a_modified_branch_unchanged(sglang_source, tmp_path, capsys):
    branch = _branch(sglang_source, tmp_path)
    argv = ["run", "--scenario", "skewed", "--steps", "3", "--tokens", "64", "--layers", "2",
            "--experts", "16", "--gpus", "4", "--policies", "sglang:dynamic"]
    pinned = _run_json(capsys, argv)[0]
    mine = _run_json(capsys, argv + ["--engine-source", f"sglang={branch}"])[0]
    assert pinned["rank_agreement"] == 1 and pinned["output_rel_error"] == 0
    assert mine["rank_agreement"] < 1
    assert mine["output_rel_error"] > 0
    assert mine["engine"] == f"sglang at {branch.resolve()}"


def _one_error_line(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_missing_or_old_sources_are_one_line(sglang_source, tmp_path, capsys, monkeypatch):
    argv = ["run", "--scenario", "skewed", "--steps", "2", "--tokens", "16", "--layers", "1",
            "--experts", "8", "--gpus", "2", "--policies", "sglang:static"]
    _one_error_line(capsys, argv + ["--engine-source", f"sglang={tmp_path}"], "no folder sglang/")
    old = tmp_path / "old"
    shutil.copytree(sglang_source, old)
    file = old / "sglang/srt/eplb/expert_location.py"
    file.write_text(file.read_text().replace("def init_by_mapping(", "def init_from_map("))
    _one_error_line(capsys, argv + ["--engine-source", f"sglang={old}"],
                    "has no ExpertLocationMetadata.init_by_mapping")
    monkeypatch.setenv("EPLBSIM_CACHE", str(tmp_path / "empty"))
    engines.adapter.cache_clear()
    _one_error_line(capsys, argv, "is not fetched: run `eplbsim engines fetch`")
    from eplbsim.engines import source

    def no_such_release(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution "
                                           "found for sglang==0.0.1\n")
    monkeypatch.setattr(source.subprocess, "run", no_such_release)
    _one_error_line(capsys, ["engines", "fetch", "sglang==0.0.1"],
                    "pip could not download sglang==0.0.1: ERROR: No matching distribution")


def test_list_says_what_is_fetched_and_exposed(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("EPLBSIM_CACHE", str(tmp_path))
    rows = _run_json(capsys, ["engines", "list"])
    assert [r["engine"] for r in rows] == list(engines.ENGINES)
    assert all(r["fetched"] == [] and r["exposes"] for r in rows)
    assert "sglang:static" in rows[0]["policies"]
    assert rows[0]["pinned"] in rows[0]["tested"]
    assert all(set(r["observed"].values()) == {"pinned release not fetched"} for r in rows)


def test_list_says_how_each_policys_calls_serve_the_ranks(capsys):
    """`engines list` probes the pinned release: a call that draws nothing serves every rank
    of equal inputs; one that draws runs once a rank; an a2a-only rule is not probed."""
    if engines.release("sglang") is None or engines.release("vllm") is None:
        pytest.skip("the pinned releases are not fetched (eplbsim engines fetch)")
    rows = {r["engine"]: r["observed"] for r in _run_json(capsys, ["engines", "list"])}
    shared = "draws nothing and reads no rank, 1 call(s) serve its 4"
    assert rows["sglang"]["sglang:dynamic"].startswith(shared)
    assert rows["vllm"]["vllm:hash"].startswith(shared)
    assert rows["sglang"]["sglang:fake"] == "draws from a generator, one call a rank"
    assert rows["sglang"]["sglang:waterfill"].endswith("not probed")
    assert rows["sglang"]["sglang:auto"].startswith("not probed: ")
    main(["engines", "list"])
    assert "observed in \"none\"" in capsys.readouterr().out


def test_list_probes_a_branch_as_it_probes_a_release(capsys, tmp_path, sglang_source):
    """`engines list --engine-source PATH` says how a branch's calls serve the ranks, naming
    the channel and the line through which it reads its rank."""
    branch = tmp_path / "branch"
    shutil.copytree(sglang_source / "sglang", branch / "sglang")
    path = branch / "sglang" / "srt" / "eplb" / "expert_location_dispatch.py"
    path.write_text(path.read_text().replace("row_index % num_valid",
                                             "(row_index + torch.distributed.get_rank()) "
                                             "% num_valid"))
    row = _run_json(capsys, ["engines", "list", "--engine-source", f"sglang={branch}"])[0]
    assert row["observed"]["sglang:dynamic"].startswith(
        "reads its rank through torch.distributed.get_rank "
        "(sglang/srt/eplb/expert_location_dispatch.py:")
    main(["engines", "list", "--engine-source", f"sglang={branch}"])
    assert "reads its rank through" in capsys.readouterr().out


def test_the_engine_generator_is_the_ranks_and_comes_back():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    gen = torch.Generator().manual_seed(1)
    from eplbsim.engines.sglang import _default_generator
    with _default_generator(gen, torch.device("cpu")):
        drawn = torch.randint(0, 100, (4,))
    again = torch.Generator().manual_seed(1)
    assert torch.equal(drawn, torch.randint(0, 100, (4,), generator=again))
    assert torch.equal(gen.get_state(), again.get_state())
    assert torch.equal(torch.get_rng_state(), before)


def test_an_engine_solvers_order_reaches_the_sglang_view(sglang_source, capsys):
    """SGLang publishes a solved placement through init_by_eplb: every rank's lists in the
    solver's order. The sglang view reads that order, so row equals the engine's dynamic."""
    argv = ["run", "--scenario", "skewed", "--steps", "4", "--tokens", "64", "--layers", "2",
            "--experts", "16", "--gpus", "4", "--solver", "sglang:deepseek", "--view", "sglang",
            "--no-migration-aware", "--rebalance-every", "2"]
    ours = _run_json(capsys, argv + ["--policies", "sglang:dynamic"])[0]
    twin = _run_json(capsys, argv + ["--policies", "row"])[0]
    full = _run_json(capsys, argv + ["--policies", "row", "--view", "full"])[0]
    for row in (ours, twin, full):
        row.pop("policy"), row.pop("view")
    assert ours == twin
    assert full["replica_skew_max"] != ours["replica_skew_max"] \
        or full["gpu_imbalance"] != ours["gpu_imbalance"]


def test_a_singular_lp_system_is_not_converged_in_engine_and_twin(sglang_source):
    """One expert's every pair on a batch of one token: the KKT system is singular, which
    torch.linalg.solve refuses; both sides take it as the kernel's not-converged 0.5."""
    from eplbsim.dispatch.sglang_lp import barrier
    A = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    x = barrier(A, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0, 1000.0]))
    assert torch.equal(x, torch.full((3,), 0.5))
    run = engines.adapter("sglang")
    from eplbsim.engines.sglang import _lp_kernels
    out = torch.empty(3)
    _lp_kernels(run, "cuda_solver").solve_ipm(A, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0, 1000.0]),
                               result=out)
    assert torch.equal(out, x)


def test_fetch_is_a_no_op_when_the_files_are_there(tmp_path, monkeypatch):
    from eplbsim.engines import source
    spec = engines.ENGINES["vllm"]
    folder = tmp_path / "engines" / f"vllm-{spec.pinned}"
    folder.mkdir(parents=True)
    (folder / source.MARKER).write_text("\n".join([spec.pinned, *spec.keep]) + "\n")
    monkeypatch.setenv("EPLBSIM_CACHE", str(tmp_path))

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although every file is there")
    monkeypatch.setattr(source.subprocess, "run", no_pip)
    assert engines.fetch_engine("vllm") == folder
    (folder / source.MARKER).write_text(spec.pinned + "\n")  # kept fewer files: fetch again
    with pytest.raises(AssertionError, match="pip ran"):
        engines.fetch_engine("vllm")


def test_vllm_hash_equals_its_twin(capsys):
    _fetched("vllm")
    argv = ["run", "--scenario", "template", "--steps", "2", "--tokens", "48", "--layers", "2",
            "--experts", "16", "--top-k", "4", "--gpus", "4"]
    ours = _run_json(capsys, argv + ["--policies", "vllm:hash"])[0]
    twin = _run_json(capsys, argv + ["--policies", "hash"])[0]
    assert ours.pop("engine") == "vllm 0.33.0"
    ours.pop("policy"), twin.pop("policy")
    assert ours == twin


def test_deepseek_publishes_its_replica_order():
    from eplbsim.solvers import solve
    from eplbsim.placement.topology import Topology
    load = torch.tensor([[90.0, 5.0, 3.0, 2.0], [1.0, 1.0, 1.0, 60.0]])
    placement = solve("deepseek", load, 8, Topology(2))
    order = placement.order  # each expert's slots, then -1
    assert sorted(order[0, 0].tolist()) == placement.log2phy[0, 0].tolist()
    assert (placement.logcnt[0, 0], placement.logcnt[1, 3]) == (5, 5)
    laid = solve("deepseek", load, 8, Topology(2), previous=placement)
    assert torch.equal(laid.order, laid.log2phy)  # ascending once laid over the previous one


def test_the_engines_own_code_runs_split_over_workers(sglang_source):
    """Each worker process loads the engine from the same cache; its rows equal one process's
    bit for bit (the engine's draws come from torch generators seeded by step and layer)."""
    trace = synthesize("skewed", steps=4, tokens=32, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(gpus=4, view="sglang")
    policies = ["sglang:dynamic", "sglang:static"]
    whole = compare(trace, policies, ["none", "a2a"], spec)
    with Workers(trace, 2) as workers:
        split = compare(trace, policies, ["none", "a2a"], spec, run=workers.replay_planned)
    assert [r.row() for r in split] == [r.row() for r in whole]
    assert {r.row()["engine"] for r in split} == {"sglang 0.5.23"}


SEED_BUG = ["run", "--scenario", "skewed", "--steps", "3", "--tokens", "64", "--layers", "2",
            "--experts", "16", "--gpus", "8", "--gpus-per-node", "4", "--solver", "trivial",
            "--rng", "shared", "--mode", "none", "--policies", "sglang:dynamic"]


def test_the_seeds_bug_from_the_releases_own_code(capsys):
    """0.5.16's dynamic dispatch in "none" splits ranks from its per-rank candidate lists
    alone (every rank draws the same numbers: --rng shared); 0.5.17 (PR #32962) is exact."""
    for version in ("0.5.16", "0.5.17"):
        _fetched("sglang", version)
    old, fixed = (_run_json(capsys, SEED_BUG + ["--engine-source", f"sglang=={v}"])[0]
                  for v in ("0.5.16", "0.5.17"))
    assert old["engine"] == "sglang 0.5.16" and fixed["engine"] == "sglang 0.5.17"
    assert old["rank_agreement"] < 1 and old["output_rel_error"] > 0
    assert fixed["rank_agreement"] == 1 and fixed["output_rel_error"] == 0


def test_vllm_0_34_hash_equals_its_twin_in_both_modes(capsys):
    _fetched("vllm", "0.34.0")
    argv = ["run", "--scenario", "template", "--steps", "2", "--tokens", "48", "--layers", "2",
            "--experts", "16", "--top-k", "4", "--gpus", "4", "--mode", "none,a2a"]
    ours = _run_json(capsys, argv + ["--policies", "vllm:hash", "--engine-source",
                                     "vllm==0.34.0"])
    twin = _run_json(capsys, argv + ["--policies", "hash"])
    for a, b in zip(ours, twin):
        assert a.pop("engine") == "vllm 0.34.0"
        for row in (a, b):
            row.pop("policy"), row.pop("engine_source")
        assert a == b


def test_a_repository_checkout_and_what_a_source_lacks(sglang_source, tmp_path, capsys):
    repo = tmp_path / "repo"
    shutil.copytree(sglang_source / "sglang", repo / "python" / "sglang")
    (repo / "python" / "sglang/test/kernels/lplb.py").unlink()
    argv = ["run", "--scenario", "skewed", "--steps", "2", "--tokens", "32", "--layers", "1",
            "--experts", "8", "--gpus", "2", "--engine-source", f"sglang={repo}"]
    row = _run_json(capsys, argv + ["--policies", "sglang:dynamic"])[0]
    assert row["engine"] == f"sglang at {(repo / 'python').resolve()}"
    _one_error_line(capsys, argv + ["--policies", "sglang:lp"], "cannot run lp: no "
                    "sglang/test/kernels/lplb.py")
    listed = _run_json(capsys, ["engines", "list", "--engine-source", f"sglang={repo}"])[0]
    assert listed["algorithms"]["sglang:lp"] == "no sglang/test/kernels/lplb.py"
    assert listed["algorithms"]["sglang:dynamic"] is None
    assert listed["algorithms"]["sglang:auto"] is None  # 0.5.23: arg_groups/parallel_hook.py
    (repo / "python" / "sglang/srt/arg_groups/parallel_hook.py").unlink()
    engines.adapter.cache_clear()
    listed = _run_json(capsys, ["engines", "list", "--engine-source", f"sglang={repo}"])[0]
    assert listed["algorithms"]["sglang:auto"] == (  # where it lived before 0.5.23: not here
        "no sglang/srt/arg_groups/parallel_hook.py; no function "
        "ServerArgs._handle_eplb_and_dispatch in sglang.srt.server_args")


def test_several_releases_side_by_side_and_a_review_of_one_against_another(capsys):
    for version in ("0.5.16", "0.5.17"):
        _fetched("sglang", version)
    rows = _run_json(capsys, ["run", "--policies", "sglang:static,sglang:dynamic,row", "--mode",
                              "none", "--engine-source", "sglang==0.5.16,sglang==0.5.17",
                              "--rng", "shared", "--steps", "2", "--tokens", "64"])
    assert [(r["policy"], r.get("engine")) for r in rows] == [
        ("sglang:static", "sglang 0.5.16"), ("sglang:static", "sglang 0.5.17"),
        ("sglang:dynamic", "sglang 0.5.16"), ("sglang:dynamic", "sglang 0.5.17"),
        ("row", None)]  # a policy that is no engine's runs once
    report = _json_status(capsys, [
        "review", "sglang:dynamic", "--engine-source", "sglang==0.5.16", "--baseline",
        "sglang:dynamic", "--baseline-engine-source", "sglang==0.5.17", *SEED_BUG[1:9],
        "--solver", "trivial", "--rng", "shared"], 1)
    assert (report["candidate"], report["baseline"]) == ("sglang:dynamic (sglang 0.5.16)",
                                                         "sglang:dynamic (sglang 0.5.17)")
    assert report["verdict"] == "not recommended"
    assert report["invariance"]["counterexample"] is not None


def _json_status(capsys, argv, status):
    assert main(argv + ["--json"]) == status
    return json.loads(capsys.readouterr().out)


def test_bisect_names_the_release_that_fixed_the_seeds_bug(capsys, monkeypatch):
    """Over the tested releases (the package index listed as them, so nothing is fetched
    here): rank agreement of SGLang's own dynamic dispatch in "none" changes at 0.5.17."""
    from eplbsim.engines import bisect
    tested = engines.ENGINES["sglang"].tested
    for version in tested:
        _fetched("sglang", version)
    monkeypatch.setattr(bisect, "index_versions", lambda engine: ["0.5.1", *tested, "0.6.0"])
    argv = ["engines", "bisect", "sglang", f"{tested[0]}..{tested[-1]}", "--policies",
            "sglang:dynamic", "--mode", "none", "--metric", "rank_agreement", "--solver",
            "trivial", "--rng", "shared", "--steps", "2", "--tokens", "64", "--layers", "2",
            "--gpus", "8", "--gpus-per-node", "4"]
    out = _run_json(capsys, argv)
    assert out["first_changed"] == "0.5.17" and out["releases"] == list(tested)
    assert out["tried"] and all(  # before 0.5.17 as GOOD, from it changed
        t["status"] == ("changed" if engines.version_key(t["release"]) >=
                        engines.version_key("0.5.17") else "good") for t in out["tried"])
    assert main(argv) == 0
    assert "first release at which rank_agreement changes: 0.5.17" in capsys.readouterr().out
    _one_error_line(capsys, argv[:3] + ["0.5.23..0.5.16"] + argv[4:], "is not older than")
    _one_error_line(capsys, argv[:3] + ["0.4.0..0.5.23"] + argv[4:], "has no release 0.4.0")


def test_bisect_goes_around_a_release_that_does_not_run():
    from eplbsim.engines.bisect import bisect
    values = {"1": 0.5, "2": 0.5, "3": None, "4": 1.0, "5": 1.0}

    def measure(version):
        if values[version] is None:
            raise InputError("lacks a function")
        return values[version]
    first, tried = bisect(list(values), measure)
    assert first == "4"
    assert {t.release: t.status for t in tried}["3"] == "failed"
    first, tried = bisect(["1", "2"], lambda v: 0.5)  # nothing changed
    assert first is None and [t.status for t in tried] == ["good", "good"]


AUTO = SEED_BUG[:-1] + ["sglang:auto", "--engine-args",
                        "--enable-eplb --moe-a2a-backend none --ep-num-redundant-experts 16"]


def test_auto_runs_what_each_release_picks_and_prints_its_refusal(capsys):
    """The seed's story whole: with EPLB on and no a2a backend, 0.5.16's own settings logic
    picks static (ranks split) and 0.5.17's picks dynamic (exact); 0.5.23 refuses static
    without an a2a backend, in its own words."""
    for version in ("0.5.16", "0.5.17", "0.5.23"):
        _fetched("sglang", version)
    rows = _run_json(capsys, AUTO + ["--engine-source", "sglang==0.5.16,sglang==0.5.17"])
    assert [(r["engine"], r["picked"]) for r in rows] == [("sglang 0.5.16", "static"),
                                                         ("sglang 0.5.17", "dynamic")]
    assert rows[0]["rank_agreement"] < 1 and rows[0]["output_rel_error"] > 0
    assert rows[1]["rank_agreement"] == 1 and rows[1]["output_rel_error"] == 0
    static = _run_json(capsys, SEED_BUG[:-1] + ["sglang:static", "--engine-source",
                                                "sglang==0.5.16"])[0]
    assert static["rank_agreement"] == rows[0]["rank_agreement"]  # the same code ran
    assert main(AUTO + ["--engine-source", "sglang==0.5.17"]) == 0
    assert "sglang:auto: sglang 0.5.17 picked dynamic in none" in capsys.readouterr().out
    refused = AUTO[:-1] + ["--enable-eplb --ep-dispatch-algorithm static", "--engine-source",
                           "sglang==0.5.23"]
    _one_error_line(capsys, refused, "sglang 0.5.23 refuses these flags: "
                    "--ep-dispatch-algorithm static picks a different physical replica per rank")
    _one_error_line(capsys, AUTO[:-1] + ["--enable-eplb", "--mode", "a2a",  # one flag alone
                                         "--gpus", "1", "--gpus-per-node", "1", "--redundant", "0"],
                    "ep_size > 1")
    _one_error_line(capsys, AUTO[:-1] + ["--moe-a2a-backend none"], "picks no dispatch")
    _one_error_line(capsys, AUTO[:-1] + ["--enable-eplb --ep-num-redundant-experts 3"],
                    "this run has 16 (--redundant)")
    _one_error_line(capsys, AUTO[:-1] + ["--enable-eplb --port 30000"],
                    "'--port' is not one of them")


def test_fake_routes_each_rank_from_its_own_logits(sglang_source, capsys):
    """SGLang's fake dispatch redraws the router logits on every rank: ranks that draw alike
    (--rng shared) agree, ranks with their own generators split in "none"; either way its
    pairs run on other experts than the router chose, and the output error says so."""
    argv = SEED_BUG[:-1] + ["sglang:fake"]
    shared = _run_json(capsys, argv)[0]
    own = _run_json(capsys, argv[:argv.index("--rng")] + argv[argv.index("--rng") + 2:])[0]
    assert shared["rank_agreement"] == 1 and shared["output_rel_error"] > 0
    assert own["rank_agreement"] < 0.5 and own["output_rel_error"] > 0
    dynamic = _run_json(capsys, SEED_BUG)[0]
    assert shared["gpu_imbalance"] != dynamic["gpu_imbalance"]  # not the trace's experts


def test_the_release_views_are_those_releases_lists():
    """`sglang-0.5.14` and `sglang-0.5.16` each equal the candidate lists of the release they
    are named for, at start-up and after a rebalance, in both modes, on every rank, and
    `engines conform` checks each release against its own (`list_view`)."""
    from eplbsim.engines.conform import _placements, _rebalanced, list_view
    from eplbsim.placement import VIEWS
    for version, view in (("0.5.14", "sglang-0.5.14"), ("0.5.16", "sglang-0.5.16")):
        _fetched("sglang", version)
        source = engines.as_sources({"sglang": f"={version}"})
        assert list_view(source) == view
        run = engines.adapter("sglang", source)
        for i, start in enumerate(_placements(0, 2)):
            for placement in (start, _rebalanced(run, start, i)):
                for mode in ("none", "a2a"):
                    for r in range(placement.topology.num_gpus):
                        infos = engines.sglang_infos(run, placement, "static", mode == "a2a", r)
                        lists = torch.stack([x.partial_logical_to_all_physical_map
                                             for x in infos])
                        mine = VIEWS[view](placement, r, mode).log2phy
                        R = mine.shape[-1]
                        assert torch.equal(lists[..., :R], mine), (version, mode, r)
                        assert bool((lists[..., R:] == -1).all())


def test_ranks_and_a_sweep_over_two_releases_name_each(capsys, tmp_path):
    """`ranks` runs real processes for each source and names it; a sweep's grid takes sources
    as `engine_source.ENGINE` and its rows name the code that ran."""
    for version in ("0.5.16", "0.5.17"):
        _fetched("sglang", version)
    argv = ["ranks", "--world-size", "2", "--policies", "sglang:dynamic", "--mode", "none",
            "--engine-source", "sglang==0.5.16,sglang==0.5.17", "--steps", "2", "--tokens",
            "32", "--layers", "2", "--rng", "shared", "--solver", "trivial"]
    assert main(argv) == 0  # one launch of real processes: the table names each release
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:3] == ["policy", "mode", "engine"]
    assert [" ".join(line.split()[2:4]) for line in table[2:4]] == ["sglang 0.5.16",
                                                                    "sglang 0.5.17"]
    assert table[-1].startswith("2 of 2 configurations: every metric of the real processes")
    spec = tmp_path / "s.toml"
    spec.write_text('[grid]\n"engine_source.sglang" = ["=0.5.16", "=0.5.17"]\n[fixed]\n'
                    'policy = "sglang:dynamic"\nscenario = "skewed"\nsteps = 2\ntokens = 32\n'
                    'layers = 2\nrng = "shared"\nsolver = "trivial"\nmode = "none"\n')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--workers", "1"]) == 0
    with open(tmp_path / "out" / "results.csv") as f:
        cells = list(csv.DictReader(f))
    assert [(c["engine"], float(c["rank_agreement"]) < 1) for c in cells] == [
        ("sglang 0.5.16", True), ("sglang 0.5.17", False)]


def test_several_sources_give_one_row_per_policy_mode_and_release_it_reads(capsys):
    """Two SGLang releases side by side: `sglang:dynamic` runs under each, `vllm:hash` and
    `ordinal` (which read no SGLang code) once; the footer names each corrupt row's release."""
    for version in ("0.5.16", "0.5.17"):
        _fetched("sglang", version)
    argv = ["run", "--policies", "sglang:dynamic,vllm:hash,ordinal", "--mode", "none",
            "--engine-source", "sglang==0.5.16,sglang==0.5.17", "--scenario", "skewed",
            "--steps", "2", "--tokens", "64", "--layers", "2", "--cost", "roofline"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split()[:2] for line in lines[2:] if line.split()[:1] in (
        ["sglang:dynamic"], ["vllm:hash"], ["ordinal"])]
    table = rows[:len(rows) // 2]  # the balance table; the time table repeats the rows
    assert table == [["sglang:dynamic", "none"], ["sglang:dynamic", "none"],
                     ["vllm:hash", "none"], ["ordinal", "none"]]
    footer = next(line for line in lines if line.startswith("corrupt: "))
    assert "sglang:dynamic (none, sglang 0.5.16)" in footer
    assert footer.count("sglang:dynamic") == len(set(footer.split("sglang:dynamic")[1:]))


FLASHLB_STAND_IN = '''import torch


class FlashlbEplbPolicy:
    """A stand-in written for this test with vLLM's main-branch signature: every slot p holds
    expert p % E; it adds 1 to the loads in place, as vLLM's FlashLB does."""

    def rebalance_experts(self, weight, num_replicas, num_groups, num_nodes, num_ranks,
                          old_global_expert_indices):
        weight += 1
        layers, experts = weight.shape
        phy2log = torch.arange(num_replicas).remainder(experts).expand(layers, -1)
        return phy2log.to(torch.int32), None, None
'''


def test_vllm_flashlb_runs_from_a_checkout_that_has_it(tmp_path, capsys):
    """`vllm:flashlb` is vLLM's FlashlbEplbPolicy where a source has its file (vLLM's main
    branch), with the caller's loads left as they were; a release without it says so."""
    from eplbsim.cli import main
    from eplbsim.solvers import solve
    from eplbsim.placement.topology import Topology
    release = engines.release("vllm")
    if release is None:
        pytest.skip("vllm is not fetched (eplbsim engines fetch)")
    checkout = tmp_path / "vllm-main"
    shutil.copytree(release / "vllm", checkout / "vllm")
    (checkout / "vllm/distributed/eplb/policy/flashlb.py").write_text(FLASHLB_STAND_IN)
    load = np.arange(12, dtype=np.float64).reshape(2, 6) + 1
    before = load.copy()
    solver = engines.engine_solver("vllm:flashlb", {"vllm": str(checkout)})
    placement = solve(solver, load, 8, Topology(4))
    assert placement.phy2log.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * 2
    assert np.array_equal(load, before)
    assert engines.availability("vllm")["vllm:flashlb"].endswith("lacks "
                                                                 "vllm/distributed/eplb/policy/flashlb.py")
    assert engines.availability("vllm", engines.as_sources({"vllm": str(checkout)}))[
        "vllm:flashlb"] is None
    assert main(["engines", "list", "--engine-source", f"vllm={checkout}"]) == 0
    assert "vllm:flashlb" in capsys.readouterr().out
