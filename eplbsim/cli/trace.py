"""`eplbsim trace info | synth | convert | import-sglang`: inspect, generate and convert
traces."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from .. import runspec
from ..base.errors import InputError
from ..base.files import check_output
from ..base.progress import bar
from ..cost.catalog import model_named, model_shape
from ..replay.results import to_json
from ..traces import CountsTrace, save_trace, summarize_trace
from ..traces.counts import save_counts_trace
from ..traces.draft import draft_of
from ..traces.directory import TRACE_FILES, save_trace_dir, to_memory
from ..traces.formats import is_request_input
from ..traces.formats.jsonl import read_jsonl, write_jsonl
from ..traces.formats.sglang import import_sglang
from ..traces.formats.token_log import is_token_log
from ..traces.requests import is_request_file, save_requests
from ..traces.stages import describe_stages
from ..traces.layer_kinds import EMPTY_LAYERS, hash_layers
from ..traces.steps import (OUTLIER_FACTOR, describe_selection, flag_steps, outlier_median,
                            span_words)
from ..traces.synth import SCENARIOS
from ..traces.trace import model_in, npz_names
from ..traces.workload import batch
from .common import log_paths, positive, registered, shown_paths

HELP = "inspect or generate traces"


def _routing(trace: Any, paths: list[Path]) -> Any:
    """`trace` if it has token rows; InputError for counts only."""
    if isinstance(trace, CountsTrace):
        raise InputError(f"{shown_paths(paths)}: holds expert counts only, no token rows")
    return trace


def _source(args: argparse.Namespace, paths: list[Path], command: str
            ) -> tuple[runspec.Source, bool]:
    """The run schema's source for a file argument (one path or several: `log_paths`) with the
    reading flags given, and whether it holds requests (`is_request_input`) rather than
    steps."""
    values, _ = runspec.from_args(args, command)
    options = {k: values[k] for k in runspec.READER_OPTIONS if values.get(k) is not None}
    given = log_paths(paths)
    requests = is_request_input(given, **options)
    if requests and isinstance(given, tuple):
        raise InputError(f"{paths[0]}: several files read as requests do not join; give one "
                         f"request log")
    return runspec.Source(**{**values, ("requests" if requests else "trace"): given}), requests


def _distribution(values: np.ndarray) -> str:
    return (f"min {values.min()}, median {np.median(values):g}, mean {values.mean():.1f}, "
            f"max {values.max()}")


def _flag_lines(flags: dict[str, list[int]], trace: Any, source: runspec.Source) -> list[str]:
    """What `trace info` says of the flagged steps (`traces.steps.flag_steps`) of `trace`, the
    whole one: the flag that leaves each kind out, or that it left them out of `source`'s
    selection."""
    tokens = trace.tokens_per_step
    words = {"warmup": ("warm-up (every row routed alike, or start-up steps before the first "
                        "dummy)", "--drop-warmup"),
             "dummy": ("dummy (data-parallel padding: a step repeated row for row, or of "
                       "that size re-routing a stale row)",
                       "--drop-dummy"),
             "outlier": (f"size outliers (over {OUTLIER_FACTOR}x the median "
                         f"{outlier_median(tokens.numpy(), flags):g} tokens)",
                         "--drop-outliers")}
    dropped = {"warmup": source.drop_warmup, "dummy": source.drop_dummy,
               "outlier": source.drop_outliers}
    lines = []
    for kind, steps in flags.items():
        if steps:
            shown = ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")
            lines.append(f"  flagged {words[kind][0]}: {len(steps)} step"
                         f"{'' if len(steps) == 1 else 's'} ({shown}), "
                         f"{int(tokens[steps].sum())} tokens; {words[kind][1]} "
                         f"{'left' if dropped[kind] else 'leaves'} them out")
    return lines


def request_info(args: argparse.Namespace, source: runspec.Source) -> int:
    """`trace info` of a request input: its requests and the steps the workload makes."""
    requests = source.request_set(0)
    batched = batch(requests, source.workload(0))
    flags = flag_steps(batched.trace)
    trace = source.select(batched.trace)
    prompt, output = requests.lengths()
    summary = {"requests": len(requests.requests), "prompt_len": prompt.tolist(),
               "output_len": output.tolist(), "layers": requests.num_layers,
               "experts": requests.num_experts, "top_k": requests.top_k,
               "workload": trace.meta["workload"], "steps": trace.num_steps,
               "rows": batched.composition(), "flagged": flags, "meta": requests.meta}
    if args.json:
        print(to_json(summary))
        return 0
    tps = trace.tokens_per_step
    selected = describe_selection(trace.meta)
    print(shown_paths(args.file))
    if requests.meta.get("read_as"):
        print(f"  read as: {requests.meta['read_as']}")
    print(f"  requests {len(requests.requests)}, layers {requests.num_layers}, experts "
          f"{requests.num_experts}, top-k {requests.top_k}")
    print(f"  prompt tokens: {_distribution(prompt)}")
    print(f"  output tokens: {_distribution(output)}")
    print(f"  batched ({', '.join(f'{k} {v}' for k, v in trace.meta['workload'].items())}):")
    print(f"  {trace.num_steps} steps of {int(tps.min())}..{int(tps.max())} rows (mean "
          f"{float(tps.double().mean()):.1f}){'; ' + selected if selected else ''}; rows: "
          f"{', '.join(f'{k} {v}' for k, v in batched.composition().items())}")
    for line in _flag_lines(flags, batched.trace, source):
        print(line)
    return 0


def counts_info(args: argparse.Namespace, counts: CountsTrace) -> int:
    """`trace info` of counts only: their shape, how they were read, what they cannot show."""
    summary = {"steps": counts.num_steps, "layers": counts.num_layers,
               "experts": counts.num_experts, "pairs": int(counts.counts.sum()),
               "counts_only": True, "meta": counts.meta}
    if args.json:
        print(to_json(summary))
        return 0
    print(shown_paths(args.file))
    print(f"  counts only: steps {counts.num_steps}, layers {counts.num_layers}, experts "
          f"{counts.num_experts}, {summary['pairs']} pairs; no token rows, so a run gives a "
          f"placement's even-split promise, no dispatch")
    if counts.meta.get("read_as"):
        print(f"  read as: {counts.meta['read_as']}")
    if counts.meta.get("stages"):  # counts have no tokens to tell the stages by: marks only
        print(f"  stages: {describe_stages(counts)}")
    for line in layer_kind_lines(counts.meta, None):
        print(line)
    return 0


def trace_hash_layers(trace: Any) -> tuple[int, ...]:
    """The trace's hash-routed layers (`traces.layer_kinds.hash_layers`): as its meta says,
    else as the known model it names does (`cost.catalog`)."""
    named = model_named(model_in(trace.meta))
    return hash_layers(trace.meta, trace.num_layers,
                       model_shape(named).hash_layers if named else 0)


def layer_kind_lines(meta: dict[str, Any], summary: dict[str, Any] | None) -> list[str]:
    """What `trace info` says of the layers' kinds: the layers a dump held that route nothing
    (`meta["empty_layers"]`, dropped: never priced), and the hash-routed layers with each
    kind's mean per-step max / mean expert load (`summary["kind_skew"]`)."""
    lines = []
    if meta.get(EMPTY_LAYERS):
        lines.append(f"  empty layers in the log (no routed pair: dropped, not priced): model "
                     f"layers {', '.join(map(str, meta[EMPTY_LAYERS]))}")
    if summary is not None and summary["kind_skew"] is not None:
        skew = summary["kind_skew"]
        shown = {k: "-" if v is None else f"{v:.3f}" for k, v in skew.items()}
        numbers = [str(row["layer"]) for row in summary["layer_skew"] if row["kind"] == "hash"]
        lines.append(f"  hash-routed layers (a token-id table picks their experts): "
                     f"{span_words(numbers, 0, len(numbers), len(numbers))}; mean per-step "
                     f"max/mean load: hash {shown['hash']}, learned {shown['learned']}")
    return lines


