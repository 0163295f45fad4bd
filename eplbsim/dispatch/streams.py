"""Counter-based random streams: every draw of a run is Philox4x32-10 of a key and a counter.

A rank's stream is a 64-bit key (`stream_key`) and a per-step shift (the rng relation "drift":
the rank's coin hits so far). Any draw is computed from where it sits, without the draws before
it, so a step's draws do not depend on the steps before (a run may be split over workers by
steps) and the replay computes only the draws it reads (a rank whose GPU holds no replica of a
pair's expert never needs that pair's draw).

Counter words `(c0, c1, c2, c3)` of Philox4x32-10 (Salmon et al., SC'11, the generator of
torch's CUDA generator and of Triton's `tl.randint`), by what they draw:
- `random`'s draw of pair `i` (its flat position `t K + k` in the batch the rank dispatches) in
  layer `l` of step `s`: 16-bit lane `i % 8` of Philox(key, `(i // 8, l + shift, s, 0)`), the
  lanes being the four 32-bit words low half first. In `[0, 65536)`, as the engine's
  `randint(0, 65536)`.
- the seed of the torch generator a torch-drawing policy (lp, lplb-atomic, an engine's own code)
  gets for layer `l` of step `s`: words 0 and 1 of Philox(key, `(0, l + shift, s, 1)`).
- the drift coin of step `s`: word 0 of Philox(coin key, `(s, 0, 0, 2)`) / 2^32 < `drift_p`.

Philox is written twice, bit for bit: scalar for compiled loops (`philox`, numba; callable from
Python) and vectorized in torch on any device (`philox_torch`: `batch_draws`, the reference
policy's and the CUDA path's draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..base.compiled import JIT, jit, prange
from ..base.errors import InputError

M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # its key increments (Weyl sequence)
ROUNDS = 10
MASK = 0xFFFFFFFF
DRAW, SEED, COIN = 0, 1, 2  # the counter's last word: what a Philox block draws
LANES = 8  # 16-bit draws of one block
LANE_KEYS = 32  # keys `philox_lanes` makes blocks of together: pad to a multiple of it


@jit(**JIT, inline="always")
def philox(k0, k1, c0, c1, c2, c3):  # pragma: no cover - compiled
    """Philox4x32-10 of key `(k0, k1)` and counter `(c0, c1, c2, c3)`, each word in
    `[0, 2^32)`: four uint64 words in `[0, 2^32)` (inlined where compiled loops call it, so a
    loop over keys becomes vector code: `philox_lanes`)."""
    mask = np.uint64(MASK)
    m0, m1 = np.uint64(M0), np.uint64(M1)
    x0, x1, x2, x3 = np.uint64(c0), np.uint64(c1), np.uint64(c2), np.uint64(c3)
    a, b = np.uint64(k0), np.uint64(k1)
    for r in range(ROUNDS):
        p0 = m0 * x0
        p1 = m1 * x2
        x0, x1, x2, x3 = ((p1 >> np.uint64(32)) ^ x1 ^ a, p1 & mask,
                          (p0 >> np.uint64(32)) ^ x3 ^ b, p0 & mask)
        a = (a + np.uint64(W0)) & mask
        b = (b + np.uint64(W1)) & mask
    return x0, x1, x2, x3


@jit(**JIT, inline="always")
def philox_lanes(k0, k1, shifts, c0, c1, c2, c3, words):  # pragma: no cover - compiled
    """`philox` of every key `(k0[j], k1[j])` with counter `(c0, c1 + shifts[j], c2, c3)`, into
    `words[:, j]`: keys and shifts uint64 `[S]`, words uint64 `[4, S]`. numba makes the loop
    vector code: over 32 keys on a 2-core AVX-512 guest, 1.1 to 1.4 ns a block instead of 8
    to 17 one at a time (there a loop from a nonzero start, or over 16 keys, was not
    vectorized: callers pad `S` to a multiple of `LANE_KEYS`)."""
    for j in range(k0.shape[0]):
        w = philox(k0[j], k1[j], c0, np.uint64(c1) + shifts[j], c2, c3)
        words[0, j], words[1, j], words[2, j], words[3, j] = w


@jit(**JIT, inline="always")
def lane(word, i):  # pragma: no cover - compiled
    """Pair `i`'s 16-bit draw from `word`, the block's 32-bit word `(i % 8) // 2` (low half
    first): an int64 in `[0, 65536)`."""
    return np.int64((np.uint64(word) >> np.uint64(16 * (i & 1))) & np.uint64(0xFFFF))


@jit(**JIT, inline="always")
def lane_mod(word, i, n):  # pragma: no cover - compiled
    """`lane(word, i) % n` for `n` in `[1, 2^32)`, an int64, divided in 32 bits (a 64-bit
    division costs several times more, and it is most of a replicated pair's work)."""
    return np.int64(np.uint32(lane(word, i)) % np.uint32(n))


@jit(parallel=True, **JIT)
def _coins(k0, k1, stop, threshold, out):  # pragma: no cover - compiled
    for s in prange(stop):
        out[s] = philox(k0, k1, s, 0, 0, COIN)[0] < threshold


def _mulhilo(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(high, low)` 32-bit words of `x * m` for int64 `x` in `[0, 2^32)`, without leaving
    int64 (the product is split in 16-bit halves of `x`)."""
    low16, high16 = x & 0xFFFF, x >> 16
    a, b = low16 * m, high16 * m  # each < 2^48
    return (b + (a >> 16)) >> 16, (((b & 0xFFFF) << 16) + a) & MASK


def philox_torch(key: tuple[int, int], c0: torch.Tensor, c1: int | torch.Tensor, c2: int,
                 c3: int) -> torch.Tensor:
    """`philox` of key `key` and counters `(c0[j], c1[j], c2, c3)` for every entry of int64 `c0
    [...]` (`c1` an int, or int64 broadcasting with `c0`), on its device: int64 `[..., 4]`."""
    x1 = c1 + torch.zeros_like(c0)
    x0, x2, x3 = c0 + torch.zeros_like(x1), torch.full_like(x1, c2), torch.full_like(x1, c3)
    a, b = key
    for _ in range(ROUNDS):
        h0, l0 = _mulhilo(x0, M0)
        h1, l1 = _mulhilo(x2, M1)
        x0, x1, x2, x3 = h1 ^ x1 ^ a, l1, h0 ^ x3 ^ b, l0
        a, b = (a + W0) & MASK, (b + W1) & MASK
    return torch.stack([x0, x1, x2, x3], -1)


def batch_draws(key: tuple[int, int], num_pairs: int, layers: torch.Tensor, step: int,
                device: torch.device | str) -> torch.Tensor:
    """`random`'s draws of pairs `0 .. num_pairs - 1` at counter rows `(layers[l], step)`, int64
    `[len(layers), num_pairs]` in `[0, 65536)` on `device`: every layer at once (one Philox
    over `[L, B]` blocks, a few dozen tensor ops whatever `L`)."""
    blocks = torch.arange((num_pairs + LANES - 1) // LANES, dtype=torch.int64, device=device)
    rows = torch.as_tensor(layers, dtype=torch.int64, device=device).view(-1, 1)
    words = philox_torch(key, blocks.view(1, -1), rows, step, DRAW)  # [L, B, 4]
    halves = torch.stack([words & 0xFFFF, words >> 16], -1)  # [L, B, 4, 2]: low half first
    return halves.reshape(rows.shape[0], -1)[:, :num_pairs]


def split_key(key: int) -> tuple[int, int]:
    """A 64-bit key as Philox's two 32-bit key words."""
    return key & MASK, (key >> 32) & MASK


def stream_key(*parts: int) -> int:
    """A 64-bit key derived from integers (numpy's SeedSequence hashing)."""
    words = np.random.SeedSequence(list(parts)).generate_state(2)
    return int(words[0]) | int(words[1]) << 32


def coin_hits(key: int, drift_p: float, steps: int) -> np.ndarray:
    """The drift coin of each of steps `0 .. steps - 1` under `key`: bool `[steps]`, each True
    with probability `drift_p` (module doc)."""
    out = np.zeros(steps, np.bool_)
    _coins(*split_key(key), steps, np.uint64(min(int(drift_p * 2 ** 32), 2 ** 32)), out)
    return out


@dataclass(frozen=True)
class Stream:
    """Where one rank draws in one step: its key and its shift (0 unless it drifted).

    Draws of layer `l` sit at counter row `(l + shift, step)` (module doc)."""

    key: int
    step: int
    shift: int = 0

    @property
    def words(self) -> tuple[int, int]:
        return split_key(self.key)

    def draws(self, num_pairs: int, layer: int, device: torch.device | str,
              num_layers: int = 1) -> torch.Tensor:
        """`random`'s draws of a batch of `num_pairs` in each of layers `layer .. layer +
        num_layers - 1`, int64 `[num_layers, num_pairs]`."""
        first = layer + self.shift
        layers = torch.arange(first, first + num_layers, dtype=torch.int64, device=device)
        return batch_draws(self.words, num_pairs, layers, self.step, device)

    def generator(self, layer: int, device: torch.device | str) -> torch.Generator:
        """A torch generator on `device` for the layer's torch-drawn draws, seeded from the
        stream (module doc)."""
        words = philox(*self.words, 0, layer + self.shift, self.step, SEED)
        seed = (int(words[0]) | int(words[1]) << 32) & (2 ** 63 - 1)
        return torch.Generator(device=device).manual_seed(seed)


def torch_generator(generator: torch.Generator | None, stream: Stream | None, layer: int,
                    device: torch.device | str, who: str) -> torch.Generator:
    """The generator a torch-drawing policy draws layer `layer` from: the one it was given
    (`generator`, advancing call by call as an engine's does), else its stream's for the layer;
    InputError naming the policy `who` when it has neither."""
    if generator is not None:
        return generator
    if stream is None:
        raise InputError(f"the {who} policy needs a generator or a stream in its dispatch "
                         "context")
    return stream.generator(layer, device)
