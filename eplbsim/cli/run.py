"""`eplbsim run`: compare dispatch policies (and modes) on a trace or a scenario."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import runspec
from ..base.errors import InputError
from ..base.progress import bar, run_label
from ..cost.buffers import GIB, cap_table
from ..replay import compare, comparison, replay, replay_planned, spec_for_trace
from ..replay.drafted import draft_settings, draft_words, part_rows, run_fault
from ..replay.executors import EXECUTORS
from ..replay.stage_placements import stage_placements, stage_table
from ..replay.results import (describe, format_table, rebalance_report, series_rows, table_notes,
                              time_report, to_json, with_speedup, write_csv, write_results)
from ..replay.workers import PAYS_OFF, Workers, dispatch_work, pays_off
from ..traces.counts import CountsTrace
from ..traces.draft import drafted_of
from .common import check_out_dir, positive

HELP = "compare dispatch policies on a trace or scenario"


def add_arguments(p: argparse.ArgumentParser) -> None:
    runspec.add_flags(p, "run")
    p.add_argument("--per-layer", action="store_true",
                   help="with --out, the time series per step and layer")
    p.add_argument("--baseline", metavar="POLICY", help="with --cost, each row's speedup: the "
                   "baseline policy's moe_ms in the same mode over the row's")
    p.add_argument("--workers", type=positive, default=1, metavar="N",
                   help="split the trace's steps over N worker processes, each replaying a "
                   "contiguous range for every rank (the same numbers bit for bit; default 1: "
                   "this process)")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="with --workers: local processes (default) or Ray tasks (the ray extra)")
    p.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                   help="with --executor ray: the Ray cluster (default: start a local instance "
                   "of N CPUs)")
    p.add_argument("--stage-placements", action="store_true",
                   help="instead of the table: a placement solved from the prefill steps, one "
                   "from the decode steps and one from all, each judged on the prefill and on "
                   "the decode steps (a step's stage as its log marks it, else by "
                   "--decode-tokens), for each policy and mode")
    p.add_argument("--draft-fault", action="store_true",
                   help="with a trace holding draft (MTP) layers: also simulate SGLang "
                   "#16044's fault, the draft's statistics recorded into the target's layers "
                   "and its pairs dispatched through the target's map, and print its damage "
                   "(wrong pairs, misrecorded loads, the target's balance solved from clean and "
                   "from misrecorded loads)")
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.add_argument("--out", type=Path, help="write results.json, results.csv, timeseries.csv, "
                   "migrations.csv and the figures policies.png and timeseries.png (with PDFs)")


OUTPUTS = ("results.json", "results.csv", "timeseries.csv", "migrations.csv", "policies.pdf",
           "policies.png", "timeseries.pdf", "timeseries.png")


def handle(args: argparse.Namespace) -> int:
    values, lists = runspec.from_args(args, "run")
    source, base = runspec.build(values)
    if args.out:
        check_out_dir(args.out, [*source.files, base.solver.placement, base.schedule.initial],
                      OUTPUTS)
    trace = source.open(base.dispatch.seed, base.schedule)
    drafted = drafted_of(trace)
    if args.draft_fault and drafted is None:
        raise InputError("--draft-fault simulates a draft's (MTP) fault: the trace holds no "
                         "draft layers (an .npz trace's draft part, traces.draft)")
    if args.stage_placements:
        return _stage_placements(args, trace, base, lists)
    if isinstance(trace, CountsTrace):
        return _counts_only(args, trace, base)
    policies = lists["policy"]
    specs = comparison(base, policies, lists["mode"], lists.get("engine_source"))
    split = base.topology.fail_ranks is None and (  # the survivors' steps: one process
        args.executor != "local" or args.address is not None or pays_off(trace, specs,
                                                                          args.workers))
    with _runner(args, trace, split) as run:
        results = compare(trace, policies, lists["mode"], base,
                          lambda one: bar(trace.num_steps, run_label(one)), run,
                          lists.get("engine_source"))
    rows = [r.row() for r in results]
    if args.baseline is not None:
        if base.cost.cost is None:
            raise InputError("--baseline compares time: it needs --cost")
        rows = with_speedup(rows, args.baseline)
    drafts = fault = None
    every = rows
    if drafted is not None:  # the draft on its own placement: rows of its own
        drafts = compare(drafted.draft, policies, lists["mode"],
                         draft_settings(base, results[0].spec, drafted),
                         lambda one: bar(trace.num_steps, "draft " + run_label(one)),
                         sources=lists.get("engine_source"))
        fault = run_fault(drafted, results[0].spec) if args.draft_fault else None
        every = part_rows(rows, drafts, fault)
    if args.json:
        print(to_json(every))
    else:
        print(describe(trace, results[0].spec, base, policies,
                       len(lists.get("engine_source", [None]))))
        if results[0].failure is not None:
            print(results[0].failure.words())
        for line in results.warnings:
            print(f"warning: {line}")
        if args.workers > 1 and not split:
            work = dispatch_work(trace, specs)
            print(f"--workers {args.workers}: one process ran it ({work:.2g} pair dispatches; "
                  f"local workers pay off from about {PAYS_OFF:.2g} here)")
        print(format_table(rows))
        for note in table_notes(rows):
            print(note)
        if base.cost.dispatch_buffer_gib is not None:
            print()
            print(buffer_report(results[0].spec, trace.num_experts))
        if base.cost.cost is not None:
            print()
            print(time_report(results[0].spec, rows, trace.num_layers))
        if base.schedule.rebalance_every is not None:
            print()
            print(rebalance_report(results[0], rows))
        if drafted is not None:
            print()
            print(draft_words(drafted, drafts, fault, policies, base, results[0].spec))
    if args.out:
        from ..plots import paper_style, policy_comparison, save_figure, time_series_figure
        paths = write_results(every, args.out)
        paths.append(write_csv([row for r in results for row in series_rows(
            {"policy": r.policy, "mode": r.spec.dispatch.mode},
            r.time_series(args.per_layer))], args.out / "timeseries.csv"))
        paths.append(write_csv(results[0].migrations(), args.out / "migrations.csv"))
        with paper_style():  # the figures as the paper's: fonts, spines, editable PDF text
            paths += save_figure(policy_comparison(results), args.out / "policies.pdf")
            paths += save_figure(time_series_figure(results), args.out / "timeseries.pdf")
        if not args.json:
            print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def buffer_report(spec: runspec.RunSpec, num_experts: int, levels: int = 5) -> str:
    """What each redundancy costs in dispatch capacity under the run's `dispatch_buffer_gib`
    (`cost.buffers.cap_table`, the model's hidden size, the run's ranks): the least redundancy
    whose slots divide over the ranks and `levels - 1` more, a rank's slots apart, and the
    run's own (marked)."""
    G, own = spec.topology.gpus, spec.topology.redundant
    first = -num_experts % G
    redundants = sorted({first + k * G for k in range(levels)} | {own})
    hidden = spec.cost.shape.hidden
    rows = cap_table(round(spec.cost.dispatch_buffer_gib * GIB), hidden, num_experts, G,
                     redundants)
    lines = [f"dispatch cap of a {spec.cost.dispatch_buffer_gib:g} GiB low-latency buffer "
             f"(DeepEP's; {spec.cost.name}, hidden {hidden}, {G} ranks): the most tokens a "
             f"rank may dispatch a step, by redundant experts",
             f"{'redundant':>9}  {'physical':>8}  {'cap':>7}  {'buffer_gib':>10}"]
    lines += [f"{r['redundant']:>9}  {r['physical']:>8}  {r['cap']:>7,}  "
              f"{r['bytes'] / GIB:>10.2f}" + ("  (this run)" if r["redundant"] == own else "")
              for r in rows]
    return "\n".join(lines)


