"""Branches of the engines' own dispatch as an engineer would write them (issue 58): each learns
its rank through one channel (`engines.identity.CHANNELS`) and so gives every rank of a
deployment a different replica; `review` refuses each with a counterexample and exit status 1,
`run` and `ranks` (real processes) see the same disagreement; a rank-invariant hash branch is not
refused; a branch that raises gets the engine's own message, named by file, line and rank.

Dimensions: `G` ranks, `L` layers, `E` experts, `K` top-k.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eplbsim import engines
from eplbsim.cli import main
from eplbsim.engines.identity import EngineError
from eplbsim.ranks.checks import observed_sharing, probe_placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.review import review
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import save_trace

SGLANG_LINE = "chosen_dispatch_index = row_index % num_valid"  # 0.5.17 (PR #32962) to 0.5.23
SGLANG_FILE = "sglang/srt/eplb/expert_location_dispatch.py"
# branch -> (what it imports at the top of the file, what it adds to row_index, the channel)
SGLANG_BRANCHES = {
    "guarded-get-rank": ("", "(torch.distributed.get_rank() if "
                         "torch.distributed.is_initialized() else 0)",
                         "torch.distributed.get_rank"),
    "get-rank": ("", "torch.distributed.get_rank()", "torch.distributed.get_rank"),
    "imported-get-rank": ("from torch.distributed import get_rank, is_initialized\n",
                          "(get_rank() if is_initialized() else 0)",
                          "torch.distributed.get_rank"),
    "tp-rank": ("from sglang.srt.runtime_context import get_parallel\n",
                "get_parallel().tp_rank", "sglang get_parallel().tp_rank"),
    "ep-group": ("from sglang.srt.distributed import get_moe_ep_group\n",
                 "get_moe_ep_group().rank_in_group", "sglang get_moe_ep_group().rank_in_group"),
    "ep-getter": ("from sglang.srt.distributed import get_moe_expert_parallel_rank\n",
                  "get_moe_expert_parallel_rank()", "sglang get_moe_expert_parallel_rank"),
    "dp-attention": ("from sglang.srt.layers.dp_attention import get_attention_dp_rank\n",
                     "get_attention_dp_rank()", "sglang get_attention_dp_rank"),
    "local-rank-env": ("import os\n", "int(os.environ.get('LOCAL_RANK', '0'))",
                       "os.environ['LOCAL_RANK']"),
    "rank-getenv": ("import os\n", "int(os.getenv('RANK', '0'))", "os.environ['RANK']"),
    "device-index": ("", "torch.cuda.current_device()", "torch.cuda.current_device"),
}
HASH = "chosen_dispatch_index = (row_index * 2654435761 + topk_ids) % num_valid"
VLLM_FILE = "vllm/model_executor/layers/fused_moe/router/base_router.py"
VLLM_LINE = "        return _eplb_map_and_record_triton(\n"  # the CUDA-like wrapper, 0.33.0
VLLM_BRANCHES = {  # branch -> (the rank as it reads it, the channel)
    "ep-group": ("__import__('vllm.distributed', fromlist=['_']).get_ep_group().rank_in_group",
                 "vllm get_ep_group().rank_in_group"),
    "get-rank": ("torch.distributed.get_rank()", "torch.distributed.get_rank"),
    "device-group": ("__import__('vllm.distributed', fromlist=['_']).get_ep_group()"
                     ".device_group.rank()", "vllm get_ep_group().rank_in_group"),
    "envs-local-rank": ("__import__('vllm.envs', fromlist=['_']).LOCAL_RANK",
                        "os.environ['LOCAL_RANK']"),
}


def _release(engine: str, version: str) -> Path:
    folder = engines.release(engine, version)
    if folder is None:
        pytest.skip(f"{engine} {version} is not fetched (eplbsim engines fetch)")
    return folder


def _branch(tmp: Path, engine: str, version: str, file: str, old: str, new: str,
            imports: str = "") -> Path:
    """A copy of a release with `old` replaced by `new` in `file` (and `imports` after its
    `import torch`): a checkout, as a developer's branch is."""
    folder = tmp / f"{engine}-{version}-branch"
    shutil.copytree(_release(engine, version) / engine, folder / engine)
    path = folder / file
    text = path.read_text()
    assert text.count(old) == 1
    text = text.replace(old, new).replace("import torch\n", f"import torch\n{imports}", 1)
    path.write_text(text)
    return folder


