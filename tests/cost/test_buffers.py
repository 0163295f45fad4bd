"""DeepEP's low-latency buffer and the dispatch cap it sets (eplbsim/cost/buffers.py), against
vLLM #57894's figures (DeepSeek-V4.1-Flash, hidden 5120, EP16, 448 physical experts)."""

import pytest
import torch

from eplbsim.base.errors import InputError
from eplbsim.cost.buffers import (BUFFER_LIMIT_BYTES, GIB, cap_table, dispatch_cap,
                                  low_latency_bytes, overflow)


@pytest.mark.parametrize("tokens, gib", [(2048, 35.55), (1856, 32.21), (1840, 31.94),
                                         (1536, 26.66)])
def test_bytes_are_vllm_57894s_table(tokens, gib):
    assert round(low_latency_bytes(tokens, 5120, 448) / GIB, 2) == gib


def test_cap_at_448_experts():
    # vLLM #57894 tried multiples of 16: 1856 overflows, 1840 fits. The formula itself admits
    # three more tokens (1843), which no multiple of 16 reaches.
    assert dispatch_cap(BUFFER_LIMIT_BYTES, 5120, 448, multiple=16) == 1840
    cap = dispatch_cap(BUFFER_LIMIT_BYTES, 5120, 448)
    assert low_latency_bytes(cap, 5120, 448) < BUFFER_LIMIT_BYTES
    assert low_latency_bytes(cap + 1, 5120, 448) >= BUFFER_LIMIT_BYTES
    assert cap == 1843


def test_the_routed_experts_alone_admit_2048():
    # the documented 2048 is right for 384 experts and wrong for 448
    assert dispatch_cap(BUFFER_LIMIT_BYTES, 5120, 384) >= 2048
    assert dispatch_cap(BUFFER_LIMIT_BYTES, 5120, 448) < 2048


def test_each_redundancy_costs_capacity():
    rows = cap_table(BUFFER_LIMIT_BYTES, 5120, 384, 16, [0, 16, 32, 48, 64])
    caps = [r["cap"] for r in rows]
    assert caps == sorted(caps, reverse=True) and len(set(caps)) == len(caps)
    assert [r["physical"] for r in rows] == [384, 400, 416, 432, 448]
    assert all(r["bytes"] < BUFFER_LIMIT_BYTES for r in rows)


def test_bytes_grow_with_tokens_and_experts():
    assert low_latency_bytes(0, 7168, 256) < low_latency_bytes(1, 7168, 256)
    assert low_latency_bytes(128, 7168, 256) < low_latency_bytes(128, 7168, 288)


def test_nothing_fits_under_a_tiny_limit():
    assert dispatch_cap(1024, 7168, 256) == 0


def test_bad_input():
    with pytest.raises(InputError, match="divide"):
        cap_table(BUFFER_LIMIT_BYTES, 5120, 384, 16, [8])
    with pytest.raises(InputError, match="hidden"):
        low_latency_bytes(1, 0, 8)
    with pytest.raises(InputError, match="multiple"):
        dispatch_cap(BUFFER_LIMIT_BYTES, 5120, 448, multiple=0)


def test_overflow_flags_the_busiest_rank():
    rank_tokens = torch.tensor([[10, 12], [13, 2], [0, 0]])
    assert overflow(rank_tokens, 12).tolist() == [False, True, False]
    assert overflow(torch.zeros(0, 4, dtype=torch.int64), 1).shape == (0,)
