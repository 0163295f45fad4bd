"""`eplbsim figures`: rebuild the paper figures (`eplbsim.plots.figures`), or draw a user's trace
(`--trace`: `plots.trace`)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from .. import runspec
from ..base.errors import InputError
from .common import check_out_dir, log_paths, shown_paths, split

HELP = ("rebuild the paper figures (PDF and PNG), deterministically, or draw your own trace's "
        "(--trace)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None,
                   help="folder to write NAME.pdf and NAME.png into (default figures/; "
                        "required with --trace)")
    p.add_argument("--only", default=None,
                   help="comma-separated figure names (default all; see --list)")
    p.add_argument("--list", action="store_true", help="print the figure names and exit")
    p.add_argument("--trace", type=Path, nargs="+", default=None, metavar="FILE",
                   help="draw this trace instead (any form run reads, one file, a folder or "
                        "several files read as one log, with the reading flags below): its "
                        "expert load heatmap, top share and per-step imbalance")
    runspec.add_flags(p, "figures")


def _figures(trace: bool) -> dict:
    from ..plots.figures import FIGURES
    from ..plots import TRACE_FIGURES
    return TRACE_FIGURES if trace else FIGURES


def handle(args: argparse.Namespace) -> int:
    from ..plots.figures import build
    from ..base.registry import first_sentence, lookup
    figures = _figures(args.trace is not None)
    if args.list:
        width = max(map(len, figures)) + 2
        for name, fn in figures.items():
            print(textwrap.fill(first_sentence(fn.__doc__), 100, initial_indent=name.ljust(width),
                                subsequent_indent=" " * width))
        return 0
    names = split(args.only, "only") if args.only else list(figures)
    for name in names:
        lookup(figures, name, "figure")
    files = [f"{name}.{ext}" for name in names for ext in ("pdf", "png")]
    if args.trace is None:
        out = check_out_dir(args.out or Path("figures"), [], files)
        paths = build(out, names)
    else:
        if args.out is None:
            raise InputError("--out DIR: where to write the trace's figures")
        paths = _draw_trace(args, names, check_out_dir(args.out, args.trace, files))
    print(f"wrote {len(paths)} files to {args.out or 'figures'}: "
          + ", ".join(p.name for p in paths))
    return 0


def _draw_trace(args: argparse.Namespace, names: list[str], out: Path) -> list[Path]:
    """The figures `names` of `args.trace` (read with the reading flags, its steps selected),
    each as PDF and PNG in `out`."""
    from ..plots import save_figure, trace_figures
    values, _ = runspec.from_args(args, "figures")
    source = runspec.Source(**{**values, "trace": log_paths(args.trace)})
    trace = source.select(source.read(0, runspec.SchedulePart()))
    if trace.num_steps == 0:
        raise InputError(f"{shown_paths(args.trace)}: no steps to draw")
    paths: list[Path] = []
    for name, fig in trace_figures(trace.counts(), names).items():
        paths += save_figure(fig, out / f"{name}.pdf")
    return paths
