"""The `topology-aware` solver (`eplbsim.solvers.topology_aware`) in a run: the schedule hands it
the window's source-rank counts (`ranks.traffic.source_load`), and on traffic whose experts
come from other ranks than the default layout's it cuts the pairs sent across GPUs. SGLang's
own cases are replayed in `test_peers.py`."""

import json

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.cli import main
from eplbsim.ranks.traffic import source_counts, source_load
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.counts import CountsTrace
from eplbsim.traces.trace import Trace, save_trace


def _homesick(steps=4, tokens=64, G=4, E=16):
    """Tokens of rank `r` choose every expert of the default layout's block of rank
    `G - 1 - r` (top-`E / G`): the experts' loads are equal, every swap keeps the balance."""
    src = np.tile(np.arange(tokens) % G, steps)
    ids = ((G - 1 - src) * (E // G))[:, None, None] + np.arange(E // G)  # [N, 1, K]
    return Trace(ids, np.arange(steps + 1) * tokens, E, src_rank=src)


def test_source_counts_are_the_pairs_each_owner_sends_each_expert():
    ids = torch.tensor([[[0, 2]], [[2, -1]], [[1, 2]]])  # [T=3, L=1, K=2]
    owners = torch.tensor([1, 0, 1])
    counts = source_counts(ids, owners, 2, 3)  # [L, G, E]
    assert counts.tolist() == [[[0, 0, 1], [1, 1, 2]]]
    trace = _homesick(steps=2)
    total = source_load(trace, 4, range(2))
    assert total.sum(1).tolist() == trace.counts().sum(0).double().tolist()


@pytest.mark.filterwarnings("ignore:model deepseek-v3")
def test_a_replay_sends_fewer_pairs_across_gpus_than_the_default_layout():
    trace = _homesick()
    spec = RunSpec.of(policy="ordinal", mode="a2a", gpus=4, redundant=0, cost="roofline")
    ours, trivial = (replay(trace, spec.replace(solver=s)).metrics
                     for s in ("topology-aware", "trivial"))
    assert ours["remote_frac"] == 0 < trivial["remote_frac"]
    assert ours["gpu_imbalance"] <= trivial["gpu_imbalance"] + 1e-12


def test_counts_only_inputs_are_refused_with_the_reason():
    counts = CountsTrace(np.ones((3, 1, 8), np.int64))
    with pytest.raises(InputError, match="source-rank expert counts"):
        replay(counts, RunSpec.of(solver="topology-aware", gpus=2, redundant=0))


def test_solve_reads_the_source_counts_of_a_trace_and_a_topology_file(tmp_path, capsys):
    path = tmp_path / "t.npz"
    save_trace(_homesick(steps=1), path)
    costs = tmp_path / "topology.json"
    costs.write_text(json.dumps({"rank_cost_matrix": (1 - np.eye(4)).tolist()}))
    assert main(["solve", "--counts", str(path), "--gpus", "4", "--solver", "topology-aware",
                 "--solver-option", f"rank_costs={costs}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["traffic"] == 0 < report["seed_traffic"]
    assert report["phy2log"][0][:4] == list(range(12, 16))
