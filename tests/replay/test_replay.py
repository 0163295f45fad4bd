"""End-to-end replay: the rank-invariance and balance claims of DESIGN.md §1 on synthetic
traces, determinism, conservation, and the rebalance schedule.

Dimensions: `S` steps, `L` layers, `E` experts, `P` slots, `G` GPUs.
"""


import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplbsim.base.errors import InputError
from eplbsim.dispatch import POLICIES
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import compare, replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import Trace

from id_helpers import distinct

SIZES = dict(steps=6, tokens=96, layers=2, experts=16, top_k=4)
CFG = RunSpec.of(gpus=4, gpus_per_node=2, redundant=8)


@pytest.fixture(scope="module", params=["skewed", "uniform", "template"])
def trace(request):
    return synthesize(request.param, seed=0, **SIZES)


@pytest.mark.parametrize("policy", ["static", "random"])
def test_rank_variant_policies_corrupt_none_mode(trace, policy):
    m = replay(trace, CFG.replace(policy=policy)).metrics
    assert m["rank_agreement"] < 1
    assert m["multiplicity"]["0"] + m["multiplicity"]["2+"] > 0
    assert m["output_rel_error"] > 1e-3


@pytest.mark.parametrize("policy", ["row", "ordinal", "flat", "hash"])
def test_rank_invariant_policies_are_exact_in_none_mode(trace, policy):
    m = replay(trace, CFG.replace(policy=policy)).metrics
    assert m["rank_agreement"] == 1.0
    assert m["multiplicity"] == {"0": 0.0, "1": 1.0, "2+": 0.0}
    assert m["output_rel_error"] < 1e-6


def test_nearest_view_breaks_even_a_rank_invariant_formula(trace):
    """Per-rank candidate lists (the pre-fix view, of a placement given as a mapping: a solver's
    is published unnarrowed) make `row` rank-variant too."""
    m = replay(trace, CFG.replace(policy="row", view="sglang-0.5.14", solver="trivial")).metrics
    assert m["rank_agreement"] < 1 and m["output_rel_error"] > 1e-3


@pytest.mark.parametrize("policy", [p for p in sorted(POLICIES) if "none" in POLICIES[p].modes
                                    and not (POLICIES[p].spill and POLICIES[p].spill.local)])
@pytest.mark.parametrize("view", ["full", "sglang-0.5.14"])
def test_without_redundancy_every_policy_agrees_and_is_exact(trace, policy, view):
    m = replay(trace, CFG.replace(policy=policy, view=view, redundant=0)).metrics
    assert m["rank_agreement"] == 1.0
    assert m["multiplicity"]["1"] == 1.0
    assert m["output_rel_error"] < 1e-6
    assert m["replica_skew_mean"] is None and m["idle_replica_frac"] is None


def test_random_with_shared_generators_agrees(trace):
    m = replay(trace, CFG.replace(policy="random", rng="shared")).metrics
    assert m["rank_agreement"] == 1.0 and m["output_rel_error"] < 1e-6


def test_random_with_drift_agrees_until_the_first_drift():
    tr = synthesize("skewed", seed=0, **dict(SIZES, steps=12))
    res = replay(tr, CFG.replace(policy="random", rng="drift", drift_p=0.1))
    c = res.counters
    per_step = c.agreed.sum(1) / c.valid.sum(1)  # [S]
    drifted = c.drifted.any(1)
    first = int(drifted.nonzero()[0])
    assert 0 < first < tr.num_steps - 1, "seed chosen so the first drift falls mid-trace"
    assert not c.drifted[first].all(), "some rank must stay in step for the ranks to diverge"
    assert (per_step[:first] == 1).all()
    assert (per_step[first:] < 1).all()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a2a_executes_every_pair_once(trace, policy):
    res = replay(trace, CFG.replace(policy=policy, mode="a2a"))
    m = res.metrics
    assert m["multiplicity"] == {"0": 0.0, "1": 1.0, "2+": 0.0}
    assert m["rank_agreement"] is None and m["output_rel_error"] is None
    executed = res.slot_load.sum(-1) + res.counters.spilled.sum(-1)  # spill: with fetched
    assert torch.equal(executed, res.true_load.sum(-1))


