"""Synthetic routing traces: seeded scenario generators in the `SCENARIOS` registry.

Dimensions: `S` steps, `T` tokens per step (`T_s` for step `s` where steps differ), `L` MoE
layers, `E` logical experts, `K` top-k.

Every generator is a pure function

    gen(*, steps, tokens, layers, experts, top_k, seed, **scenario_options) -> Trace

that draws from `numpy.random.default_rng(seed)` only, so the same arguments give an identical
trace. Each token's `K` ids are distinct experts in `[0, E)` (top-k without replacement, no
padding), and `meta` records `source: "synth"`, `scenario` and every parameter (`params`,
defaults resolved) so that `synthesize(meta["scenario"], **meta["params"])` rebuilds the trace;
a scenario may add entries of its own beside `params` (`burst`: `hot_experts`). Every step has
`T = tokens` rows except in `phases`, whose decode steps have `decode_tokens` rows.

Scenarios: `skewed` (log-normal popularity, random-walk drift; the default), `uniform`,
`template` (residue classes of packed prompts), and three that make a placement solved from past
counts go stale: `drift` (popularity rotating steadily with a period), `burst` (a cold expert
suddenly hot for a stretch of steps) and `phases` (alternating prefill/decode blocks of different
batch sizes and routing).
A new scenario is one function and one line in `SCENARIOS`; `synthesize` also takes a callable.

Every scenario also takes `hash_layers` (DeepSeek-V4's hash-routed layers, DESIGN.md §16): each
token row gets a token id, drawn from a Zipf law over a vocabulary (`vocab`, exponent `zipf`),
and the first `hash_layers` layers route by a seeded table per layer, `tid2eid [vocab, K]`, of
distinct experts per token id (`traces.layer_kinds`); the other layers are the scenario's own.
Token ids and tables come from their own stream of the seed, so the learned layers are the
scenario's draws unchanged; `meta["hash_layers"]` lists the hash-routed layers, none without
`hash_layers` (a model priced with hash layers, such as DeepSeek-V4's, does not make a scenario's
own draws hash-routed).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import numpy as np

from ..base.compiled import JIT, jit, prange
from ..base.errors import InputError
from ..base.files import check_memory
from ..base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_SEED, check_at_most
from ..base.registry import lookup, name_of
from .layer_kinds import HASH_LAYERS, route_by_table, tid2eid_tables, token_ids
from .trace import Trace
from .workload import DECODE, PREFILL, STAGE_MARKS

COMPILED_TOP = 32  # a top-k of at most this many takes the compiled pass (`_topk_desc`)

Generator = Callable[..., Trace]

_SIZE_NAMES = ("steps", "tokens", "layers", "experts", "top_k")
# every scenario's options of hash-routed layers (module doc), with their defaults: V4's
# vocabulary (`vocab_size` of DeepSeek-V4's config.json) and Zipf's law's exponent 1
HASH_OPTIONS = {"hash_layers": 0, "vocab": 129280, "zipf": 1.0}
HASH_STREAM = 0x7A5  # the seed's stream that token ids and tables are drawn from
MAX_VOCAB = 2 ** 24
MAX_SIGMA = 10.0  # log-normal spread of popularities: beyond, one expert takes everything


# ----------------------------------------------------------------------------- helpers

def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise InputError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def _check_float(name: str, value: Any, lo: float, hi: float = math.inf) -> float:
    """`value` as a finite float in `[lo, hi]`; InputError naming the option otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (lo <= value <= hi) or not math.isfinite(value):
        bound = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise InputError(f"{name} must be a finite number {bound}, got {value}")
    return value


