"""The cost model against its own definitions on hand-computed cases, and its contracts over
every registry entry (DESIGN.md §8)."""

import dataclasses
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from eplbsim.base.errors import InputError
from eplbsim.cost import COST_MODELS, DEVICES, MODELS, layer_seconds
from eplbsim.cost.comm import (a2a_crossings, a2a_link_bytes, a2a_seconds, a2a_token_counts,
                               allreduce_seconds)
from eplbsim.cost.compute import ETA_COMPUTE, ETA_MEMORY, roofline
from eplbsim.cost.devices import DeviceProfile
from eplbsim.cost.shapes import ModelShape
from eplbsim.metrics import gpu_loads
from eplbsim.placement import trivial_placement
from eplbsim.placement.topology import Topology

# the measured model's tables: the `cost` extra, which `dev` installs (Python >= 3.11)
NEEDS_AIC = pytest.mark.skipif(sys.version_info < (3, 11),
                               reason="aiconfigurator-core needs Python 3.11 or later")
TINY = ModelShape(hidden=4, intermediate=2, experts=1, top_k=1, moe_layers=1)
SLOW = DeviceProfile(flops_bf16=1e3, flops_fp8=2e3, hbm=1e2, nvlink=10.0, rdma=2.0,
                     latency_s=0.5, launch_s=1e-3)


def test_roofline_of_one_gpu_one_expert_by_hand():
    """10 pairs: 6 H I x 10 = 480 FLOPs; 3 H I weights x 2 B + 10 x 2 H x 2 B = 48 + 160 bytes."""
    got = roofline(torch.tensor([[10.0]]), torch.tensor([[1.0]]), TINY, SLOW)
    want = max(480 / (1e3 * ETA_COMPUTE), 208 / (1e2 * ETA_MEMORY)) + 1e-3
    assert got.shape == (1, 1) and got.dtype == torch.float64 and float(got) == pytest.approx(want)
    fp8 = dataclasses.replace(TINY, weight_dtype="fp8")  # half the weight bytes, FP8's peak
    want8 = max(480 / (2e3 * ETA_COMPUTE), 184 / (1e2 * ETA_MEMORY)) + 1e-3
    assert float(roofline(torch.tensor([10.0]), torch.tensor([1.0]), fp8, SLOW)) \
        == pytest.approx(want8)
    assert float(roofline(torch.tensor([0.0]), torch.tensor([0.0]), TINY, SLOW)) == 1e-3


def _seconds(slot_load, placement, comm, *args, **kwargs):
    """`layer_seconds` of executed pairs per slot `[..., P]` on `placement`'s GPUs."""
    G = placement.topology.num_gpus
    return layer_seconds(gpu_loads(slot_load, G), gpu_loads(slot_load > 0, G), comm, *args,
                         **kwargs)


def test_two_node_all_to_all_volumes_by_hand():
    """4 GPUs, 2 a node. Token 0 (rank 0) -> GPUs 1, 2; token 1 (rank 0) -> 2, 3; token 2
    (rank 1) -> 0 and padding; token 3 (rank 3) -> 0, 1: rank 0 sends 2 tokens to node 1 (both
    land on GPU 2, its proxy there, which forwards token 1 to GPU 3); rank 3's token lands on
    GPU 1 and is forwarded to GPU 0."""
    topo = Topology(4, 2)
    gpu_tokens, node_tokens = a2a_token_counts(
        torch.tensor([0, 0, 1, 3]), torch.tensor([[1, 2], [2, 3], [0, -1], [0, 1]]), topo)
    assert gpu_tokens[0].tolist() == [0, 1, 2, 1] and node_tokens[0].tolist() == [1, 2]
    nvl, rdma = a2a_link_bytes(gpu_tokens, node_tokens, topo, token_bytes=3.0)
    assert nvl.tolist() == [6.0, 6.0, 3.0, 3.0]  # max(sent, received) x 3 bytes
    assert rdma.tolist() == [6.0, 3.0, 6.0, 3.0]
    shape = dataclasses.replace(TINY, dispatch_dtype="fp8")  # 4 B a token out, 8 B back
    crossings = a2a_crossings(gpu_tokens, node_tokens, topo)
    assert crossings.tolist() == [2.0, 2.0]
    got = float(a2a_seconds(crossings, shape, SLOW))
    assert got == pytest.approx((0.5 + max(2 * 4 / 10.0, 2 * 4 / 2.0))
                                + (0.5 + max(2 * 8 / 10.0, 2 * 8 / 2.0)))