def hot_pairs_placement(trace: Trace, topology: Topology, extra: int) -> Placement:
    """Every expert once plus a second replica for the `extra` most-loaded experts."""
    load = trace.counts().sum(0)  # [L, E]
    hot = load.argsort(-1, descending=True)[:, :extra]
    p2l = torch.cat([torch.arange(trace.num_experts).expand(trace.num_layers, -1), hot], 1)
    return Placement(p2l, trace.num_experts, topology)


def test_template_row_starves_a_twin_while_ordinal_balances():
    tr = synthesize("template", steps=16, tokens=512, layers=2, experts=32, top_k=4, seed=3)
    placement = hot_pairs_placement(tr, Topology(8, 4), extra=8)
    assert int(placement.logcnt.max()) == 2
    cfg = CFG.replace(gpus=8, gpus_per_node=4, redundant=8, placement=placement)
    row = replay(tr, cfg.replace(policy="row")).metrics
    ordinal = replay(tr, cfg.replace(policy="ordinal")).metrics
    assert row["replica_skew_max"] >= 1.9
    assert row["idle_replica_frac"] >= 0.45  # 0.5: one of every twin never runs
    assert ordinal["replica_skew_mean"] <= 1.05
    assert ordinal["replica_skew_cumulative"] <= 1.02
    assert ordinal["idle_replica_frac"] == 0.0


def test_replay_is_deterministic_and_leaves_the_trace_alone(trace):
    before = trace.topk_ids.clone()
    a = compare(trace, ["random", "static", "ordinal"], ["none", "a2a"], CFG)
    b = compare(trace, ["random", "static", "ordinal"], ["none", "a2a"], CFG)
    assert [r.row() for r in a] == [r.row() for r in b]
    assert torch.equal(trace.topk_ids, before)


def test_executed_load_follows_multiplicity(trace):
    """With 2 ranks c is 0, 1 or 2, so executed pairs = #(c = 1) + 2 #(c = 2)."""
    res = replay(trace, RunSpec.of(gpus=2, redundant=4, policy="random"))
    c0, c1, c2 = res.counters.multiplicity_counts.sum((0, 1)).tolist()
    assert c0 > 0 and c2 > 0
    assert int(res.slot_load.sum()) == c1 + 2 * c2
    assert c0 + c1 + c2 == int(res.true_load.sum())
    ordinal = replay(trace, CFG.replace(policy="ordinal"))
    assert torch.equal(ordinal.slot_load.sum(-1), ordinal.true_load.sum(-1))


def test_placement_imbalance_is_the_even_split_promise(trace):
    res = replay(trace, CFG.replace(policy="ordinal"))
    (_, _, placement), = res.epochs
    promised = placement.expected_load(res.true_load)  # [S, L, P]
    gpu = promised.view(*promised.shape[:-1], 4, -1).sum(-1)
    want = (gpu.amax(-1) / gpu.mean(-1)).mean()
    assert res.metrics["placement_imbalance"] == pytest.approx(float(want))


def test_rebalance_schedule_starts_trivial_and_resolves_every_n_steps(trace):
    res = replay(trace, CFG.replace(rebalance_every=4))
    starts = [start for start, _, _ in res.epochs]
    assert starts == [0, 4]
    first = res.epochs[0][2]
    assert torch.equal(first.phy2log[0], torch.arange(24) % 16)
    assert res.epochs[1][2] is not first


def test_padding_is_never_load():
    steps = [torch.tensor([[[0, -1]], [[1, 0]]]), torch.tensor([[[-1, -1]]])]
    tr = Trace.from_steps(steps, num_experts=2)
    res = replay(tr, RunSpec.of(gpus=2, redundant=2, policy="row"))
    assert int(res.slot_load.sum()) == 3
    assert res.metrics["multiplicity"]["1"] == 1.0


