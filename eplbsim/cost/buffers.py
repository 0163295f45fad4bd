"""Dispatch buffers (DESIGN.md §16): how many tokens a rank may dispatch a step through DeepEP's
low-latency kernels, and the steps whose busiest rank dispatches more.

Dimensions: `S` steps, `G` GPUs = EP ranks.

DeepEP's low-latency buffer is sized once, at start-up, for `num_max_dispatch_tokens_per_rank`
tokens a rank and every *physical* expert (`LowLatencyLayout` in `csrc/config.hpp`, DeepEP
commit 3861241a5cd49c70a22fc1a14dacb6cf54ae83e4; `Buffer.get_low_latency_rdma_size_hint` in
`deep_ep/buffer.py`, commit 04b06f7a299c8be3e97ec1dee89e481ceb08ac10): two send, two receive
and two signalling buffers, each receive buffer one message per (physical expert, token), so
redundant experts cost buffer bytes as routed ones do. The buffer must stay under 32 GiB
(`num_rdma_bytes / 16 < INT_MAX`, vLLM #57894): a fixed byte limit then caps the tokens a
rank may dispatch a step, lower the more redundant slots the placement has (vLLM #57894:
DeepSeek-V4.1-Flash, hidden 5120, EP16, 384 routed + 64 redundant = 448 physical experts).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..base.errors import InputError

GIB = 1 << 30
BUFFER_LIMIT_BYTES = 32 * GIB  # DeepEP's low-latency bound: num_rdma_bytes / 16 < INT_MAX
_ALIGN = 128  # NUM_BUFFER_ALIGNMENT_BYTES (DeepEP csrc/kernels/configs.cuh)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")


def low_latency_bytes(tokens: int, hidden: int, num_experts: int) -> int:
    """Bytes of DeepEP's low-latency RDMA buffer for `tokens` dispatched a rank a step, a
    token of `hidden` BF16 elements, `num_experts` physical experts (routed + redundant):
    `get_low_latency_rdma_size_hint` as DeepEP computes it (module doc; its `num_ranks`
    argument does not enter the size). A dispatch message is a 16-byte header and the larger
    of the BF16 token and the FP8 token with a float scale per 128 channels; a combine message
    the BF16 token and a BF16 pair per 128 channels."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise InputError(f"tokens must be a whole number >= 0, got {tokens!r}")
    _positive("hidden", hidden)
    _positive("num_experts", num_experts)
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(tokens * dispatch_msg, num_experts * tokens * combine_msg)
    recv = num_experts * tokens * max(dispatch_msg, combine_msg)
    signal = -(-num_experts * 4 // _ALIGN) * _ALIGN
    total = 2 * (send + recv + signal)
    return (total + _ALIGN) // _ALIGN * _ALIGN


def dispatch_cap(limit_bytes: int, hidden: int, num_experts: int, multiple: int = 1) -> int:
    """The most tokens a rank may dispatch a step, a multiple of `multiple`, whose low-latency
    buffer (`low_latency_bytes`) stays under `limit_bytes`; 0 when not even `multiple` tokens
    fit. `multiple` 16 gives the figures vLLM #57894 tabulates (it tried multiples of 16)."""
    _positive("limit_bytes", limit_bytes)
    _positive("multiple", multiple)
    lo, hi = 0, limit_bytes // multiple + 1  # hi: fits no more than a byte a token
    while hi - lo > 1:  # invariant: lo * multiple fits, hi * multiple does not
        mid = (lo + hi) // 2
        if low_latency_bytes(mid * multiple, hidden, num_experts) < limit_bytes:
            lo = mid
        else:
            hi = mid
    return lo * multiple


def cap_table(limit_bytes: int, hidden: int, num_experts: int, num_ranks: int,
              redundants: Sequence[int], multiple: int = 1) -> list[dict[str, int]]:
    """What each redundancy costs in dispatch capacity: for each of `redundants` (redundant
    slots beside `num_experts` routed experts; each must make the slots divide over
    `num_ranks`), a row `{"redundant", "physical", "cap", "bytes"}`: the physical experts, the
    cap (`dispatch_cap`) and the buffer's bytes at the cap."""
    _positive("num_ranks", num_ranks)
    rows = []
    for redundant in redundants:
        physical = num_experts + redundant
        if redundant < 0 or physical % num_ranks:
            raise InputError(f"{num_experts} experts + {redundant} redundant do not divide "
                             f"over {num_ranks} ranks")
        cap = dispatch_cap(limit_bytes, hidden, physical, multiple)
        rows.append({"redundant": redundant, "physical": physical, "cap": cap,
                     "bytes": low_latency_bytes(cap, hidden, physical)})
    return rows


def overflow(rank_tokens: torch.Tensor, cap: int) -> torch.Tensor:
    """The steps whose busiest rank dispatches more than `cap` tokens, bool `[S]`, from the
    tokens each rank dispatches a step, `rank_tokens [S, G]`."""
    if rank_tokens.numel() == 0:
        return torch.zeros(rank_tokens.shape[0], dtype=torch.bool)
    return rank_tokens.amax(-1) > cap