def test_all_reduce_is_a_ring_within_a_node_and_hierarchical_across():
    shape = TINY  # a token's output: 4 x 2 bytes
    tokens = torch.tensor([10.0, 0.0])
    one = allreduce_seconds(tokens, Topology(4, 4), shape, SLOW)
    two = allreduce_seconds(tokens, Topology(4, 2), shape, SLOW)
    size = 10 * 8
    assert one.tolist() == pytest.approx([0.5 + 2 * 3 / 4 * size / 10.0, 0.5])
    assert two.tolist() == pytest.approx([0.5 + size / 10.0 + (size / 2) / 2.0, 0.5])
    assert allreduce_seconds(tokens, Topology(1), shape, SLOW).tolist() == [0.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), device=st.sampled_from(sorted(DEVICES)),
       model=st.sampled_from(sorted(MODELS)), overlap=st.booleans())
def test_balanced_is_never_slower_and_time_grows_with_load(seed, device, model, overlap):
    rng = np.random.default_rng(seed)
    placement = trivial_placement(2, 16, 32, Topology(8, 4))
    load = torch.from_numpy(rng.integers(0, 3000, (3, 2, 32)) * (rng.random((3, 2, 32)) < 0.7))
    comm = torch.from_numpy(rng.random((3, 2)) * 1e-3)
    t = _seconds(load, placement, comm, model, device, overlap=overlap)
    assert all(v.shape == (3, 2) and v.dtype == torch.float64 for v in t.values())
    assert (t["compute_balanced"] <= t["compute"] * (1 + 1e-12)).all()
    assert (t["total_balanced"] <= t["total"] * (1 + 1e-12)).all()
    more = load.clone()
    more[..., int(rng.integers(32))] += int(rng.integers(1, 500))
    assert (_seconds(more, placement, comm, model, device)["compute"]
            >= _seconds(load, placement, comm, model, device)["compute"]).all()


def test_imbalance_overhead_is_exactly_zero_for_a_balanced_step():
    placement = trivial_placement(1, 16, 32, Topology(8, 4))  # 4 slots a GPU
    load = torch.tensor([[7, 0, 3, 1] * 8])  # every GPU: 11 pairs on 3 active slots
    t = _seconds(load, placement, torch.tensor([2e-4]), "deepseek-v3", "h200")
    assert torch.equal(t["compute"], t["compute_balanced"])
    assert float(t["total"] / t["total_balanced"] - 1) == 0.0


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS_AIC) if n == "measured" else n
                                  for n in sorted(COST_MODELS)])
def test_every_cost_model_gives_positive_seconds_per_gpu(name):
    pairs = torch.tensor([[0.0, 5.0, 500.0, 5000.0, 1.0, 1.0, 1.0, 1.0]])  # 8 GPUs
    active = pairs.clamp(max=32.0)  # a GPU of 8 holds 32 of deepseek-v3's experts
    out = COST_MODELS[name](pairs, active, MODELS["deepseek-v3"], DEVICES["h200"])
    assert out.shape == (1, 8) and out.dtype == torch.float64 and (out > 0).all()
    assert out[0, 0] <= out[0, 1] <= out[0, 2] <= out[0, 3]


def _table_rows(framework, ep, shape="deepseek-v3"):
    """`(num_tokens, seconds)` of aiconfigurator-core's balanced H200 rows for `shape`, read
    straight from the parquet file (not through `cost.measured`)."""
    import importlib.resources
    import pyarrow.parquet as pq
    from eplbsim.cost.measured import moe_table
    s = MODELS[shape]
    t = moe_table(s, DEVICES["h200"], ep, framework)
    path = (importlib.resources.files("aiconfigurator_core") / "systems/data/h200_sxm/moe" /
            framework / t.version / "moe_perf.parquet")
    rows = pq.read_table(path).to_pylist()
    return t, {r["num_tokens"]: r["latency"] * 1e-3 for r in reversed(rows)
               if (r["hidden_size"], r["inter_size"], r["num_experts"], r["topk"],
                   r["moe_dtype"], r["moe_tp_size"], r["moe_ep_size"], r["distribution"],
                   r["kernel_source"]) == (s.hidden, s.intermediate, s.experts, s.top_k,
                                           "fp8_block", 1, ep, "balanced", t.kernel)}


