"""The `eplbsim` command: run, trace info, trace synth, solve, bench.

Errors in the user's input end with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import metrics as M
from .traces.counts import (CountsTrace, is_counts_file, load_counts_csv, load_counts_trace,
                     load_layer_counts, parse_where)
from .dispatch.policies import resolve_policy
from .errors import InputError
from .placement import VIEWS, Placement
from .schedule.predictors import PREDICTORS
from .ranks import MODES, RNG_RELATIONS
from .schedule.plan import DEEPSEEK_V3_EXPERT_BYTES
from .registry import name_of
from .replay import ReplayConfig, Results, compare, promise_only
from .results import (DECOMPOSITION_COLUMNS, MIGRATION_COLUMNS, format_table, series_rows,
                      to_json, write_csv, write_results)
from .solvers import SOLVERS, as_load, solve_with_info
from .traces.synth import DEFAULT_SCENARIO, SCENARIOS, synthesize
from .topology import Topology
from .traces.trace import Trace, load_trace, save_trace
from .traces.directory import open_trace

DEFAULT_POLICIES = "static,random,row,ordinal"
# The embedded default scenario of `eplbsim run` (sizes chosen to run in seconds on 2 cores).
RUN_SIZES = {"steps": 32, "tokens": 512, "layers": 4, "experts": 64, "top_k": 8}
REBALANCE_STEPS_HELP = "32; with --rebalance-every N: max(32, window + 4N), for four rebalances"


def _int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `lo`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value
    return parse


_positive, _nonnegative = _int_at_least(1), _int_at_least(0)


def _option(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` with VALUE parsed as JSON when it can be (numbers, true/false), else text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _add_sizes(p: argparse.ArgumentParser, defaults: dict[str, int | None]) -> None:
    p.add_argument("--steps", type=_positive, default=defaults["steps"],
                   help=f"steps (default {defaults['steps'] or REBALANCE_STEPS_HELP})")
    p.add_argument("--tokens", type=_positive, default=defaults["tokens"],
                   help="tokens per step")
    p.add_argument("--layers", type=_positive, default=defaults["layers"])
    p.add_argument("--experts", type=_positive, default=defaults["experts"])
    p.add_argument("--top-k", type=_positive, default=defaults["top_k"])
    p.add_argument("-o", "--option", type=_option, action="append", default=[],
                   metavar="KEY=VALUE", help="scenario option, e.g. sigma=2 or noise=0.1")


def _add_replay_options(p: argparse.ArgumentParser, counts: bool) -> None:
    """The options `run` and `ranks` share: trace or scenario, solver and schedule, policies,
    modes, views, generators, topology (but the GPU count) and `--json`."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="an .npz trace (DESIGN.md §5) or a trace "
                     "directory (see trace convert)" + (
                         ", a counts-only .npz, or a counts CSV (layer,expert,count; see "
                         "--where): counts give the placement's even-split promise only"
                         if counts else ""))
    src.add_argument("--scenario", choices=sorted(SCENARIOS),
                     help=f"a synthetic scenario (default {DEFAULT_SCENARIO})")
    _add_sizes(p, {**RUN_SIZES, "steps": None})
    p.add_argument("--solver", default="deepseek", choices=sorted(SOLVERS))
    if counts:
        p.add_argument("--where", default=None, help="filters for a counts CSV --trace")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated policies (default {DEFAULT_POLICIES})")
    p.add_argument("--mode", default="none,a2a",
                   help="none, a2a, or both comma-separated (default none,a2a)")
    p.add_argument("--view", default="full", choices=sorted(VIEWS))
    p.add_argument("--rng", default="independent", choices=RNG_RELATIONS,
                   help="how the ranks' generators relate (random policy)")
    p.add_argument("--drift-p", type=float, default=0.05,
                   help="per-step drift probability for --rng drift")
    p.add_argument("--gpus-per-node", type=_positive, default=None,
                   help="GPUs per node (default 4 for run; for ranks, torchrun's "
                   "LOCAL_WORLD_SIZE, else all on one node)")
    p.add_argument("--redundant", type=_nonnegative, default=16,
                   help="redundant physical slots (P = E + redundant)")
    p.add_argument("--groups", type=_positive, default=None,
                   help="expert groups (default: the trace's, else 1)")
    p.add_argument("--rebalance-every", type=_positive, default=None, metavar="N",
                   help="re-solve the placement every N steps from predicted loads, the "
                   "first time after the first window (default: once, from the whole trace)")
    p.add_argument("--window", type=_positive, default=None, metavar="W",
                   help="steps of history the predictor reads (default N)")
    p.add_argument("--predictor", default="window", choices=sorted(PREDICTORS),
                   help="window: sum of the last W steps (default); ema: decayed sum; "
                   "oracle: the loads of the steps about to run")
    p.add_argument("--decay", type=float, default=None,
                   help="ema's per-step factor in [0, 1] (default 1 - 1/W)")
    p.add_argument("--initial", default="trivial", metavar="trivial|FILE",
                   help="the placement before the first rebalance: trivial (default) or a "
                   "JSON placement (a `solve --json` output, a bare phy2log [L][P], or an "
                   "SGLang physical_to_logical_map)")
    p.add_argument("--skip-above", type=float, default=None, metavar="B",
                   help="skip a rebalance when the placement in service has a balancedness "
                   "(mean / max GPU load, mean over layers) above B on the forecast")
    p.add_argument("--migration-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="lay each new placement out over the one in service to move fewer "
                   "experts (default on)")
    p.add_argument("--expert-bytes", type=_nonnegative, default=DEEPSEEK_V3_EXPERT_BYTES,
                   help="bytes of one expert's weights, to price migrations (default "
                   f"{DEEPSEEK_V3_EXPERT_BYTES}: a DeepSeek-V3 expert in bf16)")
    p.add_argument("--rank-offset", action="store_true",
                   help="in a2a mode, ordinal adds the rank to its offset")
    p.add_argument("--seed", type=_nonnegative, default=0)
    p.add_argument("--json", action="store_true", help="print only JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eplbsim", description="Replay MoE routing traces through expert placement "
        "solvers and dispatch policies; measure load skew and rank agreement.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="compare dispatch policies on a trace or scenario")
    _add_replay_options(run, counts=True)
    run.add_argument("--gpus", type=_positive, default=8)
    run.set_defaults(gpus_per_node=4)
    run.add_argument("--per-layer", action="store_true",
                     help="with --out, the time series per step and layer")
    run.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    run.add_argument("--out", type=Path, help="write results.json, results.csv, "
                     "timeseries.csv, migrations.csv and the figures policies.png and "
                     "timeseries.png (with PDFs)")

    ranks = sub.add_parser("ranks", help="run the dispatch on real torch.distributed "
                           "processes (gloo on CPU, NCCL on CUDA) and check every metric "
                           "against the in-process simulation")
    ranks.add_argument("--world-size", type=_positive, default=None,
                       help="ranks = GPUs to spawn locally (under torchrun: the launched "
                       "group's, which this must match if given)")
    _add_replay_options(ranks, counts=False)
    ranks.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="cpu (gloo, default) or cuda (NCCL, one GPU per rank)")
    ranks.add_argument("--port", type=_nonnegative, default=0,
                       help="rendezvous port on 127.0.0.1 when spawning (default: a free one)")
    ranks.add_argument("--timeout", type=float, default=60.0,
                       help="seconds any one collective may wait before the group is "
                       "stopped (default 60)")

    trace = sub.add_parser("trace", help="inspect or generate traces")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    info = tsub.add_parser("info", help="summarise a trace file")
    info.add_argument("file", type=Path)
    info.add_argument("--json", action="store_true")
    syn = tsub.add_parser("synth", help="generate a synthetic trace")
    syn.add_argument("scenario", choices=sorted(SCENARIOS))
    syn.add_argument("--out", type=Path, required=True)
    _add_sizes(syn, {"steps": 32, "tokens": 256, "layers": 4, "experts": 64, "top_k": 8})
    syn.add_argument("--seed", type=_nonnegative, default=0)
    conv = tsub.add_parser("convert", help="convert a trace between .npz and the directory "
                           "form (memory-mapped, for traces larger than memory)")
    conv.add_argument("src", type=Path, help="an .npz trace, a trace directory or a .jsonl "
                      "router log ({step, layer, topk_ids} per line)")
    conv.add_argument("--out", type=Path, required=True,
                      help="DST: ending in .npz writes .npz, in .jsonl a router log, anything "
                      "else a directory (a .jsonl source is streamed into it)")
    conv.add_argument("--experts", type=_positive, default=None,
                      help="logical experts E of a .jsonl source (default: largest id + 1)")
    imp = tsub.add_parser("import-sglang", help="import SGLang expert-distribution recorder "
                          "dumps (per_token -> trace, per_pass/stat -> counts-only trace)")
    imp.add_argument("paths", type=Path, nargs="+", metavar="PATH",
                     help="dump files written by torch.save (one per rank; stat: rank 0's)")
    imp.add_argument("--out", type=Path, required=True, help="the .npz to write")
    imp.add_argument("--experts", type=_positive, default=None,
                     help="logical experts E (default: the largest logical id + 1)")
    imp.add_argument("--top-k", type=_positive, default=None,
                     help="the model's top-k: keep that many id columns (default: all)")

    sol = sub.add_parser("solve", help="solve a placement for expert loads (a JSON [L][E] "
                         "matrix or a counts CSV)")
    loads = sol.add_mutually_exclusive_group(required=True)
    loads.add_argument("--load", type=Path, help="a JSON [layers][experts] load matrix")
    loads.add_argument("--counts", type=Path,
                       help="a CSV with columns layer,expert,count (others can be filtered on), "
                       "a counts-only .npz, or a trace .npz (summed over steps)")
    sol.add_argument("--where", default=None,
                     help="filters for --counts, e.g. model=olmoe,domain=arxiv")
    sol.add_argument("--experts", type=_positive, default=None,
                     help="experts in --counts (default: the largest id + 1)")
    slots = sol.add_mutually_exclusive_group()
    slots.add_argument("--slots", type=_positive, default=None,
                       help="physical slots P (default: experts + --redundant)")
    slots.add_argument("--redundant", type=_nonnegative, default=0,
                       help="redundant slots, P = E + redundant (default 0)")
    sol.add_argument("--gpus", type=_positive, required=True)
    sol.add_argument("--gpus-per-node", type=_positive, default=None)
    sol.add_argument("--groups", type=_positive, default=1)
    sol.add_argument("--solver", default="deepseek", choices=sorted(SOLVERS))
    sol.add_argument("--anti-colocation", action="store_true",
                     help="no two replicas of one expert on one GPU")
    sol.add_argument("--previous", type=Path, default=None,
                     help="the placement in service (JSON phy2log [L][P], or a previous "
                     "`solve --json` output): change as few slots as possible")
    sol.add_argument("-o", "--option", type=_option, action="append", default=[],
                     metavar="KEY=VALUE", help="solver option, e.g. time_limit=10")
    sol.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="time the dispatch hot path against the torch "
                           "expression and the roofline (DeepSeek-V3 shape), and a replay")
    bench.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    bench.add_argument("--n", default=None, help="comma-separated pair counts N, e.g. 1e6,1e7 "
                       "(default 1e6,1e7 on CPU, 1e8 on CUDA)")
    bench.add_argument("--policies", default="row,ordinal,static,random",
                       help="comma-separated, from row, ordinal, static, random")
    bench.add_argument("--repeats", type=_positive, default=5,
                       help="timed runs after warm-up; the best is reported (default 5)")
    bench.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                       help="also time a full none-mode replay of 32 ranks (default on)")
    bench.add_argument("--replay-steps", type=_positive, default=None,
                       help="replay steps (default 16)")
    bench.add_argument("--replay-tokens", type=_positive, default=None,
                       help="replay tokens per step (default 4096)")
    bench.add_argument("--replay-layers", type=_positive, default=None,
                       help="replay layers (default 58)")
    bench.add_argument("--seed", type=_nonnegative, default=0)
    bench.add_argument("--json", action="store_true", help="print only a JSON array of rows")

    from .sweep import EXECUTORS
    swp = sub.add_parser("sweep", help="run a grid of replays from a TOML spec into one table",
                         description="Run the cells of a sweep spec (scenarios or traces x "
                         "solvers x policies x modes x topologies x seeds) into "
                         "DIR/results.csv (and .parquet with pyarrow), resuming what DIR "
                         "already holds.")
    swp.add_argument("spec", type=Path, help="the sweep spec, TOML (format: eplbsim.sweep's "
                     "doc)")
    swp.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="output directory (default: the spec's out); a rerun resumes it")
    swp.add_argument("--executor", choices=EXECUTORS, default="local",
                     help="local processes (default) or Ray tasks (the ray extra)")
    swp.add_argument("--workers", type=_positive, default=None, metavar="N",
                     help="local processes, or the CPUs of a local Ray instance (default: "
                     "all cores)")
    swp.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                     help="the Ray cluster to run on (default: start a local instance)")
    figs = sub.add_parser("figures", help="rebuild the paper figures (PDF and PNG), "
                          "deterministically")
    figs.add_argument("--out", type=Path, default=Path("figures"),
                      help="folder to write NAME.pdf and NAME.png into (default figures/)")
    figs.add_argument("--only", default=None,
                      help="comma-separated figure names (default all; see --list)")
    figs.add_argument("--list", action="store_true", help="print the figure names and exit")

    exp = sub.add_parser("export", help="write a placement (or expert loads) in a form a "
                         "serving engine loads")
    exp.add_argument("--format", required=True, choices=["sglang"],
                     help="sglang: the JSON of --init-expert-location")
    what = exp.add_mutually_exclusive_group(required=True)
    what.add_argument("--placement", type=Path, help="a `solve --json` output or a bare JSON "
                      "phy2log [L][P]; writes physical_to_logical_map")
    what.add_argument("--counts", type=Path, help="a counts-only or trace .npz; writes "
                      "logical_count (the engine runs its own solver)")
    exp.add_argument("--num-model-layers", type=_positive, default=None,
                     help="layers of the model, dense ones included (default: the trace's "
                     "num_model_layers)")
    exp.add_argument("--moe-layers", default=None,
                     help="model layer of each MoE layer, e.g. 1,2,3 (default: the file's "
                     "layers / model_layers, else 0..L-1)")
    exp.add_argument("--experts", type=_positive, default=None,
                     help="logical experts E (default: from the file)")
    exp.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    return parser


