"""Dead ranks in a run (eplbsim/replay/dead_ranks.py): the survivors serve the recovery
placement from `fail_at` on, a lost expert's pairs are masked and counted, the metrics are the
survivors', and the repair's copies are priced; through `replay`, `compare`, `run` and
`review`."""

from __future__ import annotations

import json

import pytest
import torch

from eplbsim import RunSpec
from eplbsim.base.errors import InputError
from eplbsim.cost.rebalance import layer_scale
from eplbsim.placement import Placement, rank_view
from eplbsim.placement.topology import Topology
from eplbsim.replay import compare, replay, routed_loads
from eplbsim.solvers.recovery import RECOVERIES, lost_pairs, replica_counts, strip_dead
from eplbsim.traces.lost import masked
from eplbsim.traces.synth import synthesize

from cli_helpers import assert_input_error, run

E, G = 32, 8


def _trace(seed=0, steps=8):
    return synthesize("skewed", steps=steps, tokens=256, layers=2, experts=E, top_k=4,
                      seed=seed)


def _spec(**kw):
    return RunSpec.of(gpus=G, **{"redundant": 8, **kw})


@pytest.mark.parametrize("recovery", ["recover-46370", "recover-38862", "resolve"])
def test_the_survivors_serve_the_recovery_with_every_expert_covered(recovery):
    trace = _trace()
    healthy = replay(trace, _spec())
    res = replay(trace, _spec(fail_ranks=(2,), recovery=recovery))
    P = healthy.segments[0].placement.num_slots
    placed = res.segments[0].placement
    assert res.spec.topology.gpus == G - 1 and placed.num_slots == P - P // G
    assert placed.topology.num_gpus == G - 1 and not placed.partial
    if recovery != "resolve":  # the twin on the placement the healthy run served
        twin = RECOVERIES[recovery](healthy.segments[0].placement.phy2log, [2], G, E)
        assert torch.equal(placed.phy2log, strip_dead(twin, [2], G) if recovery ==
                           "recover-46370" else twin)
    assert (replica_counts(placed.phy2log, E) >= 1).all()
    m = res.metrics
    assert m["lost_frac"] == 0.0 and res.failure.lost_experts == 0
    # every pair served once, on the survivors' GPUs alone
    assert int(res.slot_load.sum()) == int(routed_loads(trace).sum())
    buffered = replay(trace, _spec(fail_ranks=(2,), recovery=recovery, dispatch_cap=10 ** 6))
    assert buffered.rank_tokens.shape[-1] == G - 1  # a buffer on each survivor alone
    assert m["multiplicity"]["1"] == 1.0


def test_fewer_slots_than_experts_lose_pairs_and_never_dispatch_them():
    trace = _trace()
    spec = _spec(redundant=0, fail_ranks=(0, 1, 2, 3))
    results = compare(trace, ["static", "random", "row", "ordinal", "hash"], ["none", "a2a"],
                      spec)
    routed = routed_loads(trace)
    for res in results:
        placed = res.segments[0].placement
        assert placed.partial and placed.num_slots == E // 2 < E
        lost = placed.lost  # [L, E]
        assert int(lost.sum()) == res.failure.lost_experts > 0
        pairs, frac = lost_pairs(routed, placed.phy2log)
        assert res.metrics["lost_frac"] == pytest.approx(frac) and frac > 0
        # the lost pairs are never dispatched: the slots execute the rest, each pair once
        assert int(res.slot_load.sum()) == int(routed.sum()) - pairs
        assert int(res.true_load[..., lost].sum()) == 0
        assert res.metrics["multiplicity"]["1"] == 1.0
        assert res.metrics["gpu_imbalance"] >= 1.0


def test_a_full_resolve_loses_the_fewest_pairs():
    trace = _trace(seed=1)
    lost = {r: replay(trace, _spec(redundant=0, fail_ranks=(5, 6), recovery=r))
            .metrics["lost_frac"] for r in ("recover-46370", "recover-38862", "resolve")}
    # the re-solve keeps each layer's heaviest experts: no map of as many slots loses fewer
    assert lost["resolve"] <= min(lost["recover-46370"], lost["recover-38862"])
    assert lost["resolve"] > 0


