"""replay(trace, spec) -> Results: the loop from routing trace to counted loads, nothing else.

Holds `replay` and `compare` (here; each warns its caller of what `eplbsim run` warns of, and
`replay_quiet` of nothing), their `Results` and `Comparison` (`results`: rows, tables, JSON,
CSV), and the ways to run many replays: one trace's steps over worker processes
(`workers`, on the `executors`), real torch.distributed ranks (`distributed`), a grid of runs
from a spec (`sweep`), and the hot path timed beside its contenders (`bench`). Takes in a trace
and a `RunSpec`; gives out `Results`. Imports `base`, `placement`, `traces`, `cost`, `solvers`,
`dispatch`, `ranks`, `schedule`, `engines`, `metrics`, `migration` and `runspec`.

Dimensions: `S` steps, `T` tokens in a step, `L` layers, `E` logical experts, `K` top-k,
`P` physical slots, `G` GPUs = EP ranks.

Data flows one way: trace -> its steps shaped (`shaped`: the spec's `select_steps`, ...,
`max_batched_tokens`) -> loads -> (predictor ->) solver -> placement -> per-rank views ->
dispatch per rank (`ranks.MODES`) -> executed loads -> `Results` (metrics on first use). By
default one placement is solved from the whole trace's loads; with `rebalance_every` the
placement is re-solved on a schedule from predicted loads (`schedule.plan`). A counts-only trace
has no token rows: nothing is dispatched, and the results hold the placement's promise only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from ..base.errors import InputError, warn_caller
from ..base.files import check_memory
from ..base.progress import Progress
from ..base.registry import lookup
from ..cost.catalog import trace_model
from ..dispatch import resolve_policy
from ..engines import is_engine_name, resolve_solver
from ..metrics import Counters
from ..migration.replayed import serving_stretches
from ..placement import Placement, rank_view, refuse_empty_slots
from ..placement.io import load_placement
from ..ranks import LOCAL, MODES, Collectives, Epoch, make_ranks, rank_context, rank_groups
from ..ranks.dispatched import rank_tokens
from ..ranks.moe import make_toy_moe, square_sums, step_sums
from ..ranks.traffic import source_load
from ..ranks.window import none_window, window_dispatch, windows
from ..runspec import RunSpec, StepsPart, label
from ..schedule.plan import Segment, plan
from ..traces import RunTrace, TokenTrace, check_run_trace
from ..traces.coactivation import coactivation
from ..traces.counts import CountsTrace
from ..traces.draft import Drafted, drafted_of
from ..traces.layer_kinds import hash_layers
from ..traces.stages import stage_view
from ..traces.steps import shape_steps, shaped_by
from .dead_ranks import Failure, healthy, survive
from .drafted import DraftedResults, draft_settings
from .results import Comparison, Results, run_warnings


def resolve_device(name: str) -> str:
    """`auto` -> `cuda` when torch sees a CUDA device, else `cpu`; InputError for a CUDA device
    torch does not see."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {name} asks for CUDA, but torch sees no CUDA device")
    return name


UNSHAPED = StepsPart().shaping()  # every step of a trace, none cut


def shaped(trace: RunTrace | Drafted, spec: RunSpec) -> tuple[RunTrace | Drafted, RunSpec]:
    """`(trace, spec)` with the trace's steps as `spec` replays them: shaped by its steps part
    (`select_steps`, `drop_warmup`, `drop_dummy`, `drop_outliers`, `max_batched_tokens`:
    `traces.steps.shape_steps`). Given once: a trace `shape_steps` made (`open_trace(path,
    max_batched_tokens=32)`, or a command's reading) is not shaped again, and the spec comes
    back saying the settings it was made by; InputError when `spec` gives others, which would
    shape it twice. A trace holding its draft is shaped whole; a `Drafted` pair is refused
    (shape each part before pairing them)."""
    wanted = spec.steps.shaping()
    made = shaped_by(trace)
    if made is not None:
        if wanted not in (made, UNSHAPED):
            raise InputError(f"the trace's steps are shaped already ({_given(made)}: by "
                             f"open_trace or shape_steps), and the spec would shape them again "
                             f"({_given(wanted)}): give these settings once, to the spec or "
                             f"where the trace is made")
        return trace, spec.replace(**made)
    if wanted == UNSHAPED:
        return trace, spec
    if isinstance(trace, Drafted):
        raise InputError(f"the spec shapes the steps ({_given(wanted)}) of a Drafted pair: "
                         f"shape the trace holding both (Trace.draft), or each part before "
                         f"pairing them")
    return shape_steps(trace, **wanted), spec


