"""The peers' own EPLB tests, replayed on eplbsim's twins. Their inputs and the outputs their
tests expect are facts, cited by file and commit; the tests are written here. Where a peer's
test checks less than its code does, the expected numbers come from running that code (said
so at each), and where the twin differs, the test says why.

- vLLM `tests/distributed/test_eplb_flashlb.py` (commit 7e7c90bcfd5a) on `flashlb`, the twin of
  vLLM's `vllm/distributed/eplb/policy/flashlb.py` (commit 90caa233d597);
- vLLM `tests/distributed/test_eplb_algo.py` (commit 8744bb0924a5): groups that do not divide
  (`test_parameter_validation`), the slots kept (`test_preserve_intragpu_slots`);
- DeepSeek `eplb.py` (deepseek-ai/EPLB, commit 57919718be1f) on `deepseek` at a float32 tie;
- SGLang `test/registered/unit/eplb/test_topology_aware.py` (commit 2112426b4b1e) on
  `topology-aware`, the twin of SGLang's `eplb_algorithms/topology_aware.py` (a82469114dbc),
  which no release up to 0.5.23 ships. Its tests of the server's argument guards and of the
  engine's `rebalance_experts` dispatch have no counterpart here; its private helpers'
  cases run on `topology_aware.improved`, which takes the same budgets.

Dimensions: `L` layers, `E` experts, `P` slots, `G` GPUs, `S = P / G` slots a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cli_helpers import run
from eplbsim import engines
from eplbsim.base.errors import InputError, InputWarning
from eplbsim.placement.topology import Topology
from eplbsim.solvers import solve, solve_with_info
from eplbsim.solvers.few_moves import _keep_slots

README = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]


def _topology(num_gpus: int, num_nodes: int) -> Topology:
    return Topology(num_gpus, num_gpus // num_nodes)


def _counts(phy2log: np.ndarray, num_experts: int) -> list[list[int]]:
    return [np.bincount(row, minlength=num_experts).tolist() for row in np.asarray(phy2log)]


def _pairs_on_a_gpu(phy2log: np.ndarray, num_gpus: int) -> int:
    """GPUs (over all layers) that hold two replicas of one expert."""
    rows = np.sort(np.asarray(phy2log).reshape(len(phy2log), num_gpus, -1), -1)
    return int((np.diff(rows, axis=-1) == 0).any(-1).sum())


# ---- vLLM tests/distributed/test_eplb_flashlb.py @ 7e7c90bcfd5a ----------------------------

def test_flashlb_is_vllms_flashlb_on_its_basic_rebalance():
    # test_basic_rebalance: the README weights, 16 slots, 4 groups, 2 nodes, 8 GPUs
    placement = solve("flashlb", README, 16, _topology(8, 2), 4)
    assert placement.phy2log.tolist() == [[1, 7, 4, 3, 10, 2, 10, 6, 0, 8, 11, 8, 5, 9, 5, 3],
                                          [1, 3, 2, 11, 5, 0, 5, 4, 6, 7, 6, 7, 9, 8, 8, 10]]
    assert placement.logcnt.tolist() == [[1, 1, 1, 2, 1, 2, 1, 1, 2, 1, 2, 1],
                                         [1, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1]]
    assert _pairs_on_a_gpu(placement.phy2log, 8) == 0  # FlashLB spreads an expert's replicas


def test_flashlb_paper_is_the_named_variant_that_differs_there():
    # eplbsim's FlashLB from the paper's description (risk-aware, a search moving one replica
    # at a time) is kept under its own name: other counts, and two replicas of expert 10 on
    # GPU 7, which vLLM's FlashLB never places
    placement = solve("flashlb-paper", README, 16, _topology(8, 2), 4)
    assert placement.logcnt[0].tolist() == [1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 3, 1]
    assert placement.phy2log[0, 14:].tolist() == [10, 10]
    assert _pairs_on_a_gpu(placement.phy2log[:1], 8) == 1


# (weight, slots, groups, nodes, GPUs, the vLLM test's own check, phy2log from running vLLM's
# flashlb.py @ 90caa233d597 under numba 0.68.1)
VLLM_FLASHLB_CASES = {
    "test_single_gpu_case": ([[10, 20, 30, 40]], 4, 1, 1, 1,
                             lambda p, c: set(p[0]) == {0, 1, 2, 3}, [[3, 2, 1, 0]]),
    "test_equal_weights": ([[50] * 8], 16, 2, 2, 4, lambda p, c: c == [[2] * 8],
                           [[0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7]]),
    "test_multiple_layers": ([[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25] * 6],
                             8, 2, 2, 4, lambda p, c: all(min(r) >= 1 and sum(r) == 8 for r in c),
                             [[3, 0, 2, 1, 5, 4, 5, 4], [2, 5, 3, 4, 0, 1, 0, 1],
                              [1, 0, 2, 0, 4, 3, 5, 3]]),
    "test_small_scale_hierarchical": ([[100, 50, 200, 75, 150, 25, 300, 80]], 12, 4, 2, 4,
                                      lambda p, c: sum(c[0]) == 12 and min(c[0]) >= 1
                                      and c[0][6] >= 2,
                                      [[4, 6, 5, 0, 3, 6, 2, 7, 6, 2, 6, 1]]),
    "test_global_load_balance_fallback": ([[10, 20, 30, 40, 50, 60]], 8, 3, 2, 4,
                                          lambda p, c: sum(c[0]) == 8,
                                          [[3, 0, 2, 1, 5, 4, 5, 4]]),
    "test_device_compatibility": ([[10, 20, 30, 40]], 6, 2, 1, 2,
                                  lambda p, c: len(p[0]) == 6, [[1, 3, 2, 3, 2, 0]]),
}


@pytest.mark.parametrize("name", list(VLLM_FLASHLB_CASES))
def test_flashlb_passes_vllms_flashlb_tests_and_gives_vllms_placement(name):
    weight, slots, groups, nodes, gpus, check, vllm_phy2log = VLLM_FLASHLB_CASES[name]
    placement, info = solve_with_info("flashlb", weight, slots, _topology(gpus, nodes), groups)
    phy2log = placement.phy2log.tolist()
    assert check(phy2log, _counts(phy2log, len(weight[0])))
    assert phy2log == vllm_phy2log and info == {}


def test_flashlb_takes_the_lowest_expert_where_vllm_draws_one_at_random():
    # test_extreme_weight_imbalance: expert 0 (1000) gets 5 replicas, one more than the 4 GPUs;
    # vLLM fills the slot it loses with an expert GPU 3 lacks, drawn at random (three runs of
    # its code gave 1, 5 and 1 in the last slot); eplbsim takes the lowest and says so
    placement, info = solve_with_info("flashlb", [[1000] + [1] * 7], 12, _topology(4, 2), 2)
    counts = placement.logcnt[0].tolist()
    assert counts[0] == max(counts)  # the vLLM test's check
    assert placement.phy2log.tolist() == [[0, 1, 5, 0, 2, 6, 0, 3, 7, 0, 4, 1]]
    assert info == {"random_slots": 1}


def test_slots_that_do_not_divide_over_the_gpus_are_refused_as_vllm_asserts():
    # test_parameter_validation, second half: 7 slots on 4 GPUs is vLLM's AssertionError
    with pytest.raises(InputError, match="7 slots are not divisible by 4 GPUs"):
        solve("flashlb", [[10, 20, 30, 40]], 7, _topology(4, 2), 2)


def _old_map() -> np.ndarray:
    """The test's `generate_expert_map(256, 32, 10, 32)`: GPU `g < 31` holds experts `8g` to
    `8g + 8`, GPU 31 experts 247 to 255, every layer alike; phy2log int64 `[10, 288]`."""
    gpus = [np.arange(8 * g, 8 * g + 9) for g in range(31)] + [np.arange(247, 256)]
    return np.tile(np.concatenate(gpus), (10, 1))


def test_a_warm_start_keeps_flashlbs_rules_on_vllms_experts_exchange():
    # test_experts_exchange: torch.manual_seed(27), loads randint(1, 1000) for 10 layers x 256
    # experts (the same generator, so the same loads), 288 slots, 4 groups, 2 nodes, 32 GPUs,
    # the old map as the placement in service. Before this fix the warm start (chosen in 5 of
    # the 10 layers for fewer moves) put two replicas of one expert on 8 GPUs and moved
    # staying experts on 10 (layer 0, GPU 14: [73, 23, 114, 4, 116, 117, 118, 119, 119])
    torch.manual_seed(27)
    weight = torch.randint(1, 1000, (10, 256))
    old = _old_map()
    placement, info = solve_with_info("flashlb", weight, 288, _topology(32, 2), 4, previous=old)
    new = placement.phy2log.numpy().reshape(10, 32, 9)
    before = old.reshape(10, 32, 9)
    for layer in range(10):
        assert len(np.unique(new[layer])) == 256  # every expert placed
        for gpu in range(32):
            now, then = new[layer, gpu], before[layer, gpu]
            assert len(np.unique(now)) == 9, (layer, gpu)  # no two replicas on one GPU
            stays = np.isin(now, then)
            assert (now[stays] == then[stays]).all(), (layer, gpu)  # staying experts stay put
    assert info["moved_slots"] < info["fresh_moved_slots"]  # the warm start was taken


def test_a_warm_start_keeps_every_staying_replica_in_its_slot():
    # the slot rule for a solver that may pair replicas on a GPU (deepseek), on the same case:
    # per GPU and expert, as many replicas stay in their old slots as the GPU keeps (broken
    # twice before this fix, by the warm start)
    torch.manual_seed(27)
    weight = torch.randint(1, 1000, (10, 256))
    old = _old_map()
    new = solve("deepseek", weight, 288, _topology(32, 2), 4, previous=old).phy2log.numpy()
    for layer in range(10):
        for gpu in range(32):
            now, then = (x[layer, 9 * gpu:9 * gpu + 9] for x in (new, old))
            for expert in np.unique(now):
                kept = min((now == expert).sum(), (then == expert).sum())
                assert ((now == expert) & (then == expert)).sum() == kept, (layer, gpu, expert)


# ---- vLLM tests/distributed/test_eplb_algo.py @ 8744bb0924a5 -------------------------------

def test_groups_that_do_not_divide_the_experts_are_balanced_globally_with_a_note():
    # test_parameter_validation: [[10, 20, 30, 40]], 8 slots, 3 groups, 2 nodes, 4 GPUs gives
    # a placement (vLLM and FastDeploy's eplb.py @ 66549b36 balance globally when the groups
    # do not divide over the nodes); eplbsim balances it as one group and says so
    with pytest.warns(InputWarning, match="3 groups do not divide the 4 experts: balanced "
                                          "globally, as one group"):
        placement, info = solve_with_info("deepseek", [[10, 20, 30, 40]], 8, _topology(4, 2), 3)
    assert placement.phy2log.tolist() == solve("deepseek", [[10, 20, 30, 40]], 8,
                                               _topology(4, 2), 1).phy2log.tolist()
    assert placement.logcnt.tolist() == [[1, 2, 2, 3]]  # vLLM's counts too (running its code)
    assert info["notes"] == ["3 groups do not divide the 4 experts: balanced globally, as one "
                             "group (vLLM's and FastDeploy's rebalance_experts do so where the "
                             "groups do not divide over the nodes, and fail otherwise)"]


def test_the_note_is_warned_at_the_callers_line_through_replay_too():
    from eplbsim.replay import replay
    from eplbsim.runspec import RunSpec
    from eplbsim.traces import synthesize
    trace = synthesize("skewed", seed=0, steps=2, tokens=32, layers=1, experts=8, top_k=2)
    with pytest.warns(InputWarning, match="3 groups do not divide the 8 experts") as caught:
        line = __import__("inspect").currentframe().f_lineno + 1
        replay(trace, RunSpec.of(gpus=2, redundant=2, groups=3, policy="ordinal"))
    noted = [w for w in caught if "groups do not divide" in str(w.message)]
    assert noted and all((w.filename, w.lineno) == (__file__, line) for w in noted)


def test_the_command_line_says_so_too(tmp_path, capsys):
    load = tmp_path / "load.json"
    load.write_text("[[10, 20, 30, 40]]")
    code, out, err = run(capsys, "solve", "--load", load, "--slots", 8, "--gpus", 4,
                         "--gpus-per-node", 2, "--groups", 3)
    assert code == 0 and "layer 0:" in out
    assert "eplbsim: warning: 3 groups do not divide the 4 experts: balanced globally" in err
    code, out, err = run(capsys, "run", "--steps", 2, "--tokens", 64, "--experts", 16,
                         "--groups", 3, "--policies", "row", "--mode", "none")
    assert code == 0 and "row" in out  # run and sweep fall back as solve does
    assert "eplbsim: warning: 3 groups do not divide the 16 experts: balanced globally" in err


@pytest.mark.parametrize("num_gpus, old, new", [
    (2, [0, 1, 2, 3, 4, 5, 6, 7], [1, 5, 0, 4, 6, 2, 7, 3]),  # "simple"
    (2, [0, 1, 0, 2, 3, 4, 5, 6, 1, 2], [0, 5, 4, 0, 1, 6, 2, 3, 2, 1]),  # "duplicates"
    (3, [0, 1, 2, 3] * 3, [0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 0]),  # "skewed_expert"
])
def test_staying_experts_keep_their_slots_as_vllms_preserve_intragpu_slots(num_gpus, old, new):
    # test_preserve_intragpu_slots: per GPU, the new experts (none lost) with each expert the
    # GPU kept at its first old slot; eplbsim's rule (`few_moves._keep_slots`, which both
    # candidates of `solve(previous=...)` go through) keeps every kept replica in place
    S = len(old) // num_gpus
    for gpu in range(num_gpus):
        then, now = np.array(old[gpu * S:(gpu + 1) * S]), np.array(new[gpu * S:(gpu + 1) * S])
        laid = _keep_slots(now, then)
        assert sorted(laid.tolist()) == sorted(now.tolist())
        for expert in set(then.tolist()) & set(now.tolist()):
            assert laid[then.tolist().index(expert)] == expert


# ---- DeepSeek eplb.py (deepseek-ai/EPLB) @ 57919718be1f ------------------------------------

TIE = [[10, 8, 7, 5, 4, 3, 2, 1], [4, 9, 3, 8, 2, 7, 1, 6]]
TIE_TWIN = [[0, 1, 2, 4, 0, 1, 2, 7, 0, 3, 2, 6, 5, 1, 3, 4],
            [1, 7, 5, 0, 2, 1, 5, 6, 7, 3, 3, 4, 1, 3, 5, 0]]
# rebalance_experts(TIE, 16, 1, 1, 4) of eplb.py @ 57919718be1f, run with torch 2.13 (float32)
TIE_EPLB_PY = [[0, 1, 2, 4, 0, 1, 2, 7, 0, 3, 2, 4, 5, 1, 3, 6],
               [1, 7, 5, 4, 2, 1, 5, 0, 7, 3, 3, 6, 1, 3, 5, 0]]


def test_deepseek_is_vllms_answer_at_a_tie_that_eplb_py_rounds_in_float32():
    placement = solve("deepseek", TIE, 16, _topology(4, 1))
    assert placement.phy2log.tolist() == TIE_TWIN != TIE_EPLB_PY
    assert placement.order[0, 4].tolist() == [15, 3, -1]  # eplb.py's log2phy: [11, 3]
    assert placement.order[0, 6].tolist() == [11, -1, -1]  # eplb.py's: [15]
    # why: after 13 of layer 0's 16 replicas GPU 2 holds 10/3, 5/2, 7/3 and GPU 3 holds
    # 3, 8/3, 5/2, both 49/6; the next replica (load 2) goes to the lighter, the lower index on
    # a tie. Summed as eplb.py sums them (float32, in that order) GPU 2 is lighter; in float64
    # (eplbsim, and vLLM's float64 pack sums) GPU 3 is, by one rounding
    f32, f64 = ([np.cumsum(np.array(x, dtype=t))[-1] for x in ([10 / 3, 5 / 2, 7 / 3],
                                                               [3, 8 / 3, 5 / 2])]
                for t in (np.float32, np.float64))
    assert f32[0] < f32[1] and f64[0] > f64[1]
    assert TIE_EPLB_PY[0][8:12] == [0, 3, 2, 4] and TIE_TWIN[0][12:] == [5, 1, 3, 4]


def test_deepseek_equals_vllms_default_policy_at_that_tie():
    if engines.release("vllm") is None:
        pytest.skip("vLLM is not fetched (eplbsim engines fetch)")
    vllm = engines.engine_solver("vllm:default")
    assert vllm(np.array(TIE, dtype=np.float64), 16, _topology(4, 1), 1).tolist() == TIE_TWIN


# ---- SGLang test/registered/unit/eplb/test_topology_aware.py @ 2112426b4b1e ---------------

def _topology_aware(counts, costs, **options):
    """`topology-aware` on source counts `[L, G, E]`, the loads their sum over the sources."""
    counts = np.asarray(counts, dtype=np.float64)
    L, G, E = counts.shape
    return solve_with_info("topology-aware", counts.sum(1), E, Topology(G),
                           source_load=counts, rank_costs=costs, **options)


def _two_ranks(first, second):
    counts = np.zeros((1, 2, 4))
    counts[0, 0], counts[0, 1] = first, second
    return counts


def test_topology_aware_keeps_experts_on_the_ranks_they_come_from():
    placement, info = _topology_aware(_two_ranks([10, 10, 0, 0], [0, 0, 10, 10]),
                                      [[0, 5], [5, 0]])
    assert placement.phy2log.tolist() == [[0, 1, 2, 3]]
    assert placement.log2phy[0, :, 0].tolist() == [0, 1, 2, 3]
    assert placement.logcnt.tolist() == [[1, 1, 1, 1]]
    assert info["traffic"] == info["seed_traffic"] == 0


def test_topology_aware_swaps_reversed_traffic_home_without_worse_balance():
    placement, info = _topology_aware(_two_ranks([0, 0, 10, 10], [10, 10, 0, 0]),
                                      [[0, 5], [5, 0]])
    assert placement.phy2log.tolist() == [[2, 3, 0, 1]]
    assert (info["traffic"], info["seed_traffic"], info["max_load_ratio"]) == (0, 200, 1)


def test_topology_aware_never_costs_more_traffic_or_balance_than_the_default_layout():
    counts = _two_ranks([10, 9, 8, 7], [0, 0, 0, 0])
    placement, info = _topology_aware(counts, [[0, 10], [10, 0]])
    rank = np.empty(4, np.int64)
    rank[placement.phy2log[0].numpy()] = [0, 0, 1, 1]
    costs = np.array([[0, 10], [10, 0]])
    assert (counts[0] * costs[:, rank]).sum() <= (counts[0] * costs[:, [0, 0, 1, 1]]).sum()
    load = np.bincount(rank, weights=counts[0].sum(0), minlength=2)
    assert load.max() <= max(19, 15) and info["max_load_ratio"] <= 1


def test_topology_aware_maps_are_permutations_with_equal_ranks_and_deterministic():
    counts = [[[4, 0, 2, 1, 0, 0], [0, 3, 0, 0, 5, 1], [2, 1, 0, 0, 1, 4]],
              [[0, 1, 6, 0, 2, 0], [3, 0, 0, 4, 0, 1], [1, 0, 0, 2, 5, 0]]]
    costs = [[0.0, 1.0, 3.0], [1.0, 0.0, 2.0], [3.0, 2.0, 0.0]]
    placement, info = _topology_aware(counts, costs)
    for row in placement.phy2log.tolist():
        assert sorted(row) == list(range(6))
    assert placement.logcnt.tolist() == [[1] * 6] * 2
    assert info["traffic"] <= info["seed_traffic"]
    again, _ = _topology_aware(counts, costs)
    assert torch.equal(placement.phy2log, again.phy2log)


def _helper_case(counts, costs, ranks):
    """SGLang's private-helper set-up: loads, `comm [E, G]`, the default layout and its loads."""
    from eplbsim.solvers.topology_aware import rank_loads
    counts = np.asarray(counts, dtype=np.float64)
    load = counts.sum(0)
    comm = counts.T @ np.asarray(costs, dtype=np.float64)
    seed = np.arange(load.size) // (load.size // ranks)
    return load, comm, seed, rank_loads(seed, load, ranks)