def _sglang_branch(tmp: Path, version: str, name: str) -> Path:
    imports, rank, _ = SGLANG_BRANCHES[name]
    return _branch(tmp, "sglang", version, SGLANG_FILE, SGLANG_LINE,
                   f"chosen_dispatch_index = (row_index + {rank}) % num_valid", imports)


def _vllm_branch(tmp: Path, name: str) -> Path:
    rank = VLLM_BRANCHES[name][0]
    shifted = ("        shift = " + rank + "\n"
               "        count = logical_replica_count.clamp(min=1).unsqueeze(1)\n"
               "        cols = (torch.arange(logical_to_physical_map.shape[1]).unsqueeze(0)"
               " + shift) % count\n"
               "        logical_to_physical_map = logical_to_physical_map.gather(1, cols)\n")
    return _branch(tmp, "vllm", "0.33.0", VLLM_FILE, VLLM_LINE, shifted + VLLM_LINE)


@pytest.fixture(scope="module")
def trace():
    return synthesize("template", steps=6, tokens=48, layers=2, experts=16, top_k=4, seed=1)


SPEC = dict(gpus=4, gpus_per_node=2, redundant=8, mode="none")


def _probe(policy: str, folder: Path) -> str:
    placement = probe_placement(16, 24, Topology(4, 2), 2)
    return observed_sharing(policy, placement, "full", "independent", 0, 4,
                            {policy.partition(":")[0]: str(folder)})


def _agreement(trace, policy: str, folder: Path) -> float:
    spec = RunSpec.of(policy=policy, engine_source={policy.partition(":")[0]: str(folder)},
                      **SPEC)
    return replay(trace, spec).metrics["rank_agreement"]


def _refused(trace, policy: str, folder: Path) -> None:
    """`review` of the branch against the default baseline: not recommended (exit 1), with
    a counterexample of one row or more on which the ranks chose differently."""
    spec = RunSpec.of(engine_source={policy.partition(":")[0]: str(folder)}, **SPEC)
    report = review(trace, policy, spec=spec, seeds=1, windows=1, resamples=200)
    assert report.verdict == "not recommended" and report.exit_status == 1
    example = report.invariance["counterexample"]
    assert example is not None and len(set(example["choices"].values())) > 1, example


OLDER = ("guarded-get-rank", "tp-rank", "ep-getter", "local-rank-env")  # on 0.5.17 too


@pytest.mark.parametrize("version, name", [("0.5.23", n) for n in sorted(SGLANG_BRANCHES)]
                         + [("0.5.17", n) for n in OLDER])
def test_a_sglang_branch_that_reads_its_rank_is_seen_to_and_disagrees(tmp_path, trace, version,
                                                                     name):
    folder = _sglang_branch(tmp_path, version, name)
    said = _probe("sglang:dynamic", folder)
    assert said.startswith(f"reads its rank through {SGLANG_BRANCHES[name][2]} "
                           f"({SGLANG_FILE}:"), said
    assert said.endswith("one call a rank")
    _refused(trace, "sglang:dynamic", folder)
    assert _agreement(trace, "sglang:dynamic", folder) < 1


@pytest.mark.parametrize("name", sorted(VLLM_BRANCHES))
def test_a_vllm_branch_that_reads_its_rank_is_seen_to_and_disagrees(tmp_path, trace, name):
    folder = _vllm_branch(tmp_path, name)
    said = _probe("vllm:hash", folder)
    assert said.startswith(f"reads its rank through {VLLM_BRANCHES[name][1]} ({VLLM_FILE}:")
    _refused(trace, "vllm:hash", folder)
    assert _agreement(trace, "vllm:hash", folder) < 1


def _review(capsys, tmp: Path, trace, argv: list[str]) -> tuple[int, str]:
    path = tmp / "trace.npz"
    if not path.exists():
        save_trace(trace, path)
    status = main(["review", *argv, "--trace", str(path), "--mode", "none", "--gpus", "4",
                   "--gpus-per-node", "2", "--redundant", "8", "--seeds", "1", "--windows",
                   "1", "--resamples", "200"])
    return status, capsys.readouterr().out


def _folder(tmp: Path, engine: str, version: str, name: str) -> tuple[Path, str]:
    """The branch `name` of an engine release, and the engine policy it changes."""
    if engine == "sglang":
        return _sglang_branch(tmp, version, name), "sglang:dynamic"
    return _vllm_branch(tmp, name), "vllm:hash"


@pytest.mark.parametrize("engine, version, name", [("sglang", "0.5.23", "guarded-get-rank"),
                                                   ("sglang", "0.5.23", "get-rank"),
                                                   ("sglang", "0.5.17", "tp-rank"),
                                                   ("vllm", "0.33.0", "ep-group")])
