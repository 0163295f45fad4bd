"""Benchmarks of the dispatch hot path: ours against a serving engine's torch expression and
against the device's roofline, plus a full replay beside the kernel calls it makes.

Dimensions: `N` (token, top-k slot) pairs, `T = N / K` tokens, `L` layers, `E` logical experts,
`K` top-k, `P` physical slots, `G` GPUs = EP ranks, `R` max replicas of one expert, `S` steps.

The shape is DeepSeek-V3's: `E = 256`, `K = 8`, `P = 288` slots on `G = 32` GPUs (4 nodes of 8),
one layer. For each policy and `N`, three things are timed on the same device and ids:

- **straightforward**: the torch expression a serving engine writes, each step a separate op
  (`row = arange(N) // K`, then `log2phy[ids, row % logcnt[ids]]`; a stable argsort for
  `ordinal`; a table gather for `static`; for `random`, the stream's draws made by torch ops
  (`streams.batch_draws`) `% logcnt[ids]`);
- **ours**: `eplbsim.dispatch.kernels.dispatch_step` on the `[T, 1, K]` ids;
- **roofline**: the machine's memory bandwidth, a streaming copy moving the same bytes as
  dispatch must (a copy of `6N` bytes: `6N` read + `6N` written = the `4N` id bytes read +
  `8N` output bytes written): on CUDA the device copy; on CPU the best of torch's `copy_` and
  a compiled loop copying 1 MiB chunks on every core. Its GB/s are the machine's; a kernel more
  than 10% faster than it means the roofline is wrong, and the table says so.

Each is warmed up first (numba compiles there, Triton too), then timed as the best of
`repeats` runs (`time.perf_counter` on CPU, CUDA events on CUDA). Bytes are `12` per pair
(int32 id read, int64 slot written) for all three, so GB/s compare directly; the ratios are
time ratios (ours / straightforward, ours / roofline): lower is better, below 1 ours is faster.
Before timing, ours and the straightforward expression are checked equal to the reference
policy (`reference_step`) once per `(policy, N)`; `BenchMismatch` is raised otherwise.

Everything here returns rows (dicts); `format_dispatch_table` and `format_replay_table` turn them
into text. Nothing prints.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..base.compiled import JIT, jit, prange
from ..base.progress import Progress
from ..dispatch import POLICIES, resolve_policy
from ..dispatch.kernels import dispatch_step, reference_step
from ..dispatch.policies import DispatchContext, ordinal_offset, static_table
from ..dispatch.streams import Stream, stream_key
from ..placement import View, full_view, rank_view
from ..placement.topology import Topology
from ..ranks import make_ranks, rank_context, rank_groups, share_bounds
from ..runspec import RunSpec
from ..solvers import solve
from ..traces.trace import Trace
from . import replay_quiet, resolve_device, routed_loads, schedule_of

# DeepSeek-V3's MoE shape: experts, top-k, physical slots, GPUs, GPUs per node.
EXPERTS, TOP_K, SLOTS, GPUS, GPUS_PER_NODE = 256, 8, 288, 32, 8
REDUNDANT = SLOTS - EXPERTS
BENCH_POLICIES = ("row", "ordinal", "static", "random")
REPLAY_MODES = ("none", "a2a")
BYTES_PER_PAIR = 12  # int32 id read + int64 slot written
ROOFLINE_SLACK = 1.1  # ours more than 10% faster than the roofline: the roofline is wrong
DEFAULT_N = {"cpu": (10**6, 10**7), "cuda": (10**8,)}
DEFAULT_REPEATS = 5
# The replay size of issue 14 (58 layers, 4096 tokens a step, 16 steps) on every device;
# `replay_throughput` takes smaller sizes and prints the size it ran.
REPLAY_SIZE = {"steps": 16, "tokens": 4096, "layers": 58}
BENCH_STEP = 1  # the step in the dispatch context: ordinal's offset is step + layer = 1
DISPATCH_KEYS = ("policy", "n", "device", "ns_per_pair_ours", "ns_per_pair_straightforward",
                 "ns_per_pair_roofline", "gbps_ours", "gbps_straightforward", "gbps_roofline",
                 "ours_over_straightforward", "ours_over_roofline", "roofline_wrong")


class BenchMismatch(AssertionError):
    """A benchmarked implementation disagreed with the reference policy."""


# ----------------------------------------------------------------------------- inputs

def skewed_ids(tokens: int, layers: int = 1, *, experts: int = EXPERTS, top_k: int = TOP_K,
               seed: int = 0, sigma: float = 1.0) -> torch.Tensor:
    """Routing ids int32 `[T, L, K]` from a seeded skewed popularity, fast enough for `N = 1e8`.

    The same model as `synth.skewed` without drift: each layer has a log-normal popularity
    (`log w ~ N(0, sigma^2)`), and a token's `K` distinct experts are drawn without replacement
    with probability proportional to `w` (Plackett-Luce), in draw order. Sampled as `K`
    sequential inverse-CDF draws, each redrawn where it repeats an earlier slot of its token
    (exactly the conditional distribution), so the cost is `O(T K log E)`, not `O(T E)`.
    """
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, layers, top_k), dtype=np.int32)
    for layer in range(layers):
        w = np.exp(sigma * rng.standard_normal(experts))  # [E]
        cdf = np.cumsum(w) / w.sum()
        out = ids[:, layer]  # [T, K] view
        for k in range(top_k):
            todo = np.arange(tokens)
            while todo.size:
                pick = np.minimum(np.searchsorted(cdf, rng.random(todo.size), side="right"),
                                  experts - 1).astype(np.int32)
                out[todo, k] = pick
                repeat = (out[todo, :k] == pick[:, None]).any(1) if k else \
                    np.zeros(todo.size, bool)
                todo = todo[repeat]
    return torch.from_numpy(ids)


@dataclass(frozen=True)
class Problem:
    """One benchmark input on its device.

    ids:     int32 `[T, 1, K]` routing ids (no padding); `flat` is the same memory as `[N]`
    view:    the full view of the deepseek placement solved for these ids' counts
    log2phy: int64 `[E, R]` and logcnt int64 `[E]`: the layer's maps; table int64 `[E]` static's
    """

    ids: torch.Tensor
    flat: torch.Tensor
    view: View
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    table: torch.Tensor
    seed: int

    @property
    def n(self) -> int:
        return self.flat.numel()

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def context(self) -> DispatchContext:
        """Rank 0's context at step `BENCH_STEP`, its stream keyed by the seed."""
        return DispatchContext(step=BENCH_STEP, layer=0, rank=0, seed=self.seed,
                               stream=Stream(stream_key(self.seed), BENCH_STEP), mode="none")


