"""`eplbsim policies`, `eplbsim solvers` and `eplbsim models`: every registry entry with its
properties, read from the registries themselves (`dispatch.POLICIES`, `solvers.SOLVERS`,
`cost.catalog.model_rows`), as text, JSON or Markdown."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..base.registry import first_sentence
from ..replay.results import to_json

POLICIES_HELP = "list the dispatch policies: rank-invariance class in \"none\" mode, source"
SOLVERS_HELP = "list the placement solvers: source, what each does"
MODELS_HELP = ("list the models --model names: experts, top-k, MoE layers of all layers, hidden, "
               "expert intermediate, shared experts, weight dtype, hash-routed layers, draft "
               "(MTP) layers, where each comes from; for a model whose draft has experts of its "
               "own count, the EP sizes both admit")


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


def model_rows() -> list[dict[str, Any]]:
    """Every model a name gives (`cost.catalog.model_rows`): the built-in ones, then
    aiconfigurator-core's MoE configs when it is installed."""
    from ..cost.catalog import model_rows as rows
    return rows()


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
                   help="print a Markdown table")


def handle_policies(args: argparse.Namespace) -> int:
    return _print(policy_rows(), args)


def handle_solvers(args: argparse.Namespace) -> int:
    return _print(solver_rows(), args)


def handle_models(args: argparse.Namespace) -> int:
    rows = model_rows()
    if args.json or args.markdown:
        return _print(rows, args)
    head = {"name": "name", "experts": "E", "top_k": "K", "moe_layers": "MoE/layers",
            "hidden": "H", "intermediate": "I", "shared": "shared", "dtype": "weights",
            "hash_layers": "hash", "draft": "draft", "source": "source"}
    table = [head] + [dict(r, moe_layers=f"{r['moe_layers']}/{r['layers'] or '?'}")
                      for r in rows]
    widths = {k: max(len(str(r[k])) for r in table) for k in head if k != "source"}
    for r in table:
        print("  ".join(f"{r[k]!s:{widths[k]}}" for k in widths) + f"  {r['source']}")
    for note in draft_notes(rows):
        print(note)
    return 0


def draft_notes(rows: list[dict[str, Any]]) -> list[str]:
    """A line for each model of `rows` (`model_rows`) whose draft (MTP) layers have experts of
    their own count: the EP sizes (of one to 32 eight-GPU nodes) it and its draft both admit
    with one redundancy (`schedule.draft_fault.ep_words`)."""
    from ..cost.catalog import model_shape
    from ..schedule.draft_fault import ep_words
    notes = []
    for r in rows:
        shape = model_shape(r["name"])
        if shape.draft_layers and shape.draft_experts not in (0, None, shape.experts):
            notes.append(f"{r['name']}: {shape.experts} experts, its draft "
                         f"{shape.draft_experts}: "
                         f"{ep_words(shape.experts, shape.draft_experts)}")
    return notes
