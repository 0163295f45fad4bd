"""`eplbsim ranks`: the dispatch on real torch.distributed processes, checked against the
simulation (`eplbsim.replay.distributed`)."""

from __future__ import annotations

import argparse
import math
import dataclasses
import functools
import os
import sys

from .. import runspec
from ..base.errors import InputError
from ..replay import check_fits, comparison, resolve_device
from ..replay.distributed import (REPORT_COLUMNS, GroupFailure, join_launched, launch,
                                  launched_by_torchrun, report_cells)
from ..replay.results import describe, format_table, to_json
from ..traces.counts import CountsTrace
from .common import nonnegative, positive

HELP = ("run the dispatch on real torch.distributed processes (gloo on CPU, NCCL on CUDA) and "
        "check every metric against the in-process simulation")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=positive, default=None,
                   help="ranks = GPUs to spawn locally (under torchrun: the launched group's, "
                   "which this must match if given)")
    runspec.add_flags(p, "ranks")
    p.add_argument("--port", type=nonnegative, default=0,
                   help="rendezvous port on 127.0.0.1 when spawning (default: a free one)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any one collective may wait before the group is stopped "
                   "(default 60)")
    p.add_argument("--json", action="store_true", help="print only JSON")


def handle(args: argparse.Namespace) -> int:
    torchrun = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    if world is None:
        raise InputError("--world-size is required (or start the command under torchrun)")
    if torchrun and args.world_size not in (None, world):
        raise InputError(f"--world-size {args.world_size} differs from torchrun's group of "
                         f"{world}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise InputError(f"--timeout: must be a finite number of seconds > 0, got "
                         f"{args.timeout:g}")
    values, lists = runspec.from_args(args, "ranks")
    values["gpus"] = world
    if torchrun and values.get("gpus_per_node") is None:
        values["gpus_per_node"] = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    source, base = runspec.build(values)
    if source.trace is None:  # every rank synthesizes the same steps
        source = dataclasses.replace(source, steps=source.steps or base.schedule.steps())
    load = functools.partial(source.open, base.dispatch.seed, base.schedule)
    trace = load()  # bad input fails here, before any process starts
    if isinstance(trace, CountsTrace):
        raise InputError(f"{source.trace} holds expert counts, not token rows: ranks need "
                         f"tokens to dispatch")
    base = check_fits(trace, base)  # what rank 0 would find only after every rank started
    device = resolve_device(base.dispatch.device).partition(":")[0]
    sources = lists.get("engine_source")
    specs = comparison(base, lists["policy"], lists["mode"], sources)
    try:
        rows = (join_launched(load, specs, device=device, timeout=args.timeout) if torchrun
                else launch(load, specs, world, device=device, port=args.port,
                            timeout=args.timeout))
    except GroupFailure as exc:
        print(f"eplbsim: error: {exc}", file=sys.stderr)
        return 1
    if not rows:  # a torchrun rank other than 0
        return 0
    if args.json:
        print(to_json(rows))
    else:
        print(f"{world} ranks ({rows[0]['backend']}, {device}) | "
              + describe(trace, specs[0], sources=len(sources or [None])))
        apart = sources is not None and any("engine" in r for r in rows)  # rows name code
        columns = REPORT_COLUMNS[:2] + (("engine", "engine", None),) * apart + REPORT_COLUMNS[2:]
        print(format_table([report_cells(r) for r in rows], columns, labels=3 + apart))
        matched = sum(r["match"] for r in rows)
        print(f"{matched} of {len(rows)} configurations: every metric of the real processes "
              f"equals the in-process simulation's")
    return 0 if all(r["match"] for r in rows) else 1