def _given(settings: dict[str, Any]) -> str:
    """The settings that shape a trace's steps, as keywords: "max_batched_tokens=32"."""
    return ", ".join(f"{k}={v!r}" for k, v in settings.items() if v != UNSHAPED[k])


def routed_loads(trace: RunTrace) -> torch.Tensor:
    """Routed pairs per logical expert, `[S, L, E]`, of any trace form: int32 (`load_dtype`)
    for token traces, int64 for counts."""
    if isinstance(trace, CountsTrace):
        return torch.from_numpy(trace.counts)
    return trace.counts()


def spec_for_trace(trace: RunTrace, spec: RunSpec) -> RunSpec:
    """`spec` decided for `trace`: its redundant slots (`RunSpec.fit`: those of the placement
    it serves, `placement` or `initial` before the first rebalance, a file read for the
    trace's experts and layers; else the given number, else the default), and its model when
    none is given (`cost.catalog.trace_model`: the one the trace's meta names, checked against
    its experts and top-k, else the default). InputError when `trace` is no trace."""
    check_run_trace(trace)
    if spec.cost.model is None:
        spec = spec.replace(model=trace_model(trace.meta, trace.num_experts,
                                              getattr(trace, "top_k", None)))
    given, what = ((spec.solver.placement, "given placement") if spec.schedule.initial is None
                   else (spec.schedule.initial, "initial placement"))
    slots = None
    if given is not None:
        slots = load_placement(given, trace.num_experts, spec.topology.topology(),
                               trace.num_layers, trace.meta.get("model_layers"), what).num_slots
    return spec.fit(trace.num_experts, slots, label(given))


def check_fits(trace: RunTrace, spec: RunSpec) -> RunSpec:
    """`spec` decided for the trace (`spec_for_trace`); InputError unless its topology takes
    the trace's experts (slots divide over the GPUs, groups divide the experts), its placement
    files are placements for it, its cost model can price it and it fits in memory: what a run
    would otherwise find out only after starting."""
    spec = spec_for_trace(trace, spec)
    check_memory_of(trace, spec)
    topo = spec.topology.topology()
    E = trace.num_experts
    topo.slots_per_gpu(E + spec.topology.redundant)
    for value in (spec.solver.placement, spec.schedule.initial):
        load_placement(value, E, topo, trace.num_layers, trace.meta.get("model_layers"))
    if spec.cost.cost is not None:  # a measured table lacking the shape or EP size says so now
        spec.cost.describe(spec.topology.gpus)
    return spec


def check_memory_of(trace: RunTrace, spec: RunSpec) -> None:
    """InputError when replaying `trace` under `spec` would need more memory than there is:
    loads per (step, layer, slot or expert) (int32, `load_dtype`) and the counters (80 bytes a
    step and layer, and 8 a GPU more when the shared experts are counted) for the whole run,
    plus one step's ids, choices, masks and toy-MoE pair outputs (`files.check_memory`)."""
    S, L, E = trace.num_steps, trace.num_layers, trace.num_experts
    P = E + spec.topology.redundant
    K = getattr(trace, "top_k", 0)
    T = int(trace.tokens_per_step.max()) if K else 0
    width = trace.load_dtype.itemsize if K else 8
    counters = 112 + (8 * spec.topology.gpus if spec.shared_work() > 0 else 0)
    need = S * L * (width * (P + E) + counters) + 8 * T * L * K * (16 + 3 * spec.dispatch.hidden)
    check_memory(need, f"replaying {S} steps x {L} layers x {P} slots (up to {T} tokens a "
                 f"step)", "replay fewer steps or layers (a window of the trace), or fewer "
                 "redundant slots")


