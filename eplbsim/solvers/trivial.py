"""The trivial solver: slot `p` holds logical expert `p % E`, whatever the load.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `N` nodes.
"""

from __future__ import annotations

import numpy as np

from ..topology import Topology


def trivial(load: np.ndarray, num_slots: int, topology: Topology,
            num_groups: int = 1) -> np.ndarray:
    """Slot `p` holds expert `p % E` in every layer; `load`, `topology`, `num_groups` are ignored
    beyond their shapes.

    load: float64 `[L, E]` pairs per logical expert -> phy2log int64 `[L, P]`.
    """
    num_layers, num_experts = np.shape(load)
    row = np.arange(num_slots, dtype=np.int64) % num_experts  # [P]
    return np.tile(row, (num_layers, 1))  # [L, P]