def _split(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"--{what} needs at least one name")
    return items


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {name} asked for CUDA, but torch sees no CUDA device")
    try:
        torch.device(name)
    except RuntimeError:
        raise InputError(f"unknown device {name!r}; use cpu, cuda or auto") from None
    return name


def _scenario_trace(args: argparse.Namespace, scenario: str) -> Trace:
    return synthesize(scenario, steps=args.steps, tokens=args.tokens, layers=args.layers,
                      experts=args.experts, top_k=args.top_k, seed=args.seed,
                      **dict(args.option))


def _counts_input(path: Path, where: str | None) -> CountsTrace | None:
    """The counts-only trace at `path` (a counts CSV or counts `.npz`), or None for a trace."""
    if path.suffix.lower() == ".csv":
        counts = load_counts_csv(path, parse_where(where))
        return CountsTrace(counts.load[None], {"source": str(path),
                                              "model_layers": list(counts.layers)})
    if where:
        raise InputError("--where filters a counts CSV only")
    return load_counts_trace(path) if is_counts_file(path) else None


def cmd_run(args: argparse.Namespace) -> int:
    _default_steps(args)
    counts = _counts_input(args.trace, args.where) if args.trace else None
    if counts is not None:
        return _run_counts(args, counts)
    trace = open_trace(args.trace) if args.trace else \
        _scenario_trace(args, args.scenario or DEFAULT_SCENARIO)
    policies, modes = _policies_and_modes(args)
    config = ReplayConfig(solver=args.solver, view=args.view, rng=args.rng,
                          drift_p=args.drift_p, seed=args.seed, device=_device(args.device),
                          rank_offset=args.rank_offset, **_placement_options(args, trace))
    results = compare(trace, policies, modes, config)
    rows = [r.row() for r in results]
    if args.json:
        print(to_json(rows))
    else:
        print(_run_header(trace, config))
        print(format_table(rows))
        if args.rebalance_every is not None:
            print()
            print(_rebalance_report(results[0], rows))
    if args.out:
        from .plots import policy_comparison, save_figure, time_series_figure
        paths = write_results(rows, args.out)
        paths.append(write_csv([row for r in results for row in series_rows(
            {"policy": r.policy, "mode": r.config.mode}, r.time_series(args.per_layer))],
            args.out / "timeseries.csv"))
        paths.append(write_csv(results[0].migrations(), args.out / "migrations.csv"))
        paths += save_figure(policy_comparison(results), args.out / "policies.pdf")
        paths += save_figure(time_series_figure(results), args.out / "timeseries.pdf")
        if not args.json:
            print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _default_steps(args: argparse.Namespace) -> None:
    """`--steps` left out: RUN_SIZES's, or with `--rebalance-every N` enough for four
    rebalances after the first window (REBALANCE_STEPS_HELP)."""
    if args.steps is None:
        every = args.rebalance_every
        args.steps = (RUN_SIZES["steps"] if every is None else
                      max(RUN_SIZES["steps"], (args.window or every) + 4 * every))


