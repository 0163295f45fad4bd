"""eplbsim.traces.coactivation: pair counts equal a straightforward numpy count, the partition
shares, `trace info --coactivation`, the clustered scenario's structure, and `colocate`, the
rank-invariant policy that sends a token to fewer GPUs."""

import json

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.dispatch import DispatchContext, POLICIES
from eplbsim.placement import Placement, full_view
from eplbsim.placement.topology import Topology
from eplbsim.ranks.checks import rank_invariance
from eplbsim.traces.coactivation import coactivation, grouped, kept_share, random_groups
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace, save_trace

from cli_helpers import run


def _numpy_counts(trace):
    """Within-layer and next-layer pair counts, one token at a time."""
    L, E = trace.num_layers, trace.num_experts
    within, across = np.zeros((L, E, E), np.int64), np.zeros((max(L - 1, 0), E, E), np.int64)
    for s in range(trace.num_steps):
        for row in trace.step(s).numpy():  # [L, K]
            for layer in range(L):
                a = row[layer][row[layer] >= 0]
                within[layer][np.ix_(a, a)] += 1
                if layer + 1 < L:
                    b = row[layer + 1][row[layer + 1] >= 0]
                    across[layer][np.ix_(a, b)] += 1
    return within, across


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_compiled_pass_equals_a_numpy_count(seed):
    rng = np.random.default_rng(seed)
    S, L, E, K = 3, 3, 12, 4
    sizes = rng.integers(1, 20, S)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(sizes.sum() * L)]).reshape(-1, L, K)
    ids[rng.random(ids.shape) < 0.1] = -1  # padding counts nowhere
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]))
    trace = Trace(torch.from_numpy(ids.astype(np.int32)), offsets, E)
    within, across = coactivation(trace, cross=True)
    want_within, want_across = _numpy_counts(trace)
    assert (within == want_within).all() and (across == want_across).all()
    assert (within == within.transpose(0, 2, 1)).all()
    diagonal = np.stack([np.diag(w) for w in within])
    assert (diagonal == trace.counts().sum(0).numpy()).all()
    first = coactivation(trace, steps=[0])
    alone = Trace(trace.step(0), torch.tensor([0, sizes[0]]), E)
    assert (first == _numpy_counts(alone)[0]).all()
    with pytest.raises(InputError, match="outside the trace's 3 steps"):
        coactivation(trace, steps=[3])


def test_a_partition_keeps_what_the_clusters_hold():
    trace = synthesize("clustered", steps=4, tokens=256, layers=2, experts=64, top_k=8, seed=0)
    pairs = coactivation(trace)
    assert kept_share(pairs, np.zeros((2, 64), np.int64)) == 1.0
    greedy, scattered = grouped(pairs, 8), random_groups(2, 64, 8)
    assert sorted(np.bincount(greedy[0])) == [8] * 8
    assert kept_share(pairs, greedy) > 3 * kept_share(pairs, scattered)
    with pytest.raises(InputError, match="do not split into 7 equal groups"):
        grouped(pairs, 7)


def test_the_clustered_scenario_takes_most_of_a_tokens_choices_in_one_hidden_group():
    trace = synthesize("clustered", steps=2, tokens=128, layers=1, experts=32, top_k=4, seed=3,
                       clusters=4, within=0.75)
    pairs = coactivation(trace)[0].astype(float)
    np.fill_diagonal(pairs, 0)
    best = grouped(coactivation(trace), 4)[0]
    inside = pairs[best[:, None] == best[None, :]].sum() / pairs.sum()
    assert inside > 0.35  # 3 of 4 choices in one group: (3 x 2) / (4 x 3) of the pairs
    with pytest.raises(InputError, match="clusters=40 exceeds experts=32"):
        synthesize("clustered", steps=1, tokens=8, layers=1, experts=32, top_k=4, clusters=40)


def test_trace_info_prints_the_strongest_pairs_and_the_partitions(capsys, tmp_path):
    path = tmp_path / "c.npz"
    save_trace(synthesize("clustered", steps=2, tokens=128, layers=2, experts=32, top_k=4,
                          seed=0), path)
    code, out, err = run(capsys, "trace", "info", path, "--coactivation", "--groups", "4")
    assert code == 0, err
    assert "  layer  strongest pairs (tokens)" in out
    assert "a greedy partition into 4 groups of 8 experts keeps" in out
    code, out, _ = run(capsys, "trace", "info", path, "--coactivation", "--json")
    co = json.loads(out)["coactivation"]
    assert co["groups"] == 8 and co["kept_greedy"] > co["kept_random"]
    assert all(n > 0 and a < b for layer in co["strongest"] for a, b, n in layer)


def test_colocate_never_sends_a_token_to_more_gpus_than_ordinal():
    """Each colocate choice reuses a GPU the token already uses, or is ordinal's own: so its
    GPUs are a subset of ordinal's, token by token, on every placement."""
    rng = np.random.default_rng(0)
    for trial in range(6):
        G, E, P, K, T = 4, 16, 24, 4, 64
        phy2log = torch.from_numpy(np.concatenate([rng.permutation(E), rng.integers(0, E, P - E)]))
        placement = Placement(phy2log.view(1, P), E, Topology(G, 2))
        view = full_view(placement)
        ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)]))
        ids[::7, -1] = -1
        ctx = DispatchContext(step=trial, layer=0)
        gpus = {}
        for name in ("ordinal", "colocate"):
            slots = POLICIES[name].fn(ids, view, ctx)
            gpus[name] = [set(placement.slot_gpu[row[row >= 0]].tolist()) for row in slots]
        assert all(c <= o for c, o in zip(gpus["colocate"], gpus["ordinal"]))
        assert sum(map(len, gpus["colocate"])) <= sum(map(len, gpus["ordinal"]))
        assert rank_invariance("colocate", ids.view(T, 1, K), placement).invariant