def make_problem(n: int, device: str | torch.device = "cpu", seed: int = 0) -> Problem:
    """`N` pairs (`T = ceil(N / K)` tokens) of the DeepSeek-V3 shape, placement solved by
    deepseek from the ids' own counts, everything on `device`."""
    tokens = max(1, math.ceil(n / TOP_K))
    ids = skewed_ids(tokens, seed=seed)  # [T, 1, K]
    counts = np.bincount(ids.numpy().reshape(-1), minlength=EXPERTS)[None]  # [1, E]
    placement = solve("deepseek", counts, SLOTS, Topology(GPUS, GPUS_PER_NODE))
    view = full_view(placement, 0).to(device)
    table = static_table(view, 0, seed)[0]  # [E] rank 0's table
    ids = ids.to(device)
    return Problem(ids, ids.view(-1), view, view.log2phy[0], view.logcnt[0], table, seed)


# ----------------------------------------------------------------------------- the contenders

def straightforward(policy: str, prob: Problem) -> torch.Tensor:
    """The serving engine's torch expression for `policy`, each step a separate op (random's
    draws the stream's, by torch ops): phys int64 `[N]` (the ids carry no padding, so no
    masking)."""
    ids, log2phy, logcnt = prob.flat, prob.log2phy, prob.logcnt
    n, device = ids.numel(), ids.device
    if policy == "row":
        row = torch.arange(n, device=device) // TOP_K
        return log2phy[ids, row % logcnt[ids]]
    if policy == "ordinal":
        order = torch.argsort(ids, stable=True)
        ordered = ids[order]
        position = torch.arange(n, device=device)
        new_run = torch.ones(n, dtype=torch.bool, device=device)
        new_run[1:] = ordered[1:] != ordered[:-1]
        run_start = torch.cummax(torch.where(new_run, position, 0), 0).values
        occ = torch.empty(n, dtype=torch.int64, device=device)
        occ[order] = position - run_start
        return log2phy[ids, (occ + ordinal_offset(prob.context())) % logcnt[ids]]
    if policy == "static":
        return prob.table[ids]
    if policy == "random":
        draws = prob.context().stream.draws(n, 0, device)[0]
        return log2phy[ids, draws % logcnt[ids]]
    raise ValueError(f"no straightforward expression for policy {policy!r}")