@NEEDS_AIC
@pytest.mark.parametrize("framework, ep", [("trtllm", 8), ("trtllm", 32), ("sglang", 32),
                                           ("vllm", 8)])
def test_measured_equals_the_table_at_its_own_points(framework, ep):
    """A GPU reading the weights of the `E / EP` experts an EP rank of the table holds, at
    the pairs such a rank executes at a row's token count, takes that row's latency."""
    from eplbsim.cost.measured import measured, moe_tables
    table, rows = _table_rows(framework, ep)
    assert len(rows) >= 20 and table.framework == framework and table.ep == ep
    tokens = sorted(rows)
    pairs = torch.tensor([[x * 8 / ep] * ep for x in tokens], dtype=torch.float64)
    held = torch.full_like(pairs, 256 / ep)
    got = measured(pairs, held, MODELS["deepseek-v3"], DEVICES["h200"], framework)
    assert got[:, 0].tolist() == [rows[x] for x in tokens]
    # between two rows: between their latencies, on the log-log line through them
    mid = torch.full((1, ep), (tokens[-2] * tokens[-1]) ** 0.5 * 8 / ep, dtype=torch.float64)
    between = float(measured(mid, held[:1], MODELS["deepseek-v3"], DEVICES["h200"],
                             framework)[0, 0])
    assert between == pytest.approx((rows[tokens[-2]] * rows[tokens[-1]]) ** 0.5, rel=1e-12)
    idle = measured(torch.zeros(1, ep), torch.zeros(1, ep), MODELS["deepseek-v3"],
                    DEVICES["h200"], framework)
    fewest = moe_tables(MODELS["deepseek-v3"], DEVICES["h200"], ep, framework)[0]
    assert fewest.ep == 256  # an idle GPU: the rank holding the fewest experts stands in,
    assert (idle == float(fewest.seconds[0])).all()  # at its first row (its launch)


@NEEDS_AIC
def test_a_gpu_reading_two_experts_is_priced_at_the_rows_of_ranks_holding_two():
    """Mixtral-8x7B (8 experts, top-2) on 8 H100s with 8 redundant slots: a GPU reading two
    experts' weights is priced at the EP 4 rows (ranks of 2 experts, aiconfigurator's own
    layout), at the tokens where such a rank executes its pairs, not at the EP 8 rows (ranks
    of 1 expert), which would price it as reading half the weights it reads; between one and
    two experts, linear in the experts (issue 59)."""
    from eplbsim.cost.measured import measured, moe_tables
    shape, device = MODELS["mixtral-8x7b"], DEVICES["h100-sxm"]
    tables = {t.ep: dict(zip(t.tokens.tolist(), t.seconds.tolist()))
              for t in moe_tables(shape, device, 8)}
    assert sorted(tables) == [1, 2, 4, 8]
    pairs = torch.full((1, 8), 8.0)  # a 32-token step, top-2, spread over 8 GPUs
    one, half, two = (float(measured(pairs, torch.full((1, 8), a), shape, device)[0, 0])
                      for a in (1.0, 1.5, 2.0))
    assert one == tables[8][32] and two == tables[4][16]  # 8 pairs: 32 tokens at EP 8, 16 at 4
    assert two > 1.5 * one and half == pytest.approx((one + two) / 2, rel=1e-12)