def test_bad_configurations_are_input_errors(trace):
    with pytest.raises(InputError, match="23 slots.*4 GPUs"):
        replay(trace, CFG.replace(redundant=7))
    with pytest.raises(InputError, match="divisible by GPUs per node"):
        replay(trace, CFG.replace(gpus_per_node=3))
    with pytest.raises(InputError, match="unknown mode"):
        replay(trace, CFG.replace(mode="both"))
    with pytest.raises(InputError, match="the given placement is for"):
        replay(trace, CFG.replace(placement=Placement(torch.zeros(1, 4, dtype=torch.long), 1,
                                                       Topology(4))))
    wrong_topology = Placement(torch.arange(24).remainder(16).expand(2, 24), 16, Topology(4))
    with pytest.raises(InputError, match="laid out on"):
        replay(trace, CFG.replace(placement=wrong_topology))


def test_device_replay_matches_cpu(device):
    """The replay kept on the device (windows for `row` in "none", the toy layer's error summed
    there for the rank-variant policies) gives the CPU's every metric, in both modes."""
    tr = synthesize("skewed", seed=1, **SIZES)
    for policy in ("row", "ordinal", "static", "random"):
        for mode in ("none", "a2a"):
            cpu = replay(tr, CFG.replace(policy=policy, mode=mode)).row()
            dev = replay(tr, CFG.replace(policy=policy, mode=mode, device=device)).row()
            assert (cpu.pop("device"), dev.pop("device")) == ("cpu", device)  # where each ran
            assert cpu == dev, (policy, mode)