def ours(policy: str, prob: Problem) -> torch.Tensor:
    """`dispatch_step` on the `[T, 1, K]` ids: phys int64 `[T, 1, K]`."""
    return dispatch_step(POLICIES[policy], prob.ids, prob.view, prob.context())


def roofline(prob: Problem) -> list[Callable[[], Any]]:
    """The machine's memory roofline for `prob`'s bytes (the benchmark keeps the fastest): a
    streaming copy moving `12 N` bytes (`6N` read, `6N` written), as dispatch reads `4N` id
    bytes and writes `8N` slot bytes. On CUDA the device copy; on CPU every core copying, by
    torch (`copy_`, its own threads) and by a compiled parallel loop over 1 MiB chunks."""
    n, device = prob.n, prob.device
    src = torch.ones(n * BYTES_PER_PAIR // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        return [lambda: dst.copy_(src)]
    a, b = src.numpy(), dst.numpy()
    return [lambda: dst.copy_(src), lambda: _stream_copy(a, b, COPY_CHUNK)]


COPY_CHUNK = 1 << 20  # bytes each parallel task of the CPU roofline copies


@jit(parallel=True, **JIT)
def _stream_copy(src, dst, chunk):  # pragma: no cover - compiled
    """`dst[:] = src` in chunks of `chunk` bytes, the chunks spread over every core."""
    n = src.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(n, lo + chunk)
        dst[lo:hi] = src[lo:hi]


def check_against_reference(policy: str, prob: Problem) -> None:
    """Raise BenchMismatch unless ours and the straightforward expression both equal the
    reference policy on `prob`."""
    expected = reference_step(POLICIES[policy], prob.ids, prob.view, prob.context()).reshape(-1)
    got = {"ours": ours(policy, prob).reshape(-1),
           "straightforward": straightforward(policy, prob)}
    for who, phys in got.items():
        if phys.shape != expected.shape or not torch.equal(phys.long(), expected):
            bad = (phys.long() != expected).sum() if phys.shape == expected.shape else "shape"
            raise BenchMismatch(f"{who} {policy} differs from the reference policy at "
                                f"N={prob.n} on {prob.device} ({bad} pairs)")


# ----------------------------------------------------------------------------- timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], Any], device: str | torch.device, repeats: int = DEFAULT_REPEATS,
              warmup: int = 2) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, after `warmup` untimed calls (which
    absorb JIT compilation and allocator growth). CUDA: measured with events around each call,
    after a synchronize, so queued work never leaks into a measurement."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    best = math.inf
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            with torch.cuda.device(device):  # events on the current stream of this device
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return best


def _rate(seconds: float, n: int) -> tuple[float, float]:
    """(ns per pair, effective GB/s at `BYTES_PER_PAIR` bytes a pair)."""
    return seconds * 1e9 / n, BYTES_PER_PAIR * n / seconds / 1e9


def warm_up_kernels(device: str, policies: Sequence[str] = BENCH_POLICIES) -> None:
    """Compile every policy's kernel on a tiny problem (numba's JIT, Triton's autotune) so no
    compile time lands in a measurement."""
    prob = make_problem(4096, device)
    for policy in policies:
        ours(policy, prob)
    _sync(torch.device(device))


