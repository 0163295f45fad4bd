"""The `affinity` solver (`eplbsim.solvers.affinity`): co-activated experts together, within the
slack on the balance solver's max GPU load, its report against the MILP bound."""

import json

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.cli import main
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.solvers import solve, solve_with_info
from eplbsim.traces import synthesize
from eplbsim.traces.counts import CountsTrace
from eplbsim.traces.trace import save_trace


def _planted(E=16, clusters=4, seed=0):
    """Loads `[1, E]` near-uniform and a co-activation with `clusters` hidden groups of
    experts (a random permutation), strong pairs within, weak across."""
    rng = np.random.default_rng(seed)
    group = rng.permutation(np.arange(E) % clusters)
    load = 1000 + rng.integers(0, 50, E).astype(np.float64)
    pairs = np.where(group[:, None] == group[None, :], 300.0, 10.0)
    np.fill_diagonal(pairs, load)
    return load[None], pairs[None], group


def _gpu_sets(placement):
    G = placement.topology.num_gpus
    return [set(placement.phy2log[0].reshape(G, -1)[g].tolist()) for g in range(G)]


def test_planted_clusters_land_one_on_each_gpu_and_the_milp_proves_it():
    load, pairs, group = _planted()
    placement, info = solve_with_info("affinity", load, 16, Topology(4), coactivation=pairs,
                                      slack=0.2, milp_vars=1000)
    for members in _gpu_sets(placement):
        assert len({int(group[e]) for e in members}) == 1  # one hidden group a GPU
    assert info["objective"] < info["balance_objective"]
    assert info["bound"] <= info["objective"] + 1e-6 and info["gap"] < 1e-6


def test_the_load_cap_holds_on_summed_and_on_per_step_loads():
    trace = synthesize("clustered", seed=4, steps=6, tokens=256, layers=2, experts=32, top_k=4)
    from eplbsim.replay import routed_loads
    from eplbsim.traces.coactivation import coactivation

    steps = routed_loads(trace).double().numpy()  # [S, L, E]
    load, pairs, topo = steps.sum(0), coactivation(trace), Topology(4)
    base = solve("deepseek", load, 40, topo)
    for history in (None, steps):
        placement, info = solve_with_info("affinity", load, 40, topo, coactivation=pairs,
                                          history=history, slack=0.05)
        assert torch.equal(placement.logcnt, base.logcnt)  # the balance solver's replication
        per_gpu = [p.expected_load(torch.from_numpy(steps if history is not None else load))
                   .reshape(*(steps.shape[:2] if history is not None else (2,)), 4, -1).sum(-1)
                   for p in (placement, base)]
        peaks = [g.amax(-1).mean(0) if history is not None else g.amax(-1) for g in per_gpu]
        assert (peaks[0] <= peaks[1] * 1.05 + 1e-9).all()
        assert info["objective"] <= info["balance_objective"]
        assert info["max_load_ratio"] <= 1.05 + 1e-9 or history is not None


def test_its_balance_solver_is_handed_in_by_name_or_as_a_callable():
    """`solve` resolves a registry name into the callable affinity builds on; the solver module
    itself never looks a name up (it would import the registry that lists it)."""
    from eplbsim.solvers.affinity import affinity
    from eplbsim.solvers.lpt import lpt

    load, pairs, _ = _planted()
    topo = Topology(4)
    by_name = solve("affinity", load, 20, topo, coactivation=pairs, balance="lpt")
    by_callable = solve("affinity", load, 20, topo, coactivation=pairs, balance=lpt)
    assert torch.equal(by_name.phy2log, by_callable.phy2log)
    assert torch.equal(by_name.logcnt, solve("lpt", load, 20, topo).logcnt)
    with pytest.raises(InputError, match="unknown solver"):
        solve("affinity", load, 20, topo, coactivation=pairs, balance="nope")
    with pytest.raises(InputError, match="registry name"):
        affinity(load, 20, topo, coactivation=pairs, balance="lpt")


def test_it_needs_the_coactivation_and_says_so():
    with pytest.raises(InputError, match="co-activation"):
        solve("affinity", np.ones((1, 4)), 4, Topology(2))
    with pytest.raises(InputError, match=r"\[layers, experts, experts\]"):
        solve("affinity", np.ones((1, 4)), 4, Topology(2), coactivation=np.ones((1, 4, 3)))
    counts = CountsTrace(np.ones((3, 1, 8), np.int64))
    with pytest.raises(InputError, match="counts-only"):
        replay(counts, RunSpec.of(solver="affinity", gpus=2, redundant=0))


def test_a_replay_on_clustered_traffic_fans_out_less_than_deepseek():
    trace = synthesize("clustered", seed=1, steps=4, tokens=512, layers=2, experts=32,
                       top_k=6)
    spec = RunSpec.of(policy="ordinal", mode="a2a", gpus=4, redundant=4, cost="roofline")
    ours, theirs = (replay(trace, spec.replace(solver=s)).metrics
                    for s in ("affinity", "deepseek"))
    assert ours["fanout_gpus"] < 0.9 * theirs["fanout_gpus"]
    assert ours["comm_ms"] < theirs["comm_ms"]


def test_solve_reads_the_coactivation_of_a_trace_and_reports_the_bound(tmp_path, capsys):
    trace = synthesize("clustered", seed=2, steps=2, tokens=128, layers=1, experts=8, top_k=4)
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    assert main(["solve", "--counts", str(path), "--gpus", "2", "--redundant", "2", "--solver",
                 "affinity", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["objective"] <= report["balance_objective"]
    assert report["bound"] <= report["objective"] + 1e-9 and 0 <= report["gap"] <= 1
    load = tmp_path / "load.json"
    load.write_text("[[1, 2, 3, 4]]")
    assert main(["solve", "--load", str(load), "--gpus", "2", "--solver", "affinity"]) == 2
    assert "co-activation" in capsys.readouterr().err
