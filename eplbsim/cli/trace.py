"""`eplbsim trace info | synth | convert | import-sglang`: inspect, generate and convert
traces."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .. import spec
from ..errors import InputError
from ..files import check_output
from ..progress import bar
from ..results import to_json
from ..traces import CountsTrace, open_trace, save_trace, summarize_trace
from ..traces.formats import is_request_input, open_requests
from ..traces.formats.token_log import is_token_log
from ..traces.requests import save_requests
from ..traces.workload import batch
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


LOG_KEYS = ("request_key", "token_key", "layer_key", "ids_key", "step_key", "skip_type",
            "prompt_len_key")


def _reader_options(args: argparse.Namespace) -> dict[str, object]:
    """The reader options given (`--experts` and the per-token log's keys)."""
    return {k: getattr(args, k) for k in ("experts", *LOG_KEYS)
            if getattr(args, k, None) is not None}


def _distribution(values: np.ndarray) -> str:
    return (f"min {values.min()}, median {np.median(values):g}, mean {values.mean():.1f}, "
            f"max {values.max()}")


def request_info(args: argparse.Namespace) -> int:
    """`trace info` of a request input: its requests and the steps the workload makes."""
    requests = open_requests(args.file, **_reader_options(args))
    values, _ = spec.from_args(args, "info")
    batched = batch(requests, spec.workload_of(values, 0))
    prompt, output = requests.lengths()
    trace = batched.trace
    summary = {"requests": len(requests.requests), "prompt_len": prompt.tolist(),
               "output_len": output.tolist(), "layers": requests.num_layers,
               "experts": requests.num_experts, "top_k": requests.top_k,
               "workload": trace.meta["workload"], "steps": trace.num_steps,
               "rows": batched.composition(), "meta": requests.meta}
    if args.json:
        print(to_json(summary))
        return 0
    tps = trace.tokens_per_step
    print(f"{args.file}")
    print(f"  requests {len(requests.requests)}, layers {requests.num_layers}, experts "
          f"{requests.num_experts}, top-k {requests.top_k}")
    print(f"  prompt tokens: {_distribution(prompt)}")
    print(f"  output tokens: {_distribution(output)}")
    print(f"  batched ({', '.join(f'{k} {v}' for k, v in trace.meta['workload'].items())}):")
    print(f"  {trace.num_steps} steps of {int(tps.min())}..{int(tps.max())} rows (mean "
          f"{float(tps.double().mean()):.1f}); rows: "
          f"{', '.join(f'{k} {v}' for k, v in batched.composition().items())}")
    return 0


def info(args: argparse.Namespace) -> int:
    if is_request_input(args.file, **_reader_options(args)):
        return request_info(args)
    summary = summarize_trace(_routing(args.file, **_reader_options(args)))
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
    options = _reader_options(args)
    if is_request_input(args.src, **options):
        if out_kind != ".npz":
            raise InputError(f"{args.src} holds requests: write them to an .npz request file "
                             f"(run --requests batches it into steps)")
        requests = open_requests(args.src, **options)
        save_requests(requests, args.out)
        prompt, output = requests.lengths()
        print(f"wrote {args.out} (request file): {len(requests.requests)} requests, "
              f"{int(prompt.sum())} prompt and {int(output.sum())} output tokens, "
              f"{requests.num_layers} layers, {requests.num_experts} experts, "
              f"top-{requests.top_k}")
        return 0
    streamed = args.src.suffix.lower() == ".jsonl" and not is_token_log(args.src) \
        and options.keys() <= {"experts"}
    if streamed and out_kind not in (".npz", ".jsonl"):
        with bar(None, "convert") as steps:  # streamed into the directory
            trace = read_jsonl(args.src, args.experts, args.out, steps.update)
    else:
        trace = _routing(args.src, **options)
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


def _add_reader_flags(cmd: argparse.ArgumentParser) -> None:
    """`--experts` and the keys of a per-token JSONL router log (`traces.formats.token_log`)."""
    cmd.add_argument("--experts", type=positive, default=None,
                     help="logical experts E of a log (default: largest id + 1)")
    keys = {"request_key": "the request id (the log is then read as requests)",
            "token_key": "the token index (default token_idx)",
            "layer_key": "the layer (default layer)", "ids_key": "the top-k ids (default "
            "topk_ids)", "step_key": "the step (default: a new step when token indices "
            "restart)", "prompt_len_key": "a request's prompt length (with --request-key)"}
    for key, text in keys.items():
        cmd.add_argument("--" + key.replace("_", "-"), default=None, metavar="KEY",
                         help=f"per-token log: the key of {text}")
    cmd.add_argument("--skip-type", default=None, metavar="TYPE",
                     help="per-token log: skip records whose \"type\" is TYPE (a header)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", required=True)
    cmd = sub.add_parser("info", help="summarise a trace file, or a request file and the "
                         "steps a workload batches it into")
    cmd.add_argument("file", type=Path, help="a trace in any form run reads, or a request "
                     "input (a request .npz, vLLM routed experts, a per-token log with "
                     "--request-key)")
    cmd.add_argument("--json", action="store_true", help="print only JSON")
    _add_reader_flags(cmd)
    spec.add_flags(cmd, "info")
    cmd.set_defaults(handler=info)

    cmd = sub.add_parser("synth", help="generate a synthetic trace")
    cmd.add_argument("scenario", choices=sorted(SCENARIOS),
                     help="the scenario: " + ", ".join(sorted(SCENARIOS)))
    cmd.add_argument("--out", type=Path, required=True, help="the .npz trace to write")
    spec.add_flags(cmd, "synth")
    cmd.set_defaults(handler=synth)

    cmd = sub.add_parser("convert", help="convert a trace between .npz, the directory form "
                         "(memory-mapped, for traces larger than memory) and a JSONL log")
    cmd.add_argument("src", type=Path, help="an .npz trace, a trace directory or a .jsonl "
                     "router log ({step, layer, topk_ids} per line)")
    cmd.add_argument("--out", type=Path, required=True,
                     help="DST: ending in .npz writes .npz, in .jsonl a router log, anything "
                     "else a directory (a .jsonl source is streamed into it)")
    _add_reader_flags(cmd)
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
