"""Requests -> steps, as serving engines batch them (DESIGN.md §9): `batch(requests, workload)`.

Dimensions: `R` requests, `S` steps, `T_s` rows of step `s`, `L` layers, `K` top-k, `D` DP
attention ranks.

- **Arrivals** (`arrivals`), in steps: `all` at step 0; `poisson` at `rate` requests a step
  (seeded exponential gaps; a request arriving at time `t` can be admitted from step
  `ceil(t)`); `trace`: each request's own `arrival` (None: 0).
- **DP attention** (`dp = D`): requests, in arrival order, go to DP ranks `round-robin` or
  `least-loaded` (the rank with the fewest tokens, prompt plus output, assigned so far; ties to
  the lowest rank). Each DP rank batches its own requests with the same limits, all ranks
  stepping together. The MoE batch of a step gathers the ranks' batches in rank order, in the
  `sum` layout (no padding), the `max` layout (every rank padded with `-1` rows to the
  largest rank's size), or SGLang's choice (`sglang`: `sum` for a step with prefill rows, `max`
  for a decode-only step, and `max` always when CUDA graphs are captured). With `D > 1` every
  row's `src_rank` is its DP rank (its GPU in "a2a").
- **Continuous batching** (`BATCHERS["continuous"]`), per DP rank and step: every running
  request whose prompt is done contributes one decode row (its next output token), in admission
  order, while the step's `max_batched_tokens` budget lasts; then running requests with prompt
  left continue their prefill, then waiting requests that have arrived are admitted
  first-come first-served while fewer than `max_running` run and budget is left, each prefilling
  a chunk of at most `chunk` tokens (chunked prefill; default `max_batched_tokens`). A request
  decodes from the step after its prompt's last chunk and leaves after its last output token.
  The rows are ordered decode rows first (`order="decode-first"`, the engines' order) or
  prefill rows first; the order never changes what runs. Steps in which no rank runs anything
  (waiting for arrivals) are not emitted.
- **CUDA-graph padding** (`graph_sizes`, empty: none): a step whose batch is decode rows only
  runs as the smallest captured size `>= b` for `b` rows (a rank's rows; in the `max` layout,
  the largest rank's), every rank padded to it; above the largest size it runs eagerly,
  unpadded. Padded rows are `masked` (`-1`) or `routed`: each carries one fixed top-k set per
  layer, drawn once from `seed` (the gate on stale inputs), which heats a few phantom experts.
  Under CUDA graphs the `max` layout's padding is graph padding too.

The result is an ordinary Trace (`Batched.trace`) with the workload's settings in
`meta["workload"]`, each step's stage in `meta["stages"]` (`STAGE_MARKS`: prefill when it has a
prefill row, else decode), and which request, token and DP rank each row is (`Batched`), for
tests and `trace info`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from ..base.errors import InputError
from ..base.limits import MAX_BATCH, check_at_most
from .requests import RequestSet
from .trace import Trace, id_dtype, model_in

ARRIVALS = ("all", "poisson", "trace")
DP_ASSIGN = ("round-robin", "least-loaded")
DP_LAYOUTS = ("sum", "max", "sglang")
ORDERS = ("decode-first", "prefill-first")
PADDING = ("masked", "routed")
DEFAULT_GRAPH_SIZES = (1, 2, 4) + tuple(range(8, 257, 8))
DECODE, PREFILL, DP_PAD, GRAPH_PAD = 0, 1, 2, 3  # row kinds
ROW_KINDS = ("decode", "prefill", "dp padding", "graph padding")
# `meta["stages"]`, one mark a step (`traces.stages`): its stage's (DECODE, PREFILL), "?" (-1)
# when the log does not say
STAGE_MARKS = "dp?"


@dataclass(frozen=True)
class Workload:
    """How requests become steps (module doc); checked on construction."""

    batcher: str = "continuous"
    max_running: int = 256
    max_batched_tokens: int = 8192
    chunk: int | None = None
    order: str = "decode-first"
    arrivals: str = "all"
    rate: float = 1.0
    dp: int = 1
    dp_assign: str = "round-robin"
    dp_layout: str = "sum"
    graph_sizes: tuple[int, ...] = ()
    padding: str = "masked"
    seed: int = 0

    def __post_init__(self) -> None:
        for name, allowed in (("batcher", BATCHERS), ("order", ORDERS), ("arrivals", ARRIVALS),
                              ("dp_assign", DP_ASSIGN), ("dp_layout", DP_LAYOUTS),
                              ("padding", PADDING)):
            if getattr(self, name) not in allowed:
                raise InputError(f"unknown {name.replace('_', ' ')} {getattr(self, name)!r}; "
                                 f"choose one of {', '.join(allowed)}")
        for name in ("max_running", "max_batched_tokens", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        if self.chunk is not None and (isinstance(self.chunk, bool)
                                       or not isinstance(self.chunk, int) or self.chunk < 1):
            raise InputError(f"chunk must be an integer >= 1, got {self.chunk!r}")
        if not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate)
                and self.rate > 0):
            raise InputError(f"rate must be a number > 0 (requests a step), got {self.rate!r}")
        sizes = tuple(self.graph_sizes)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes) \
                or list(sizes) != sorted(set(sizes)):
            raise InputError(f"graph sizes must be increasing integers >= 1, got {list(sizes)}")
        if sizes:
            check_at_most(sizes[-1], MAX_BATCH, "the largest CUDA-graph size")
        object.__setattr__(self, "graph_sizes", sizes)

    @property
    def chunk_tokens(self) -> int:
        """The prefill chunk: `chunk`, else `max_batched_tokens`."""
        return self.chunk or self.max_batched_tokens


@dataclass(frozen=True, eq=False)
class Batched:
    """A workload's steps: the `trace`, and for each of its rows (`[sum T_s]`, int64) the
    request index it belongs to (`request`, -1 for padding), the token of that request
    (`token`, -1 for padding), its DP rank (`dp_rank`) and its kind (`kind`: `ROW_KINDS`)."""

    trace: Trace
    request: np.ndarray
    token: np.ndarray
    dp_rank: np.ndarray
    kind: np.ndarray

    def __repr__(self) -> str:
        return f"Batched({self.trace!r}, rows {self.composition()})"

    def composition(self) -> dict[str, int]:
        """Rows of each kind over the whole trace."""
        counts = np.bincount(self.kind, minlength=len(ROW_KINDS))
        return dict(zip(ROW_KINDS, counts.tolist()))


# A batch of one DP rank in one step: `(request index, first token, tokens, kind)` in order.
Rows = list[tuple[int, int, int, int]]


def continuous(prompt: np.ndarray, output: np.ndarray, arrival: np.ndarray,
               order: list[int], workload: Workload) -> dict[int, Rows]:
    """Continuous batching (module doc) of one DP rank's requests `order` (indices into the
    per-request `prompt`, `output` lengths and `arrival` steps, in arrival order): its batch at
    each step it runs something."""
    w = workload
    waiting = deque(order)
    running: list[int] = []
    done_prompt = {i: 0 for i in order}
    done_output = {i: 0 for i in order}
    steps: dict[int, Rows] = {}
    step = 0
    while waiting or running:
        if not running and arrival[waiting[0]] > step:
            step = int(arrival[waiting[0]])  # idle until the next arrival
        budget, decodes, prefills = w.max_batched_tokens, [], []
        for i in running:
            if done_prompt[i] == prompt[i] and budget > 0:
                decodes.append((i, int(prompt[i] + done_output[i]), 1, DECODE))
                budget -= 1
        for i in running:
            left = prompt[i] - done_prompt[i]
            if left > 0 and budget > 0:
                n = int(min(left, w.chunk_tokens, budget))
                prefills.append((i, done_prompt[i], n, PREFILL))
                budget -= n
        while waiting and arrival[waiting[0]] <= step and len(running) < w.max_running \
                and budget > 0:
            i = waiting.popleft()
            running.append(i)
            if prompt[i] > 0:
                n = int(min(prompt[i], w.chunk_tokens, budget))
                prefills.append((i, 0, n, PREFILL))
                budget -= n
        for i, _, n, kind in decodes + prefills:
            if kind == DECODE:
                done_output[i] += 1
            else:
                done_prompt[i] += n
        running = [i for i in running
                   if done_prompt[i] < prompt[i] or done_output[i] < output[i]]
        rows = decodes + prefills if w.order == "decode-first" else prefills + decodes
        if rows:
            steps[step] = rows
        step += 1
    return steps


BATCHERS: dict[str, Callable[..., dict[int, Rows]]] = {
    "continuous": continuous,
}


def arrival_steps(requests: RequestSet, workload: Workload) -> np.ndarray:
    """The first step each request can be admitted at, int64 `[R]` (module doc)."""
    R = len(requests.requests)
    if workload.arrivals == "all":
        return np.zeros(R, dtype=np.int64)
    if workload.arrivals == "trace":
        times = np.array([r.arrival or 0.0 for r in requests.requests])
    else:
        gaps = np.random.default_rng(workload.seed).exponential(1.0 / workload.rate, R)
        times = np.cumsum(gaps)
    return np.ceil(times).astype(np.int64)


def assign_dp(lengths: np.ndarray, arrival: np.ndarray, workload: Workload) -> list[list[int]]:
    """The requests of each DP rank in arrival order (ties by index), `[D]` lists, for the
    requests' total token counts `lengths [R]`."""
    order = sorted(range(len(arrival)), key=lambda i: (arrival[i], i))
    ranks: list[list[int]] = [[] for _ in range(workload.dp)]
    load = [0] * workload.dp
    for n, i in enumerate(order):
        r = n % workload.dp if workload.dp_assign == "round-robin" else load.index(min(load))
        ranks[r].append(i)
        load[r] += int(lengths[i])
    return ranks


