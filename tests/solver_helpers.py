"""What a registry-wide solver test gives a solver beside the loads: the co-activation, for a
solver that places by it (`affinity`, whose MILP bound, tested in tests/solvers/test_affinity.py, is
given a short time limit here: the contract is about the placement, which it does not change),
and the source-rank counts, for one that places by them (`topology-aware`)."""

import numpy as np

from eplbsim.solvers import NO_REDUNDANCY, SOLVERS, solver_options


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


def sources_of(load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Source-rank counts `[L, G, E]` summing to `load [L, E]`: seeded, deterministic shares."""
    rng = np.random.default_rng(int(load.sum()) % 2**32)
    share = rng.random(load.shape[:1] + (num_gpus,) + load.shape[1:])
    return load[:, None, :] * share / share.sum(1, keepdims=True)


def inputs(name: str, load: np.ndarray, num_gpus: int) -> dict:
    """The options solver `name` needs beside `load [L, E]` on `num_gpus` GPUs: its
    co-activation when it takes one (and a short time for its bound), its source-rank counts
    when it takes them, else none."""
    takes = solver_options(SOLVERS[name])
    out: dict = {}
    if "coactivation" in takes:
        out.update(coactivation=pairs_of(load), milp_seconds=0.1)
    if "source_load" in takes:
        out["source_load"] = sources_of(load, num_gpus)
    return out


def fits(name: str, num_experts: int, num_slots: int) -> bool:
    """Whether solver `name` places `num_experts` on `num_slots` slots (one in `NO_REDUNDANCY`
    places none redundant)."""
    return SOLVERS[name] not in NO_REDUNDANCY or num_slots == num_experts