def test_the_failure_step_and_the_schedule_decide_what_is_repaired():
    trace = _trace(steps=12)
    spec = _spec(rebalance_every=4)
    healthy = replay(trace, spec)
    res = replay(trace, spec.replace(fail_ranks=(1,), fail_at=6, recovery="recover-38862"))
    assert res.true_load.shape[0] == 12 - 6
    assert torch.equal(res.true_load, routed_loads(trace)[6:])
    served = next(s.placement for s in healthy.segments if s.start <= 6 < s.stop)
    assert torch.equal(res.segments[0].placement.phy2log,
                       RECOVERIES["recover-38862"](served.phy2log, [1], G, E))
    assert res.spec.schedule.rebalance_every is None  # the recovery serves the rest


def test_the_repair_is_priced_as_a_rebalance():
    trace = _trace()
    for recovery in ("recover-46370", "resolve"):
        spec = _spec(fail_ranks=(3,), recovery=recovery)
        res = replay(trace, spec)
        f = res.failure
        scale = layer_scale(res.spec.cost, trace.num_layers)
        assert f.copies > 0
        assert res.metrics["repair_bytes"] == round(f.copies * res.spec.expert_bytes() * scale)
        assert f.repair_disk_bytes == round(f.from_disk * res.spec.expert_bytes() * scale)
        if recovery == "recover-46370":  # a missing expert had its replicas on the dead rank
            assert f.from_disk == f.copies and f.repair_ms == 0
        else:  # a re-solve also moves experts the survivors hold
            assert f.copies > f.from_disk and f.repair_ms > 0


def test_bad_failures():
    trace = _trace()
    with pytest.raises(InputError, match="fail_at 8 is not a step"):
        replay(trace, _spec(fail_ranks=(1,), fail_at=8))
    with pytest.raises(InputError, match="only with fail_ranks"):
        _spec(recovery="resolve")
    with pytest.raises(InputError, match="not all"):
        _spec(fail_ranks=tuple(range(G)))
    with pytest.raises(InputError, match="dead ranks"):
        _spec(redundant=-8)


def test_a_partial_placement_and_its_views():
    topo = Topology(2)
    with pytest.raises(InputError, match="fewer than"):
        Placement(torch.tensor([[0, 1]]), 3, topo)
    placed = Placement(torch.tensor([[0, 2]]), 3, topo, partial=True)
    assert placed.lost.tolist() == [[False, True, False]]
    view = rank_view("full", placed, 0)
    assert view.logcnt.tolist() == [[1, 1, 1]] and int(view.log2phy[0, 1, 0]) == -1
    ids = torch.tensor([[[0, 1]], [[2, -1]]])
    assert masked(ids, placed.lost).tolist() == [[[0, -1]], [[2, -1]]]


def test_run_says_what_the_failure_did(capsys, tmp_path):
    args = ("run", "--scenario", "skewed", "--steps", "6", "--tokens", "128", "--layers", "2",
            "--experts", str(E), "--policies", "row,ordinal", "--redundant", "0",
            "--fail-ranks", "0,1,2,3")
    code, out, _ = run(capsys, *args)
    assert code == 0
    assert "4 GPUs" in out and "ranks 0,1,2,3 dead from step 0, recovery recover-46370" in out
    assert "lost_frac" in out.splitlines()[2]
    code, out, _ = run(capsys, *args, "--recovery", "resolve", "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == 4
    for r in rows:  # the survivors' run, labelled with who died
        assert (r["fail_ranks"], r["fail_at"], r["recovery"], r["gpus"]) == \
            ([0, 1, 2, 3], 0, "resolve", 4)
        assert r["lost_frac"] > 0 and r["repair_bytes"] > 0 and r["repair_ms"] > 0
    assert_input_error(capsys, *args, "--fail-at", "6", match="fail_at 6 is not a step")


def test_review_scores_the_survivors(capsys):
    code, out, _ = run(capsys, "review", "ordinal", "--scenario", "skewed", "--steps", "8",
                       "--tokens", "128", "--layers", "2", "--experts", str(E), "--mode", "a2a",
                       "--fail-ranks", "3", "--seeds", "1", "--json")
    report = json.loads(out)
    assert code in (0, 1, 3)
    assert report["setup"]["gpus"] == G - 1
    assert report["setup"]["failure"]["dead"] == [3]
    rests = next(line for line in report["headline"] if line.startswith("Rests on:"))
    assert "each policy on recovery recover-46370 on the survivors of the placement" in rests
