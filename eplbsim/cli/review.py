"""`eplbsim review`: one verdict, one page, before a dispatch or placement change goes upstream
(`eplbsim.review`). Its exit status is its verdict's (`EPILOG`): a CI job can gate on it."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import runspec
from ..base.errors import InputError
from ..dispatch import is_file_policy, resolve_policy
from ..engines.identity import EngineError
from ..placement import VIEWS
from ..review import WINDOWS, review, to_json
from ..review.evidence import RESAMPLES
from ..review.page import html, markdown
from ..review.verdict import EXIT, MIN_EFFECT, exit_statuses
from .common import check_out_dir

HELP = ("judge a dispatch or placement change before upstreaming it: correctness, held-out "
        "balance, traffic and time against a baseline, one verdict")
OUTPUTS = ("report.md", "report.html", "report.json")
EPILOG = f"exit status: {exit_statuses()}."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("candidate", metavar="CANDIDATE", help="the policy under review: a "
                   "registered policy, an engine algorithm (sglang:dynamic, with "
                   "--engine-source for a branch) or a function in a file, path/to/file.py:"
                   "function")
    p.add_argument("--baseline", metavar="POLICY", help="what it is judged against, any form "
                   "CANDIDATE takes (default: SGLang's dispatch for the mode, row in none, "
                   "random in a2a; with --baseline-solver, CANDIDATE itself)")
    p.add_argument("--baseline-solver", metavar="SOLVER", help="review a placement change "
                   "instead: --solver's placements (the candidate's) against this solver's, "
                   "any form --solver takes (a registered solver, an engine's such as "
                   "sglang:deepseek, or path/to/file.py:function)")
    p.add_argument("--holdout", type=float, default=0.5, metavar="FRACTION",
                   help="the share of the trace's steps scored; the placement is solved on the "
                   "steps before them (default 0.5)")
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds each scored step "
                   "is replayed with; a policy that draws at random carries their spread into "
                   "the intervals (default 3)")
    p.add_argument("--windows", type=int, default=WINDOWS, metavar="N", help="held-out windows "
                   "the scored steps are cut into, each placed on every step before it and "
                   f"scored alone (a rolling origin; default {WINDOWS})")
    p.add_argument("--min-effect", type=float, default=MIN_EFFECT, metavar="PCT",
                   help="the smallest gain worth a pull request, in %% of the baseline's step "
                   f"time (default {MIN_EFFECT:g})")
    p.add_argument("--resamples", type=int, default=RESAMPLES, metavar="N", help="resamples of "
                   "the block bootstrap that gives the differences' 95%% intervals (default "
                   f"{RESAMPLES})")
    p.add_argument("--baseline-engine-source", action="append", default=[],
                   metavar="ENGINE==VERSION|ENGINE=PATH", help="run the baseline's engine code "
                   "from this release or folder (default: --engine-source's): a branch against "
                   "main is --engine-source sglang=BRANCH --baseline-engine-source sglang=MAIN")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", type=Path, help="write report.md, report.html (self-contained, its "
                   "figures embedded) and report.json")
    runspec.add_flags(p, "review", helps={
        "mode": "none (every rank dispatches every token) or a2a (each token once, by its "
                "owner); a review runs in one (default none)",
        "cost": "cost model turning loads into time: roofline or measured (aiconfigurator-core's "
                "measured kernels: pip install 'eplbsim[cost]'); a review always prices time "
                "(default roofline, where run's default is off); with roofline it also prices "
                "with measured where its tables have the model",
        "view": f"what each rank knows of the placement, one of {', '.join(VIEWS)}: every "
                "side that is not an engine's dispatches from it (default: the view equal to an "
                "engine side's own lists, the candidate's first, so both sides choose from the "
                "same lists; else full)"})


def handle(args: argparse.Namespace) -> int:
    if args.mode is None:  # one mode, not the listed default of run
        args.mode = "none"
    values, lists = runspec.from_args(args, "review")
    if len(lists.get("engine_source", [])) > 1:
        raise InputError("--engine-source: a review runs the candidate from one source (the "
                         "baseline's is --baseline-engine-source)")
    if len(lists.get("mode", [])) > 1:
        raise InputError("--mode: a review runs in one mode, none or a2a")
    source, base = runspec.build(values)
    sources = base.dispatch.engine_source
    named = next(knob for _, name, knob in runspec.knobs(("dispatch",)) if name == "policy")
    for flag, policy in (("CANDIDATE", args.candidate), ("--baseline", args.baseline)):
        if policy is not None:  # an unknown name is refused before any work, as run's are
            runspec.checked("policy", named, policy, flag)
            resolve_policy(policy, sources)
    if args.baseline_solver is not None:
        solver = next(knob for _, name, knob in runspec.knobs(("solver",)) if name == "solver")
        runspec.checked("solver", solver, args.baseline_solver, "--baseline-solver")
        base.replace(solver=args.baseline_solver, solver_options={}, affinity_slack=None,
                     lplb_topology=None)  # its own settings refused here, before any work
    if args.out:
        files = [p.rpartition(":")[0] for p in (args.candidate, args.baseline,
                                                base.solver.solver, args.baseline_solver)
                 if is_file_policy(p)]
        check_out_dir(args.out, [*source.files, base.solver.placement, base.schedule.initial,
                                 *files], OUTPUTS)
    trace = source.open(base.dispatch.seed, base.schedule)
    try:
        report = review(trace, args.candidate, args.baseline, base, holdout=args.holdout,
                        seeds=args.seeds, windows=args.windows, min_effect=args.min_effect,
                        resamples=args.resamples, baseline_sources=_baseline_sources(args),
                        baseline_solver=args.baseline_solver, view_asked="view" in values)
    except EngineError as exc:
        if not _candidates(exc, args.candidate, sources):
            raise
        return _crashed(args, exc)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(markdown(report))
        (args.out / "report.html").write_text(html(report))
        (args.out / "report.json").write_text(to_json(report) + "\n")
    print(to_json(report) if args.json else markdown(report))
    if args.out and not args.json:
        print("wrote " + ", ".join(str(args.out / name) for name in OUTPUTS))
    return report.exit_status


def _candidates(error: EngineError, candidate: str, sources: dict) -> bool:
    """Whether `error` was raised by the candidate's engine code (its source's label)."""
    from ..engines import is_engine_name, label
    return is_engine_name(candidate) and error.label == label(candidate.partition(":")[0],
                                                              tuple(sorted(sources.items())))


def _crashed(args: argparse.Namespace, error: EngineError) -> int:
    """The verdict on a candidate whose own code raised: not recommended, with the engine's
    message (file, line and rank), as the page or its JSON. Returns the verdict's status."""
    verdict = "not recommended"
    reason = f"the candidate's own code raised: {error}"
    if args.json:
        print(to_json({"verdict": verdict, "reasons": [reason], "candidate": args.candidate,
                       "baseline": args.baseline}))
    else:
        print(f"# Review: {args.candidate}\n\n## Verdict: {verdict}\n\n{reason}")
    return EXIT[verdict]


def _baseline_sources(args: argparse.Namespace) -> dict | None:
    """`--baseline-engine-source` as one source set, or None (the candidate's)."""
    if not args.baseline_engine_source:
        return None
    sets = runspec.EngineSources("engine_source").sets(args.baseline_engine_source)
    if len(sets) > 1:
        raise InputError("--baseline-engine-source: one source an engine (a review compares "
                         "two runs)")
    return sets[0]
