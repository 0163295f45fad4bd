"""`eplbsim export`: a placement (or expert loads) in the form a serving engine loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .. import runspec
from ..base.errors import InputError
from ..base.files import atomic_file, check_output
from ..base.limits import MAX_LAYERS
from ..placement.io import (placement_experts, read_json, read_phy2log, sglang_logical_count,
                            sglang_placement)
from ..traces import CountsTrace
from .common import log_paths, positive, shown_paths, split

HELP = "write a placement (or expert loads) in a form a serving engine loads"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", required=True, choices=["sglang"],
                   help="sglang: the JSON of --init-expert-location")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--placement", type=Path, help="a placement file (a `solve --json` "
                      "output, a bare JSON phy2log [L][P] or an SGLang map); writes "
                      "physical_to_logical_map")
    what.add_argument("--counts", type=Path, nargs="+", metavar="FILE",
                      help="a counts-only or routing trace (one file, a folder or several read "
                      "as one log); writes logical_count (the engine runs its own solver)")
    p.add_argument("--num-model-layers", type=positive, default=None,
                   help="layers of the model, dense ones included (default: the trace's "
                   "num_model_layers)")
    p.add_argument("--moe-layers", default=None,
                   help="model layer of each MoE layer, e.g. 1,2,3 (default: the file's "
                   "layers / model_layers, else 0..L-1)")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    runspec.add_flags(p, "export")  # how --counts is read; --experts for a placement too


def handle(args: argparse.Namespace) -> int:
    check_output(args.out, [args.placement, *(args.counts or [])])
    meta: dict[str, Any] = {}
    values, _ = runspec.from_args(args, "export")
    if args.placement is not None:
        reading = sorted(set(values) - {"experts"})
        if reading:
            raise InputError(f"{', '.join(reading)} apply to reading --counts only")
        data = read_json(args.placement, "a JSON placement")
        experts = values.get("experts") or placement_experts(data, args.placement)
        phy2log = read_phy2log(data, args.placement, experts)
        if isinstance(data, dict) and data.get("layers") is not None:
            meta["model_layers"] = data["layers"]
        num_layers = len(phy2log)
    else:
        trace = runspec.Source(trace=log_paths(args.counts), **values).open(
            0, runspec.SchedulePart())
        counts = trace.counts if isinstance(trace, CountsTrace) else trace.counts().numpy()
        meta = trace.meta  # counts [S, L, E]
        num_layers = counts.shape[1]
    model_layers = args.num_model_layers or meta.get("num_model_layers")
    if model_layers is None:
        raise InputError("--num-model-layers is required (the file does not record the "
                         "model's layer count)")
    if not isinstance(model_layers, int) or isinstance(model_layers, bool) or \
            not 1 <= model_layers <= MAX_LAYERS:
        given = "--num-model-layers" if args.num_model_layers else \
            f"{shown_paths(args.counts)}: its num_model_layers"
        raise InputError(f"{given}: the model's layer count must be an integer in [1, "
                         f"{MAX_LAYERS}], got {model_layers!r}")
    if args.moe_layers is not None:
        try:
            moe = [int(s) for s in split(args.moe_layers, "moe-layers")]
        except ValueError:
            raise InputError(f"--moe-layers takes comma-separated integers, got "
                             f"{args.moe_layers!r}") from None
    else:
        moe = meta.get("model_layers") or list(range(num_layers))
    if args.placement is not None:
        obj = sglang_placement(phy2log, experts, model_layers, moe)
        shape = f"physical_to_logical_map [{model_layers}, {phy2log.shape[1]}]"
    else:
        obj = sglang_logical_count(counts, model_layers, moe)
        shape = f"logical_count [{model_layers}, {counts.shape[2]}]"
    with atomic_file(args.out) as tmp:
        tmp.write_text(json.dumps(obj))
    print(f"wrote {args.out}: sglang {shape}, MoE layers {moe}")
    return 0