def schedule_of(trace: RunTrace, spec: RunSpec, true_load: torch.Tensor) -> tuple[Segment, ...]:
    """The run's segments (`schedule.plan`) over `true_load [S, L, E]`, with the spec's
    placement files read for this trace, or its placement solved from one stage's steps
    (`solve_from`: `stage_placement`)."""
    topo = spec.topology.topology()
    S, L, E = true_load.shape
    model_layers = trace.meta.get("model_layers")
    placement, initial = (load_placement(value, E, topo, L, model_layers)
                          for value in (spec.solver.placement, spec.schedule.initial))
    if spec.solver.solve_from != "all":
        placement = stage_placement(trace, spec)
    solver = replace(spec.solver, solver=resolve_solver(spec.solver.solver,
                                                         spec.dispatch.engine_source))
    given = {} if isinstance(trace, CountsTrace) else {
        "coactivation": lambda lo, hi: coactivation(trace, range(lo, hi)),
        "source_load": lambda lo, hi: source_load(trace, topo.num_gpus, range(lo, hi))}
    return plan(true_load, spec.schedule, solver, topo, E + spec.topology.redundant,
                spec.topology.groups or trace.num_groups or 1, placement, initial,
                spec.dispatch.seed, given, hash_layers=hash_layers_of(trace, spec))


def hash_layers_of(trace: RunTrace, spec: RunSpec) -> tuple[int, ...]:
    """The trace's hash-routed layers (`traces.layer_kinds.hash_layers`): as its meta says,
    else as the model `spec` prices says."""
    return hash_layers(trace.meta, trace.num_layers, spec.cost.shape.hash_layers)


def stage_placement(trace: RunTrace, spec: RunSpec) -> Placement:
    """The placement `spec`'s solver makes from the steps of one stage of `trace` alone
    (`spec.solver.solve_from`, "prefill" or "decode"; `traces.stages`: as the log marks them,
    else by `decode_tokens`), as a run of those steps solves it. InputError when the trace
    has no step of that stage."""
    view = stage_view(trace, spec.solver.solve_from, spec.solver.decode_tokens)
    return schedule_of(view, spec.replace(solve_from="all"), routed_loads(view))[0].placement


def run_steps(trace: TokenTrace, spec: RunSpec, segments: Sequence[Segment],
              own_ranks: Sequence[int] | None = None, comm: Collectives = LOCAL,
              device: str | None = None, fast: bool = True,
              progress: Progress | None = None) -> tuple[torch.Tensor, Counters]:
    """Dispatch every step of `trace` on the ranks `own_ranks` (default all `G`, in this
    process),
    combining counts with the group through `comm`. Returns the executed pairs per slot,
    `trace.load_dtype` (int32) `[S, L, P]`, and the rank counters, both summed over the
    group. `fast` counts with compiled loops where that is possible (`ranks`), with the same
    results; exact norms it leaves out are filled in by `fill_norms`. `progress` is told of
    each step done."""
    slot_load, counters = dispatch_steps(trace, spec, segments, range(trace.num_steps), own_ranks,
                                         comm, device, fast, progress)
    fill_norms(trace, spec, counters, device)
    return slot_load, counters


