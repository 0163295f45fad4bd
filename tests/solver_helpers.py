"""What a registry-wide solver test gives a solver beside the loads: the co-activation, for a
solver that places by it (`affinity`, whose MILP bound, tested in tests/solvers/test_affinity.py, is
given a short time limit here: the contract is about the placement, which it does not change)."""

import numpy as np

from eplbsim.solvers import SOLVERS, solver_options


def pairs_of(load: np.ndarray) -> np.ndarray:
    """A co-activation `[L, E, E]` for `load [L, E]`: symmetric, each expert's load on the
    diagonal, pairs drawn from the loads (a seeded, deterministic stand-in for a trace's)."""
    rng = np.random.default_rng(int(load.sum()) % 2**32)
    pairs = np.minimum(load[:, :, None], load[:, None, :]) * rng.random(load.shape
                                                                        + load.shape[1:])
    pairs = np.floor((pairs + pairs.transpose(0, 2, 1)) / 2)
    idx = np.arange(load.shape[1])
    pairs[:, idx, idx] = load
    return pairs


def inputs(name: str, load: np.ndarray) -> dict:
    """The options solver `name` needs beside `load [L, E]`: its co-activation when it takes
    one (and a short time for its bound), else none."""
    if "coactivation" not in solver_options(SOLVERS[name]):
        return {}
    return {"coactivation": pairs_of(load), "milp_seconds": 0.1}
