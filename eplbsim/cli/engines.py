"""`eplbsim engines`: fetch the engines' own EPLB code, list what is supported and fetched, and
check every eplbsim twin against the engine function it models (`engines.conform`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import InputError
from ..results import to_json

HELP = "the engines' own EPLB code: fetch it, list it, check eplbsim's twins against it"
SUBCOMMANDS = {
    "fetch": "download the pinned engine wheels (no dependencies) and unpack the EPLB files "
             "into the user cache; a no-op when they are there",
    "list": "the supported engines and versions, what is fetched, the functions each adapter "
            "exposes",
    "conform": "the conformance table: each eplbsim twin against the engine function it "
               "models; exit status 0 only when every row conforms",
}


def _wanted(specs: list[str]) -> dict[str, str | None]:
    """`ENGINE[==VERSION]` arguments as {engine: version or None}; every engine when none."""
    from ..engines import ENGINES
    if not specs:
        return {e: None for e in ENGINES}
    out: dict[str, str | None] = {}
    for text in specs:
        engine, sep, version = text.partition("==")
        if engine not in ENGINES:
            raise InputError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        out[engine] = version if sep else None
    return out


def fetch(args: argparse.Namespace) -> int:
    from ..engines import fetch_engine
    for engine, version in _wanted(args.engines).items():
        print(f"{engine}: {fetch_engine(engine, version)}")
    return 0


def listing(args: argparse.Namespace) -> int:
    from ..engines import ENGINE_POLICIES, ENGINE_SOLVERS, ENGINES
    from ..engines.source import missing_files, pinned_folder
    rows = []
    for engine, spec in ENGINES.items():
        folder = pinned_folder(engine, spec.version)
        rows.append({"engine": engine, "version": spec.version,
                     "fetched": str(folder) if not missing_files(folder, spec.files) else None,
                     "exposes": dict(spec.exposes),
                     "policies": [n for n, e in ENGINE_POLICIES.items() if e[0] == engine],
                     "solvers": [n for n, e in ENGINE_SOLVERS.items() if e[0] == engine]})
    if args.json:
        print(to_json(rows))
        return 0
    for r in rows:
        state = (f"fetched, {r['fetched']}" if r["fetched"]
                 else "not fetched (eplbsim engines fetch)")
        print(f"{r['engine']} {r['version']}: {state}")
        print(f"  policies: {', '.join(r['policies'])}")
        print(f"  solvers:  {', '.join(r['solvers'])}")
        for fn, what in r["exposes"].items():
            print(f"  {fn}: {what}")
    return 0


def conform(args: argparse.Namespace) -> int:
    from ..engines import as_sources
    from ..engines.conform import conformance
    sources = as_sources(dict(_source(s) for s in args.engine_source))
    rows = conformance(list(_wanted(args.engine or [])), sources, args.seed)
    if args.json:
        print(to_json([r.as_dict() for r in rows]))
    else:
        keys = ("engine", "function", "twin", "path", "equal")
        cells = [[r.engine, r.function, r.twin, r.path, f"{r.equal}/{r.cases}",
                  "yes" if r.conforms else "NO", r.note] for r in rows]
        head = [*keys, "conforms", "note"]
        widths = [max(len(str(c[i])) for c in [head, *cells]) for i in range(len(head) - 1)]
        for line in [head, *cells]:
            print(("  ".join(f"{c:{w}s}" for c, w in zip(line, widths)) + "  "
                   + line[-1]).rstrip())
        bad = sum(not r.conforms for r in rows)
        print(f"{len(rows) - bad} of {len(rows)} rows conform")
    return 0 if all(r.conforms for r in rows) else 1


def _source(text: str) -> tuple[str, Any]:
    engine, sep, path = text.partition("=")
    if not sep or not engine or not path:
        raise InputError(f"--engine-source takes ENGINE=PATH, got {text!r}")
    return engine, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="engines_command", required=True)

    def command(name: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=SUBCOMMANDS[name], description=SUBCOMMANDS[name])

    cmd = command("fetch")
    cmd.add_argument("engines", nargs="*", metavar="ENGINE[==VERSION]",
                     help="the engines to fetch, e.g. sglang==0.5.23 (default: every one, at "
                     "its pinned version)")
    cmd.set_defaults(handler=fetch)
    cmd = command("list")
    cmd.add_argument("--json", action="store_true", help="print a JSON array")
    cmd.set_defaults(handler=listing)
    cmd = command("conform")
    cmd.add_argument("--engine", action="append", metavar="ENGINE",
                     help="check this engine only (repeat for several; default: every one)")
    cmd.add_argument("--engine-source", action="append", default=[], metavar="ENGINE=PATH",
                     help="check the code in this folder (a checkout's package parent) "
                     "instead of the pinned version")
    cmd.add_argument("--seed", type=int, default=0, help="seeds the random placements and "
                     "batches (default 0)")
    cmd.add_argument("--json", action="store_true", help="print the rows as a JSON array")
    cmd.set_defaults(handler=conform)