def dispatch_steps(trace: TokenTrace, spec: RunSpec, segments: Sequence[Segment], steps: range,
                   own_ranks: Sequence[int] | None = None, comm: Collectives = LOCAL,
                   device: str | None = None, fast: bool = True,
                   progress: Progress | None = None,
                   resident: bool | None = None) -> tuple[torch.Tensor, Counters]:
    """`run_steps` for the contiguous `steps` of the run alone: `(slot_load [len(steps), L,
    P], counters of those steps)`, norms left `UNMEASURED` where the fast path left them. A
    step's outcome depends on nothing but its index, its ids and its segment (every draw is
    counter-based, `dispatch.streams`), so ranges dispatched apart and concatenated equal the
    whole run bit for bit. No policy's pair reaches an empty slot (-1): the guarded ones are
    checked (`dispatch.kernels.check_choices`), and one that reroutes to any slot (`unmapped`,
    `sglang:fake`) is refused in one line on a placement with an empty slot.

    `resident` (default: on a device other than the CPU): the slot loads and counters stay on
    `device` for the whole range and come back in one copy at its end, and each step's ids go
    there through pinned memory without the host waiting for the copy (`to_device`): the host
    never waits on a step unless the policy's own code does (a guarded reference policy is
    checked on the host; the named kernels of `dispatch.kernels` are not)."""
    d = spec.dispatch
    name, policy = resolve_policy(d.policy, d.engine_source, d.engine_args or "")
    mode_step = lookup(MODES, d.mode, "mode")
    device = device or resolve_device(d.device)
    if resident is None:
        resident = torch.device(device).type != "cpu"
    held = device if resident else "cpu"  # where the run's counts are kept while it runs
    L, E, G = trace.num_layers, trace.num_experts, spec.topology.gpus
    ranks = make_ranks(d.rng, d.seed, G, own_ranks, d.drift_p)
    moe = make_toy_moe(L, E, d.hidden, d.seed, device, trace)
    slot_load = torch.zeros(len(steps), L, segments[0].placement.num_slots,
                            dtype=trace.load_dtype, device=held)
    shared = spec.shared_work() > 0
    counters = Counters.zeros(len(steps), L, G, shared, spec.spills(), held)
    read = getattr(trace, "stored_step", trace.step)  # ids as stored: the steps widen them
    served: list[tuple[int, int, Epoch]] = []  # each stretch's steps and epoch
    for start, stop, placement, serving, experts in serving_stretches(spec, segments):
        if policy.reroutes:  # it may choose any slot, an empty one too: the engine has none
            refuse_empty_slots(placement, f"policy {name} (it reroutes pairs to any slot)")
        if experts is None and policy.reroutes:  # its pairs may land on another expert's slot
            experts = placement.phy2log
        start, stop = max(start, steps.start), min(stop, steps.stop)
        if start >= stop:
            continue
        views = tuple(rank_view(d.view, placement if serving is None else serving[r.rank],
                                r.rank, d.mode).to(device) for r in ranks)
        contexts = [rank_context(start, r, d.mode, d.seed, d.rank_offset, d.tp) for r in ranks]
        epoch = Epoch(name=name, policy=policy, placement=placement, ranks=ranks, views=views,
                      groups=rank_groups(views, policy, d.rank_offset, contexts, trace.top_k),
                      num_ranks=G, mode=d.mode, seed=d.seed, rank_offset=d.rank_offset, moe=moe,
                      comm=comm, fast=fast, count_links=spec.cost.cost is not None,
                      slot_experts=None if experts is None else experts.to(device),
                      shared=shared, tp=d.tp, spill_slack=d.spill_slack, resident=resident)
        served.append((start, stop, epoch))
        counted = epoch.counts_fast(torch.device(device))  # compiled CPU counts: faster still
        kernel = window_dispatch(epoch) if resident and not counted else None
        if kernel is not None:  # a window of steps a call, the same counts (`ranks.window`)
            sizes = trace.tokens_per_step[start:stop].tolist()
            for a, b in windows(sizes, L * trace.top_k):
                lo, hi = start + a, start + b
                ids = to_device(torch.cat([read(s) for s in range(lo, hi)]), device)
                out = none_window(epoch, kernel, range(lo, hi), ids, sizes[a:b])
                done = slice(lo - steps.start, hi - steps.start)
                slot_load[done] = out.slot_load
                counters.record(done, out, torch.tensor(sizes[a:b]))
                if progress is not None:
                    progress(hi - lo)
            continue
        for s in range(start, stop):
            ids = to_device(read(s), device)  # [T, L, K]
            out = mode_step(epoch, s, ids, trace.step_src_rank(s))
            slot_load[s - steps.start] = out.slot_load
            counters.record(s - steps.start, out, ids.shape[0])
            if progress is not None:
                progress(1)
    counters = counters.to("cpu")
    if resident:
        _redo_inexact(trace, mode_step, served, steps.start, counters, device)
    return slot_load.cpu(), counters