def test_topology_aware_load_phase_spends_only_its_traffic_budget():
    from eplbsim.solvers.topology_aware import improved, rank_loads
    load, comm, seed, seed_load = _helper_case([[80, 20, 1, 0], [1, 0, 10, 10]],
                                               [[0, 1], [1, 0]], 2)
    ranks = improved(seed, load, comm, 2, 10, 20.0, seed_load.max())
    assert rank_loads(ranks, load, 2).max() < seed_load.max()
    assert comm[np.arange(4), ranks].sum() <= comm[np.arange(4), seed].sum() * 21


def test_topology_aware_reserves_swaps_for_the_busiest_rank():
    from eplbsim.solvers.topology_aware import improved, rank_loads
    load, comm, seed, seed_load = _helper_case([[28, 8, 23, 7], [0, 8, 21, 10]],
                                               [[0, 1], [1, 0]], 2)
    traffic_only = improved(seed, load, comm, 2, 4, 0.0, seed_load.max())
    with_budget = improved(seed, load, comm, 2, 4, 1.0, seed_load.max())
    assert rank_loads(with_budget, load, 2).max() < rank_loads(traffic_only, load, 2).max()


def test_topology_aware_breaks_an_equal_peak_by_the_sum_of_squares():
    from eplbsim.solvers.topology_aware import improved, rank_loads
    load = np.array([12, 8, 6, 4, 12, 8], dtype=np.float64)
    seed = np.arange(6) // 2
    seed_load = rank_loads(seed, load, 3)
    ranks = improved(seed, load, np.zeros((6, 3)), 3, 1, 1.0, seed_load.max())
    after = rank_loads(ranks, load, 3)
    assert (after ** 2).sum() < (seed_load ** 2).sum() and after.max() == seed_load.max()