@NEEDS_AIC
def test_both_cost_models_price_redundant_slots_in_a_small_mixtral_step_alike():
    """The issue's case, on a synthetic Mixtral-shaped trace (8 experts, top-2, 32-token
    steps): 8 redundant slots on 8 H100s put two experts' weights on every GPU, which both
    the roofline and the measured tables price as slower (they once disagreed in sign)."""
    from eplbsim import RunSpec, replay
    from eplbsim.traces.synth import synthesize
    trace = synthesize("skewed", steps=4, tokens=32, layers=2, experts=8, top_k=2)
    for cost in ("roofline", "measured"):
        ms = [replay(trace, RunSpec.of(cost=cost, model="mixtral-8x7b", device_profile="h100-sxm",
                                       gpus=8, redundant=r, policy="ordinal", mode="a2a")
                     ).metrics["moe_ms"] for r in (0, 8)]
        assert ms[1] > 1.4 * ms[0], (cost, ms)


@NEEDS_AIC
@pytest.mark.parametrize("call, match", [
    (lambda m, t: m(torch.ones(1, 8), torch.ones(1, 8), MODELS["olmoe-1b-7b"], DEVICES["h200"]),
     r"no MoE kernel of H 2048 I 1024 E 64 K 8 bfloat16; nearest of its \d+ shapes: H "),
    (lambda m, t: m(torch.ones(1, 3), torch.ones(1, 3), MODELS["deepseek-v3"], DEVICES["h200"]),
     "at EP sizes 1, 2, 4, 8, .*not at 3 GPUs"),
    (lambda m, t: m(torch.full((1, 8), 1e6), torch.ones(1, 8), MODELS["deepseek-v3"],
                    DEVICES["h200"]), "beyond the measured table's largest"),
    (lambda m, t: m(torch.ones(1, 8), torch.ones(1, 8), MODELS["deepseek-v3"], DEVICES["h800"]),
     "no aiconfigurator-core tables"),
    (lambda m, t: m(torch.ones(1, 8), torch.ones(1, 8), MODELS["deepseek-v3"], DEVICES["h200"],
                    "tgi"), "unknown framework 'tgi'"),
    (lambda m, t: m(torch.ones(1, 8), torch.ones(1, 8), MODELS["deepseek-v3"], DEVICES["h200"],
                    "trtllm", "0.0.1"), "no trtllm 0.0.1 MoE table for h200_sxm"),
])
def test_measured_says_what_its_table_lacks(call, match):
    from eplbsim.cost.measured import measured
    with pytest.raises(InputError, match=match):
        call(measured, None)


@NEEDS_AIC
def test_measured_without_the_extra_names_it(monkeypatch):
    import sys
    from eplbsim.cost.measured import measured, moe_tables
    moe_tables.cache_clear()
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails
    with pytest.raises(InputError, match=r"pip install 'eplbsim\[cost\]'"):
        measured(torch.ones(1, 8), torch.ones(1, 8), MODELS["deepseek-v3"], DEVICES["h200"])
    monkeypatch.undo()
    moe_tables.cache_clear()


@NEEDS_AIC
def test_cost_options_reach_the_model_and_unknown_ones_are_refused():
    from eplbsim.runspec import RunSpec
    spec = RunSpec.of(cost="measured", cost_options={"framework": "sglang"}, gpus=8)
    assert "h200_sxm sglang " in spec.cost.describe(8)
    table = RunSpec.of(cost="measured").cost.describe(8)  # the table, kernel and shape read
    assert "h200_sxm trtllm " in table and "kernel " in table and "H 7168 I 2048 E 256 K 8" \
        in table and len(table) < 200
    assert "eta_compute=0.5" in RunSpec.of(cost="roofline",
                                           cost_options={"eta_compute": 0.5}).cost.describe(8)
    with pytest.raises(InputError, match="has no option speed; its options are: framework"):
        RunSpec.of(cost="measured", cost_options={"speed": 2})
    with pytest.raises(InputError, match="cost option eta_memory must be a number > 0"):
        RunSpec.of(cost="roofline", cost_options={"eta_memory": "fast"})
    with pytest.raises(InputError, match="only apply with a cost model"):
        RunSpec.of(cost_options={"framework": "vllm"})
    placement = trivial_placement(1, 16, 32, Topology(8, 4))
    load = torch.full((1, 32), 500)
    slow = _seconds(load, placement, torch.zeros(1), "deepseek-v3", "h200",
                    options={"eta_compute": 0.1})
    fast = _seconds(load, placement, torch.zeros(1), "deepseek-v3", "h200")
    assert (slow["compute"] > fast["compute"]).all()