@st.composite
def tiny_setups(draw):
    """Random ragged traces with -1 padding on tiny or odd topologies."""
    G = draw(st.sampled_from([1, 2, 3, 4]))
    gpn = draw(st.sampled_from([d for d in (1, 2, 4) if G % d == 0]))
    E = draw(st.integers(1, 9))
    per_gpu = draw(st.integers(-(-E // G), -(-E // G) + 2))
    L, K = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(0, 12), min_size=1, max_size=4).filter(sum))
    seed = draw(st.integers(0, 1000))
    gen = torch.Generator().manual_seed(seed)
    steps = [distinct(torch.where(torch.rand(T, L, K, generator=gen) < 0.25, -1,
                                  torch.randint(0, E, (T, L, K), generator=gen))) for T in sizes]
    cfg = RunSpec.of(gpus=G, gpus_per_node=gpn, redundant=G * per_gpu - E, seed=seed)
    return Trace.from_steps(steps, num_experts=E), cfg


@settings(max_examples=30, deadline=None)
@given(tiny_setups())
def test_replay_invariants_on_random_tiny_setups(setup):
    trace, cfg = setup
    valid = int((trace.topk_ids >= 0).sum())
    for policy in sorted(POLICIES):
        a2a = replay(trace, cfg.replace(policy=policy, mode="a2a"))
        executed = a2a.slot_load.sum(-1) + a2a.counters.spilled.sum(-1)  # spill: fetched
        assert int(executed.sum()) == valid
        assert torch.equal(executed, a2a.true_load.sum(-1))
        if "none" not in POLICIES[policy].modes:
            continue
        none = replay(trace, cfg.replace(policy=policy)).metrics
        if valid == 0:
            assert none["rank_agreement"] is None
            continue
        assert sum(none["multiplicity"].values()) == pytest.approx(1.0)
        rule = POLICIES[policy].spill
        if (policy in ("row", "ordinal", "flat", "hash", "spill", "llep")
                or (cfg.topology.redundant == 0 and not (rule and rule.local))):
            assert none["rank_agreement"] == 1.0 and none["multiplicity"]["1"] == 1.0
            assert none["output_rel_error"] is None or none["output_rel_error"] < 1e-6


def test_summary_in_chunks_equals_the_whole(monkeypatch, trace):
    import eplbsim.metrics as M
    cfg = CFG.replace(policy="random", rebalance_every=4)
    whole = replay(trace, cfg).metrics
    monkeypatch.setattr(M, "SUMMARY_CHUNK", 1)
    chunked = replay(trace, cfg).metrics
    assert chunked.keys() == whole.keys()
    for key, value in whole.items():
        assert chunked[key] == (pytest.approx(value) if isinstance(value, float) else value)


def test_compare_counts_and_solves_once_for_all_its_rows(monkeypatch):
    import importlib
    R = importlib.import_module("eplbsim.replay")  # the module: eplbsim.replay is the function
    trace = synthesize("skewed", steps=4, tokens=32, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(gpus=4, rebalance_every=2)
    calls = {"count": 0, "plan": 0}
    count, plan = R.routed_loads, R.schedule_of

    def counted(*args, **kwargs):
        calls["count"] += 1
        return count(*args, **kwargs)

    def planned(*args, **kwargs):
        calls["plan"] += 1
        return plan(*args, **kwargs)
    monkeypatch.setattr(R, "routed_loads", counted)
    monkeypatch.setattr(R, "schedule_of", planned)
    rows = R.compare(trace, ["row", "ordinal", "random"], ["none", "a2a"], spec)
    assert len(rows) == 6 and calls == {"count": 1, "plan": 1}
    monkeypatch.setattr(R, "routed_loads", count)
    monkeypatch.setattr(R, "schedule_of", plan)
    alone = R.replay(trace, spec.replace(policy="ordinal", mode="a2a"))
    assert rows[4].metrics == alone.metrics  # the same numbers as replaying one alone


def test_the_output_error_weighs_each_pair_by_the_traces_gating_weight():
    """A trace with gating weights prices a mis-executed pair by its own weight: where every
    pair but one slot has weight 0 the error comes from that slot alone, and with all
    weights 0 but the last slot's it differs from the drawn gates' error; a replay of the
    same weighted trace is bit-identical."""
    base = synthesize("skewed", seed=0, **SIZES)
    spec = CFG.replace(policy="random")
    weights = torch.zeros(base.ids_shape)
    weights[:, :, -1] = 1.0
    weighted = Trace(base.topk_ids, base.step_offsets, base.num_experts, None, base.meta,
                     weights)
    drawn = replay(base, spec).metrics["output_rel_error"]
    mine = replay(weighted, spec).metrics["output_rel_error"]
    assert mine > 0 and mine != drawn
    assert replay(weighted, spec).metrics["output_rel_error"] == mine
    none = Trace(base.topk_ids, base.step_offsets, base.num_experts, None, base.meta,
                 torch.zeros(base.ids_shape))
    assert replay(none, spec).metrics["output_rel_error"] in (0.0, None)


@pytest.mark.parametrize("thing", [np.zeros((4, 2, 8), dtype=np.int16), "traces/x.npz", None])
def test_a_run_of_something_that_is_no_trace_is_one_clear_error(thing):
    """`replay`, `compare` and `review` take a trace of any form (`traces.RunTrace`); anything
    else is an InputError naming what was given, not an AttributeError deep in the loop."""
    from eplbsim import compare, review
    for call in (lambda: replay(thing), lambda: compare(thing, ["row"], ["none"]),
                 lambda: review(thing, "ordinal")):
        with pytest.raises(InputError, match=f"not {type(thing).__name__}"):
            call()


def test_a_pair_on_a_slot_holding_another_expert_is_wrong_in_eplbsims_own_model():
    """Issue 51: with no migration each slot holds what the serving placement names, so a
    policy that reroutes (`unmapped`: the logical id as the slot) is wrong once the placement is
    not the trivial one: "a2a" counts its pairs on other experts' slots, "none" computes them
    with those slots' weights; the trivial placement before the first rebalance is exact."""
    trace = synthesize("drift", seed=0, steps=8, tokens=64, layers=2, experts=16, top_k=4)
    spec = RunSpec.of(gpus=4, redundant=4, rebalance_every=4)
    rows = {(r.spec.dispatch.policy, r.spec.dispatch.mode): r.metrics
            for r in compare(trace, ["unmapped", "ordinal"], ["none", "a2a"], spec)}
    assert rows["unmapped", "a2a"]["wrong_expert_frac"] > 0
    assert rows["unmapped", "none"]["output_rel_error"] > 0
    assert rows["ordinal", "a2a"]["wrong_expert_frac"] == 0
    assert rows["ordinal", "none"]["output_rel_error"] == 0
    first = replay(trace.window(0, 4), spec.replace(rebalance_every=None, initial="trivial",
                                                     solver="trivial", policy="unmapped"))
    assert first.metrics["output_rel_error"] == 0  # every logical id's slot holds it


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# each policy's device kernel (`DispatchPolicy.kernels["cuda"]`) that runs on CPU tensors too
DEVICE_KERNELS = {"row": "torch_step.row_step", "static": "torch_step.static_step",
                  "random": "torch_step.random_step"}


@pytest.mark.parametrize("mode", ["none", "a2a"])
@pytest.mark.parametrize("policy", sorted(DEVICE_KERNELS))
def test_the_device_path_reads_back_to_the_host_a_constant_number_of_times_a_run(
        monkeypatch, policy, mode):
    """The replay as it runs on a GPU (`resident`: counts kept on the device, the steps'
    device kernels, no compiled CPU counts), on CPU tensors: the calls that read a tensor back
    to the host (a device sync there) are counted while it runs. A longer run makes no more
    of them: none happens a step ("none" with a rank-variant policy sums its toy layer's
    error squares on the device too)."""
    from dataclasses import replace as swap

    from eplbsim.ranks import moe
    from eplbsim.ranks.epoch import Epoch
    from eplbsim.replay import dispatch_steps, routed_loads, schedule_of, spec_for_trace
    assert POLICIES[policy].kernels["cuda"][-1] == DEVICE_KERNELS[policy]
    monkeypatch.setitem(POLICIES, policy, swap(POLICIES[policy],
                                               kernels={"cpu": (DEVICE_KERNELS[policy],)}))
    monkeypatch.setattr(Epoch, "counts_fast", lambda self, device: False)  # as on a GPU
    monkeypatch.setattr(moe, "step_sums", lambda toy, step, ids, executed=None: moe.pair_sums(
        toy, ids, *moe.token_inputs(toy, step, ids.shape), executed))  # the toy layer in torch
    reads = []
    for name in HOST_READS:
        def counted(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
            reads.append(1)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = []
    for steps in (2, 6):
        trace = synthesize("skewed", steps=steps, tokens=48, layers=2, experts=16, top_k=4)
        spec = spec_for_trace(trace, CFG.replace(policy=policy, mode=mode, rng="drift",
                                                 drift_p=0.5))
        segments = schedule_of(trace, spec, routed_loads(trace))
        del reads[:]
        slot_load, _ = dispatch_steps(trace, spec, segments, range(steps), device="cpu",
                                      resident=True)
        counts.append(len(reads))
        assert slot_load.shape[0] == steps
    assert counts[0] == counts[1] <= 8, counts


def test_a_resident_replay_redoes_on_the_host_what_it_could_not_sum_exactly(monkeypatch):
    """Where the device cannot sum a step's error squares exactly (NaN), the step is
    dispatched again with the host's exact rounding: the same counters as a replay kept on the
    host, corruption and all."""
    from eplbsim.ranks import epoch as epochs
    from eplbsim.replay import dispatch_steps, routed_loads, schedule_of, spec_for_trace
    trace = synthesize("skewed", steps=5, tokens=32, layers=2, experts=16, top_k=4, seed=2)
    spec = spec_for_trace(trace, CFG.replace(policy="static", mode="none"))
    segments = schedule_of(trace, spec, routed_loads(trace))
    host = dispatch_steps(trace, spec, segments, range(5), device="cpu", fast=False)
    assert (host[1].error[:, :, 0] > 0).any()  # static corrupts: the error is measured
    exact = epochs.device_square_sums
    for wrong in ({1, 3}, set(range(5))):
        calls = []

        def sometimes(rows, _calls=calls, _wrong=wrong):
            _calls.append(1)
            out = exact(rows)
            return out * math.nan if (len(_calls) - 1) // 2 in _wrong else out
        monkeypatch.setattr(epochs, "device_square_sums", sometimes)
        kept = dispatch_steps(trace, spec, segments, range(5), device="cpu", fast=False,
                              resident=True)
        assert torch.equal(kept[1].error, host[1].error) and torch.equal(kept[0], host[0])
