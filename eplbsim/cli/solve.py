"""`eplbsim solve`: a placement for expert loads (a JSON `[L][E]` matrix or real counts)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .. import runspec
from ..base.errors import InputError
from ..engines import resolve_solver
from ..metrics import placement_report
from ..placement.io import read_json, read_phy2log
from ..placement.topology import Topology
from ..replay.results import to_json
from ..solvers.exact import NODE_LIMIT
from ..solvers import SOLVERS, as_load, find_solver, solve_with_info, solver_options
from ..ranks.traffic import source_load
from ..traces.coactivation import coactivation
from ..traces.counts import CountsTrace
from ..traces.formats import layer_loads
from .common import log_paths, nonnegative, positive, registered

HELP = "solve a placement for expert loads (a JSON [L][E] matrix or a counts CSV)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    loads = p.add_mutually_exclusive_group(required=True)
    loads.add_argument("--load", type=Path, help="a JSON [layers][experts] load matrix")
    loads.add_argument("--counts", type=Path, nargs="+", metavar="FILE",
                       help="a CSV with columns layer,expert,count (others can be filtered on), "
                       "a counts matrix (JSON, .npy), a counts-only .npz, or any routing trace "
                       "(summed over steps): one file, a folder or several read as one log")
    runspec.add_flags(p, "solve")  # how --counts is read
    slots = p.add_mutually_exclusive_group()
    slots.add_argument("--slots", type=positive, default=None,
                       help="physical slots P (default: experts + --redundant)")
    slots.add_argument("--redundant", type=nonnegative, default=0,
                       help="redundant slots, P = E + redundant (default 0)")
    p.add_argument("--gpus", type=positive, required=True, help="GPUs = EP ranks")
    p.add_argument("--gpus-per-node", type=positive, default=None,
                   help="GPUs per node (default: all on one node)")
    p.add_argument("--groups", type=positive, default=1,
                   help="expert groups, kept on one node by hierarchical solvers (default 1)")
    p.add_argument("--solver", default="deepseek", type=registered(SOLVERS, "solver"),
                   help="placement solver: " + ", ".join(SOLVERS) + " (default deepseek; "
                   "eplbsim solvers says what each does)")
    p.add_argument("--anti-colocation", action="store_true",
                   help="no two replicas of one expert on one GPU")
    p.add_argument("--previous", type=Path, default=None,
                   help="the placement in service (any placement file: a previous `solve "
                   "--json` output, a bare phy2log [L][P], an SGLang map): change as few "
                   "slots as possible")
    p.add_argument("-o", "--option", "--solver-option", action="append", default=[],
                   metavar="KEY=VALUE", dest="option",
                   help=f"solver option, e.g. anti_colocation=true, or exact's node_limit=N "
                   f"(its work budget a layer, default {NODE_LIMIT} branch-and-bound nodes: "
                   f"the same placement on every machine; time_limit=S adds a wall clock)")
    p.add_argument("--json", action="store_true",
                   help="print the placement and its report as one JSON object (default: a "
                   "text summary)")


def handle(args: argparse.Namespace) -> int:
    topology = Topology(args.gpus, args.gpus_per_node)
    values, _ = runspec.from_args(args, "solve")
    taken = solver_options(find_solver(resolve_solver(args.solver)))
    options: dict = {}
    if args.counts is not None:
        trace = runspec.Source(trace=log_paths(args.counts), **values).open(
            0, runspec.SchedulePart())
        counts = layer_loads(trace)
        load, layers = counts.load, list(counts.layers)
        if "coactivation" in taken and not isinstance(trace, CountsTrace):  # affinity's
            options["coactivation"] = coactivation(trace)
            options["history"] = trace.counts().double().numpy()
        if "source_load" in taken and not isinstance(trace, CountsTrace):  # topology-aware's
            options["source_load"] = source_load(trace, args.gpus, range(trace.num_steps))
    else:
        if values:
            raise InputError(f"{', '.join(sorted(values))} apply to reading --counts only")
        load = read_json(args.load, "a JSON [layers][experts] load matrix")
        layers = None
    load = as_load(load)  # [L, E] validated
    options.update(runspec.Options("solver_option").parse(item) for item in args.option)
    if args.anti_colocation:
        options["anti_colocation"] = True
    if args.previous is not None:
        options["previous"] = read_phy2log(read_json(args.previous, "a JSON placement"),
                                           args.previous, load.shape[1])
    slots = args.slots or load.shape[1] + args.redundant
    placement, info = solve_with_info(args.solver, load, slots, topology, args.groups,
                                      **options)
    result = {"phy2log": placement.phy2log.tolist(), "logcnt": placement.logcnt.tolist(),
              **placement_report(placement, torch.from_numpy(load)),
              **({"layers": layers} if layers is not None else {}), **info}
    if args.json:
        print(to_json(result, indent=None))
        return 0
    shown = {k: "-" if result[k] is None else f"{result[k]:.4f}"
             for k in ("placement_imbalance", "placement_gap")}
    print(f"solver {args.solver}: {placement.num_layers} layers, {placement.num_experts} "
          f"experts, {slots} slots"
          + (f" ({placement.num_slots} a layer, some empty)" if placement.num_slots != slots
             else "") + f" on {args.gpus} GPUs; placement_imbalance "
          f"{shown['placement_imbalance']}, placement_gap {shown['placement_gap']}"
          + (f", moved_slots {info['moved_slots']}" if "moved_slots" in info else ""))
    report = {k: v for k, v in info.items() if k != "moved_slots" and isinstance(v, float)}
    if report:  # a solver's own figures (affinity's objective, its bound and gap)
        print("  " + ", ".join(f"{k} {v:.6g}" for k, v in report.items()))
    for layer, row in enumerate(result["phy2log"]):  # -1: an empty slot
        empty = row.count(-1)
        print(f"  layer {layers[layer] if layers is not None else layer}: {row}"
              + (f" ({empty} empty)" if empty else "") + _proven(info, layer))
    return 0


def _proven(info: dict, layer: int) -> str:
    """What a solver that proves its placements (`exact`) proved of layer `layer`: its status,
    the gap to the optimum it proved and the nodes it explored; "" for other solvers."""
    if not isinstance(info.get("gap"), list):
        return ""
    return (f" ({info['status'][layer]}, proven gap {info['gap'][layer]:.3%}, "
            f"{info['nodes'][layer]} nodes)")
