"""Routing ids for tests: a router picks top_k distinct experts, so traces refuse a token
that routes one expert twice in a layer; `distinct` makes random ids obey that."""

import numpy as np
import torch


def distinct(ids):
    """`ids [..., K]` (numpy or torch) with every repeat of an id within a row after its first
    occurrence turned into padding (-1)."""
    out = np.array(ids.numpy() if isinstance(ids, torch.Tensor) else ids, copy=True)
    for k in range(1, out.shape[-1]):
        again = (out[..., k:k + 1] == out[..., :k]).any(-1) & (out[..., k] >= 0)
        out[..., k][again] = -1
    return torch.from_numpy(out) if isinstance(ids, torch.Tensor) else out
