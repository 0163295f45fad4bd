"""`flashlb` (`solvers.flashlb`): FlashLB's published toy case, its risk awareness and its
search, beside the registry contract tests every solver passes (`test_solvers`,
`test_migration`)."""

import numpy as np
import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.placement.topology import Topology
from eplbsim.solvers import solve
from eplbsim.solvers.bounds import peak_gpu_load
from eplbsim.solvers.flashlb import flashlb

TOY = np.array([[600, 560, 120, 120, 20, 10, 10, 10]], dtype=np.float64)


def test_the_published_toy_case_beats_the_reference_solver():
    # FlashLB's example: 8 GPUs x 2 slots; the reference solver reaches 232, FlashLB 205, the
    # optimum is 196.67
    peaks = {name: float(peak_gpu_load(TOY, solve(name, TOY, 16, Topology(8)).phy2log, 8)[0])
             for name in ("deepseek", "flashlb")}
    assert peaks["deepseek"] == 232.0
    assert peaks["flashlb"] <= 205.0
    assert peaks["flashlb"] == pytest.approx(590 / 3)  # it finds the optimum here
    greedy = float(peak_gpu_load(TOY, flashlb(TOY, 16, Topology(8), depth=0), 8)[0])
    assert greedy > peaks["flashlb"]  # the search, not the greedy counts, gets there


def test_a_volatile_expert_gets_more_replicas_than_a_steady_one_of_the_same_mean():
    rng = np.random.default_rng(0)
    steady = np.full(64, 100.0)
    volatile = 100.0 + 80.0 * rng.choice([-1.0, 1.0], 64)
    rest = rng.uniform(20, 30, (64, 6))
    history = np.concatenate([steady[:, None], volatile[:, None], rest], 1)[:, None, :]
    phy2log = flashlb(history.sum(0), 12, Topology(4), history=history)
    counts = np.bincount(phy2log[0], minlength=8)
    assert counts[1] > counts[0]
    calm = flashlb(history.sum(0), 12, Topology(4))  # no history: the two look alike
    assert np.bincount(calm[0], minlength=8)[0] == np.bincount(calm[0], minlength=8)[1]


def test_a_schedule_gives_flashlb_the_window_it_forecasts_from():
    from eplbsim.replay import replay
    from eplbsim.runspec import RunSpec
    from eplbsim.traces.synth import synthesize
    trace = synthesize("drift", seed=0, steps=12, tokens=64, layers=2, experts=16, top_k=4)
    result = replay(trace, RunSpec.of(gpus=4, redundant=4, solver="flashlb",
                                      rebalance_every=4))
    assert result.metrics["rebalances"] == 2 and result.metrics["gpu_imbalance"] > 1


def test_bad_history_is_refused():
    with pytest.raises(InputError, match="history must be"):
        flashlb(TOY, 16, Topology(8), history=np.ones((3, 2, 8)))
    with pytest.raises(InputError, match="history must be"):
        flashlb(TOY, 16, Topology(8), history="yesterday")
    with pytest.raises(InputError, match="history must be"):
        flashlb(TOY, 16, Topology(8), history=-torch.ones(3, 1, 8).numpy())