def bench_dispatch(ns: Sequence[int] | None = None, policies: Sequence[str] = BENCH_POLICIES,
                   device: str = "auto", repeats: int = DEFAULT_REPEATS,
                   seed: int = 0, progress: Progress | None = None) -> list[dict[str, Any]]:
    """One row per `(N, policy)` with the `DISPATCH_KEYS`: ns per pair and GB/s of ours, the
    straightforward expression and the roofline, and the time ratios ours / straightforward
    and ours / roofline (lower is better). Ours is checked against the reference first.
    `progress` is told of each row done."""
    device = resolve_device(device)
    ns = [int(n) for n in (ns or DEFAULT_N.get(torch.device(device).type, DEFAULT_N["cpu"]))]
    for policy in policies:
        if policy not in BENCH_POLICIES:
            raise ValueError(f"unknown bench policy {policy!r}; choose from "
                             f"{', '.join(BENCH_POLICIES)}")
    warm_up_kernels(device, policies)
    return [row for n in ns for row in _bench_n(make_problem(n, device, seed), policies, repeats,
                                                  progress)]


def _bench_n(prob: Problem, policies: Sequence[str], repeats: int,
             progress: Progress | None = None) -> list[dict[str, Any]]:
    """The rows of one problem (one `N`): the roofline once, then each policy (`progress` told
    of each)."""
    device = str(prob.device)
    roof = min(best_time(fn, device, repeats) for fn in roofline(prob))
    rows = []
    for policy in policies:
        check_against_reference(policy, prob)
        t_ours = best_time(partial(ours, policy, prob), device, repeats)
        t_str = best_time(partial(straightforward, policy, prob), device, repeats)
        (ns_o, gb_o), (ns_s, gb_s), (ns_r, gb_r) = (_rate(t, prob.n)
                                                    for t in (t_ours, t_str, roof))
        rows.append({"policy": policy, "n": prob.n, "device": device.split(":")[0],
                     "ns_per_pair_ours": ns_o, "ns_per_pair_straightforward": ns_s,
                     "ns_per_pair_roofline": ns_r, "gbps_ours": gb_o,
                     "gbps_straightforward": gb_s, "gbps_roofline": gb_r,
                     "ours_over_straightforward": t_ours / t_str,
                     "ours_over_roofline": t_ours / roof,
                     "roofline_wrong": t_ours * ROOFLINE_SLACK < roof})
        if progress is not None:
            progress(1)
    return rows


# ----------------------------------------------------------------------------- replay

def skewed_trace(steps: int, tokens: int, layers: int, seed: int = 0) -> Trace:
    """A DeepSeek-V3-shaped trace of `steps` equal steps from `skewed_ids`."""
    ids = skewed_ids(steps * tokens, layers, seed=seed)  # [S*T, L, K]
    offsets = torch.arange(steps + 1, dtype=torch.int64) * tokens  # [S + 1]
    meta = {"source": "eplbsim.bench", "scenario": "skewed_ids", "seed": seed}
    return Trace(ids, offsets, EXPERTS, None, meta)


def _replay_spec(policy: str, mode: str, device: str, seed: int) -> RunSpec:
    return RunSpec.of(policy=policy, mode=mode, gpus=GPUS, gpus_per_node=GPUS_PER_NODE,
                      redundant=REDUNDANT, seed=seed, device=device)


