"""`eplbsim engines`: fetch the engines' own EPLB code, list what is supported and fetched, and
check every eplbsim twin against the engine function it models (`engines.conform`)."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from typing import Any

from .. import runspec
from ..base.errors import InputError
from ..replay.results import to_json
from .common import positive

HELP = "the engines' own EPLB code: fetch it, list it, check eplbsim's twins against it"
SUBCOMMANDS = {
    "fetch": "download engine releases' wheels (no dependencies) and unpack their EPLB files "
             "into the user cache; a no-op for those there",
    "list": "the supported engines, their pinned and tested releases, what is fetched, the "
            "functions each adapter exposes; with --engine-source, what a source can run",
    "conform": "the conformance table: each eplbsim twin against the engine function it "
               "models; exit status 0 only when every row conforms",
    "bisect": "the first release of an engine between GOOD and BAD whose own code changes a "
              "run's metric, by binary search over the package index's releases",
}


def _wanted(specs: list[str]) -> list[tuple[str, str | None]]:
    """`ENGINE[==VERSION]` arguments as `(engine, version or None)` pairs."""
    from ..engines import ENGINES
    out = []
    for text in specs:
        engine, sep, version = text.partition("==")
        if engine not in ENGINES:
            raise InputError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        if sep and not version:
            raise InputError(f"{text!r}: give a release after ==, e.g. {engine}=="
                             f"{ENGINES[engine].pinned}")
        out.append((engine, version if sep else None))
    return out


def fetch(args: argparse.Namespace) -> int:
    from ..engines import ENGINES, fetch_engine
    wanted = _wanted(args.engines) or [(e, v) for e, spec in ENGINES.items()
                                       for v in spec.tested]
    for engine, version in wanted:
        folder = fetch_engine(engine, version)
        print(f"{engine} {version or ENGINES[engine].pinned}: {folder}")
    return 0


PROBE_LAYOUT = (16, 24, 4, 2, 2, 4)  # what `engines list` observes on: E experts, P slots,
# G GPUs in N nodes, L layers, top-k K


def _observed(engine: str, policies: list[str], sources: Any = ()) -> dict[str, str]:
    """How each of `policies` (an engine's own) serves the ranks in "none" from `sources`
    (default its pinned release): `checks.observed_sharing`, on `PROBE_LAYOUT` (every expert
    once, the first `P - E` again): whether it draws or reads its rank, and through which
    channel. The release not fetched, the policy a shared rule or a2a-only, or one that cannot
    run (`sglang:auto` without flags, a branch's own error), said so."""
    from ..ranks.checks import observed_sharing, probe_placement
    from ..dispatch import resolve_policy
    from ..engines import release
    from ..placement.topology import Topology
    if not sources and release(engine) is None:
        return {name: "pinned release not fetched" for name in policies}
    E, P, G, N, L, K = PROBE_LAYOUT
    placement = probe_placement(E, P, Topology(G, G // N), L)
    out = {}
    for name in policies:
        entry = resolve_policy(name, sources)[1]
        if entry.observed is None or "none" not in entry.modes:
            out[name] = "a shared rule over every rank's tokens (a2a only): not probed"
        else:
            try:
                out[name] = observed_sharing(name, placement, "full", "independent", 0, K,
                                             sources)
            except InputError as exc:  # sglang:auto without flags picks nothing
                out[name] = f"not probed: {exc}"
    return out


def listing(args: argparse.Namespace) -> int:
    if args.engine_source:
        return _source_listing(args)
    from ..engines import ENGINE_POLICIES, ENGINE_SOLVERS, ENGINES, fetched
    rows = [{"engine": engine, "pinned": spec.pinned, "tested": list(spec.tested),
             "fetched": fetched(engine), "exposes": dict(spec.exposes),
             "policies": [n for n, e in ENGINE_POLICIES.items() if e[0] == engine],
             "solvers": [n for n, e in ENGINE_SOLVERS.items() if e[0] == engine]}
            for engine, spec in ENGINES.items()]
    for r in rows:
        r["observed"] = _observed(r["engine"], r["policies"])
    if args.json:
        print(to_json(rows))
        return 0
    for r in rows:
        have = ", ".join(r["fetched"]) or "none (eplbsim engines fetch)"
        print(f"{r['engine']}: pinned {r['pinned']}, tested {', '.join(r['tested'])}; "
              f"fetched: {have}")
        print(f"  policies: {', '.join(r['policies'])}")
        print(f"  solvers:  {', '.join(r['solvers'])}")
        for fn, what in r["exposes"].items():
            print(f"  {fn}: {what}")
        _print_observed(r["observed"])
    return 0


def _source_listing(args: argparse.Namespace) -> int:
    """`engines list --engine-source S`: which algorithms S has, and what each lacking one
    misses."""
    from ..engines import ENGINE_POLICIES, as_sources, availability, label
    rows = []
    for text in args.engine_source:
        for one in text.split(","):
            engine, given = _source(one)
            sources = as_sources({engine: given})
            have = availability(engine, sources)
            runs = [n for n, e in ENGINE_POLICIES.items() if e[0] == engine and have[n] is None]
            rows.append({"engine": engine, "source": label(engine, sources), "algorithms": have,
                         "observed": _observed(engine, runs, sources)})
    if args.json:
        print(to_json(rows))
        return 0
    for r in rows:
        print(f"{r['source']}:")
        width = max(map(len, r["algorithms"]))
        for name, why in r["algorithms"].items():
            print(f"  {name:{width}s}  {'yes' if why is None else 'no: ' + why}")
        _print_observed(r["observed"])
    return 0


def _print_observed(observed: dict[str, str]) -> None:
    """The `_observed` lines of one source, under their heading."""
    E, P, G, N, L, K = PROBE_LAYOUT
    print(f"  observed in \"none\" (E={E} P={P} on {G} GPUs in {N} nodes):")
    width = max(map(len, observed), default=0)
    for name, how in observed.items():
        print(f"    {name:{width}s}  {how}")


def conform(args: argparse.Namespace) -> int:
    from ..engines import ENGINES, as_sources, release
    from ..engines.conform import conformance
    sources = as_sources(dict(_source(s) for s in args.engine_source))
    chosen = [e for e, _ in _wanted(args.engine or [])]
    missing = []
    if not args.engine:  # every engine: those with no code here are said, not an error
        missing = [e for e in ENGINES if e not in dict(sources) and release(e) is None]
        chosen = [e for e in ENGINES if e not in missing]
        if not chosen:
            raise InputError("no engine is fetched: run `eplbsim engines fetch`")
    rows = conformance(chosen, sources, args.seed)
    for engine in missing:
        print(f"{engine} {ENGINES[engine].pinned} is not fetched (eplbsim engines fetch): not "
              f"conformed", file=sys.stderr)
    if args.json:
        print(to_json([r.as_dict() for r in rows]))
    else:
        keys = ("engine", "function", "twin", "path", "equal")
        cells = [[r.engine, r.function, r.twin, r.path,
                  "-" if r.absent else f"{r.equal}/{r.cases}",
                  "absent" if r.absent else "yes" if r.conforms else "NO", r.note]
                 for r in rows]
        head = [*keys, "conforms", "note"]
        widths = [max(len(str(c[i])) for c in [head, *cells]) for i in range(len(head) - 1)]
        for line in [head, *cells]:
            print(("  ".join(f"{c:{w}s}" for c, w in zip(line, widths)) + "  "
                   + line[-1]).rstrip())
        bad = sum(not r.conforms for r in rows)
        print(f"{len(rows) - bad} of {len(rows)} rows conform")
    return 0 if all(r.conforms for r in rows) else 1


def bisect(args: argparse.Namespace) -> int:
    """`engines bisect`: the first release whose metric differs from GOOD's
    (`eplbsim.engines.bisect`)."""
    from ..engines.bisect import bisect as search, releases
    from ..engines import ENGINES, is_engine_name, version_key
    from ..metrics import METRICS
    from ..replay import replay
    from ..replay.workers import Workers, pays_off
    engine = args.engine
    if engine not in ENGINES:
        raise InputError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    good, sep, bad = args.range.partition("..")
    if not sep or not good or not bad:
        raise InputError(f"GOOD..BAD: give two releases, e.g. 0.5.14..0.5.23, got {args.range!r}")
    metric = METRICS.get(args.metric)
    if metric is None or metric.subkeys is not None:
        raise InputError(f"--metric {args.metric!r}: give one number of a row's metrics, e.g. "
                         f"rank_agreement or output_rel_error")
    if args.policy is None:
        raise InputError("--policies: name the one policy the bisect replays")
    values, lists = runspec.from_args(args, "run")
    if len(lists["policy"]) > 1 or len(lists["mode"]) > 1:
        raise InputError("a bisect replays one policy in one mode (--policies P --mode M)")
    source, base = runspec.build(values)
    if engine in base.dispatch.engine_source:
        raise InputError(f"--engine-source: the bisect runs {engine} from each release itself")
    if not any(is_engine_name(n) and n.startswith(engine + ":")
               for n in (base.dispatch.policy, base.solver.solver)) \
            and base.schedule.migration != engine:
        raise InputError(f"neither the policy, the solver nor the migration is {engine}'s: "
                         f"nothing would run {engine}'s code (e.g. --policies {engine}:"
                         f"{'dynamic' if engine == 'sglang' else 'hash'}, or --migration "
                         f"{engine})")
    trace = source.open(base.dispatch.seed, base.schedule)
    versions = releases(engine, good, bad)
    with ExitStack() as stack:
        pool = (stack.enter_context(Workers(trace, args.workers)) if args.workers > 1
                else None)

        def measure(version: str) -> float:
            run = base.replace(engine_source={**base.dispatch.engine_source,
                                              engine: "=" + version})
            split = pool is not None and pays_off(trace, [run], args.workers)
            value = (pool.replay if split else replay)(trace, run).metrics[args.metric]
            if value is None:
                raise InputError(f"{args.metric} is undefined for this run")
            return value

        first, tried = search(versions, measure, args.tolerance)
    tried.sort(key=lambda t: version_key(t.release))
    if args.json:
        print(to_json({"engine": engine, "range": [good, bad], "releases": versions,
                       "metric": args.metric, "tolerance": args.tolerance,
                       "first_changed": first, "tried": [t.as_dict() for t in tried]}))
        return 0
    print(f"{engine} {good}..{bad}: {len(versions)} releases; {values['policy']} in "
          f"{base.dispatch.mode} mode, {args.metric} (tolerance {args.tolerance:g}):")
    width = max(len(args.metric), 5)
    print(f"{'release':12s}  {args.metric:>{width}s}  {'status':8s}  seconds")
    for t in tried:
        value = "-" if t.value is None else f"{t.value:.4f}"
        print(f"{t.release:12s}  {value:>{width}s}  {t.status:8s}  {t.seconds:7.1f}"
              + (f"  {t.why}" if t.why else ""))
    by = {t.release: t.value for t in tried}
    if first is None:
        print(f"{args.metric} does not change between the releases that ran")
    else:
        print(f"first release at which {args.metric} changes: {first} ({by[good]:.4f} in "
              f"{good}, {by[first]:.4f} in {first})")
    return 0


def _source(text: str) -> tuple[str, Any]:
    """`ENGINE=PATH` or `ENGINE==VERSION` as `(engine, PATH or "=VERSION")`."""
    engine, sep, path = text.partition("=")
    if not sep or not engine or path in ("", "="):
        raise InputError(f"--engine-source takes ENGINE=PATH or ENGINE==VERSION, got {text!r}")
    return engine, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="engines_command", required=True)

    def command(name: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=SUBCOMMANDS[name], description=SUBCOMMANDS[name])

    cmd = command("fetch")
    cmd.add_argument("engines", nargs="*", metavar="ENGINE[==VERSION]",
                     help="the releases to fetch, any of the package index's, e.g. "
                     "sglang==0.5.16 (ENGINE alone: its pinned release; default: every "
                     "engine's tested releases)")
    cmd.set_defaults(handler=fetch)
    cmd = command("list")
    cmd.add_argument("--engine-source", action="append", default=[],
                     metavar="ENGINE=PATH|ENGINE==VERSION", help="say which algorithms this "
                     "source has, and for each it lacks, which function is missing (repeat, or "
                     "comma-separate, for several)")
    cmd.add_argument("--json", action="store_true", help="print a JSON array")
    cmd.set_defaults(handler=listing)
    cmd = command("bisect")
    cmd.add_argument("engine", metavar="ENGINE", help="the engine: sglang or vllm")
    cmd.add_argument("range", metavar="GOOD..BAD", help="the releases to search between, both "
                     "included, e.g. 0.5.14..0.5.23")
    cmd.add_argument("--metric", required=True, metavar="KEY", help="the row's metric that "
                     "changed, e.g. rank_agreement (JSON keys: eplbsim run --json)")
    cmd.add_argument("--tolerance", type=float, default=0.0, metavar="X", help="a change is a "
                     "difference above X from GOOD's value (default 0)")
    cmd.add_argument("--json", action="store_true", help="print the table as JSON")
    cmd.add_argument("--workers", type=positive, default=1, metavar="N",
                     help="replay each release over N local worker processes where that pays "
                     "off (as run --workers: the same numbers bit for bit; default 1)")
    runspec.add_flags(cmd, "run")
    cmd.set_defaults(handler=bisect)
    cmd = command("conform")
    cmd.add_argument("--engine", action="append", metavar="ENGINE",
                     help="check this engine only (repeat for several; default: every one)")
    cmd.add_argument("--engine-source", action="append", default=[],
                     metavar="ENGINE=PATH|ENGINE==VERSION", help="check this release, or the "
                     "code in this folder (a checkout's package parent), instead of the pinned "
                     "release")
    cmd.add_argument("--seed", type=int, default=0, help="seeds the random placements and "
                     "batches (default 0)")
    cmd.add_argument("--json", action="store_true", help="print the rows as a JSON array")
    cmd.set_defaults(handler=conform)
