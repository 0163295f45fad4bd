"""`metro`: the placement that balances the experts each GPU is expected to activate (METRO,
arXiv 2512.09277: in memory-bound decode a GPU's time follows the distinct experts whose
weights it reads, not its tokens; written from the paper's description, no code of it read).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs.

Replicas are water-filled on the loads as `lpt` does (each extra one to the expert with the
highest load per replica). A step of `batch_pairs` routed pairs activates a replica of expert
`e` (share `q_e` of the layer's pairs, split evenly over its `c_e` replicas) with probability
`1 - (1 - q_e / c_e) ^ batch_pairs`; the replicas are packed as `lpt` packs (largest first onto
the least-loaded GPU with a free slot, then improving swaps) on that probability instead of
their pairs, so each GPU's expected activated experts, the sum of its replicas', are balanced.
Small batches activate few experts and the packing spreads the likely ones; at prefill sizes
every replica is all but certain to run, every GPU expects its `P / G` slots, and the token
balance is left to chance: `metro` then loses to a token-balancing solver.
"""

from __future__ import annotations

import numpy as np

from ..placement.topology import Topology
from .bounds import replicate
from .lpt import _check_anti, pack_items

BATCH_PAIRS = 512.0  # routed pairs a decode step: 64 tokens of top-8


def activation(load: np.ndarray, counts: np.ndarray, batch_pairs: float) -> np.ndarray:
    """The probability that a step of `batch_pairs` pairs activates a given replica of each
    expert, float64 `[L, E]`, for loads `load [L, E]` split over `counts [L, E]` replicas."""
    total = load.sum(1, keepdims=True)
    share = np.divide(load, total * counts, out=np.zeros_like(load), where=total > 0)
    return 1.0 - np.power(1.0 - share, batch_pairs)


def metro(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
          batch_pairs: float = BATCH_PAIRS, anti_colocation: bool = False) -> np.ndarray:
    """Balance the experts each GPU is expected to activate (module doc).

    load:            float64 `[L, E]` pairs per logical expert
    num_slots:       `P`, a multiple of `G`, at least `E`
    topology:        the cluster; num_groups: ignored
    batch_pairs:     routed pairs a step (tokens x top-k) the activations are expected for
    anti_colocation: no GPU holds two replicas of one expert (InputError when impossible)
    Returns phy2log int64 `[L, P]`.
    """
    load = np.asarray(load, dtype=np.float64)
    G = topology.num_gpus
    if anti_colocation:
        _check_anti(load.shape[1], num_slots, G)
    items, counts = replicate(load, num_slots, G if anti_colocation else None)  # [L, P], [L, E]
    weight = np.take_along_axis(activation(load, counts, float(batch_pairs)), items, 1)
    slot_item = pack_items(weight, items, G, bool(anti_colocation))
    return np.take_along_axis(items, slot_item, 1)
