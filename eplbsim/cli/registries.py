"""`eplbsim policies` and `eplbsim solvers`: every registry entry with its properties, read from
the registries themselves (`dispatch.POLICIES`, `solvers.SOLVERS`), as text or JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..registry import first_sentence
from ..results import to_json

POLICIES_HELP = "list the dispatch policies: rank-invariance class in \"none\" mode, source"
SOLVERS_HELP = "list the placement solvers: source, what each does"


def policy_rows() -> list[dict[str, Any]]:
    """`name`, `class` (`DispatchPolicy.invariance`), `source` and `summary` of every policy."""
    from ..dispatch import POLICIES
    return [{"name": name, "class": entry.invariance(), "source": entry.source,
             "summary": entry.summary} for name, entry in POLICIES.items()]


def solver_rows() -> list[dict[str, Any]]:
    """`name`, `source` (its module docstring's first sentence) and `summary` (its own
    docstring's) of every solver."""
    from ..solvers import SOLVERS
    return [{"name": name, "source": first_sentence(sys.modules[fn.__module__].__doc__),
             "summary": first_sentence(fn.__doc__)} for name, fn in SOLVERS.items()]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """`rows` (`policy_rows` or `solver_rows`) as the Markdown table README.md holds."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(f"`{r[k]}`" if k == "name" else str(r[k]) for k in keys) + " |"
              for r in rows]
    return "\n".join(lines)


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> int:
    if args.json:
        print(to_json(rows))
        return 0
    if args.markdown:
        print(markdown_table(rows))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        extra = f"  [{r['class']}]" if "class" in r else ""
        print(f"{r['name']:{width}s}{extra}  {r['summary']}\n{'':{width}s}  source: {r['source']}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON array of the entries")
    p.add_argument("--markdown", action="store_true",
                   help="print a Markdown table (the one README.md holds)")


def handle_policies(args: argparse.Namespace) -> int:
    return _print(policy_rows(), args)


def handle_solvers(args: argparse.Namespace) -> int:
    return _print(solver_rows(), args)
