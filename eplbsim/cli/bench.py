"""`eplbsim bench`: the dispatch hot path against the torch expression and the roofline, and a
full replay (`eplbsim.replay.bench`)."""

from __future__ import annotations

import argparse
import math

import torch

from ..base.errors import InputError
from ..base.files import check_memory
from ..base.progress import bar
from ..replay import bench as B
from ..replay import resolve_device
from ..replay.results import to_json
from ..runspec import Device
from .common import positive, seed, split

HELP = ("time the dispatch hot path against the torch expression and the roofline "
        "(DeepSeek-V3 shape), and a replay")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    p.add_argument("--n", default=None, help="comma-separated pair counts N, e.g. 1e6,1e7 "
                   "(default 1e6,1e7 on CPU, 1e8 on CUDA)")
    p.add_argument("--policies", default="row,ordinal,static,random",
                   help="comma-separated, from row, ordinal, static, random")
    p.add_argument("--repeats", type=positive, default=5,
                   help="timed runs after warm-up; the best is reported (default 5)")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                   help="also time a full replay of 32 ranks beside its kernel calls, for "
                   "--policies in --replay-modes (default on)")
    p.add_argument("--replay-modes", default="none,a2a",
                   help="comma-separated modes of the replay (default none,a2a)")
    p.add_argument("--replay-steps", type=positive, default=None,
                   help="replay steps (default 16)")
    p.add_argument("--replay-tokens", type=positive, default=None,
                   help="replay tokens per step (default 4096)")
    p.add_argument("--replay-layers", type=positive, default=None,
                   help="replay layers (default 58)")
    p.add_argument("--replay-repeats", type=positive, default=3,
                   help="timed replays (and kernel runs) per row; the best is reported "
                   "(default 3)")
    p.add_argument("--end-to-end", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the whole `eplbsim run` on a DeepSeek-V3-shaped trace of "
                   "2 and of 130 steps, a process each: its throughput is the two lengths' "
                   "difference (default on)")
    p.add_argument("--end-to-end-form", choices=("dir", "npz"), default="dir",
                   help="the trace file the end-to-end run reads: dir (the uncompressed "
                   "directory form, default) or npz (compressed)")
    p.add_argument("--seed", type=seed, default=0,
                   help="seeds the random ids and the replay's scenario (default 0)")
    p.add_argument("--json", action="store_true", help="print only a JSON array of rows")


def _pair_counts(text: str) -> list[int]:
    """`--n 1e6,1e7` -> [1000000, 10000000]: positive whole numbers, plain or in e-notation."""
    counts = []
    for item in split(text, "n"):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 1 or value != int(value):
            raise InputError(f"--n takes positive whole numbers such as 1e6, got {item!r}")
        check_memory(value * 4 * B.BYTES_PER_PAIR, f"--n {item}: {value:.0f} pairs",
                     "time fewer pairs")  # ids, slots and the contenders' temporaries
        counts.append(int(value))
    return counts


def _check_replay_size(args: argparse.Namespace) -> None:
    """InputError when the replay's trace (`--replay-steps` x `--replay-tokens` x
    `--replay-layers` x K pairs: an int32 id and an int64 slot each) would not fit in memory."""
    S, T, L = (getattr(args, f"replay_{key}") or B.REPLAY_SIZE[key]
               for key in ("steps", "tokens", "layers"))
    pairs = S * T * L * B.TOP_K
    check_memory(pairs * B.BYTES_PER_PAIR, f"the replay's trace of {S} steps x {T} tokens x "
                 f"{L} layers ({pairs:,} pairs)", "give it fewer --replay-steps, "
                 "--replay-tokens or --replay-layers")


def handle(args: argparse.Namespace) -> int:
    device = resolve_device(Device().check(args.device))
    policies = split(args.policies, "policies")
    for p in policies:
        if p not in B.BENCH_POLICIES:
            raise InputError(f"unknown bench policy {p!r}; choose from "
                             f"{', '.join(B.BENCH_POLICIES)}")
    modes = split(args.replay_modes, "replay-modes")
    for m in modes:
        if m not in B.REPLAY_MODES:
            raise InputError(f"unknown mode {m!r}; choose from {', '.join(B.REPLAY_MODES)}")
    ns = _pair_counts(args.n) if args.n is not None else None
    if args.replay:
        _check_replay_size(args)
    sizes = len(ns or B.DEFAULT_N.get(torch.device(device).type, B.DEFAULT_N["cpu"]))
    total = len(policies) * (sizes + (len(modes) if args.replay else 0))
    with bar(total, "bench", "row") as rows_done:
        rows = B.bench_dispatch(ns, policies, device, args.repeats, args.seed,
                                rows_done.update)
        replay_rows = B.replay_throughput(device, args.replay_steps, args.replay_tokens,
                                          args.replay_layers, policies, modes, args.seed,
                                          args.replay_repeats, rows_done.update) \
            if args.replay else []
    e2e = ([B.end_to_end(seed=args.seed, device=device, form=args.end_to_end_form)]
           if args.end_to_end else [])
    if args.json:
        print(to_json(rows + replay_rows + e2e))
        return 0
    print(B.format_dispatch_table(rows))
    if replay_rows:
        print()
        print(B.format_replay_table(replay_rows))
    for row in e2e:
        print()
        print(B.format_end_to_end(row))
    return 0
