"""One trace over many workers: a run's steps split into contiguous ranges, one a worker.

The schedule (the routed counts, every placement and segment) is planned once, here, from the
whole trace; each worker dispatches its range of steps for every rank (`replay.dispatch_steps`)
and its counters are put in place. A step's outcome depends only on its index, its ids and its
segment (every random draw is counter-based, `dispatch.streams`), so the result is the
one-process result bit for bit (`tests/replay/test_workers.py` checks every policy, both modes and an
async rebalance schedule).

Executors (`executors`): "local" spawns `workers` processes; "ray" runs a task per range on the
cluster at an address, or on a local instance. The trace goes to each worker once: a directory
trace as its path (each worker reads its own steps from the files), a trace in memory pickled
once per local process or put once in Ray's object store. Each local process takes its share
of the cores for its compiled loops and torch; a Ray task takes one CPU.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Sequence

import numpy as np
import torch

from ..base.compiled import set_threads
from ..base.errors import InputError
from ..base.progress import Progress
from ..dispatch import resolve_policy
from ..metrics import Counters
from ..runspec import RunSpec
from ..schedule.plan import Segment
from ..traces import TokenTrace
from . import Plan, dispatch_steps, fill_norms, plan_run, replay_planned, shaped, spec_for_trace
from .executors import check_executor, local_pool, ray_session
from .results import Results

_TRACE: list[Any] = []  # a local worker's trace, set once by `_hold`
# Pair dispatches (`dispatch_work`) below which local worker processes cost more than they
# save: on a 2-core guest, where one process already runs its compiled loops on both cores, two
# workers were slower at 4.1e9 and 1.19x faster at 5.5e9 (benchmarks/history/2026-12.md,
# "Workers: when they pay off").
PAYS_OFF = 5e9
# An engine's own code in eplbsim's compiled pair dispatches (0.7 ns each): a call costs
# `ENGINE_CALL` and each pair it maps `ENGINE_PAIR`. Fitted to a DeepSeek-V3 step (58 layers,
# 1.9M pairs, 32 ranks) of sglang:dynamic: 1856 calls of a rank's tokens each in "a2a" took
# 0.246 s, 1856 calls of every token in "none" (one a rank) 2.17 s: 0.10 ms a call and 33 ns a
# pair (benchmarks/history/2026-12.md, "bench_engines after the lighter engine calls").
ENGINE_CALL, ENGINE_PAIR = 1.4e5, 47.0


def dispatch_work(trace: TokenTrace, specs: Sequence[RunSpec]) -> float:
    """The work of replaying `specs` on `trace`, summed over the specs, in eplbsim's compiled
    pair dispatches. eplbsim's policies: tokens x layers x top-k pairs, times the ranks that
    compute each token's choice (every rank in "none", where a policy with a table,
    `DispatchPolicy.table`, is counted from expert counts once for all; its owner in "a2a").
    An engine's code: its calls at `ENGINE_CALL` and the pairs they map at `ENGINE_PAIR`, one
    call a layer, step and group of ranks its calls are observed to serve in "none"
    (`checks.observed_calls`), one a layer, step and rank in "a2a"."""
    pairs = float(trace.num_tokens) * trace.num_layers * trace.top_k
    batches = float(trace.num_steps) * trace.num_layers
    out = 0.0
    for s in specs:
        entry = resolve_policy(s.dispatch.policy, s.dispatch.engine_source)[1]
        none = s.dispatch.mode == "none"
        if entry.observed is None:
            out += pairs * (s.topology.gpus if none and entry.table is None else 1)
            continue
        calls = _engine_calls(trace, s) if none else s.topology.gpus
        out += pairs * (calls if none else 1) * ENGINE_PAIR + batches * calls * ENGINE_CALL
    return out


def _engine_calls(trace: TokenTrace, spec: RunSpec) -> int:
    """The calls an engine's policy makes for one token in "none" under `spec`, observed on a
    one-layer `checks.probe_placement` of the trace's experts and the spec's slots."""
    from ..ranks.checks import observed_calls, probe_placement
    d, E = spec.dispatch, trace.num_experts
    topology = spec.topology.topology()
    placement = probe_placement(E, E + spec.topology.fit(E), topology)
    return observed_calls(d.policy, placement, d.view, d.rng, d.seed, trace.top_k,
                          d.engine_source)


def pays_off(trace: TokenTrace, specs: Sequence[RunSpec], workers: int) -> bool:
    """Whether `workers` local processes replay `specs` on `trace` sooner than one: more than
    one worker, and at least `PAYS_OFF` pair dispatches (`dispatch_work`)."""
    return workers > 1 and dispatch_work(trace, specs) >= PAYS_OFF


def step_ranges(tokens: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """`parts` (at most one a step) contiguous, non-empty ranges `[lo, hi)` covering the steps
    whose token counts are `tokens [S]`, cut where the running token count crosses each
    `1 / parts` of the total (equal steps: equal ranges)."""
    S = len(tokens)
    parts = max(1, min(parts, S))
    weight = np.cumsum(np.asarray(tokens, np.float64) + 1e-9)  # a step of no tokens still counts
    cuts = np.searchsorted(weight, weight[-1] * np.arange(1, parts) / parts, "right")
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, S - 1), [S]]))
    return [(int(lo), int(hi)) for lo, hi in zip(bounds, bounds[1:])]


def _hold(trace: TokenTrace, threads: int) -> None:
    """Local worker initializer: keep the trace, take `threads` cores."""
    _TRACE[:] = [trace]
    _threads(threads)


def _threads(threads: int) -> None:
    """Compiled loops and torch on `threads` cores."""
    set_threads(threads)
    torch.set_num_threads(max(1, threads))


def _local_range(spec: RunSpec, segments: Sequence[Segment], lo: int,
                 hi: int) -> tuple[torch.Tensor, Counters]:
    """A local worker's task: steps `[lo, hi)` of the trace it holds (`dispatch_steps`)."""
    return dispatch_steps(_TRACE[0], spec, segments, range(lo, hi))