def _stage_placements(args: argparse.Namespace, trace: Any, base: runspec.RunSpec,
                      lists: dict[str, list[Any]]) -> int:
    """`run --stage-placements`: the stage placements of each (policy, mode)
    (`replay.stage_placements`); of the even-split promise alone on counts only."""
    if args.out or args.baseline is not None:
        raise InputError("--stage-placements prints its own table: it takes no --out or "
                         "--baseline")
    counts_only = isinstance(trace, CountsTrace)
    if counts_only and args.policy is not None:
        raise InputError(f"{args.trace} holds expert counts, not token rows: no dispatch "
                         f"policy can run on it (leave --policies out)")
    specs = [base] if counts_only else comparison(base, lists["policy"], lists["mode"],
                                                  lists.get("engine_source"))
    found = [stage_placements(trace, spec) for spec in specs]
    rows = [row for one in found for row in one.rows()]
    if args.json:
        print(to_json(rows))
        return 0
    print(describe(trace, spec_for_trace(trace, specs[0]), base, lists.get("policy", ())))
    print(stage_table(rows, found[0].stages, found[0].warnings))
    return 0


@contextmanager
def _runner(args: argparse.Namespace, trace: Any, split: bool) -> Iterator[Callable[..., Any]]:
    """How each row is replayed: in this process, or (`split`) over `--workers`."""
    if not split:
        yield replay_planned
        return
    with Workers(trace, args.workers, args.executor, args.address) as workers:
        yield workers.replay_planned


def _counts_only(args: argparse.Namespace, counts: CountsTrace, base: runspec.RunSpec) -> int:
    """`run` on counts only: the placement's even-split promise; no policy can run."""
    if args.policy is not None:
        raise InputError(f"{args.trace} holds expert counts, not token rows: dispatch policies "
                         f"choose a replica per (token, slot), so none can run on it; without "
                         f"--policies, run reports the placement's even-split promise")
    result = replay(counts, base)
    rows = [result.row()]
    if args.json:
        print(to_json(rows))
        return 0
    print(describe(counts, result.spec, base) + ": the placement's even-split promise (no "
          "token rows, so no dispatch)")
    for line in result.warnings:
        print(f"warning: {line}")
    print(format_table(rows))
    if args.out:
        print("wrote " + ", ".join(str(p) for p in write_results(rows, args.out)))
    return 0
