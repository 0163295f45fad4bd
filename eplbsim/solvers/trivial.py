"""The trivial solver: slot `p` holds logical expert `p % E`, whatever the load.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

import numpy as np

from ..placement import trivial_placement
from ..topology import Topology


def trivial(load: np.ndarray, num_slots: int, topology: Topology,
            num_groups: int = 1) -> np.ndarray:
    """Slot `p` holds expert `p % E` in every layer; `load`, `topology`, `num_groups` are ignored
    beyond their shapes.

    load: float64 `[L, E]` pairs per logical expert -> phy2log int64 `[L, P]`.
    """
    num_layers, num_experts = np.shape(load)
    return trivial_placement(num_layers, num_experts, num_slots, topology).phy2log.numpy()