def test_a_user_cost_model_is_taken_like_a_policy():
    def flat(pairs, active, shape, device):
        return pairs * 1e-6
    placement = trivial_placement(1, 4, 4, Topology(2))
    t = _seconds(torch.tensor([[1, 2, 3, 4]]), placement, torch.zeros(1), "olmoe-1b-7b",
                      "b200", model=flat)
    assert t["compute"].tolist() == pytest.approx([7e-6])


def test_registries_have_sources_and_bad_figures_are_refused():
    assert all(m.source for m in MODELS.values()) and all(d.source for d in DEVICES.values())
    assert MODELS["deepseek-v3"].expert_weight_bytes == 3 * 7168 * 2048  # FP8: 1 byte each
    with pytest.raises(InputError, match="hbm"):
        dataclasses.replace(DEVICES["h200"], hbm=-1.0)
    with pytest.raises(InputError, match="nvlink"):
        dataclasses.replace(DEVICES["h200"], nvlink=float("nan"))
    with pytest.raises(InputError, match="weight_dtype"):
        dataclasses.replace(TINY, weight_dtype="int3")
    with pytest.raises(InputError, match="hidden"):
        dataclasses.replace(TINY, hidden=0)
    with pytest.raises(InputError, match="unknown model 'gpt-5'"):
        _seconds(torch.ones(1, 4), trivial_placement(1, 4, 4, Topology(2)),
                      torch.zeros(1), "gpt-5", "h200")


# ---------------------------------------------------------------- in a replay

def _replayed(mode, cost="roofline", policy="ordinal", **more):
    from eplbsim.replay import replay
    from eplbsim.runspec import RunSpec
    from eplbsim.traces.synth import synthesize
    trace = synthesize("skewed", seed=2, steps=6, tokens=64, layers=3, experts=16, top_k=4)
    spec = RunSpec.of(policy=policy, mode=mode, gpus=8, gpus_per_node=4, redundant=8,
                      cost=cost, model="olmoe-1b-7b", device_profile="h100-sxm", **more)
    return replay(trace, spec)


TIME_KEYS = ("moe_ms", "compute_ms", "comm_ms", "moe_ms_balanced", "imbalance_overhead",
             "moe_tokens_per_s")


@pytest.mark.parametrize("mode", ["none", "a2a"])
def test_a_replay_with_a_cost_model_reports_time_that_adds_up(mode):
    r = _replayed(mode)
    m = r.metrics
    assert all(isinstance(m[k], float) for k in TIME_KEYS)
    assert m["moe_ms"] == pytest.approx(m["compute_ms"] + m["comm_ms"])
    assert m["moe_ms_balanced"] <= m["moe_ms"] and m["imbalance_overhead"] >= 0
    assert m["moe_tokens_per_s"] == pytest.approx(64 / (m["moe_ms"] / 1e3))
    placement = r.segments[0].placement  # one placement: no rebalance
    shape, device = MODELS["olmoe-1b-7b"], DEVICES["h100-sxm"]
    compute = _seconds(r.slot_load, placement, torch.zeros(6, 3), shape, device)["compute"]
    scale = shape.moe_layers / 3  # the trace's 3 layers stand for the model's 16
    assert m["compute_ms"] == pytest.approx(float(compute.sum(1).mean()) * 1e3 * scale)
    if mode == "none":
        per_layer = float(allreduce_seconds(torch.tensor(64), Topology(8, 4), shape, device))
        assert m["comm_ms"] == pytest.approx(shape.moe_layers * per_layer * 1e3)
    else:
        assert (r.counters.crossings > 0).any()
    series = r.time_series()
    assert series["moe_ms"] == pytest.approx((compute.sum(1) * 1e3 * scale).numpy()
                                             + series["comm_ms"])
    assert m["layer_us"] == pytest.approx(m["moe_ms"] * 1e3 / shape.moe_layers)


def test_without_a_cost_model_the_time_metrics_are_undefined():
    r = _replayed("a2a", cost=None)
    assert all(r.metrics[k] is None for k in TIME_KEYS)
    assert not r.counters.crossings.any()