def batch(requests: RequestSet, workload: Workload | None = None) -> Batched:
    """The steps an engine runs for `requests` under `workload` (default `Workload()`), as a
    Trace and its rows' origins (module doc). The same inputs give the same trace."""
    w = Workload() if workload is None else workload
    reqs = requests.requests
    prompt, output = requests.lengths()
    arrival = arrival_steps(requests, w)
    per_rank = [BATCHERS[w.batcher](prompt, output, arrival, order, w)
                for order in assign_dp(prompt + output, arrival, w)]
    L, K = requests.num_layers, requests.top_k
    pad_ids = _padding_ids(requests.num_experts, L, K, w)  # [L, K]
    pieces: list[np.ndarray] = []
    origin: list[tuple[np.ndarray, ...]] = []
    sizes, marks = [], []
    for step in sorted(set().union(*per_rank)):
        batches = [rank.get(step, []) for rank in per_rank]
        counts = [sum(n for _, _, n, _ in b) for b in batches]
        decode_only = all(k == DECODE for b in batches for *_, k in b)
        marks.append(STAGE_MARKS[DECODE if decode_only else PREFILL])
        graph = bool(w.graph_sizes) and decode_only
        targets = _padded_sizes(counts, decode_only, graph, w)
        total = 0
        for r, (rows, n, target) in enumerate(zip(batches, counts, targets)):
            for i, lo, count, kind in rows:
                pieces.append(reqs[i].ids[lo:lo + count])
                origin.append((np.full(count, i), np.arange(lo, lo + count),
                               np.full(count, r), np.full(count, kind)))
            if target > n:
                kind = GRAPH_PAD if graph else DP_PAD
                fill = pad_ids if kind == GRAPH_PAD and w.padding == "routed" else \
                    np.full((L, K), -1)
                pieces.append(np.broadcast_to(fill, (target - n, L, K)))
                origin.append((np.full(target - n, -1), np.full(target - n, -1),
                               np.full(target - n, r), np.full(target - n, kind)))
            total += target
        sizes.append(total)
    ids = np.concatenate(pieces).astype(id_dtype(requests.num_experts))
    request, token, dp_rank, kind = (np.concatenate(parts).astype(np.int64)
                                     for parts in zip(*origin))
    origin_of = requests.meta.get("scenario") or requests.meta.get("source") or "requests"
    meta = {"source": f"{origin_of}, batched", "requests": len(reqs),
            "request_meta": requests.meta, "workload": asdict(w), "stages": "".join(marks)}
    if model_in(requests.meta) is not None:  # the model the requests ran on
        meta["model"] = model_in(requests.meta)  # (`cost.catalog.trace_model`)
    trace = Trace(torch.from_numpy(ids), torch.from_numpy(np.concatenate([[0],
                                                                         np.cumsum(sizes)])),
                  requests.num_experts, torch.from_numpy(dp_rank) if w.dp > 1 else None, meta)
    return Batched(trace, request, token, dp_rank, kind)


