"""Synthetic request sets (DESIGN.md §9): seeded generators in `REQUEST_SCENARIOS`.

Dimensions: `R` requests, `n_r` tokens of request `r`, `L` layers, `E` experts, `K` top-k.

A generator is `gen(*, layers, experts, top_k, seed, **options) -> RequestSet`, drawing from
`numpy.random.default_rng(seed)` only. `requests` (the one scenario so far):
- prompt and output lengths log-normal around `prompt_mean` and `output_mean` tokens (spread
  `length_sigma`; at least 1 each);
- a share `template_share` of the requests start with one of `templates` system prompts of
  `template_len` tokens: the same prefix routes to the same ids in every request that has it
  (an engine batching such requests packs identical rows, the layout `row` dispatch trips on);
- every request has a topic among `topics`, each with its own log-normal expert popularity
  (spread `sigma`), so the hot experts move with the request mix; each token's `K` distinct
  experts are drawn from its topic's popularity (Gumbel top-k).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import numpy as np

from ..base.errors import InputError
from ..base.files import check_memory
from ..base.registry import lookup
from .requests import RequestSet, requests_of
from .trace import id_dtype


def _draw(rng: np.random.Generator, logits: np.ndarray, n: int, top_k: int) -> np.ndarray:
    """`n` tokens' top-k distinct experts from per-layer `logits [L, E]`: int `[n, L, K]`."""
    scores = logits[None] + rng.gumbel(size=(n,) + logits.shape)
    return np.argsort(-scores, axis=-1)[..., :top_k]


def requests(*, layers: int, experts: int, top_k: int, seed: int, num_requests: int = 64,
             prompt_mean: float = 256.0, output_mean: float = 64.0, length_sigma: float = 0.5,
             template_share: float = 0.5, templates: int = 2, template_len: int = 64,
             topics: int = 4, sigma: float = 1.0) -> RequestSet:
    """The `requests` scenario (module doc)."""
    if top_k > experts:
        raise InputError(f"top_k={top_k} must not exceed experts={experts}")
    for name, value, least in (("num_requests", num_requests, 1), ("templates", templates, 1),
                               ("template_len", template_len, 0), ("topics", topics, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"{name} must be an integer >= {least}, got {value!r}")
    for name, value in (("prompt_mean", prompt_mean), ("output_mean", output_mean)):
        if not isinstance(value, (int, float)) or not value >= 1:
            raise InputError(f"{name} must be a number >= 1, got {value!r}")
    if not (isinstance(template_share, (int, float)) and 0 <= template_share <= 1):
        raise InputError(f"template_share must be in [0, 1], got {template_share!r}")
    for name, value in (("length_sigma", length_sigma), ("sigma", sigma)):
        if not (isinstance(value, (int, float)) and 0 <= value <= 10):
            raise InputError(f"{name} must be a number in [0, 10], got {value!r}")
    tokens = num_requests * (prompt_mean + output_mean) * math.exp(length_sigma ** 2 / 2)
    longest = (prompt_mean + output_mean) * math.exp(4 * length_sigma)  # a generous request
    check_memory(2 * layers * top_k * (tokens + templates * template_len)  # the ids
                 + 16 * layers * experts * (longest + template_len),  # one request's draws
                 f"the requests scenario: {num_requests} requests of about "
                 f"{prompt_mean + output_mean:g} tokens, {layers} layers, {experts} experts",
                 "ask for fewer or shorter requests")
    rng = np.random.default_rng(seed)
    popularity = rng.normal(0.0, sigma, (topics, layers, experts))  # log-popularity logits
    prefixes = [_draw(rng, popularity[t % topics], template_len, top_k)
                for t in range(templates)]
    prompt = np.maximum(1, np.round(prompt_mean * rng.lognormal(0, length_sigma,
                                                                num_requests))).astype(int)
    output = np.maximum(1, np.round(output_mean * rng.lognormal(0, length_sigma,
                                                                num_requests))).astype(int)
    topic = rng.integers(0, topics, num_requests)
    templated = rng.random(num_requests) < template_share
    which = rng.integers(0, templates, num_requests)
    ids, prompts = [], []
    for r in range(num_requests):
        own = _draw(rng, popularity[topic[r]], int(prompt[r] + output[r]), top_k)
        head = [prefixes[which[r]]] if templated[r] else []
        ids.append(np.concatenate(head + [own]).astype(id_dtype(experts)))
        prompts.append(int(prompt[r]) + (template_len if templated[r] else 0))
    params = dict(layers=layers, experts=experts, top_k=top_k, seed=seed,
                  num_requests=num_requests, prompt_mean=prompt_mean, output_mean=output_mean,
                  length_sigma=length_sigma, template_share=template_share,
                  templates=templates, template_len=template_len, topics=topics, sigma=sigma)
    return requests_of(ids, prompts, experts, meta={"source": "synth", "scenario": "requests",
                                                    "params": params})


RequestGenerator = Callable[..., RequestSet]

REQUEST_SCENARIOS: dict[str, RequestGenerator] = {
    "requests": requests,
}


def request_options(scenario: str | RequestGenerator) -> list[str]:
    """The options (`-o NAME=VALUE`) a request scenario takes beyond the sizes and seed."""
    fn = lookup(REQUEST_SCENARIOS, scenario, "request scenario")
    return [n for n in inspect.signature(fn).parameters
            if n not in ("layers", "experts", "top_k", "seed")]


def synthesize_requests(scenario: str | RequestGenerator = "requests", *, layers: int,
                        experts: int, top_k: int, seed: int, **options: Any) -> RequestSet:
    """A request scenario's set; InputError for an option it does not take."""
    fn = lookup(REQUEST_SCENARIOS, scenario, "request scenario")
    unknown = sorted(set(options) - set(request_options(fn)))
    if unknown:
        raise InputError(f"request scenario has no option {', '.join(unknown)}; its options "
                         f"are: {', '.join(request_options(fn))}")
    return fn(layers=layers, experts=experts, top_k=top_k, seed=seed, **options)
