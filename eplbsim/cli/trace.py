"""`eplbsim trace info | synth | convert | import-sglang`: inspect, generate and convert
traces."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import spec
from ..errors import InputError
from ..files import check_output
from ..progress import bar
from ..results import to_json
from ..traces import CountsTrace, open_trace, save_trace, summarize_trace
from ..traces.counts import save_counts_trace
from ..traces.directory import save_trace_dir, to_memory
from ..traces.formats.jsonl import read_jsonl, write_jsonl
from ..traces.formats.sglang import import_sglang
from ..traces.synth import SCENARIOS
from .common import positive

HELP = "inspect or generate traces"


def _routing(path: Path, **options: object) -> object:
    """The routing trace at `path` (any form with token rows); InputError for counts only."""
    trace = open_trace(path, **options)
    if isinstance(trace, CountsTrace):
        raise InputError(f"{path}: holds expert counts only, no token rows")
    return trace


def info(args: argparse.Namespace) -> int:
    summary = summarize_trace(_routing(args.file))
    if args.json:
        print(to_json(summary))
        return 0
    tps = summary["tokens_per_step"]
    print(f"{args.file}")
    print(f"  steps {summary['steps']}, tokens {summary['tokens']} (per step {tps['min']}.."
          f"{tps['max']}, mean {tps['mean']:.1f}), layers {summary['layers']}, "
          f"experts {summary['experts']}, top-k {summary['top_k']}")
    print(f"  groups {summary['groups'] or '-'}, src_rank "
          f"{'yes' if summary['src_rank'] else 'no'}, padding {summary['padding_frac']:.2%}, "
          f"source {summary['meta'].get('source', '-')}")
    print("  layer  max/mean load (whole trace)  mean per-step max/mean  hottest expert")
    for row in summary["layer_skew"]:
        whole, step = row["max_over_mean"], row["per_step_max_over_mean"]
        print(f"  {row['layer']:>5}  {'-' if whole is None else f'{whole:.3f}':>27}  "
              f"{'-' if step is None else f'{step:.3f}':>22}  {row['hottest_expert']:>14}")
    return 0


def synth(args: argparse.Namespace) -> int:
    check_output(args.out, [])
    values, _ = spec.from_args(args, "synth")
    source, run = spec.build({**values, "scenario": args.scenario})
    trace = source.open(run.dispatch.seed, run.schedule)
    save_trace(trace, args.out)
    per_step = trace.num_tokens / trace.num_steps
    print(f"wrote {args.out}: {trace.num_steps} steps x {per_step:g} tokens (mean), "
          f"{trace.num_layers} layers, {trace.num_experts} experts, top-{trace.top_k}")
    return 0


def convert(args: argparse.Namespace) -> int:
    out_kind = args.out.suffix.lower()
    check_output(args.out, [args.src], replaces=out_kind not in (".npz", ".jsonl"))
    if args.src.suffix.lower() == ".jsonl" and out_kind not in (".npz", ".jsonl"):
        with bar(None, "convert") as steps:  # streamed into the directory
            trace = read_jsonl(args.src, args.experts, args.out, steps.update)
    else:
        trace = _routing(args.src, experts=args.experts)
        with bar(trace.num_steps, "convert") as steps:
            if out_kind == ".jsonl":
                write_jsonl(trace, args.out, steps.update)
            elif out_kind == ".npz":
                save_trace(to_memory(trace, steps.update), args.out)
            else:
                save_trace_dir(trace, args.out, progress=steps.update)
    kind = {".jsonl": "JSONL router log", ".npz": ".npz"}.get(out_kind, "trace directory")
    print(f"wrote {args.out} ({kind}): {trace.num_steps} steps, {trace.num_tokens} tokens, "
          f"{trace.num_layers} layers, {trace.num_experts} experts, top-{trace.top_k}")
    return 0


def import_dumps(args: argparse.Namespace) -> int:
    check_output(args.out, args.paths)
    with bar(len(args.paths), "import-sglang", "file") as files:
        trace = import_sglang(args.paths, args.experts, args.top_k, files.update)
    counts_only = isinstance(trace, CountsTrace)
    (save_counts_trace if counts_only else save_trace)(trace, args.out)
    kind = "counts-only trace" if counts_only else f"trace (top-{trace.top_k}, src_rank)"
    print(f"wrote {args.out}: {kind} from SGLang {trace.meta['mode']} dump, "
          f"{trace.num_steps} steps, {trace.num_layers} layers (of "
          f"{trace.meta['num_model_layers']} model layers), {trace.num_experts} experts")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", required=True)
    cmd = sub.add_parser("info", help="summarise a trace file")
    cmd.add_argument("file", type=Path)
    cmd.add_argument("--json", action="store_true")
    cmd.set_defaults(handler=info)

    cmd = sub.add_parser("synth", help="generate a synthetic trace")
    cmd.add_argument("scenario", choices=sorted(SCENARIOS))
    cmd.add_argument("--out", type=Path, required=True)
    spec.add_flags(cmd, "synth")
    cmd.set_defaults(handler=synth)

    cmd = sub.add_parser("convert", help="convert a trace between .npz, the directory form "
                         "(memory-mapped, for traces larger than memory) and a JSONL log")
    cmd.add_argument("src", type=Path, help="an .npz trace, a trace directory or a .jsonl "
                     "router log ({step, layer, topk_ids} per line)")
    cmd.add_argument("--out", type=Path, required=True,
                     help="DST: ending in .npz writes .npz, in .jsonl a router log, anything "
                     "else a directory (a .jsonl source is streamed into it)")
    cmd.add_argument("--experts", type=positive, default=None,
                     help="logical experts E of a .jsonl source (default: largest id + 1)")
    cmd.set_defaults(handler=convert)

    cmd = sub.add_parser("import-sglang", help="import SGLang expert-distribution recorder "
                         "dumps (per_token -> trace, per_pass/stat -> counts-only trace)")
    cmd.add_argument("paths", type=Path, nargs="+", metavar="PATH",
                     help="dump files written by torch.save (one per rank; stat: rank 0's)")
    cmd.add_argument("--out", type=Path, required=True, help="the .npz to write")
    cmd.add_argument("--experts", type=positive, default=None,
                     help="logical experts E (default: the largest logical id + 1)")
    cmd.add_argument("--top-k", type=positive, default=None,
                     help="the model's top-k: keep that many id columns (default: all)")
    cmd.set_defaults(handler=import_dumps)