def info(args: argparse.Namespace) -> int:
    source, requests = _source(args, args.file, "info")
    if requests:
        return request_info(args, source)
    whole = source.read(0, runspec.SchedulePart())
    if isinstance(whole, CountsTrace):
        return counts_info(args, source.select(whole))
    flags = flag_steps(whole)
    trace = source.chunked(source.select(whole))
    draft = draft_of(trace)
    summary = {**summarize_trace(trace, trace_hash_layers(trace)), "flagged": flags,
               "stages": describe_stages(trace),
               "draft": None if draft is None else summarize_trace(draft)}
    if args.coactivation:
        summary["coactivation"] = coactivation_summary(trace, args.groups)
    if args.json:
        print(to_json(summary))
        return 0
    tps = summary["tokens_per_step"]
    selected = describe_selection(trace.meta)
    print(shown_paths(args.file))
    if trace.meta.get("read_as"):
        print(f"  read as: {trace.meta['read_as']}")
    print(f"  steps {summary['steps']}, tokens {summary['tokens']} (per step {tps['min']}.."
          f"{tps['max']}, mean {tps['mean']:.1f}), layers {summary['layers']}, "
          f"experts {summary['experts']}, top-k {summary['top_k']}"
          + (f"; {selected}" if selected else ""))
    print(f"  groups {summary['groups'] or '-'}, src_rank "
          f"{'yes' if summary['src_rank'] else 'no'}, padding {summary['padding_frac']:.2%}, "
          f"source {summary['meta'].get('source', '-')}")
    print(f"  stages: {summary['stages']}")
    for line in _flag_lines(flags, whole, source) + layer_kind_lines(trace.meta, summary):
        print(line)
    for line in _skew_lines(summary, summary["kind_skew"] is not None):
        print(line)
    if draft is not None:
        for line in draft_lines(summary["draft"]):
            print(line)
    if args.coactivation:
        co = summary["coactivation"]
        print("  co-activation: the pairs of experts one token chooses most often")
        print("  layer  strongest pairs (tokens)")
        for layer, pairs in enumerate(co["strongest"]):
            print(f"  {layer:>5}  " + ", ".join(f"{a}+{b} ({n})" for a, b, n in pairs))
        print(f"  a greedy partition into {co['groups']} groups of "
              f"{trace.num_experts // co['groups']} experts keeps {co['kept_greedy']:.1%} of a "
              f"token's other choices in its group; a random one {co['kept_random']:.1%}")
    return 0