def kernel_calls(trace: Trace, spec: RunSpec) -> tuple[Callable[[], None], int]:
    """The dispatch calls a replay of `spec` makes, alone: `(run, calls per step)`, where
    `run()` makes them for every step of `trace` on the placement the replay serves, with the
    same views and contexts ("none": one call per group of identical ranks over every token;
    "a2a": one per rank over its contiguous share) and nothing else."""
    d = spec.dispatch
    _, policy = resolve_policy(d.policy)
    device = resolve_device(d.device)
    placement = schedule_of(trace, spec, routed_loads(trace))[0].placement
    G = spec.topology.gpus
    ranks = make_ranks(d.rng, d.seed, G, drift_p=d.drift_p)
    views = [rank_view(d.view, placement, r, d.mode).to(device) for r in range(G)]
    steps = [trace.step(s).to(device) for s in range(trace.num_steps)]
    if d.mode == "none":  # (rank, rows) per call
        calls = [(group[0], slice(None)) for group in rank_groups(views, policy)]
    else:
        bounds = share_bounds(trace.step(0).shape[0], G).tolist()
        calls = [(r, slice(lo, hi)) for r, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]

    def run() -> None:
        for s, ids in enumerate(steps):
            for r, rows in calls:
                dispatch_step(policy, ids[rows], views[r],
                              rank_context(s, ranks[r], d.mode, d.seed, d.rank_offset, d.tp))

    return run, len(calls)


def replay_throughput(device: str = "auto", steps: int | None = None, tokens: int | None = None,
                      layers: int | None = None, policies: Sequence[str] = BENCH_POLICIES,
                      modes: Sequence[str] = REPLAY_MODES, seed: int = 0,
                      repeats: int = 3, progress: Progress | None = None
                      ) -> list[dict[str, Any]]:
    """A full replay beside its own kernel, in one run: for each mode and policy, the wall time
    of `replay` on the DeepSeek-V3 shape (`G = 32` ranks, 8 a node, `E = 256`, `K = 8`, 32
    redundant slots; equal steps of `T` tokens) and of the dispatch calls it makes
    (`kernel_calls`), each the fastest of `repeats` runs after a warm-up of both (JIT compiled,
    tables built). Sizes default to `REPLAY_SIZE`.

    `pairs` = `S * T * L * K` trace pairs; `replay_pairs_per_s = pairs / replay_seconds`;
    `kernel_pairs_per_s` = pairs dispatched per second of kernel time (in "none" every call
    dispatches every pair: a rank-variant policy dispatches each once per rank; in "a2a" each
    pair is dispatched once, by its owner);
    `replay_over_kernel` = replay_seconds / kernel_seconds (1 = the replay costs nothing beyond
    its kernel). Rows carry `kind: "replay"`; `progress` is told of each row done.
    """
    device = resolve_device(device)
    sizes = dict(REPLAY_SIZE)
    for key, value in (("steps", steps), ("tokens", tokens), ("layers", layers)):
        if value is not None:
            sizes[key] = int(value)
    S, T, L = sizes["steps"], sizes["tokens"], sizes["layers"]
    tiny = skewed_trace(2, 64, 2, seed)
    trace = skewed_trace(S, T, L, seed)
    pairs = S * T * L * TOP_K
    rows = []
    for mode in modes:
        for policy in policies:
            spec = _replay_spec(policy, mode, device, seed)
            replay_quiet(tiny, spec)
            run, calls = kernel_calls(trace, spec)
            run()
            kernel = best_time(run, device, repeats=repeats, warmup=0)
            seconds = best_time(lambda: replay_quiet(trace, spec), device, repeats=repeats,
                                warmup=0)
            passes = calls if mode == "none" else 1  # times each pair is dispatched
            rows.append({"kind": "replay", "policy": policy, "device": device, "mode": mode,
                         "ranks": GPUS, "steps": S, "tokens": T, "layers": L,
                         "experts": EXPERTS, "top_k": TOP_K, "slots": SLOTS, "pairs": pairs,
                         "calls_per_step": calls, "replay_seconds": seconds,
                         "kernel_seconds": kernel, "replay_pairs_per_s": pairs / seconds,
                         "kernel_pairs_per_s": pairs * passes / kernel,
                         "replay_over_kernel": seconds / kernel})
            if progress is not None:
                progress(1)
    return rows


E2E_STEPS = (2, 130)  # the run lengths whose difference is the end-to-end throughput (at 34
# steps the difference, about 0.4 s here, was within this 2-core guest's start-up noise)


