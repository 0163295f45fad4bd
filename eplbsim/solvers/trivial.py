"""The trivial solver: slot `p` holds logical expert `p % E`, whatever the load.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

import numpy as np

from ..base.errors import InputError
from ..placement import trivial_placement
from ..placement.topology import Topology


def trivial(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
            anti_colocation: bool = False) -> np.ndarray:
    """Slot `p` holds expert `p % E` in every layer; `load`, `topology`, `num_groups` are ignored
    beyond their shapes.

    load: float64 `[L, E]` pairs per logical expert -> phy2log int64 `[L, P]`.
    anti_colocation: require that no GPU holds two replicas of one expert. A GPU's `P / G`
    slots are consecutive, so their experts `p % E` differ exactly when `P / G <= E`; otherwise
    InputError (this solver cannot move replicas to honour it).
    """
    num_layers, num_experts = np.shape(load)
    per_gpu = num_slots // topology.num_gpus
    if anti_colocation and per_gpu > num_experts:
        raise InputError(f"the trivial solver cannot honour anti_colocation: each GPU holds "
                         f"{per_gpu} consecutive slots p, more than the {num_experts} experts, so "
                         f"two of them hold the same expert p % {num_experts}")
    return trivial_placement(num_layers, num_experts, num_slots, topology).phy2log.numpy()