def _skew_lines(summary: dict[str, Any], kind: bool, label: str = "layer") -> list[str]:
    """The table of each layer's skew in a trace's `summary` (`summarize_trace`), its rows'
    kinds too when `kind`; its first column headed `label`."""
    lines = [f"  {label:>5}  max/mean load (whole trace)  mean per-step max/mean  hottest expert"
             + ("  kind" if kind else "")]
    for row in summary["layer_skew"]:
        skew, step = row["max_over_mean"], row["per_step_max_over_mean"]
        lines.append(f"  {row['layer']:>{len(label)}}  "
                     f"{'-' if skew is None else f'{skew:.3f}':>27}  "
                     f"{'-' if step is None else f'{step:.3f}':>22}  {row['hottest_expert']:>14}"
                     + (f"  {row['kind']}" if kind else ""))
    return lines


def draft_lines(summary: dict[str, Any]) -> list[str]:
    """What `trace info` says of a trace's draft (MTP) layers (`traces.draft`), apart from the
    target's: their sizes and each draft layer's skew, of the draft's `summary`
    (`summarize_trace`)."""
    tps = summary["tokens_per_step"]
    return [f"  draft (MTP) layers, of their own experts, placed and recorded apart: layers "
            f"{summary['layers']}, experts {summary['experts']}, top-k {summary['top_k']}; "
            f"tokens {summary['tokens']} (per step {tps['min']}..{tps['max']}, mean "
            f"{tps['mean']:.1f}), padding {summary['padding_frac']:.2%}"] + \
        _skew_lines(summary, False, "draft layer")