def end_to_end(steps: Sequence[int] = E2E_STEPS, tokens: int = REPLAY_SIZE["tokens"],
               layers: int = REPLAY_SIZE["layers"], policy: str = "row", mode: str = "none",
               seed: int = 0, repeats: int = 5, folder: Any = None,
               device: str = "cpu", form: str = "dir", warmups: int = 1) -> dict[str, Any]:
    """The whole `eplbsim run` as a user meets it, a file in and JSON out: the DeepSeek-V3-shaped
    trace (`skewed_trace`, 32 ranks) of each of two lengths written into `folder` (a temporary
    one by default) as `form`: "npz" (`save_trace`: compressed) or "dir" (`save_trace_dir`: the
    uncompressed directory form), then `eplbsim run --trace PATH --device DEVICE --json` timed
    as a separate process for each, the fastest of `repeats` runs after `warmups` rounds that
    are not timed (the two lengths alternating: this guest has slow spells of a second or
    more). The
    difference of the two lengths' pairs over the difference of their wall times is the
    throughput of the run beyond its fixed start-up (imports, numba's cache), which the shorter
    run's time minus its share gives: `{"e2e_pairs_per_s", "startup_s", ...}`, both None when
    the longer run was not slower (the difference lost in the noise)."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from ..traces import save_trace
    from ..traces.directory import save_trace_dir

    short, long = sorted(int(s) for s in steps)
    if short < 1 or long <= short:
        raise ValueError(f"end_to_end needs two run lengths, the second longer, got {steps}")
    lengths = (short, long)
    with tempfile.TemporaryDirectory(prefix="eplbsim-e2e-", dir=folder) as tmp:
        cmds = []
        for S in lengths:
            path = Path(tmp) / f"trace{S}{'.npz' if form == 'npz' else ''}"
            (save_trace if form == "npz" else save_trace_dir)(
                skewed_trace(S, tokens, layers, seed), path)
            cmds.append([sys.executable, "-m", "eplbsim.cli", "run", "--trace", str(path),
                         "--policies", policy, "--mode", mode, "--gpus", str(GPUS),
                         "--gpus-per-node", str(GPUS_PER_NODE), "--redundant", str(REDUNDANT),
                         "--seed", str(seed), "--device", device, "--json"])
        times: list[list[float]] = [[], []]
        for _ in range(warmups + repeats):  # a warm-up round fills numba's and the page cache
            for i, cmd in enumerate(cmds):  # alternating, so a slow spell slows both lengths
                start = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True)
                times[i].append(time.perf_counter() - start)
                if done.returncode:
                    raise RuntimeError(f"eplbsim run failed: {done.stderr.strip()[-300:]}")
        seconds = [min(t[warmups:]) for t in times]
        pairs = [S * tokens * layers * TOP_K for S in lengths]
    gained = seconds[1] - seconds[0]
    rate = (pairs[1] - pairs[0]) / gained if gained > 0 else None  # None: lost in the noise
    return {"kind": "end_to_end", "policy": policy, "mode": mode, "ranks": GPUS,
            "device": device, "form": form, "steps": [short, long], "tokens": tokens,
            "layers": layers, "seconds": seconds, "pairs": pairs, "e2e_pairs_per_s": rate,
            "startup_s": None if rate is None else seconds[0] - pairs[0] / rate}


def format_end_to_end(row: dict[str, Any]) -> str:
    """The end-to-end row as two lines of text."""
    (s1, s2), (t1, t2) = row["steps"], row["seconds"]
    what = "a .npz" if row["form"] == "npz" else "a trace directory"
    return (f"end to end (eplbsim run on {row['device']}, {what} in, JSON out, "
            f"{row['ranks']} ranks, {row['policy']}, \"{row['mode']}\"): {s1} steps in "
            f"{t1:.2f} s, {s2} steps in {t2:.2f} s of {row['tokens']} tokens x "
            f"{row['layers']} layers\n"
            + ("the longer run was not slower: the difference is lost in the noise; lengthen "
               "the runs" if row["e2e_pairs_per_s"] is None else
               f"{row['e2e_pairs_per_s'] / 1e6:.0f} M trace pairs/s beyond a fixed "
               f"{row['startup_s']:.2f} s (the two lengths' difference)"))


# ----------------------------------------------------------------------------- text

def _num(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _count(n: int) -> str:
    """1000000 -> '1e6', 25000000 -> '2.5e7', 4096 -> '4096'."""
    mantissa, _, exponent = f"{n:e}".partition("e")
    short = f"{float(mantissa):g}e{int(exponent)}"
    return short if n >= 10**4 and float(short) == n else str(n)


def _columns(header: Sequence[str], body: Sequence[Sequence[str]], labels: int) -> list[str]:
    """The lines of a fixed-width table: the first `labels` columns left-aligned, the
    numbers right-aligned."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    return ["  ".join(c.rjust(w) if i >= labels else c.ljust(w)
                      for i, (c, w) in enumerate(zip(cells, widths)))
            for cells in [header, *body]]


