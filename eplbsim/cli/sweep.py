"""`eplbsim sweep`: a grid of replays from a TOML spec into one table
(`eplbsim.replay.sweep`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..base.errors import InputError
from ..base.limits import MAX_CELLS
from .common import positive

HELP = "run a grid of replays from a TOML spec into one table"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..replay.executors import EXECUTORS
    p.description = ("Run the cells of a sweep spec (scenarios or traces x solvers x policies "
                     "x modes x topologies x seeds, any setting of the run schema) into "
                     "DIR/results.csv (and .parquet with pyarrow), resuming what DIR already "
                     "holds.")
    p.add_argument("spec", type=Path,
                   help="the sweep spec, TOML (format: eplbsim.replay.sweep's doc)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output directory (default: the spec's out); a rerun resumes it")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local processes (default) or Ray tasks (the ray extra)")
    p.add_argument("--workers", type=positive, default=None, metavar="N",
                   help="local processes, or the CPUs of a local Ray instance (default: all "
                   "cores)")
    p.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                   help="the Ray cluster to run on (default: start a local instance)")
    p.add_argument("--max-cells", type=positive, default=MAX_CELLS, metavar="N",
                   help=f"refuse a grid of more cells (default {MAX_CELLS})")


def handle(args: argparse.Namespace) -> int:
    from ..replay.sweep import read_spec, run_sweep, summary_lines
    sweep = read_spec(args.spec, args.max_cells)
    out = args.out or sweep.out
    if out is None:
        raise InputError(f"{args.spec}: no output directory; give --out DIR or out in the spec")
    run = run_sweep(sweep, out, args.executor, args.workers, args.address)
    n = len(sweep.cells)
    print(f"{n} cells ({run.ran} run now, {n - run.ran} done before):")
    for line in summary_lines(sweep, run.rows):
        print(line)
    print(f"wrote {', '.join(str(p) for p in run.paths)}")
    return 0