def test_overlap_takes_the_larger_of_compute_and_communication():
    summed, overlapped = _replayed("a2a").metrics, _replayed("a2a", overlap=True).metrics
    assert overlapped["moe_ms"] < summed["moe_ms"]
    assert overlapped["moe_ms"] >= max(overlapped["compute_ms"], overlapped["comm_ms"]) - 1e-12


@pytest.mark.parametrize("per_node, link", [(1, "rdma"), (2, "nvlink")])
def test_sync_stall_is_the_slowest_gpus_copies_over_its_links(per_node, link):
    """Experts 0 and 2 swap GPUs: one copy into each GPU, from another node or the same one."""
    from eplbsim.cost.rebalance import sync_stall_seconds
    from eplbsim.placement import Placement
    from eplbsim.schedule.transfers import transfer_kinds
    topo = Topology(2, per_node)
    old = Placement(torch.tensor([[0, 1, 2, 3]]), 4, topo)
    new = Placement(torch.tensor([[2, 1, 0, 3]]), 4, topo)
    kinds = transfer_kinds(old, new)
    assert kinds.tolist() == [[2 if per_node == 1 else 1, -1, 2 if per_node == 1 else 1, -1]]
    stall = sync_stall_seconds(kinds, new.slot_gpu.numpy(), 2, 1000, SLOW)
    assert stall == pytest.approx(1000 / getattr(SLOW, link))
    swapped = Placement(torch.tensor([[1, 0, 2, 3]]), 4, topo)  # within GPU 0: over HBM
    assert sync_stall_seconds(transfer_kinds(old, swapped), swapped.slot_gpu.numpy(), 2, 1000,
                              SLOW) == pytest.approx(2 * 2 * 1000 / SLOW.hbm)
    assert sync_stall_seconds(transfer_kinds(old, old), old.slot_gpu.numpy(), 2, 1000,
                              SLOW) == 0.0


def test_rebalance_stall_is_counted_only_for_rebalances_that_moved_experts():
    assert _replayed("none").metrics["rebalance_stall_ms"] == 0.0
    moved = _replayed("none", rebalance_every=2, window=2)
    assert moved.metrics["moved_slots"] > 0 and moved.metrics["rebalance_stall_ms"] > 0


@pytest.mark.parametrize("name, key", [
    ("Qwen/Qwen1.5-MoE-A2.7B-Chat", "qwen1.5-moe-a2.7b"), ("deepseek-ai/DeepSeek-V3-0324",
                                                          "deepseek-v3"),
    ("DeepSeek-R1", "deepseek-r1"), ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
    ("allenai/OLMoE-1B-7B-0924", "olmoe-1b-7b"), ("Qwen/Qwen3-235B-A22B-Instruct-2507", "qwen3-235b-a22b"),
    ("synthetic: eplbsim's skewed scenario", None), ("deepseek-v30", None), (None, None),
    (7, None)])
def test_a_model_name_is_read_case_and_suffix_tolerant(name, key):
    from eplbsim.cost.catalog import model_named
    assert model_named(name) == key


def test_the_trace_names_its_model_or_gets_the_default():
    from eplbsim.cost.catalog import trace_model
    from eplbsim.cost.shapes import DEFAULT_MODEL
    qwen = {"model": "Qwen/Qwen1.5-MoE-A2.7B-Chat"}
    assert trace_model(qwen, 60, 4) == "qwen1.5-moe-a2.7b"
    assert trace_model(qwen, 60, None) == "qwen1.5-moe-a2.7b"  # counts only: no top-k
    assert trace_model({"model": "mine"}, 64, 8) == trace_model({}, 7, 3) == DEFAULT_MODEL
    with pytest.raises(InputError, match=r"names model 'Qwen/Qwen1.5-MoE-A2.7B-Chat' \("
                                         r"qwen1.5-moe-a2.7b: 60 experts, top-4\), but the trace "
                                         r"has 64 experts, top-8: name the model"):
        trace_model(qwen, 64, 8)
    with pytest.raises(InputError, match="read it with --experts 60 if its ids never reach"):
        trace_model(qwen, 59, 4)