def test_review_refuses_a_rank_reading_branch(tmp_path, capsys, trace, engine, version, name):
    folder, policy = _folder(tmp_path, engine, version, name)
    status, out = _review(capsys, tmp_path, trace,
                          [policy, "--engine-source", f"{engine}={folder}"])
    assert status == 1, out
    assert "## Verdict: not recommended" in out and "ranks choose different replicas" in out
    assert "Smallest counterexample" in out and "reads its rank through" in out


@pytest.mark.parametrize("engine, version, name", [("sglang", "0.5.23", "guarded-get-rank"),
                                                   ("vllm", "0.33.0", "ep-group")])
def test_real_processes_disagree_as_the_simulation_does(tmp_path, capsys, trace, engine,
                                                        version, name):
    """`ranks` (gloo processes, each its own rank) on the branch the simulation refuses."""
    folder, policy = _folder(tmp_path, engine, version, name)
    path = tmp_path / "trace.npz"
    save_trace(trace, path)
    assert main(["ranks", "--trace", str(path), "--policies", policy, "--engine-source",
                 f"{engine}={folder}", "--mode", "none", "--gpus-per-node", "2", "--redundant",
                 "8", "--world-size", "2", "--json"]) == 0
    agree = json.loads(capsys.readouterr().out)[0]["metrics"]["rank_agreement"]
    assert agree["match"] and agree["real"] < 1, agree


def test_review_passes_a_rank_invariant_hash_branch(tmp_path, capsys, trace):
    folder = _branch(tmp_path, "sglang", "0.5.23", SGLANG_FILE, SGLANG_LINE, HASH)
    assert _probe("sglang:dynamic", folder).startswith("draws nothing and reads no rank")
    status, out = _review(capsys, tmp_path, trace,
                          ["sglang:dynamic", "--engine-source", f"sglang={folder}"])
    assert status in (0, 3), out
    assert "ranks agree" in out and "## Verdict: not recommended" not in out
    assert _agreement(trace, "sglang:dynamic", folder) == 1


def test_a_branch_that_raises_gets_the_engines_message(tmp_path, capsys, trace):
    folder = _branch(tmp_path, "sglang", "0.5.23", SGLANG_FILE, SGLANG_LINE,
                     "chosen_dispatch_index = row_index % num_valid[:1].expand(5)")
    spec = RunSpec.of(policy="sglang:dynamic", engine_source={"sglang": str(folder)}, **SPEC)
    with pytest.raises(EngineError) as caught:
        replay(trace, spec)
    text = str(caught.value)
    assert text.startswith(f"sglang at {folder}, rank 0: the engine's code raised in "
                           f"topk_ids_logical_to_physical at {SGLANG_FILE}:")
    assert "num_valid[:1].expand(5)" in text and "RuntimeError" in text
    status, out = _review(capsys, tmp_path, trace,
                          ["sglang:dynamic", "--engine-source", f"sglang={folder}"])
    assert status == 1 and "not recommended" in out and SGLANG_FILE in out
    assert main(["run", "--trace", str(tmp_path / "trace.npz"), "--policies",
                 "sglang:dynamic", "--engine-source", f"sglang={folder}"]) == 2
    assert "the engine's code raised" in capsys.readouterr().err


POLICY_FILE = '''import torch


def pol(topk_ids, view, ctx):
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    ids = topk_ids.clamp(min=0)
    rows = torch.arange(topk_ids.shape[0])[:, None]
    phys = view.log2phy[ctx.layer][ids, (rows + rank) % view.logcnt[ctx.layer][ids]]
    return torch.where(topk_ids >= 0, phys, -1)


def broken(topk_ids, view, ctx):
    return view.log2phy[ctx.layer][topk_ids, 99]
'''


def test_a_policy_file_is_that_rank_to_every_channel_too(tmp_path, capsys, trace):
    """A candidate in a file (`file.py:function`), as review takes one, learns its rank as an
    engine branch does, and its own exception names its file, line and rank."""
    file = tmp_path / "mine.py"
    file.write_text(POLICY_FILE)
    status, out = _review(capsys, tmp_path, trace, [f"{file}:pol"])
    assert status == 1 and "ranks choose different replicas" in out, out
    with pytest.raises(EngineError, match=r"policy .*mine\.py:broken, rank 0: its code raised "
                                          r"in broken at mine\.py:13 .*IndexError"):
        replay(trace, RunSpec.of(policy=f"{file}:broken", **SPEC))
