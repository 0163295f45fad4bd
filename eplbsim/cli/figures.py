"""`eplbsim figures`: rebuild the paper figures (`eplbsim.figures`)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from .common import check_out_dir, split

HELP = "rebuild the paper figures (PDF and PNG), deterministically"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("figures"),
                   help="folder to write NAME.pdf and NAME.png into (default figures/)")
    p.add_argument("--only", default=None,
                   help="comma-separated figure names (default all; see --list)")
    p.add_argument("--list", action="store_true", help="print the figure names and exit")


def handle(args: argparse.Namespace) -> int:
    from ..figures import FIGURES, build
    from ..registry import first_sentence, lookup
    if args.list:
        width = max(map(len, FIGURES)) + 2
        for name, fn in FIGURES.items():
            print(textwrap.fill(first_sentence(fn.__doc__), 100, initial_indent=name.ljust(width),
                                subsequent_indent=" " * width))
        return 0
    names = split(args.only, "only") if args.only else list(FIGURES)
    for name in names:
        lookup(FIGURES, name, "figure")
    check_out_dir(args.out, [], [f"{name}.{ext}" for name in names for ext in ("pdf", "png")])
    paths = build(args.out, names)
    print(f"wrote {len(paths)} files to {args.out}: " + ", ".join(p.name for p in paths))
    return 0
