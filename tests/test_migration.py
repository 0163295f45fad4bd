"""Migration-aware solving: permutations that keep GPU loads, the warm start, moved_slots."""

import numpy as np
import pytest
import torch

from eplbsim.errors import InputError
from eplbsim.metrics import gpu_loads
from eplbsim.solvers import KEEP_LAYOUT, SOLVERS, solve, solve_with_info
from eplbsim.solvers.migration import align_to_previous, moved_slots
from eplbsim.topology import Topology

TOPO = Topology(8, 4)


def loads(seed, L=4, E=32, scale=0.05):
    rng = np.random.default_rng(seed)
    base = np.exp(rng.standard_normal((L, E)))
    return base, base * np.exp(scale * rng.standard_normal((L, E)))


def peak(placement, load):
    return gpu_loads(placement.expected_load(torch.from_numpy(load)), 8).amax(-1)  # [L]


def test_align_permutes_without_changing_gpu_loads():
    old, new = loads(0)
    prev = solve("deepseek", old, 40, TOPO).phy2log.numpy()
    fresh = solve("deepseek", new, 40, TOPO).phy2log.numpy()
    aligned = align_to_previous(fresh, prev, TOPO, 32)
    per_gpu = lambda p: np.sort(p.reshape(4, 8, 5), -1)  # noqa: E731  multiset per GPU
    assert sorted(map(tuple, per_gpu(aligned)[0])) == sorted(map(tuple, per_gpu(fresh)[0]))
    assert (moved_slots(prev, aligned) <= moved_slots(prev, fresh)).all()
    assert (align_to_previous(prev, prev, TOPO, 32) == prev).all()


@pytest.mark.parametrize("name", sorted(n for n in SOLVERS if n != "exact"
                                         and SOLVERS[n] not in KEEP_LAYOUT))
def test_previous_moves_far_fewer_slots_within_tolerance(name):
    old, new = loads(1, L=6, E=64)
    prev = solve(name, old, 72, TOPO)
    placement, info = solve_with_info(name, new, 72, TOPO, previous=prev)
    fresh = solve(name, new, 72, TOPO)
    assert info["moved_slots"] == int(moved_slots(prev.phy2log, placement.phy2log).sum())
    assert info["moved_slots"] <= info["fresh_moved_slots"]
    assert (peak(placement, new) <= peak(fresh, new) * 1.005 + 1e-9).all()
    if name != "trivial":  # trivial ignores the loads: nothing ever moves
        assert info["moved_slots"] < 0.5 * int(moved_slots(prev.phy2log, fresh.phy2log).sum())


def test_previous_of_the_wrong_shape_is_an_input_error():
    old, new = loads(2)
    with pytest.raises(InputError, match="previous placement has shape"):
        solve_with_info("deepseek", new, 40, TOPO, previous=np.zeros((4, 48), dtype=int))


def test_a_rows_bytes_and_stalls_are_on_one_scale():
    """Moved bytes count the whole model, as the stalls price it: a 2-layer trace standing for
    a 58-layer model moves 29 times its own slots' bytes, in the row and in the migrations."""
    from eplbsim.replay import replay
    from eplbsim.runspec import RunSpec
    from eplbsim.traces.synth import synthesize
    trace = synthesize("skewed", steps=24, tokens=128, layers=2, experts=32, top_k=4, seed=0)
    spec = RunSpec.of(gpus=4, redundant=8, rebalance_every=8, expert_bytes=1000,
                      cost="roofline", model="deepseek-v3")
    result = replay(trace, spec)
    rows = result.migrations()
    slots = sum(r["moved_slots"] for r in rows)
    assert slots > 0 and result.metrics["moved_bytes"] == slots * 1000 * 58 // 2
    assert sum(r["bytes"] for r in rows) == result.metrics["moved_bytes"]