def coactivation_summary(trace: Any, groups: int, strongest: int = 3) -> dict[str, Any]:
    """What `trace info --coactivation` reports (`traces.coactivation`): each layer's
    `strongest` pairs `(a, b, tokens)`, and the share of a token's other choices a greedy
    partition into `groups` equal groups keeps in its group, against a seeded random one."""
    from ..traces.coactivation import coactivation, grouped, kept_share, random_groups
    pairs = coactivation(trace)  # [L, E, E]
    E = trace.num_experts
    upper = np.triu(np.ones((E, E), bool), 1)
    top = []
    for layer in pairs:
        flat = np.where(upper, layer, -1).ravel()
        best = [i for i in np.argsort(-flat, kind="stable")[:strongest] if flat[i] > 0]
        top.append([(int(i // E), int(i % E), int(flat[i])) for i in best])
    return {"groups": groups, "strongest": top,
            "kept_greedy": kept_share(pairs, grouped(pairs, groups)),
            "kept_random": kept_share(pairs, random_groups(trace.num_layers, E, groups))}


def synth(args: argparse.Namespace) -> int:
    check_output(args.out, [])
    values, _ = runspec.from_args(args, "synth")
    source, run = runspec.build({**values, "scenario": args.scenario})
    trace = source.open(run.dispatch.seed, run.schedule)
    save_trace(trace, args.out)
    per_step = trace.num_tokens / trace.num_steps
    print(f"wrote {args.out}: {trace.num_steps} steps x {per_step:g} tokens (mean), "
          f"{trace.num_layers} layers, {trace.num_experts} experts, top-{trace.top_k}")
    return 0


def _written_by_convert(out: Path) -> bool:
    """Whether `out` is absent, or holds only what `trace convert` writes there (an empty
    folder or a trace directory; an .npz trace or request file; a JSONL router log, judged by
    how `write_jsonl` starts one): what it may replace without --force."""
    if not (out.exists() or out.is_symlink()):
        return True
    if out.is_dir() and not out.is_symlink():
        return {p.name for p in out.iterdir()} <= set(TRACE_FILES)
    if out.suffix.lower() == ".npz":
        names = npz_names(out)
        return {"topk_ids.npy", "step_offsets.npy"} <= names or is_request_file(out)
    if out.suffix.lower() == ".jsonl" and out.is_file():
        with open(out, "rb") as f:
            head = f.read(256)  # a line may be long: its start is enough
        return head.startswith(b'{"step": ') and b'"topk_ids": [' in head
    return False


def convert(args: argparse.Namespace) -> int:
    out_kind = args.out.suffix.lower()
    check_output(args.out, args.src, replaces=out_kind not in (".npz", ".jsonl"))
    if not args.force and not _written_by_convert(args.out):
        raise InputError(f"{args.out}: exists and is not what trace convert writes (a trace "
                         f"directory, an .npz trace or request file, a JSONL router log), so "
                         f"writing would replace it: give another --out, or --force")
    source, requests = _source(args, args.src, "convert")
    if requests:
        if out_kind != ".npz":
            raise InputError(f"{args.src[0]} holds requests: write them to an .npz request "
                             f"file (run --requests batches it into steps)")
        if source.selects:
            raise InputError(f"{args.src[0]} holds requests, not steps: steps are selected "
                             f"where they are batched (run --requests ... --select-steps)")
        requests = source.request_set(0)
        save_requests(requests, args.out)
        prompt, output = requests.lengths()
        print(f"wrote {args.out} (request file): {len(requests.requests)} requests, "
              f"{int(prompt.sum())} prompt and {int(output.sum())} output tokens, "
              f"{requests.num_layers} layers, {requests.num_experts} experts, "
              f"top-{requests.top_k}")
        return 0
    src = args.src[0]
    streamed = len(args.src) == 1 and src.suffix.lower() == ".jsonl" and not is_token_log(src) \
        and source.reader_options().keys() <= {"experts"} and not source.selects
    if streamed and out_kind not in (".npz", ".jsonl"):
        with bar(None, "convert") as steps:  # streamed into the directory
            trace = read_jsonl(src, source.experts, args.out, steps.update)
    else:
        trace = _routing(source.open(0, runspec.SchedulePart()), args.src)
        draft = draft_of(trace)
        if draft is not None and out_kind != ".npz":
            raise InputError(f"{args.src[0]} holds draft (MTP) layers beside the target's; "
                             f"only an .npz trace holds both: write one")
        with bar(trace.num_steps, "convert") as steps:
            if out_kind == ".jsonl":
                write_jsonl(trace, args.out, steps.update)
            elif out_kind == ".npz":
                memory = to_memory(trace, steps.update)
                if draft is not None and memory.draft is None:  # a view's steps of its draft
                    memory = dataclasses.replace(memory, draft=to_memory(draft))
                save_trace(memory, args.out)
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


SUBCOMMANDS = {
    "info": "summarise a trace file (and flag its warm-up, dummy and outlier steps), or a "
            "request file and the steps a workload batches it into",
    "synth": "generate a synthetic trace",
    "convert": "convert a trace between .npz, the directory form (memory-mapped, for traces "
               "larger than memory) and a JSONL log; or read a request log into a request file",
    "import-sglang": "import SGLang expert-distribution recorder dumps (per_token -> trace, "
                     "per_pass/stat -> counts-only trace)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", required=True)

    def command(name: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=SUBCOMMANDS[name], description=SUBCOMMANDS[name])

    cmd = command("info")
    cmd.add_argument("file", type=Path, nargs="+", metavar="FILE",
                     help="a trace in any form run reads (one file, a folder, or several files "
                     "read as one log), or a request input (a request .npz, vLLM routed "
                     "experts, a per-token log with --request-key)")
    cmd.add_argument("--json", action="store_true", help="print only JSON")
    cmd.add_argument("--coactivation", action="store_true",
                     help="also count the pairs of experts one token chooses: each layer's "
                          "strongest pairs, and what a partition of the experts into --groups "
                          "equal groups keeps together")
    cmd.add_argument("--groups", type=positive, default=8, metavar="G",
                     help="with --coactivation: the groups (GPUs) of the partition (default 8)")
    runspec.add_flags(cmd, "info")
    cmd.set_defaults(handler=info)

    cmd = command("synth")
    cmd.add_argument("scenario", type=registered(SCENARIOS, "scenario"), metavar="SCENARIO",
                     help="the scenario: " + ", ".join(sorted(SCENARIOS)))
    cmd.add_argument("--out", type=Path, required=True, help="the .npz trace to write")
    runspec.add_flags(cmd, "synth")
    cmd.set_defaults(handler=synth)

    cmd = command("convert")
    cmd.add_argument("src", type=Path, nargs="+", metavar="SRC",
                     help="a trace in any form run reads (one file, a folder, or several files "
                     "read as one log; a .jsonl router log of {step, layer, topk_ids} lines is "
                     "streamed), or a request input")
    cmd.add_argument("--out", type=Path, required=True,
                     help="DST: ending in .npz writes .npz, in .jsonl a router log, anything "
                     "else a directory (a .jsonl source is streamed into it)")
    cmd.add_argument("--force", action="store_true",
                     help="replace --out even when it is not what convert writes (an unrelated "
                     "file, or a folder holding other files, which are deleted)")
    runspec.add_flags(cmd, "convert")
    cmd.set_defaults(handler=convert)

    cmd = command("import-sglang")
    cmd.add_argument("paths", type=Path, nargs="+", metavar="PATH",
                     help="dump files written by torch.save (one per rank; stat: rank 0's)")
    cmd.add_argument("--out", type=Path, required=True, help="the .npz to write")
    cmd.add_argument("--experts", type=positive, default=None,
                     help="logical experts E (default: the largest logical id + 1)")
    cmd.add_argument("--top-k", type=positive, default=None,
                     help="the model's top-k: keep that many id columns (default: all)")
    cmd.set_defaults(handler=import_dumps)