def format_dispatch_table(rows: Sequence[dict[str, Any]]) -> str:
    """The dispatch rows as a text table, one line per `(policy, N)`, ratios last."""
    if not rows:
        return "(no dispatch rows)"
    device = rows[0]["device"]
    roof = ("every core's streaming copy of the same bytes" if not device.startswith("cuda")
            else "a device copy moving the same bytes")
    head = [(f"dispatch on {device}: DeepSeek-V3 shape E={EXPERTS}, K={TOP_K}, P={SLOTS}, "
             f"G={GPUS} ({GPUS // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}), one layer, "
             f"T = N/{TOP_K} tokens"),
            (f"str = straightforward torch expression, ours = eplbsim.dispatch.kernels.dispatch_step, "
             f"roof = roofline ({roof})"),
            (f"GB/s at {BYTES_PER_PAIR} bytes/pair (int32 id in, int64 slot out); ratios are "
             f"time ratios: lower is better, < 1 means ours is faster")]
    cols = ("policy", "N", "ns/pair str", "ns/pair ours", "ns/pair roof", "GB/s str",
            "GB/s ours", "GB/s roof", "ours/str", "ours/roof")
    body = [(r["policy"], _count(r["n"]), _num(r["ns_per_pair_straightforward"]),
             _num(r["ns_per_pair_ours"]), _num(r["ns_per_pair_roofline"]),
             _num(r["gbps_straightforward"]), _num(r["gbps_ours"]), _num(r["gbps_roofline"]),
             f"{r['ours_over_straightforward']:.2f}",
             "roofline wrong" if r["roofline_wrong"] else f"{r['ours_over_roofline']:.2f}")
            for r in rows]
    wrong = ["roofline wrong: ours ran more than 10% faster than the machine's copy, so that "
             "copy did not reach the machine's bandwidth"] if any(
        r["roofline_wrong"] for r in rows) else []
    return "\n".join(head + _columns(cols, body, labels=1) + wrong)


def format_replay_table(rows: Sequence[dict[str, Any]]) -> str:
    """The replay rows as a text table, one line per (mode, policy), the ratio last."""
    if not rows:
        return "(no replay rows)"
    r0 = rows[0]
    head = [f"replay beside its kernel on {r0['device']}: {r0['ranks']} ranks, {r0['steps']} "
            f"steps x {r0['tokens']} tokens x {r0['layers']} layers, K={r0['top_k']}, "
            f"E={r0['experts']}, P={r0['slots']} ({r0['pairs']:,} trace pairs)",
            "kernel = the dispatch calls the replay makes, alone (calls/step of them); "
            "M pairs/s: trace pairs for the replay, dispatched pairs for the kernel"]
    cols = ("mode", "policy", "calls/step", "replay s", "replay M pairs/s", "kernel s",
            "kernel M pairs/s", "replay/kernel")
    body = [(r["mode"], r["policy"], str(r["calls_per_step"]), f"{r['replay_seconds']:.3f}",
             _num(r["replay_pairs_per_s"] / 1e6), f"{r['kernel_seconds']:.3f}",
             _num(r["kernel_pairs_per_s"] / 1e6), f"{r['replay_over_kernel']:.2f}")
            for r in rows]
    return "\n".join(head + _columns(cols, body, labels=2))
