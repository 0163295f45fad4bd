"""`lplb`: DeepSeek LPLB's placement over a redundancy topology (DESIGN.md §10), written from its
description and source (deepseek-ai/LPLB `lplb/planner.py` `update_redundancy_mapping`, read
in a verbatim copy at shizhengLi/deepseek-lplb-learning ba2936a2; the topologies of its
`tests/utils.py`).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` GPUs, `n` GPUs of one
topology group, `D` links (redundant slots) of a GPU, `C` copies a link carries.

A redundancy topology links each GPU `g` of a group of `n` to `D` others, `r2o[g][d]`:
- `ring` (n = 8, D = 1): `g + 1 mod 8`;
- `cube` (n = 8, D = 2): `[3,0,1,2,7,4,5,6]` and `[6,7,4,5,0,1,2,3]`;
- `hypercube` (n = 16, D = 2): `4 floor(g/4) + (g - 1) mod 4` and `(g + 12) mod 16`;
- `torus` (an `m x n'` grid, D = 2, option `torus_rows = m`): `g = i n' + j` links
  `((i+1) mod m) n' + j` and `i n' + (j+1) mod n'`.
The `G` GPUs form `G / n` groups of consecutive GPUs. The placement is the reference solver's
without replication (`deepseek` on `E` slots: `E / G` originals a GPU), then each GPU's
originals are ranked by load (descending, stable), and redundant slot `(c, d)` of GPU `g` (its
`c D + d`-th redundant slot) takes a copy of the `c D + d`-th heaviest original of GPU
`r2o[g][d]` of the same group. Every replicated expert thus has exactly two replicas, its
original and one copy on a linked GPU. A GPU's slots are its originals, then its redundant
slots.
"""

from __future__ import annotations

import numpy as np

from ..base.errors import InputError
from ..placement.topology import Topology
from .deepseek import deepseek

TOPOLOGIES = ("ring", "cube", "hypercube", "torus")


def redundancy_links(kind: str, group_size: int | None = None,
                     torus_rows: int = 8) -> np.ndarray:
    """`r2o [n, D]` of a redundancy topology (module doc); `group_size` for the torus only."""
    if kind == "ring":
        return ((np.arange(8) + 1) % 8).reshape(8, 1)
    if kind == "cube":
        return np.array([[3, 0, 1, 2, 7, 4, 5, 6], [6, 7, 4, 5, 0, 1, 2, 3]]).T
    if kind == "hypercube":
        g = np.arange(16)
        return np.stack([4 * (g // 4) + (g - 1) % 4, (g + 12) % 16], 1)
    if kind == "torus":
        n = group_size
        if n is None or torus_rows < 1 or n % torus_rows:
            raise InputError(f"a torus of {torus_rows} rows needs a group size divisible by "
                             f"it, got {n}")
        cols = n // torus_rows
        i, j = np.divmod(np.arange(n), cols)
        return np.stack([((i + 1) % torus_rows) * cols + j, i * cols + (j + 1) % cols], 1)
    raise InputError(f"unknown redundancy topology {kind!r}; choose one of "
                     f"{', '.join(TOPOLOGIES)}")


def lplb(load: np.ndarray, num_slots: int, topology: Topology, num_groups: int = 1, *,
         redundancy: str = "cube", torus_rows: int = 8) -> np.ndarray:
    """DeepSeek LPLB's placement over a redundancy topology (module doc).

    load:       float64 `[L, E]` pairs per logical expert
    num_slots:  `P`: `E / G` originals and the redundant slots on each GPU
    topology:   the cluster; num_groups: ignored
    redundancy: the redundancy topology, one of `TOPOLOGIES`; torus_rows: its rows (torus)
    Returns phy2log int64 `[L, P]`. InputError when the GPUs do not form whole groups of the
    topology or the redundant slots a GPU has are not a multiple of its links.
    """
    L, E = load.shape
    G = topology.num_gpus
    if E % G:
        raise InputError(f"lplb places E / G originals a GPU: {E} experts do not divide over "
                         f"{G} GPUs")
    per_gpu, redundant = E // G, num_slots // G - E // G
    size = {"ring": 8, "cube": 8, "hypercube": 16}.get(redundancy, G)
    links = redundancy_links(redundancy, size, int(torus_rows))  # [n, D]
    n, D = links.shape
    if G % n or redundant < D or redundant % D or redundant > per_gpu:
        raise InputError(f"the {redundancy} topology links groups of {n} GPUs with {D} "
                         f"redundant slot(s) a link: {G} GPUs with {redundant} redundant slots "
                         f"each do not fit it (GPUs a multiple of {n}, redundant slots a "
                         f"multiple of {D}, at most {per_gpu})")
    originals = deepseek(load, E, topology, num_groups)[0].reshape(L, G, per_gpu)  # [L, G, E/G]
    out = np.empty((L, G, per_gpu + redundant), dtype=np.int64)
    for layer in range(L):
        ranked = np.array([sorted(row, key=lambda e: -load[layer, e]) for row in
                           originals[layer]])  # [G, E/G] heaviest first (stable)
        out[layer, :, :per_gpu] = originals[layer]
        for g in range(G):
            base = g - g % n
            for slot in range(redundant):
                c, d = divmod(slot, D)
                out[layer, g, per_gpu + slot] = ranked[base + links[g % n, d], c * D + d]
    return out.reshape(L, num_slots)