def _padded_sizes(counts: list[int], decode_only: bool, graph: bool,
                  w: Workload) -> list[int]:
    """Each DP rank's rows after padding its `counts` (module doc): to the largest rank's in
    the `max` layout (`sglang`: for a `decode_only` step, or with CUDA graphs), and to the
    captured size when the step runs as a CUDA `graph`."""
    padded = w.dp_layout == "max" or (w.dp_layout == "sglang"
                                      and (decode_only or bool(w.graph_sizes)))
    if padded:
        top = max(counts)
        return [_graph_size(top, w.graph_sizes) if graph else top] * len(counts)
    return [_graph_size(n, w.graph_sizes) if graph and n else n for n in counts]


def _graph_size(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest captured size `>= n`; `n` itself above the largest (eager)."""
    return next((s for s in sizes if s >= n), n)


def _padding_ids(num_experts: int, num_layers: int, top_k: int, w: Workload) -> np.ndarray:
    """The fixed top-k set routed padding rows carry, int64 `[L, K]`: `K` distinct experts a
    layer, drawn from the workload's seed."""
    rng = np.random.default_rng([w.seed, 1])
    k = min(top_k, num_experts)
    sets = np.stack([rng.permutation(num_experts)[:k] for _ in range(num_layers)])
    return np.pad(sets, ((0, 0), (0, top_k - k)), constant_values=-1)