def _ray_range(trace: TokenTrace, spec: RunSpec, segments: Sequence[Segment], lo: int,
               hi: int) -> tuple[torch.Tensor, Counters]:
    """A Ray task: steps `[lo, hi)` of `trace` on the task's one CPU."""
    _threads(1)
    return dispatch_steps(trace, spec, segments, range(lo, hi))


class Workers:
    """`workers` processes replaying ranges of `trace`'s steps, as a context manager: the
    processes start (and the trace is shipped) on entry and stop on exit. `replay` is called as
    `replay.replay` is, and `replay_planned` as `replay.replay_planned`, so
    `replay.compare(..., run=workers.replay_planned)` splits every row.

    executor: "local" (default) or "ray"; address: the Ray cluster (default a local instance of
    `workers` CPUs). InputError for an unknown executor, an address without Ray, or settings
    that cannot be sent to a worker (a policy given as a function of this process)."""

    def __init__(self, trace: TokenTrace, workers: int, executor: str = "local",
                 address: str | None = None) -> None:
        check_executor(executor, address)
        if workers < 1:
            raise InputError(f"--workers must be at least 1, got {workers}")
        self.trace, self.workers, self.executor, self.address = trace, workers, executor, address
        self._pool: Any = None
        self._ray: Any = None
        self._session: Any = None
        self._trace_ref: Any = None

    def __enter__(self) -> "Workers":
        if self.executor == "local":
            threads = max(1, (os.cpu_count() or 1) // self.workers)
            self._pool = local_pool(self.workers, _hold, (self.trace, threads))
        else:
            self._session = ray_session(self.workers, self.address)
            self._ray = self._session.__enter__()
            self._trace_ref = self._ray.put(self.trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._session is not None:
            self._session.__exit__(*exc)

    def replay(self, trace: TokenTrace, spec: RunSpec | None = None,
               progress: Progress | None = None) -> Results:
        """`replay.replay(trace, spec, progress)` with the steps split over the workers
        (`trace`, its steps shaped by the spec, `shaped`, must be the one they hold); the same
        Results bit for bit. InputError for a run whose ranks die (`fail_ranks`: the
        survivors' steps are another trace)."""
        trace, spec = shaped(trace, RunSpec() if spec is None else spec)
        spec = spec_for_trace(trace, spec)
        if spec.topology.fail_ranks is not None:
            raise InputError("a run whose ranks die (fail_ranks) replays the survivors' steps "
                             "in one process: use replay")
        return self.replay_planned(trace, spec, plan_run(trace, spec), progress)

    def replay_planned(self, trace: TokenTrace, spec: RunSpec, plan: Plan,
                       progress: Progress | None = None) -> Results:
        """`replay.replay_planned` with the steps split over the workers (`trace` must be the
        one they hold); the same Results bit for bit."""
        if trace is not self.trace:
            raise ValueError("Workers.replay replays the trace its workers hold")
        return replay_planned(trace, spec, plan, progress, self.run_steps)

    def run_steps(self, trace: TokenTrace, spec: RunSpec, segments: Sequence[Segment],
                  progress: Progress | None = None) -> tuple[torch.Tensor, Counters]:
        """`replay.run_steps` for every step of the trace the workers hold, one contiguous
        range a worker (balanced by tokens), the ranges' counts put in place."""
        _shippable(spec)
        S, L = trace.num_steps, trace.num_layers
        ranges = step_ranges(trace.tokens_per_step.numpy(), self.workers)
        slot_load = torch.zeros(S, L, segments[0].placement.num_slots, dtype=trace.load_dtype)
        counters = Counters.zeros(S, L, spec.topology.gpus, spec.shared_work() > 0,
                                  spec.spills())
        for (lo, hi), (part_load, part) in zip(ranges, self._run(spec, segments, ranges)):
            slot_load[lo:hi] = part_load
            counters.put(lo, part)
            if progress is not None:
                progress(hi - lo)
        fill_norms(trace, spec, counters)
        return slot_load, counters

    def _run(self, spec: RunSpec, segments: Sequence[Segment],
             ranges: list[tuple[int, int]]) -> Any:
        """Each range's `(slot_load, counters)`, in order of the ranges."""
        if self._pool is not None:
            futures = [self._pool.submit(_local_range, spec, segments, lo, hi)
                       for lo, hi in ranges]
            try:
                for future in futures:
                    yield future.result()
            finally:
                for future in futures:
                    future.cancel()
            return
        ray = self._ray
        task = ray.remote(num_cpus=1)(_ray_range)
        pending = [task.remote(self._trace_ref, spec, segments, lo, hi) for lo, hi in ranges]
        try:
            while pending:
                try:
                    part = ray.get(pending[0])
                except ray.exceptions.RayError as exc:
                    cause = getattr(exc, "cause", None) or exc
                    raise (cause if isinstance(cause, InputError) else
                           InputError(f"a worker failed: {type(cause).__name__}: {cause}"))
                pending.pop(0)
                yield part
        finally:  # only the tasks not yet returned: cancelling a finished one can abort Ray
            for ref in pending:
                ray.cancel(ref)


def _shippable(spec: RunSpec) -> None:
    """InputError unless `spec` pickles, as what goes to a worker process must (a policy given
    as a function of this process does not)."""
    try:
        pickle.dumps(spec)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InputError(f"the run's settings cannot be sent to worker processes ({exc}); "
                         "give a policy of your own as file.py:function") from None