def check_sizes(*, steps: Any, tokens: Any, layers: Any, experts: Any, top_k: Any,
                seed: Any) -> tuple[int, int, int, int, int, int]:
    """Validate trace sizes; InputError naming the bad one. Returns them as Python ints."""
    S = _check_int("steps", steps, 1)
    T = _check_int("tokens", tokens, 1)
    L = _check_int("layers", layers, 1)
    E = _check_int("experts", experts, 1)
    K = _check_int("top_k", top_k, 1)
    if K > E:
        raise InputError(f"top_k={K} must not exceed experts={E} (top-k ids are distinct experts)")
    sd = _check_int("seed", seed, 0)
    check_at_most(E, MAX_EXPERTS, "experts")
    check_at_most(L, MAX_LAYERS, "layers")
    check_at_most(sd, MAX_SEED, "seed")
    # the trace's ids (and two copies on the way) plus one step's scores and their top-k
    check_memory(12 * S * T * L * K + 24 * T * L * E + 8 * S * L * E,
                 f"a {S}-step x {T}-token x {L}-layer x {E}-expert trace",
                 "ask for fewer steps, tokens, layers or experts")
    return S, T, L, E, K, sd


def _topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` largest entries along the last axis, in descending score order.

    scores: `[..., E]` float -> int64 `[..., k]`. Ties are broken by argpartition/argsort; the
    scores used here carry continuous noise so ties have probability zero among finite entries.
    A row whose `k + 1` largest are distinct has one answer, found by a compiled pass
    (`_top_rows`, for `k` up to `COMPILED_TOP`); the others (ties, NaN) take numpy's, so the
    result is numpy's, bit for bit, either way.
    """
    E = scores.shape[-1]
    if k >= E or k > COMPILED_TOP:
        return _topk_numpy(scores, k)
    rows = np.ascontiguousarray(scores).reshape(-1, E)  # [R, E]
    out, tied = np.empty((rows.shape[0], k), np.int64), np.empty(rows.shape[0], np.bool_)
    _top_rows(rows, k, out, tied)
    if tied.any():
        out[tied] = _topk_numpy(rows[tied], k)
    return out.reshape(scores.shape[:-1] + (k,))


def _topk_numpy(scores: np.ndarray, k: int) -> np.ndarray:
    """`_topk_desc` by numpy's argpartition and a stable argsort of the `k` it picked."""
    E = scores.shape[-1]
    if k < E:
        idx = np.argpartition(-scores, k - 1, axis=-1)[..., :k]  # [..., k] unordered
    else:
        idx = np.broadcast_to(np.arange(E), scores.shape).copy()
    top = np.take_along_axis(scores, idx, axis=-1)
    order = np.argsort(-top, axis=-1, kind="stable")
    return np.take_along_axis(idx, order, axis=-1)


@jit(parallel=True, **JIT)
def _top_rows(rows, k, out, tied):  # pragma: no cover - compiled
    """Each row's `k` largest of `rows [R, E]` (`k < E`) into int64 `out [R, k]`, largest
    first; `tied [R]` where the row's `k + 1` largest are not all distinct (or it holds NaN):
    there the order is not unique and `out` is not to be used."""
    for r in prange(rows.shape[0]):
        vals = np.empty(k + 1, rows.dtype)  # the k + 1 largest so far, descending
        idx = np.empty(k + 1, np.int64)
        n, nan = 0, False
        for e in range(rows.shape[1]):
            v = rows[r, e]
            if v != v:
                nan = True
                continue
            if n == k + 1 and not v > vals[k]:
                continue  # an equal value there leaves the k + 1 largest values as they are
            j = n if n < k + 1 else k
            while j > 0 and vals[j - 1] < v:
                vals[j], idx[j] = vals[j - 1], idx[j - 1]
                j -= 1
            vals[j], idx[j] = v, e
            n = min(n + 1, k + 1)
        distinct = True
        for j in range(k):
            distinct &= vals[j] > vals[j + 1]
        tied[r] = nan or not distinct
        for j in range(k):
            out[r, j] = idx[j]


def _gumbel(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard Gumbel noise, float32 (`-log(-log U)`, U in (0, 1)), computed in place."""
    u = rng.random(shape, dtype=np.float32)
    np.maximum(u, np.float32(1e-30), out=u)  # keep log finite at u == 0
    for op in (np.log, np.negative, np.log, np.negative):
        op(u, out=u)
    return u


def _add_noise(rng: np.random.Generator, ids: np.ndarray, E: int, noise: float) -> np.ndarray:
    """Replace each slot of `ids [T, L, K]` with probability `noise` by a uniformly random
    expert not held by the token's kept slots; the replacements of one token are distinct."""
    noisy = rng.random(ids.shape) < noise  # [T, L, K] slots that go uniform
    keys = rng.random(ids.shape[:-1] + (E + 1,), dtype=np.float32)  # [T, L, E + 1]
    # Kept experts get key 2 (after every uniform key); noisy slots mark the spare column E.
    np.put_along_axis(keys, np.where(noisy, E, ids), np.float32(2.0), axis=-1)
    K = ids.shape[-1]
    cand = _topk_desc(-keys[..., :E], K)  # [T, L, K] remaining experts, smallest key first
    rank = np.maximum(np.cumsum(noisy, axis=-1) - 1, 0)  # [T, L, K] r-th noisy slot -> r
    return np.where(noisy, np.take_along_axis(cand, rank, axis=-1), ids)


def _trace(ids: np.ndarray, steps: int, tokens: int | np.ndarray, experts: int, scenario: str,
           params: dict[str, Any], **extra: Any) -> Trace:
    """Wrap `[sum T_s, L, K]` ids as a Trace with provenance meta.

    tokens: `T`, the rows of every step (equal steps), or int `[S]` per-step row counts `T_s`.
    extra:  scenario-specific meta entries (JSON-serialisable), stored beside `params`.
    """
    sizes = np.broadcast_to(np.asarray(tokens, dtype=np.int64), (steps,))  # [S]
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)  # [S + 1]
    meta = {"source": "synth", "scenario": scenario, "params": params, **extra}
    return Trace(ids.astype(np.int32, copy=False), offsets, experts, None, meta)


# ----------------------------------------------------------------------------- scenarios

def skewed(*, steps: int, tokens: int, layers: int, experts: int, top_k: int, seed: int,
           sigma: float = 1.0, drift: float = 0.02) -> Trace:
    """Hot-expert skew with slow drift (the default scenario).

    Each layer has a log-normal expert popularity `w [L, E]`, `log w ~ N(0, sigma^2)`. Before
    every step after the first, `log w` takes a Gaussian random-walk step of scale `drift`.
    A token's top-k are drawn without replacement with probability proportional to `w`
    (Plackett-Luce, sampled as the arg-top-k of `log w + Gumbel noise`), listed in descending
    score like a router's top-k.

    Returns a Trace with `S = steps` steps of `T = tokens` rows, ids `[S*T, L, K]`.
    """
    S, T, L, E, K, seed = check_sizes(steps=steps, tokens=tokens, layers=layers,
                                      experts=experts, top_k=top_k, seed=seed)
    sigma = _check_float("sigma", sigma, 0.0, MAX_SIGMA)
    drift = _check_float("drift", drift, 0.0, 1.0)
    rng = np.random.default_rng(seed)
    logw = (sigma * rng.standard_normal((L, E))).astype(np.float32)  # [L, E]
    steps_walk = rng.standard_normal((S, L, E)).astype(np.float32)  # [S, L, E]
    steps_walk[0] = 0.0
    logw_s = logw + drift * np.cumsum(steps_walk, axis=0)  # [S, L, E]
    ids = np.empty((S, T, L, K), dtype=np.int32)
    for s in range(S):  # one [T, L, E] score block per step keeps memory bounded
        scores = logw_s[s][None] + _gumbel(rng, (T, L, E))  # [T, L, E]
        ids[s] = _topk_desc(scores, K)
    params = dict(steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=seed,
                  sigma=sigma, drift=drift)
    return _trace(ids.reshape(S * T, L, K), S, T, E, "skewed", params)


def uniform(*, steps: int, tokens: int, layers: int, experts: int, top_k: int,
            seed: int) -> Trace:
    """Every expert equally likely: each token's top-k is a uniform random k-subset of `[0, E)`
    in random order. Returns ids `[S*T, L, K]`."""
    S, T, L, E, K, seed = check_sizes(steps=steps, tokens=tokens, layers=layers,
                                      experts=experts, top_k=top_k, seed=seed)
    rng = np.random.default_rng(seed)
    ids = np.empty((S, T, L, K), dtype=np.int32)
    for s in range(S):
        ids[s] = _topk_desc(rng.random((T, L, E), dtype=np.float32), K)  # [T, L, K]
    params = dict(steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=seed)
    return _trace(ids.reshape(S * T, L, K), S, T, E, "uniform", params)


def template(*, steps: int, tokens: int, layers: int, experts: int, top_k: int, seed: int,
             template_len: int = 8, period: int = 2, sigma: float = 1.0,
             noise: float = 0.0) -> Trace:
    """Fixed-length templated prompts packed row after row (DESIGN.md §1, the balance trap).

    The token at batch row `t` of a step sits at position `j = t % template_len` of its prompt.
    Per layer, each expert `e` belongs to one residue class `c_e in [0, period)` (a seeded,
    balanced assignment: class sizes differ by at most one). A token at position `j` picks its
    top-k without replacement, proportional to `w_e * f_{j,e}`, among the experts of class
    `j % period` only; `w [L, E]` is log-normal (`sigma`), the position factor `f [L, J, E]` is
    log-normal with sigma 0.5; both stay fixed over steps. So, with `noise = 0`, every expert
    appears only on rows of one residue class mod `period`, and a row-based replica choice
    `row % n_e` with `n_e` dividing `period` sends all of its pairs to one replica.
    With probability `noise` each slot independently instead takes a uniformly random expert
    (any class) not held by the token's other kept slots; ids stay distinct.

    Requires `template_len % period == 0` and at least `top_k` experts in every class
    (`experts // period >= top_k`). Returns ids `[S*T, L, K]` in descending score order
    (noise slots keep their position).
    """
    S, T, L, E, K, seed = check_sizes(steps=steps, tokens=tokens, layers=layers,
                                      experts=experts, top_k=top_k, seed=seed)
    J = _check_int("template_len", template_len, 1)
    C = _check_int("period", period, 1)
    sigma = _check_float("sigma", sigma, 0.0, MAX_SIGMA)
    noise = _check_float("noise", noise, 0.0, 1.0)
    if J % C:
        raise InputError(f"template: template_len={J} must be a multiple of period={C}")
    if E // C < K:
        raise InputError(f"template: period={C} splits experts={E} into classes of {E // C} "
                         f"experts, fewer than top_k={K}; use a smaller period, more experts "
                         f"or a smaller top_k")
    check_memory(24 * L * J * E, f"a template of {J} rows x {L} layers x {E} experts",
                 "use a shorter template_len")
    rng = np.random.default_rng(seed)
    perm = np.argsort(rng.random((L, E)), axis=-1)  # [L, E] random order of experts per layer
    cls = np.empty((L, E), dtype=np.int64)  # [L, E] class of each expert; sizes differ by <= 1
    np.put_along_axis(cls, perm, np.broadcast_to(np.arange(E) % C, (L, E)), axis=-1)
    logw = sigma * rng.standard_normal((L, 1, E)) + 0.5 * rng.standard_normal((L, J, E))
    allowed = cls[:, None, :] == (np.arange(J) % C)[None, :, None]  # [L, J, E]
    base = np.where(allowed, logw, -np.inf).astype(np.float32)  # [L, J, E]
    pos = np.arange(T) % J  # [T] prompt position of each row
    base_t = base[:, pos, :].transpose(1, 0, 2)  # [T, L, E]
    ids = np.empty((S, T, L, K), dtype=np.int32)
    for s in range(S):
        top = _topk_desc(base_t + _gumbel(rng, (T, L, E)), K)  # [T, L, K]
        if noise > 0.0:
            top = _add_noise(rng, top, E, noise)
        ids[s] = top
    params = dict(steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=seed,
                  template_len=J, period=C, sigma=sigma, noise=noise)
    return _trace(ids.reshape(S * T, L, K), S, T, E, "template", params)


def drift(*, steps: int, tokens: int, layers: int, experts: int, top_k: int, seed: int,
          sigma: float = 1.0, period: float = 200) -> Trace:
    """Expert popularity rotating steadily (deterministically, not a random walk).

    Two independent log-popularity vectors `a, b [L, E]`, each `N(0, sigma^2)`, are drawn once;
    at step `s` the log-popularity is `log w_s = cos(theta_s) a + sin(theta_s) b` with
    `theta_s = 2 pi s / period`. Its marginal distribution is `N(0, sigma^2)` at every step
    (the skew never changes), while which experts are hot changes steadily: `log w` at step
    `period / 2` is the negation of step 0's, and the pattern repeats every `period` steps.
    A token's top-k are drawn without replacement proportional to `w_s` (Plackett-Luce), in
    descending score order. `period` is in steps, `>= 1`, finite, int or float (stored as float).

    Returns a Trace with `S = steps` steps of `T = tokens` rows, ids `[S*T, L, K]`.
    """
    S, T, L, E, K, seed = check_sizes(steps=steps, tokens=tokens, layers=layers,
                                      experts=experts, top_k=top_k, seed=seed)
    sigma = _check_float("sigma", sigma, 0.0, MAX_SIGMA)
    period = _check_float("period", period, 1.0)
    if math.isinf(period):
        raise InputError(f"period must be finite, got {period}")
    rng = np.random.default_rng(seed)
    a = sigma * rng.standard_normal((L, E))  # [L, E] log-popularity at theta = 0
    b = sigma * rng.standard_normal((L, E))  # [L, E] log-popularity at theta = pi / 2
    ids = np.empty((S, T, L, K), dtype=np.int32)
    for s in range(S):  # one [T, L, E] score block per step keeps memory bounded
        theta = 2.0 * math.pi * s / period
        logw = (math.cos(theta) * a + math.sin(theta) * b).astype(np.float32)  # [L, E]
        ids[s] = _topk_desc(logw[None] + _gumbel(rng, (T, L, E)), K)  # [T, L, K]
    params = dict(steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=seed,
                  sigma=sigma, period=period)
    return _trace(ids.reshape(S * T, L, K), S, T, E, "drift", params)


def burst(*, steps: int, tokens: int, layers: int, experts: int, top_k: int, seed: int,
          sigma: float = 1.0, start: int | None = None, length: int | None = None,
          share: float = 0.5) -> Trace:
    """A cold expert suddenly turning hot for a stretch of steps.

    Each layer has a stationary log-normal expert popularity `w [L, E]`, `log w ~ N(0, sigma^2)`.
    Per layer, the hot expert `h_l` is the least popular one under `w` (so a placement solved
    before the burst gave it one replica). For steps `start <= s < start + length` (clipped at
    the end of the trace) its weight is raised to `w_h = share / (1 - share) * sum_{e != h} w_e`,
    so that it is a token's first pick (slot `k = 0`) with probability `share`; the other
    experts keep their weights. Outside the burst, routing uses `w` unchanged. Top-k are drawn
    without replacement proportional to the step's weights (Plackett-Luce), in descending score.

    Defaults: `start = (2 * steps) // 5`, `length = max(1, steps // 4)`; requires
    `0 <= start < steps`, `length >= 1`, `0 <= share < 1`. `meta["params"]` holds the resolved
    `start` and `length`; `meta["hot_experts"]` is the hot expert of each layer, a list of `L`
    ints. Returns a Trace with `S = steps` steps of `T = tokens` rows, ids `[S*T, L, K]`.
    """
    S, T, L, E, K, seed = check_sizes(steps=steps, tokens=tokens, layers=layers,
                                      experts=experts, top_k=top_k, seed=seed)
    sigma = _check_float("sigma", sigma, 0.0, MAX_SIGMA)
    start = (2 * S) // 5 if start is None else _check_int("start", start, 0)
    if start >= S:
        raise InputError(f"burst: start={start} must be < steps={S}")
    length = max(1, S // 4) if length is None else _check_int("length", length, 1)
    share = _check_float("share", share, 0.0, 1.0)
    if share >= 1.0:
        raise InputError(f"share must be in [0, 1), got {share}")
    rng = np.random.default_rng(seed)
    logw = sigma * rng.standard_normal((L, E))  # [L, E] base log-popularity, float64
    hot = np.argmin(logw, axis=-1)  # [L] least popular expert of each layer
    top = logw.max(axis=-1)  # [L]
    rel = np.exp(logw - top[:, None])  # [L, E] weights relative to each layer's largest
    rest = rel.sum(-1) - rel[np.arange(L), hot]  # [L] sum of the other experts' weights
    logw_b = logw.copy()  # [L, E] log-popularity during the burst
    with np.errstate(divide="ignore"):  # share == 0 or E == 1: the hot weight is 0, log -inf
        logw_b[np.arange(L), hot] = np.log(share / (1.0 - share) * rest) + top
    base, hotw = logw.astype(np.float32), logw_b.astype(np.float32)
    ids = np.empty((S, T, L, K), dtype=np.int32)
    for s in range(S):  # one [T, L, E] score block per step keeps memory bounded
        w = hotw if start <= s < start + length else base  # [L, E]
        ids[s] = _topk_desc(w[None] + _gumbel(rng, (T, L, E)), K)  # [T, L, K]
    params = dict(steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=seed,
                  sigma=sigma, start=start, length=length, share=share)
    return _trace(ids.reshape(S * T, L, K), S, T, E, "burst", params,
                  hot_experts=[int(h) for h in hot])


def phases(*, steps: int, tokens: int, layers: int, experts: int, top_k: int, seed: int,
           sigma: float = 1.0, phase_len: int = 8, decode_tokens: int | None = None,
           rho: float = 0.5) -> Trace:
    """Alternating prefill-like and decode-like batches of different sizes and routing.

    Steps come in blocks of `phase_len`, starting with prefill: step `s` is prefill when
    `(s // phase_len) % 2 == 0`, else decode. Prefill steps have `tokens` rows, decode steps
    `decode_tokens` rows (default `max(1, tokens // 16)`), so the trace is ragged. Prefill routes
    with log-popularity `a [L, E] ~ N(0, sigma^2)`, decode with `rho a + sqrt(1 - rho^2) c`, `c`
    an independent `N(0, sigma^2)` draw (`rho` in `[-1, 1]`: the two phases' log-popularities
    have correlation `rho` and the same marginal skew). Top-k are drawn without replacement
    proportional to the phase's weights (Plackett-Luce), in descending score order.

    Returns a Trace with `S = steps` steps, `T_s` = `tokens` or `decode_tokens` rows (see
    `tokens_per_step`), ids `[sum T_s, L, K]`, each step's phase in `meta["stages"]`
    (`traces.stages`).
    """
    S, T, L, E, K, seed = check_sizes(steps=steps, tokens=tokens, layers=layers,
                                      experts=experts, top_k=top_k, seed=seed)
    sigma = _check_float("sigma", sigma, 0.0, MAX_SIGMA)
    J = _check_int("phase_len", phase_len, 1)
    Td = max(1, T // 16) if decode_tokens is None else _check_int("decode_tokens",
                                                                   decode_tokens, 1)
    if Td > T:
        raise InputError(f"phases: decode_tokens={Td} must not exceed tokens={T} (decode "
                         f"batches are the small ones)")
    rho = _check_float("rho", rho, -1.0, 1.0)
    rng = np.random.default_rng(seed)
    a = sigma * rng.standard_normal((L, E))  # [L, E] prefill log-popularity
    c = sigma * rng.standard_normal((L, E))  # [L, E] independent part of decode's
    logw = np.stack([a, rho * a + math.sqrt(1.0 - rho * rho) * c]).astype(np.float32)  # [2, L, E]
    phase = (np.arange(S) // min(J, S)) % 2  # [S] 0 prefill, 1 decode (J >= S: all prefill)
    sizes = np.where(phase == 0, T, Td).astype(np.int64)  # [S] rows T_s of each step
    ids = np.empty((int(sizes.sum()), L, K), dtype=np.int32)  # [sum T_s, L, K]
    row = 0
    for s in range(S):  # one [T_s, L, E] score block per step keeps memory bounded
        n = int(sizes[s])
        ids[row:row + n] = _topk_desc(logw[phase[s]][None] + _gumbel(rng, (n, L, E)), K)
        row += n
    params = dict(steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=seed,
                  sigma=sigma, phase_len=J, decode_tokens=Td, rho=rho)
    return _trace(ids, S, sizes, E, "phases", params,
                  stages="".join(STAGE_MARKS[DECODE if p else PREFILL] for p in phase.tolist()))


def clustered(*, steps: int, tokens: int, layers: int, experts: int, top_k: int, seed: int,
              clusters: int = 8, within: float = 0.75, sigma: float = 1.0) -> Trace:
    """Co-activated experts, as co-activation studies find them (DESIGN.md §13): per layer the
    experts form `clusters` hidden groups (a seeded random split, sizes differing by at most
    one, not contiguous ids), and each token chooses one group, by the groups' log-normal
    popularity (`sigma`), then takes `round(within * top_k)` of its top-k inside the group (at
    most the group's size) and the rest outside it, each without replacement proportionally to
    the experts' own log-normal popularity (`sigma`), fixed over steps. Ids are listed in
    descending score, the group's first. Returns ids `[S*T, L, K]`."""
    S, T, L, E, K, seed = check_sizes(steps=steps, tokens=tokens, layers=layers,
                                      experts=experts, top_k=top_k, seed=seed)
    C = _check_int("clusters", clusters, 1)
    within = _check_float("within", within, 0.0, 1.0)
    sigma = _check_float("sigma", sigma, 0.0, MAX_SIGMA)
    if C > E:
        raise InputError(f"clustered: clusters={C} exceeds experts={E}")
    rng = np.random.default_rng(seed)
    perm = np.argsort(rng.random((L, E)), axis=-1)  # [L, E] random order of experts per layer
    group = np.empty((L, E), dtype=np.int64)  # [L, E] hidden group of each expert
    np.put_along_axis(group, perm, np.broadcast_to(np.arange(E) % C, (L, E)), axis=-1)
    inside = min(round(within * K), E // C, K)  # picks in the token's group
    if K - inside > E - (E + C - 1) // C:
        raise InputError(f"clustered: top_k={K} needs {K - inside} experts outside a group of "
                         f"{(E + C - 1) // C}; use fewer clusters or a larger within")
    logw = (sigma * rng.standard_normal((L, 1, E))).astype(np.float32)  # [L, 1, E]
    logg = (sigma * rng.standard_normal((L, C))).astype(np.float32)  # [L, C]
    ids = np.empty((S, T, L, K), dtype=np.int32)
    for s in range(S):
        chosen = _topk_desc(logg[None] + _gumbel(rng, (T, L, C)), 1)  # [T, L, 1] the group
        mine = group[None] == chosen  # [T, L, E] experts of the token's group
        score = logw.transpose(1, 0, 2) + _gumbel(rng, (T, L, E))  # [T, L, E]
        top_in = _topk_desc(np.where(mine, score, -np.inf), inside)  # [T, L, inside]
        top_out = _topk_desc(np.where(mine, -np.inf, score), K - inside)
        ids[s] = np.concatenate([top_in, top_out], axis=-1)
    params = dict(steps=S, tokens=T, layers=L, experts=E, top_k=K, seed=seed,
                  clusters=C, within=within, sigma=sigma)
    return _trace(ids.reshape(S * T, L, K), S, T, E, "clustered", params)


SCENARIOS: dict[str, Generator] = {
    "skewed": skewed,
    "uniform": uniform,
    "template": template,
    "drift": drift,
    "burst": burst,
    "phases": phases,
    "clustered": clustered,
}

DEFAULT_SCENARIO = "skewed"
# The default sizes of a synthetic trace: the scenario `eplbsim run` embeds (seconds on 2 cores).
DEFAULT_SIZES = {"steps": 32, "tokens": 512, "layers": 4, "experts": 64, "top_k": 8}


def scenario_options(scenario: str | Generator, options: dict[str, Any]) -> dict[str, Any]:
    """`options` if the scenario (a registry name or a generator) takes them all; InputError
    naming the ones it lacks and listing those it has. A generator taking `**options` takes
    anything."""
    gen = lookup(SCENARIOS, scenario, "scenario")
    try:
        params = inspect.signature(gen).parameters
    except (TypeError, ValueError):
        return options
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return options
    accepted = [p for p in params if p not in _SIZE_NAMES + ("seed",)] + list(HASH_OPTIONS)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InputError(f"scenario {name_of(scenario)!r} has no option {', '.join(unknown)}; "
                         f"its options are: {', '.join(accepted) or 'none'}")
    return options


def synthesize(scenario: str | Generator = DEFAULT_SCENARIO, *,
               steps: int = DEFAULT_SIZES["steps"], tokens: int = DEFAULT_SIZES["tokens"],
               layers: int = DEFAULT_SIZES["layers"], experts: int = DEFAULT_SIZES["experts"],
               top_k: int = DEFAULT_SIZES["top_k"], seed: int = 0, **options: Any) -> Trace:
    """Generate a synthetic trace from a registered scenario name or a generator callable.

    Sizes are validated first (steps/tokens/layers/experts >= 1, 1 <= top_k <= experts,
    seed >= 0); scenario options (e.g. `sigma`, `drift`, `template_len`, `period`, `noise`,
    `share`, `rho`) are passed through. InputError on an unknown scenario name (listing the
    choices), an unknown option, or a bad value.
    """
    gen = lookup(SCENARIOS, scenario, "scenario")
    name = name_of(scenario)
    check_sizes(steps=steps, tokens=tokens, layers=layers, experts=experts, top_k=top_k,
                seed=seed)
    scenario_options(scenario, options)
    hashing = {k: options.pop(k) for k in HASH_OPTIONS if k in options}
    trace = gen(steps=steps, tokens=tokens, layers=layers, experts=experts, top_k=top_k,
                seed=seed, **options)
    if not isinstance(trace, Trace):
        raise InputError(f"scenario {name!r} returned {type(trace).__name__}, not a Trace")
    if hashing:
        return hash_routed(trace, seed, **hashing)
    trace.meta.setdefault(HASH_LAYERS, [])  # its own draws route every layer, whatever a model
    return trace                            # priced says of its first layers


def hash_routed(trace: Trace, seed: int, hash_layers: int = 0,
                vocab: int = HASH_OPTIONS["vocab"], zipf: float = HASH_OPTIONS["zipf"]) -> Trace:
    """`trace` with its first `hash_layers` layers routed by token id (module doc): token ids
    `[N]` from a Zipf law over `vocab` ids (`zipf`), a table `[vocab, K]` per hash layer, both
    from the seed's `HASH_STREAM`; `meta["params"]` gains the three options (so
    `synthesize(scenario, **params)` rebuilds it) and `meta["hash_layers"]` the layers.
    `hash_layers = 0` adds the options and changes nothing else."""
    L = trace.num_layers
    H = _check_int("hash_layers", hash_layers, 0)
    if H > L:
        raise InputError(f"hash_layers={H} must not exceed the scenario's {L} layers")
    V = _check_int("vocab", vocab, 1)
    check_at_most(V, MAX_VOCAB, "vocab")
    zipf = _check_float("zipf", zipf, 0.0, MAX_SIGMA)
    ids = trace.topk_ids.numpy()
    if H:
        rng = np.random.default_rng((seed, HASH_STREAM))
        tokens = token_ids(rng, ids.shape[0], V, zipf)  # [N]
        tables = tid2eid_tables(rng, H, V, trace.num_experts, trace.top_k)  # [H, V, K]
        ids = route_by_table(ids, tuple(range(H)), tables, tokens)
    meta = dict(trace.meta, params=dict(trace.meta.get("params", {}), hash_layers=H,
                                        vocab=V, zipf=zipf))
    meta[HASH_LAYERS] = list(range(H))
    return Trace(ids, trace.step_offsets, trace.num_experts, trace.src_rank, meta,
                 trace.topk_weights)