@pytest.mark.parametrize("options, match", [
    ({"comm_budget": -1.0}, "comm_budget must be a finite number >= 0"),
    ({"rank_costs": np.ones((2, 2))}, "diagonal"),
    ({"rank_costs": np.zeros((3, 3))}, "does not match"),
])
def test_topology_aware_refuses_what_sglang_refuses(options, match):
    counts = np.ones((1, 2, 4))
    with pytest.raises(InputError, match=match):
        solve_with_info("topology-aware", counts.sum(1), 4, Topology(2),
                        **{"source_load": counts, "rank_costs": np.zeros((2, 2)), **options})


def test_topology_aware_places_no_redundant_experts_and_needs_source_counts():
    counts = np.ones((1, 2, 4))
    with pytest.raises(InputError, match="no redundant experts"):
        solve("topology-aware", counts.sum(1), 6, Topology(2), source_load=counts)
    with pytest.raises(InputError, match="source-rank expert counts"):
        solve("topology-aware", counts.sum(1), 4, Topology(2))


def test_topology_aware_reads_sglangs_topology_json_in_rank_order(tmp_path):
    from eplbsim.solvers.topology_aware import rank_cost_matrix
    path = tmp_path / "topology.json"
    path.write_text('{"rank_cost_matrix": [[0, 1, 4], [2, 0, 3], [5, 6, 0]]}')
    assert rank_cost_matrix(str(path), Topology(3)).tolist() == [[0, 1, 4], [2, 0, 3], [5, 6, 0]]
    default = rank_cost_matrix(None, Topology(4, 2))
    assert default[0].tolist() == [0, 1, default[0, 3], default[0, 3]] and default[0, 3] > 1