def _policies_and_modes(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The validated `--policies` and `--mode` lists."""
    modes = _split(args.mode, "mode")
    for m in modes:
        if m not in MODES:
            raise InputError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    policies = _split(args.policies or DEFAULT_POLICIES, "policies")
    for p in policies:
        resolve_policy(p)
    return policies, modes


def cmd_ranks(args: argparse.Namespace) -> int:
    from .distributed import (GroupFailure, TraceSource, join_launched, launch,
                              launched_by_torchrun)
    torchrun = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    if world is None:
        raise InputError("--world-size is required (or start the command under torchrun)")
    if torchrun and args.world_size not in (None, world):
        raise InputError(f"--world-size {args.world_size} differs from torchrun's group of "
                         f"{world}")
    if args.gpus_per_node is None and torchrun:
        args.gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    args.gpus = world
    _default_steps(args)
    if args.trace is not None:
        if _counts_input(args.trace, None) is not None:
            raise InputError(f"{args.trace} holds expert counts, not token rows: ranks need "
                             f"tokens to dispatch")
        source = TraceSource(path=str(args.trace))
    else:
        source = TraceSource(scenario=args.scenario or DEFAULT_SCENARIO, options=dict(
            steps=args.steps, tokens=args.tokens, layers=args.layers, experts=args.experts,
            top_k=args.top_k, seed=args.seed, **dict(args.option)))
    trace = source.load()  # bad input fails here, before any process starts
    policies, modes = _policies_and_modes(args)
    base = ReplayConfig(solver=args.solver, view=args.view, rng=args.rng, drift_p=args.drift_p,
                        seed=args.seed, rank_offset=args.rank_offset,
                        **_placement_options(args, trace))
    Topology(base.num_gpus, base.gpus_per_node)
    configs = [replace(base, policy=p, mode=m) for m in modes for p in policies]
    try:
        rows = (join_launched(source, configs, device=args.device, timeout=args.timeout)
                if torchrun else launch(source, configs, world, device=args.device,
                                        port=args.port, timeout=args.timeout))
    except GroupFailure as exc:
        print(f"eplbsim: error: {exc}", file=sys.stderr)
        return 1
    if not rows:  # a torchrun rank other than 0
        return 0
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{world} ranks ({rows[0]['backend']}, {args.device}) | "
              + _run_header(trace, base))
        print(format_table([_ranks_cells(r) for r in rows], RANKS_COLUMNS, labels=3))
        matched = sum(r["match"] for r in rows)
        print(f"{matched} of {len(rows)} configurations: every metric of the real processes "
              f"equals the in-process simulation's")
    return 0 if all(r["match"] for r in rows) else 1


RANKS_COLUMNS = tuple((h, h, None) for h in (
    "policy", "mode", "rng", "agree", "agree_sim", "c=0", "c=1", "c>=2", "out_err",
    "out_err_sim", "gpu_imb", "gpu_imb_sim", "match"))


def _ranks_cells(row: dict[str, Any]) -> dict[str, Any]:
    """A `ranks` report row as table cells: real and simulated side by side."""
    m = row["metrics"]
    mult = m["multiplicity"]["real"] or {}
    wrong = [k for k, v in m.items() if not v["match"]]
    return {"policy": row["policy"], "mode": row["mode"], "rng": row["rng"],
            "agree": m["rank_agreement"]["real"], "agree_sim": m["rank_agreement"]["sim"],
            "c=0": mult.get("0"), "c=1": mult.get("1"), "c>=2": mult.get("2+"),
            "out_err": m["output_rel_error"]["real"],
            "out_err_sim": m["output_rel_error"]["sim"],
            "gpu_imb": m["gpu_imbalance"]["real"], "gpu_imb_sim": m["gpu_imbalance"]["sim"],
            "match": "yes" if not wrong else "NO: " + ",".join(wrong)}


def _placement_options(args: argparse.Namespace, trace: Trace | CountsTrace) -> dict[str, Any]:
    """The ReplayConfig fields for topology, solver schedule and migration pricing."""
    topo = Topology(args.gpus, args.gpus_per_node)
    initial = None
    if args.initial != "trivial":
        initial = _placement_file(Path(args.initial), trace, topo)
    return dict(num_gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                num_redundant=args.redundant, num_groups=args.groups,
                rebalance_every=args.rebalance_every, window=args.window,
                predictor=args.predictor, decay=args.decay, initial=initial,
                skip_above=args.skip_above, migration_aware=args.migration_aware,
                expert_bytes=args.expert_bytes)


def _placement_file(path: Path, trace: Trace | CountsTrace, topology: Topology) -> Placement:
    """The placement in a JSON file for `trace` on `topology`: a `solve --json` output, a bare
    phy2log `[L][P]`, or an SGLang `physical_to_logical_map` (`[L_model][P]`, its rows picked
    by the trace's `model_layers` when the counts differ)."""
    from .placement_io import PLACEMENT_KEY, read_sglang_placement
    data = _read_json(path, "a JSON placement")
    E = trace.num_experts
    if isinstance(data, dict) and PLACEMENT_KEY in data:
        moe = trace.meta.get("model_layers")
        rows = data[PLACEMENT_KEY]
        picked = moe if isinstance(rows, list) and len(rows) != trace.num_layers else None
        phy2log = read_sglang_placement(data, E, picked)
    else:
        phy2log = _phy2log_of(data, path)
    try:
        tensor = torch.tensor(phy2log, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InputError(f"{path}: phy2log is not a [layers][slots] list of integers") from None
    placement = Placement(tensor, E, topology)
    if placement.num_layers != trace.num_layers:
        raise InputError(f"{path}: the placement has {placement.num_layers} layers; the trace "
                         f"has {trace.num_layers}")
    return placement


def _phy2log_of(data: Any, path: Path) -> Any:
    """The phy2log of a JSON placement: a `solve --json` object's key, or the bare list."""
    if not isinstance(data, dict):
        return data
    if data.get("phy2log") is None:
        raise InputError(f"{path}: a JSON object placement needs a phy2log key")
    return data["phy2log"]


def _rebalance_report(result: Results, rows: list[dict[str, Any]]) -> str:
    """The decomposition of every row and the migration table of the (shared) schedule."""
    cfg = result.config
    migrations = result.migrations()
    lines = ["executed imbalance = solver x prediction x dispatch (means over steps and "
             "layers):", format_table(rows, DECOMPOSITION_COLUMNS), "",
             f"rebalances (predictor {name_of(cfg.predictor)}, every {cfg.rebalance_every}, "
             f"window {cfg.window or cfg.rebalance_every}, expert {cfg.expert_bytes} bytes):"]
    lines.append(format_table(migrations, MIGRATION_COLUMNS, labels=0) if migrations else
                 "  none: the trace ends before the first window does")
    return "\n".join(lines)


def _run_counts(args: argparse.Namespace, counts: CountsTrace) -> int:
    """`run` on counts only: the placement's even-split promise; no policy can run."""
    if args.policies:
        raise InputError(f"{args.trace} holds expert counts, not token rows: dispatch policies "
                         f"choose a replica per (token, slot), so none can run on it; without "
                         f"--policies, run reports the placement's even-split promise")
    config = ReplayConfig(solver=args.solver, seed=args.seed,
                          **_placement_options(args, counts))
    rows = [promise_only(counts, config)]
    if args.json:
        print(to_json(rows))
        return 0
    print(f"{args.trace}: counts only, {counts.num_steps} steps, {counts.num_layers} layers, "
          f"E={counts.num_experts} | {args.gpus} GPUs, P={counts.num_experts + args.redundant} "
          f"slots, solver {args.solver}: the placement's even-split promise (no token rows, "
          f"so no dispatch)")
    print(format_table(rows))
    if args.out:
        print("wrote " + ", ".join(str(p) for p in write_results(rows, args.out)))
    return 0


def _run_header(trace: Trace, cfg: ReplayConfig) -> str:
    source = trace.meta.get("scenario") or trace.meta.get("source") or "trace"
    P = trace.num_experts + cfg.num_redundant
    per_step = trace.num_tokens / trace.num_steps
    return (f"{source}: {trace.num_steps} steps x {per_step:g} tokens, "
            f"{trace.num_layers} layers, E={trace.num_experts}, K={trace.top_k} | "
            f"{cfg.num_gpus} GPUs ({cfg.gpus_per_node or cfg.num_gpus}/node), P={P} slots, "
            f"solver {cfg.solver}, view {cfg.view}, rng {cfg.rng}, seed {cfg.seed}")


def trace_summary(trace: Trace) -> dict[str, Any]:
    """Sizes and the expert-load skew (max / mean expert load) per layer."""
    counts = trace.counts().to(torch.float64)  # [S, L, E]
    whole_skew = M.max_over_mean(counts.sum(0))  # [L]
    step_skew = M.max_over_mean(counts)  # [S, L]
    tps = trace.tokens_per_step
    pairs = trace.num_tokens * trace.num_layers * trace.top_k
    padding = pairs - int(counts.sum())
    has_src = trace.num_steps > 0 and trace.step_src_rank(0) is not None
    return {
        "steps": trace.num_steps, "tokens": trace.num_tokens,
        "tokens_per_step": {"min": int(tps.min()), "mean": float(tps.double().mean()),
                            "max": int(tps.max())},
        "layers": trace.num_layers, "experts": trace.num_experts, "top_k": trace.top_k,
        "groups": trace.num_groups, "src_rank": has_src,
        "padding_frac": padding / max(pairs, 1),
        "layer_skew": [{"layer": layer,
                        "max_over_mean": M.nanmean_or_none(whole_skew[layer:layer + 1]),
                        "per_step_max_over_mean": M.nanmean_or_none(step_skew[:, layer]),
                        "hottest_expert": int(counts[:, layer].sum(0).argmax())}
                       for layer in range(trace.num_layers)],
        "meta": trace.meta,
    }


def cmd_trace_info(args: argparse.Namespace) -> int:
    info = trace_summary(open_trace(args.file))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    tps = info["tokens_per_step"]
    print(f"{args.file}")
    print(f"  steps {info['steps']}, tokens {info['tokens']} (per step {tps['min']}.."
          f"{tps['max']}, mean {tps['mean']:.1f}), layers {info['layers']}, "
          f"experts {info['experts']}, top-k {info['top_k']}")
    print(f"  groups {info['groups'] or '-'}, src_rank {'yes' if info['src_rank'] else 'no'}, "
          f"padding {info['padding_frac']:.2%}, source {info['meta'].get('source', '-')}")
    print("  layer  max/mean load (whole trace)  mean per-step max/mean  hottest expert")
    for row in info["layer_skew"]:
        whole, step = row["max_over_mean"], row["per_step_max_over_mean"]
        print(f"  {row['layer']:>5}  {'-' if whole is None else f'{whole:.3f}':>27}  "
              f"{'-' if step is None else f'{step:.3f}':>22}  {row['hottest_expert']:>14}")
    return 0


def cmd_trace_synth(args: argparse.Namespace) -> int:
    trace = _scenario_trace(args, args.scenario)
    try:
        save_trace(trace, args.out)
    except OSError as exc:
        raise InputError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    per_step = trace.num_tokens / trace.num_steps
    print(f"wrote {args.out}: {trace.num_steps} steps x {per_step:g} tokens (mean), "
          f"{trace.num_layers} layers, {trace.num_experts} experts, top-{trace.top_k}")
    return 0


def cmd_trace_convert(args: argparse.Namespace) -> int:
    from .traces.formats.jsonl import read_jsonl, write_jsonl
    from .traces.directory import save_trace_dir, to_memory
    out_kind = args.out.suffix.lower()
    if args.src.suffix.lower() == ".jsonl":
        trace = read_jsonl(args.src, args.experts, None if out_kind in (".npz", ".jsonl")
                           else args.out)
    elif args.experts is not None:
        raise InputError("--experts applies to a .jsonl source only")
    else:
        trace = open_trace(args.src)
    if out_kind == ".jsonl":
        write_jsonl(trace, args.out)
        kind = "JSONL router log"
    elif out_kind == ".npz":
        try:
            save_trace(to_memory(trace), args.out)
        except OSError as exc:
            raise InputError(f"cannot write {args.out}: {exc.strerror or exc}") from None
        kind = ".npz"
    else:
        if args.src.suffix.lower() != ".jsonl":  # a .jsonl source was streamed there already
            save_trace_dir(trace, args.out)
        kind = "trace directory"
    print(f"wrote {args.out} ({kind}): {trace.num_steps} steps, {trace.num_tokens} tokens, "
          f"{trace.num_layers} layers, {trace.num_experts} experts, top-{trace.top_k}")
    return 0


def cmd_trace_import(args: argparse.Namespace) -> int:
    from .traces.counts import CountsTrace, save_counts_trace
    from .traces.formats.sglang import import_sglang
    trace = import_sglang(args.paths, args.experts, args.top_k)
    counts_only = isinstance(trace, CountsTrace)
    try:
        (save_counts_trace if counts_only else save_trace)(trace, args.out)
    except OSError as exc:
        raise InputError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    kind = "counts-only trace" if counts_only else f"trace (top-{trace.top_k}, src_rank)"
    print(f"wrote {args.out}: {kind} from SGLang {trace.meta['mode']} dump, "
          f"{trace.num_steps} steps, {trace.num_layers} layers (of "
          f"{trace.meta['num_model_layers']} model layers), {trace.num_experts} experts")
    return 0


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: not {what} ({exc})") from None


def cmd_solve(args: argparse.Namespace) -> int:
    if args.counts is not None:
        counts = load_layer_counts(args.counts, parse_where(args.where), args.experts)
        load, layers = counts.load, list(counts.layers)
    else:
        if args.where or args.experts:
            raise InputError("--where and --experts apply to --counts only")
        load = _read_json(args.load, "a JSON [layers][experts] load matrix")
        layers = None
    options = dict(args.option)
    if args.anti_colocation:
        options["anti_colocation"] = True
    if args.previous is not None:
        options["previous"] = _phy2log_of(_read_json(args.previous, "a JSON phy2log "
                                                     "[layers][slots]"), args.previous)
    topo = Topology(args.gpus, args.gpus_per_node)
    load = as_load(load)  # [L, E] validated
    slots = args.slots or load.shape[1] + args.redundant
    placement, info = solve_with_info(args.solver, load, slots, topo, args.groups, **options)
    routed = torch.from_numpy(load)  # [L, E]
    promised = M.gpu_loads(placement.expected_load(routed), args.gpus)
    gap = M.placement_gap(placement, routed)
    result = {"phy2log": placement.phy2log.tolist(), "logcnt": placement.logcnt.tolist(),
              "placement_imbalance": M.nanmean_or_none(M.gpu_imbalance(promised)),
              "placement_gap": M.nanmean_or_none(gap), "placement_gap_per_layer": gap.tolist(),
              **({"layers": layers} if layers is not None else {}), **info}
    if args.json:
        print(json.dumps(result, default=_plain))
        return 0
    print(f"solver {args.solver}: {placement.num_layers} layers, {placement.num_experts} "
          f"experts, {slots} slots on {args.gpus} GPUs; placement_imbalance "
          f"{result['placement_imbalance']:.4f}, placement_gap {result['placement_gap']:.4f}"
          + (f", moved_slots {info['moved_slots']}" if "moved_slots" in info else ""))
    for layer, row in enumerate(result["phy2log"]):
        name = layers[layer] if layers is not None else layer
        print(f"  layer {name}: {row}")
    return 0


def _plain(value: Any) -> Any:
    """JSON for numpy scalars and arrays in a solver's report."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _pair_counts(text: str) -> list[int]:
    """`--n 1e6,1e7` -> [1000000, 10000000]: positive whole numbers, plain or in e-notation."""
    counts = []
    for item in _split(text, "n"):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 1 or value != int(value):
            raise InputError(f"--n takes positive whole numbers such as 1e6, got {item!r}")
        counts.append(int(value))
    return counts


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench as B
    device = _device(args.device)
    policies = _split(args.policies, "policies")
    for p in policies:
        if p not in B.BENCH_POLICIES:
            raise InputError(f"unknown bench policy {p!r}; choose from "
                             f"{', '.join(B.BENCH_POLICIES)}")
    ns = _pair_counts(args.n) if args.n is not None else None
    rows = B.bench_dispatch(ns, policies, device, args.repeats, args.seed)
    replay_rows = B.replay_throughput(device, args.replay_steps, args.replay_tokens,
                                      args.replay_layers, seed=args.seed) if args.replay else []
    if args.json:
        print(to_json(rows + replay_rows))
        return 0
    print(B.format_dispatch_table(rows))
    if replay_rows:
        print()
        print(B.format_replay_table(replay_rows))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import read_spec, run_sweep
    sweep = read_spec(args.spec)
    out = args.out or sweep.out
    if out is None:
        raise InputError(f"{args.spec}: no output directory; give --out DIR or out in the spec")
    run = run_sweep(sweep, out, args.executor, args.workers, args.address)
    n = len(sweep.cells)
    print(f"{n} cells ({run.ran} run now, {n - run.ran} done before); wrote "
          f"{', '.join(str(p) for p in run.paths)}")
    return 0


def cmd_figures(args: argparse.Namespace) -> int:
    from .figures import FIGURES, build
    if args.list:
        for name, fn in FIGURES.items():
            print(f"{name:22s} {(fn.__doc__ or '').split(chr(10))[0]}")
        return 0
    names = _split(args.only, "only") if args.only else None
    paths = build(args.out, names)
    print(f"wrote {len(paths)} files to {args.out}: " + ", ".join(p.name for p in paths))
    return 0


def _moe_layers_arg(text: str) -> list[int]:
    try:
        return [int(s) for s in _split(text, "moe-layers")]
    except ValueError:
        raise InputError(f"--moe-layers takes comma-separated integers, got {text!r}") from None


def cmd_export(args: argparse.Namespace) -> int:
    from .traces.counts import is_counts_file, load_counts_trace
    from .placement_io import sglang_logical_count, sglang_placement
    meta: dict[str, Any] = {}
    if args.placement is not None:
        data = _read_json(args.placement, "a JSON placement")
        phy2log = _phy2log_of(data, args.placement)
        if isinstance(data, dict) and data.get("layers") is not None:
            meta["model_layers"] = data["layers"]
        experts = args.experts
        if experts is None:
            logcnt = data.get("logcnt") if isinstance(data, dict) else None
            try:
                experts = len(logcnt[0]) if logcnt else max(max(r) for r in phy2log) + 1
            except (TypeError, ValueError, IndexError):
                raise InputError(f"{args.placement}: phy2log is not a [layers][slots] list of "
                                 f"integers") from None
        num_layers = len(phy2log) if isinstance(phy2log, list) else 0
    else:
        if is_counts_file(args.counts):
            ct = load_counts_trace(args.counts)
            counts, meta = ct.counts, ct.meta  # [S, L, E]
        else:
            trace = load_trace(args.counts)
            counts, meta = trace.counts().numpy(), trace.meta  # [S, L, E]
        if args.experts is not None and args.experts != counts.shape[2]:
            raise InputError(f"{args.counts}: holds {counts.shape[2]} experts, --experts says "
                             f"{args.experts}")
        num_layers = counts.shape[1]
    model_layers = args.num_model_layers or meta.get("num_model_layers")
    if model_layers is None:
        raise InputError("--num-model-layers is required (the file does not record the "
                         "model's layer count)")
    if args.moe_layers is not None:
        moe = _moe_layers_arg(args.moe_layers)
    else:
        moe = meta.get("model_layers") or list(range(num_layers))
    if args.placement is not None:
        obj = sglang_placement(phy2log, experts, model_layers, moe)
        shape = f"physical_to_logical_map [{model_layers}, {len(obj['physical_to_logical_map'][0])}]"
    else:
        obj = sglang_logical_count(counts, model_layers, moe)
        shape = f"logical_count [{model_layers}, {counts.shape[2]}]"
    try:
        args.out.write_text(json.dumps(obj))
    except OSError as exc:
        raise InputError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {args.out}: sglang {shape}, MoE layers {moe}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"run": cmd_run, "ranks": cmd_ranks, "solve": cmd_solve, "bench": cmd_bench,
                "export": cmd_export, "sweep": cmd_sweep, "figures": cmd_figures}
    if args.command == "trace":
        handler = {"info": cmd_trace_info, "synth": cmd_trace_synth,
                   "import-sglang": cmd_trace_import,
                   "convert": cmd_trace_convert}[args.trace_command]
    else:
        handler = handlers[args.command]
    try:
        return handler(args)
    except InputError as exc:
        print(f"eplbsim: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
