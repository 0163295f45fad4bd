"""Which of a trace's layers route by token id (DeepSeek-V4's hash layers, DESIGN.md §16), and
the routing of those layers by a token-id table.

Dimensions: `N` token rows, `L` layers, `E` logical experts, `K` top-k, `V` vocabulary.

A hash-routed layer takes each token's experts from a fixed table `tid2eid [V, K]` indexed by
the token's id, not from the router: DeepSeek-V4 routes its first `num_hash_layers` layers so.
Router bias cannot rebalance such a layer, but a placement can, and its load is known from a
batch's token ids before any routing. A trace says which of its layers are hash-routed by its
meta: `hash_layers`, the trace's layer indices (as `trace synth` writes them), else
`num_hash_layers`, the model's count (as its config names it); else the model priced says it
(`ModelShape.hash_layers`). A trace layer stands for the model layer `meta["model_layers"][i]`
(an importer that drops layers keeps their numbers), else `i`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.errors import InputError
from ..base.files import check_memory

HASH_LAYERS = "hash_layers"  # meta: the trace's hash-routed layers, trace layer indices
NUM_HASH_LAYERS = "num_hash_layers"  # meta: the model's first layers that are hash-routed
EMPTY_LAYERS = "empty_layers"  # meta: model layers a log held that route nothing (dropped)
KINDS = ("hash", "learned")  # the two kinds of MoE layer, as results name them


def _int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def hash_layers(meta: dict[str, Any], num_layers: int, model_hash_layers: int = 0
                ) -> tuple[int, ...]:
    """The trace layers (indices in `[0, L)`, ascending) that are hash-routed (module doc):
    `meta["hash_layers"]`, else those standing for a model layer below `meta["num_hash_layers"]`,
    else below `model_hash_layers` (the priced model's); `()` when none says so. InputError
    naming the key for a malformed entry."""
    listed = meta.get(HASH_LAYERS)
    if listed is not None:
        if not isinstance(listed, (list, tuple)) or not all(_int(i) for i in listed) or \
                len(set(listed)) != len(listed) or any(not 0 <= i < num_layers for i in listed):
            raise InputError(f"meta {HASH_LAYERS} must list distinct layer indices in "
                             f"[0, {num_layers}), got {listed!r:.80}")
        return tuple(sorted(int(i) for i in listed))
    count = meta.get(NUM_HASH_LAYERS, model_hash_layers)
    if not _int(count) or count < 0:
        raise InputError(f"meta {NUM_HASH_LAYERS} must be an integer >= 0, got {count!r:.40}")
    numbers = meta.get("model_layers") or range(num_layers)
    return tuple(i for i, number in enumerate(numbers) if number < count)


def learned_layers(num_layers: int, hashed: tuple[int, ...]) -> tuple[int, ...]:
    """The layers of `[0, L)` that are not in `hashed`: those the router picks for."""
    return tuple(i for i in range(num_layers) if i not in set(hashed))


def token_ids(rng: np.random.Generator, count: int, vocab: int, zipf: float) -> np.ndarray:
    """`count` token ids in `[0, V)` drawn from `rng`, int64 `[N]`: id `v` with probability
    proportional to `(v + 1) ** -zipf` (Zipf's law over the vocabulary; 0: uniform)."""
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -float(zipf)  # [V]
    return rng.choice(vocab, size=count, p=weights / weights.sum())


def tid2eid_tables(rng: np.random.Generator, layers: int, vocab: int, experts: int,
                   top_k: int) -> np.ndarray:
    """Each hash layer's own table (DeepSeek-V4 keeps a `tid2eid` buffer in every hash layer's
    gate), int32 `[H, V, K]`: each token id's `K` distinct experts in `[0, E)`, a uniform random
    `K`-subset drawn from `rng`, in blocks of rows so memory stays bounded."""
    check_memory(4 * layers * vocab * top_k + 2 ** 25, f"{layers} tid2eid tables of {vocab} "
                 f"tokens x top-{top_k}", "use a smaller vocab")
    tables = np.empty((layers, vocab, top_k), dtype=np.int32)
    block = max(1, 2 ** 22 // experts)  # rows of `E` uniform keys at a time
    for table in tables:
        for lo in range(0, vocab, block):
            keys = rng.random((min(block, vocab - lo), experts))  # [b, E]
            table[lo:lo + block] = np.argpartition(keys, top_k - 1, axis=-1)[:, :top_k]
    return tables


def route_by_table(ids: np.ndarray, layers: tuple[int, ...], tables: np.ndarray,
                   tokens: np.ndarray) -> np.ndarray:
    """`ids [N, L, K]` with layer `layers[h]` rerouted by `tables[h] [V, K]` from each row's
    token id `tokens [N]` (a copy; the other layers as they are)."""
    out = ids.copy()
    out[:, list(layers)] = tables[:, tokens].transpose(1, 0, 2)  # [N, H, K]
    return out
