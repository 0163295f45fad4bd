"""Counter-based streams: Philox4x32-10 against its published answers, the scalar and torch
forms bit for bit, and `random`'s statistics under the new stream against their closed forms.

Dimensions: `T` tokens, `L` layers, `K` top-k, `G` ranks.
"""

import math

import numpy as np
import pytest
import torch

from eplbsim.dispatch.streams import (DRAW, MASK, Stream, batch_draws, coin_hits, philox,
                                      philox_lanes,
                                      philox_torch, split_key, stream_key)
from eplbsim.placement import Placement
from eplbsim.placement.topology import Topology
from eplbsim.replay import replay
from eplbsim.runspec import RunSpec
from eplbsim.traces.trace import Trace

# Random123's known answers for Philox4x32-10: (key, counter) -> output
KNOWN = [((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
         ((MASK, MASK), (MASK,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
         ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
          (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("key, counter, want", KNOWN)
def test_philox_gives_the_published_answers(key, counter, want):
    assert tuple(int(w) for w in philox(*key, *counter)) == want
    c0 = torch.tensor([counter[0], 5])
    assert tuple(philox_torch(key, c0, *counter[1:])[0].tolist()) == want


def test_torch_and_compiled_philox_agree_and_lanes_are_16_bit_halves():
    key = split_key(stream_key(3, 1))
    c0 = torch.arange(0, 1000, 7)
    torch_words = philox_torch(key, c0, 4, 9, 0)
    assert torch_words.tolist() == [[int(w) for w in philox(*key, c, 4, 9, 0)]
                                    for c in c0.tolist()]
    draws = batch_draws(key, 21, [4], 9, "cpu")[0]  # pair i: block i // 8, lane i % 8
    for i in range(21):
        word = int(philox(*key, i // 8, 4, 9, 0)[(i % 8) // 2])
        assert draws[i] == (word >> (16 * (i % 2))) & 0xFFFF
    assert draws.dtype == torch.int64 and 0 <= int(draws.min()) and int(draws.max()) < 65536


@pytest.mark.parametrize("count", [1, 32, 96])
def test_philox_lanes_are_philox_of_each_key(count):
    """Every key's block at once (the vector loop), each the scalar `philox` of its key and
    its shifted counter."""
    keys = np.array([split_key(stream_key(7, j)) for j in range(count)], np.uint64).T  # [2, S]
    shifts = np.arange(count, dtype=np.uint64) * np.uint64(3)
    words = np.zeros((4, count), np.uint64)
    philox_lanes(keys[0].copy(), keys[1].copy(), shifts, 11, 5, 2, DRAW, words)
    assert words.T.tolist() == [[int(w) for w in philox(*keys[:, j], 11, 5 + 3 * j, 2, DRAW)]
                                for j in range(count)]


def test_streams_are_counter_based_and_keyed():
    a, b = Stream(stream_key(0), 5), Stream(stream_key(0, 1), 5)
    assert torch.equal(a.draws(64, 2, "cpu"), Stream(stream_key(0), 5).draws(64, 2, "cpu"))
    assert not torch.equal(a.draws(64, 2, "cpu"), b.draws(64, 2, "cpu"))
    assert torch.equal(a.draws(64, 2, "cpu")[:, :10], a.draws(10, 2, "cpu")), "a prefix"
    three = a.draws(64, 2, "cpu", num_layers=3)  # every layer at once, as layer by layer
    assert torch.equal(three, torch.cat([a.draws(64, layer, "cpu") for layer in (2, 3, 4)]))
    shifted = Stream(stream_key(0), 5, shift=1)
    assert torch.equal(shifted.draws(64, 0, "cpu"), a.draws(64, 1, "cpu"))
    g1, g2 = a.generator(3, "cpu"), a.generator(3, "cpu")
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    assert not torch.equal(torch.rand(4, generator=a.generator(3, "cpu")),
                           torch.rand(4, generator=a.generator(4, "cpu")))


def test_coins_hit_at_their_rate():
    hits = coin_hits(stream_key(1, 2), 0.3, 20_000)
    assert abs(hits.mean() - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 20_000)
    assert not coin_hits(stream_key(1), 0.0, 100).any() and coin_hits(stream_key(1), 1.0, 100).all()


@pytest.mark.parametrize("n", [2, 3])
def test_random_statistics_match_their_closed_forms(n):
    """`G = n` ranks, every expert with one replica on each GPU, independent streams: each
    rank executes a pair when its draw picks its own GPU's replica (probability 1/n, draws
    independent), so `c ~ Binomial(n, 1/n)`, and all ranks agree with probability `n^(1-n)`
    (the 65536 % n bias of `draw % n` is below 1e-4 of either)."""
    E, L, K, T, S = 4, 2, 2, 4000, 3
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T * S)])
    trace = Trace(torch.from_numpy(ids).int(), torch.arange(S + 1) * T, E)
    placement = Placement(torch.arange(E).repeat(n).view(1, -1).repeat(L, 1), E, Topology(n))
    spec = RunSpec.of(gpus=n, redundant=E * (n - 1), placement=placement, policy="random")
    m = replay(trace, spec).metrics
    pairs = T * S * L * K
    p0, p1 = (1 - 1 / n) ** n, (1 - 1 / n) ** (n - 1)
    for got, want in ((m["multiplicity"]["0"], p0), (m["multiplicity"]["1"], p1),
                      (m["rank_agreement"], n ** (1 - n))):
        assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / pairs)