def _redo_inexact(trace: TokenTrace, mode_step: Callable[..., Any],
                  served: Sequence[tuple[int, int, Epoch]], first: int, counters: Counters,
                  device: str | torch.device) -> None:
    """Redo, in place, the toy layer's error of the steps whose squares a resident replay
    could not sum exactly on its device (NaN, `moe.device_square_sums`: never seen with the
    toy layer's outputs), with the host's exact rounding: each such step dispatched again
    (every choice is counter-based: the same) by its stretch's epoch, not resident."""
    redo = torch.isnan(counters.error).any(2).any(1).nonzero().flatten().tolist()
    for i in redo:
        s = first + i
        epoch = next(e for lo, hi, e in served if lo <= s < hi)
        ids = getattr(trace, "stored_step", trace.step)(s).to(device)
        out = mode_step(replace(epoch, resident=False), s, ids, trace.step_src_rank(s))
        counters.error[i] = out.error.cpu()


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: itself on the CPU; on CUDA through pinned memory with a
    copy that does not wait (`non_blocking`: queued on the current stream, ahead of the kernels
    that read it), so the host reads the next step on while it lands."""
    kind = torch.device(device).type
    if kind == "cpu":
        return t
    if kind == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def fill_norms(trace: TokenTrace, spec: RunSpec, counters: Counters,
               device: str | None = None) -> None:
    """Compute, in place, the exact norms the fast path left `UNMEASURED` in the whole run's
    `counters` when some step's error is not 0 (else nothing reads them: every relative error
    is 0), with the toy MoE layer on `device` (default the spec's)."""
    unmeasured = torch.isinf(counters.error[:, :, 1]).any(1)  # [S]
    if not (unmeasured.any() and (counters.error[:, :, 0] > 0).any()):
        return
    d = spec.dispatch
    moe = make_toy_moe(trace.num_layers, trace.num_experts, d.hidden, d.seed,
                       device or resolve_device(d.device), trace)
    for s in unmeasured.nonzero().flatten().tolist():
        counters.error[s, :, 1] = square_sums(step_sums(moe, s, trace.step(s))[0])


@dataclass(frozen=True)
class Plan:
    """What a run is planned on before any step is dispatched.

    true_load: int32 `[S, L, E]` routed pairs per logical expert (`routed_loads`)
    segments:  the run's stretches of steps, each on one placement (`schedule.plan`)
    """

    true_load: torch.Tensor
    segments: tuple[Segment, ...]


def plan_run(trace: RunTrace, spec: RunSpec) -> Plan:
    """The `Plan` of `trace` under `spec` (decided for the trace, `spec_for_trace`): its loads
    counted and its schedule solved. Runs whose topology, solver and schedule are the same
    share one plan (`compare`, `review`)."""
    true_load = routed_loads(trace)
    return Plan(true_load, schedule_of(trace, spec, true_load))


def replay_planned(trace: RunTrace, spec: RunSpec, plan: Plan, progress: Progress | None = None,
                   steps: Callable[..., tuple[torch.Tensor, Counters]] = run_steps) -> Results:
    """`replay` on a `plan` already made for `trace` by a spec whose topology, solver and
    schedule are `spec`'s: every step dispatched by `steps(trace, spec, segments, progress=)`
    (`run_steps`; `workers.Workers.run_steps` splits them over processes), then `Results`."""
    spec = spec_for_trace(trace, spec)
    check_memory_of(trace, spec)
    if isinstance(trace, CountsTrace):
        return results_of(trace, spec, None, plan.true_load, plan.segments, None)
    slot_load, counters = steps(trace, spec, plan.segments, progress=progress)
    return results_of(trace, spec, slot_load, plan.true_load, plan.segments, counters)


def results_of(trace: RunTrace, spec: RunSpec, slot_load: torch.Tensor | None,
               true_load: torch.Tensor, segments: Sequence[Segment],
               counters: Counters | None) -> Results:
    """The `Results` of a replay of `trace` (in process or on real ranks, `replay.distributed`):
    its executed and routed loads and counters, with what the trace itself says of the run:
    the tokens each rank dispatches a step (a token trace's, when the run names a dispatch
    buffer, the one figure that reads them) and its hash-routed layers."""
    buffered = spec.cost.dispatch_buffer_gib is not None or spec.cost.dispatch_cap is not None
    tokens = rank_tokens(trace, spec.topology.gpus) if buffered and \
        not isinstance(trace, CountsTrace) else None  # only a dispatch buffer reads them
    return Results(spec, slot_load, true_load, segments, counters, rank_tokens=tokens,
                   hash_layers=hash_layers_of(trace, spec))


def replay(trace: RunTrace | Drafted, spec: RunSpec | None = None,
           progress: Progress | None = None) -> Results | DraftedResults:
    """Replay a routing trace under one run's settings: plan, dispatch every step, results.

    trace:    a `Trace` (`topk_ids [N, L, K]`, `step_offsets [S + 1]`), `DirTrace` or
              `CountsTrace` (`[S, L, E]`: nothing is dispatched, the results hold the
              placement's promise only); a `traces.draft.Drafted`, or a trace with draft
              (MTP) layers (`Trace.draft`), gives a `drafted.DraftedResults`: the target's
              results (warned of as any run's) and the draft's, on its own placement
              (`drafted.draft_settings`)
    spec:     the run's settings (default `RunSpec()`): the trace's steps shaped by its steps
              part first (`shaped`: once, whether given here or where the trace was made),
              then decided for the trace (`spec_for_trace`: its redundant slots and model)
    progress: told of each step dispatched (a bar's `update`), or None
    Returns the run's `Results`: `slot_load [S, L, P]`, `true_load [S, L, E]`, the segments
    and the rank counters, with the metrics computed on first use. The same inputs give the
    same numbers. What `eplbsim run` warns of in its header (`results.run_warnings`: a model
    priced that is not the trace's, warm-up steps) is a `RunWarning` at the caller's line and
    on the results (`Results.warnings`).
    """
    trace, asked = shaped(trace, RunSpec() if spec is None else spec)
    drafted = drafted_of(trace)
    target = trace if drafted is None else drafted.target
    result = replay_quiet(target, asked, progress)
    result = replace(result, warnings=warned(target, result.spec, asked))
    if drafted is None:
        return result
    return DraftedResults(result, replay_quiet(
        drafted.draft, draft_settings(asked, result.spec, drafted), progress))


def replay_quiet(trace: RunTrace, spec: RunSpec, progress: Progress | None = None) -> Results:
    """`replay` that warns of nothing: for a caller that says the warnings its own way, or
    replays parts of a run that the warnings would misname (a sweep's cells, a review's
    windows, each rank of a distributed run, a timed replay)."""
    trace, spec, failure = failed(trace, spec)
    check_memory_of(trace, spec)
    result = replay_planned(trace, spec, plan_run(trace, spec), progress)
    return result if failure is None else replace(result, failure=failure)


def failed(trace: RunTrace, spec: RunSpec) -> tuple[RunTrace, RunSpec, Failure | None]:
    """`(trace, spec, None)` decided for the trace (`spec_for_trace`) when no rank dies; with
    `fail_ranks`, the survivors' trace and spec and what the failure did (`dead_ranks`)."""
    spec = spec_for_trace(trace, spec)
    if spec.topology.fail_ranks is None:
        return trace, spec, None
    true_load = routed_loads(trace)
    return survive(trace, spec, true_load, schedule_of(trace, healthy(spec), true_load))


def warned(trace: RunTrace, spec: RunSpec, asked: RunSpec) -> tuple[str, ...]:
    """What a run of `spec` (decided for `trace` from `asked`) warns of
    (`results.run_warnings`), each also warned of at the caller's line (a `RunWarning`)."""
    said = tuple(run_warnings(trace, spec, asked))
    for message in said:
        warn_caller(message)
    return said


def comparison(spec: RunSpec, policies: Sequence[Any], modes: Sequence[str],
               sources: Sequence[Any] | None = None) -> list[RunSpec]:
    """The specs of every (mode, policy, engine source) of `spec`, modes outermost and each
    policy's sources side by side, leaving out the modes a policy does not run in
    (`DispatchPolicy.modes`; InputError for a policy that runs in none of `modes`). `sources`:
    the engine source sets to run each engine algorithm from (default the spec's own; a
    policy that is no engine's runs once). A policy that places the shared expert has every
    spec count it (`RunSpec.sharing`)."""
    spec = spec.sharing(policies)
    runs = {p: resolve_policy(p)[1].modes for p in policies}
    for p, can in runs.items():
        if not set(modes) & set(can):
            spec.replace(policy=p, mode=modes[0])  # the part's message says why
    sets = list(sources or [spec.dispatch.engine_source])
    return [spec.replace(policy=p, mode=m, engine_source=src) for m in modes for p in policies
            if m in runs[p] for src in _distinct_sources(sets, p, spec.solver.solver)]


def _distinct_sources(sets: Sequence[Any], policy: Any, solver: Any) -> list[Any]:
    """The engine source sets among `sets` that differ in what the run of `policy` with `solver`
    reads: the sources of their engines (`sglang:dynamic` reads SGLang's, `vllm:hash` vLLM's),
    the first set of each kind; a run of no engine's code reads none (one set)."""
    engines = {name.split(":")[0] for name in (policy, solver) if is_engine_name(name)}
    seen, out = set(), []
    for src in sets:
        read = tuple(sorted((k, str(v)) for k, v in dict(src).items() if k in engines))
        if read not in seen:
            seen.add(read)
            out.append(src)
    return out


def compare(trace: RunTrace, policies: Sequence[Any], modes: Sequence[str],
            spec: RunSpec | None = None,
            progress: Callable[[RunSpec], Any] | None = None,
            run: Callable[..., Results] = replay_planned,
            sources: Sequence[Any] | None = None) -> Comparison:
    """Replay one trace under several dispatch policies and modes, planned once.

    trace:    as `replay`'s
    policies: names, files (`path.py:function`) or callables, each a row per mode it runs in
    modes:    "none" and/or "a2a"
    spec:     every other setting (default `RunSpec()`); the trace's steps shaped by it first,
              as `replay`'s; `comparison` makes each row's spec
    progress: `progress(spec)` makes a bar for one replay (a context manager with `update`,
              as `progress.bar` does), or None
    run:      replays one spec on a plan, called as `replay_planned` is
              (`workers.Workers.replay_planned` splits it over processes)
    sources:  engine source sets to run each engine algorithm from (`comparison`)
    Returns a `Comparison`, a list of `Results` that prints as the run command's tables. The
    loads are counted once and the schedule solved once for all rows (once for each engine
    source when the solver is an engine's): only the dispatch differs. What the run warns of
    reaches the caller as `replay`'s does, and is on the comparison and each row.
    """
    out = []
    trace, asked = shaped(trace, RunSpec() if spec is None else spec)
    trace, decided, failure = failed(trace, asked)
    specs = comparison(decided, policies, modes, sources)
    true_load = routed_loads(trace)
    plans: dict[str, Plan] = {}
    for one in specs:
        key = repr(sorted(one.dispatch.engine_source.items())) \
            if is_engine_name(one.solver.solver) else ""
        if key not in plans:
            plans[key] = Plan(true_load, schedule_of(trace, one, true_load))
        if progress is None:
            out.append(run(trace, one, plans[key]))
            continue
        with progress(one) as bar:
            out.append(run(trace, one, plans[key], bar.update))
    said = warned(trace, out[0].spec, asked) if out else ()
    return Comparison([replace(r, warnings=said, failure=failure) for r in out], said)
