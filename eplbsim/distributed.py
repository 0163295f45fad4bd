"""Real ranks: the dispatch on `G` torch.distributed processes, checked against the simulation.

Dimensions: `S` steps, `T` tokens in a step, `L` layers, `E` logical experts, `K` top-k,
`P` physical slots, `G` ranks = GPUs, `D` hidden size of the toy MoE layer.

Each rank is one process holding only what an EP rank of a serving engine holds: its rank id,
its view of the placement, its own random generator (related to the others' as `independent`,
`shared` or `drift`, exactly as in the simulation), and in "a2a" only its own tokens (it reads
the trace and keeps its rows). It runs the simulation's policy functions
(`kernels.dispatch_step`) on its device. Per step (all layers at once):
  - "none": every rank dispatches every token; the choices are all-gathered (agreement); each
    rank executes the pairs it sent to itself with the toy MoE layer and the partial outputs
    `[L, T, D]` are all-reduced, exactly the mechanism that corrupts outputs when ranks
    disagree; the executed masks are all-reduced into the multiplicity `c` of every pair;
  - "a2a": each rank dispatches its own tokens; the choices are all-gathered (each pair goes
    to one GPU, `c = 1`); agreement and output error are undefined, as in the simulation;
  - the executed slot loads are all-reduced.
The routed counts are all-reduced before the run and rank 0 solves the schedule and broadcasts
every placement, as an engine's rebalancer does. Rank 0 turns what it gathered into the same
metrics as `replay` (`replay.measured`), runs the in-process simulation of the same
configuration, and reports both side by side. Toy-MoE pair outputs lie on a dyadic grid
(`moe.GRID_BITS`) so the all-reduce sums exactly and every metric is expected to match bit for
bit.

Backends: gloo on CPU, NCCL on CUDA. `launch` spawns `G` local processes (127.0.0.1, a free
port); `join_launched` joins a group started by `torchrun` (environment `RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`), so one command runs across hosts. A rank that dies or raises, a
port in use, or a collective that hangs past `timeout` ends the whole group with one
`GroupFailure` message; `launch` leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import metrics as M
from .dispatch.policies import DispatchContext, resolve_policy
from .errors import InputError
from .dispatch.kernels import dispatch_step
from .moe import error_terms, make_toy_moe, pair_outputs, token_inputs
from .placement import Placement, rank_view
from .ranks import (MODES, check_choices, drift_before_step, flat_index,
                    make_rank_generators, token_owners)
from .schedule.plan import Segment, plan
from .replay import ReplayConfig, Results, measured, replay
from .timeseries import Counters, placement_epochs
from .topology import Topology
from .traces.trace import Trace
from .traces.directory import open_trace

STARTUP_SECONDS = 300  # how long ranks may take to start and meet (imports are slow)


class GroupFailure(Exception):
    """The process group could not finish: a rank died or raised, a port was taken, or a
    collective timed out. The message says which and why, in one line."""


@dataclass(frozen=True)
class TraceSource:
    """How every rank gets the trace: a file (`path`) or a seeded scenario (`scenario` with
    `options`: sizes, seed and scenario options for `synth.synthesize`)."""

    path: str | None = None
    scenario: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Trace:
        if self.path is not None:
            return open_trace(self.path)
        from .traces.synth import synthesize
        return synthesize(self.scenario, **self.options)


@dataclass(frozen=True)
class Fault:
    """A fault to inject (for tests of clean failure): at `step` of the first configuration,
    rank `rank` dies (`"die"`: killed by SIGKILL), hangs (`"hang"`: sleeps, never joining the
    next collective) or raises (`"raise"`)."""

    rank: int
    kind: str
    step: int = 0


def compare_metrics(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{key: {"real", "sim", "match"}}` for every metric key of `real`; `match` is exact
    equality (multiplicity compared key by key), None matching None."""
    return {key: {"real": value, "sim": sim.get(key), "match": value == sim.get(key)}
            for key, value in real.items()}


# ----------------------------------------------------------------------------- one rank

def run_rank(trace: Trace, cfg: ReplayConfig, rank: int, device: torch.device,
             group: Any = None, fault: Fault | None = None) -> Results | None:
    """Run `cfg` as rank `rank` of the initialised default process group (`G` = its size,
    which must equal `cfg.num_gpus`). Returns rank 0's measured Results, None elsewhere."""
    G = dist.get_world_size(group)
    if cfg.num_gpus != G:
        raise InputError(f"the configuration has {cfg.num_gpus} GPUs; the group has {G} ranks")
    if cfg.mode not in MODES:
        raise InputError(f"unknown mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
    policy = resolve_policy(cfg.policy)
    S, L, E, K = trace.num_steps, trace.num_layers, trace.num_experts, trace.top_k
    a2a = cfg.mode == "a2a"

    # routed counts: all tokens in "none"; in "a2a" each rank's own, all-reduced
    own = [_own_rows(trace, s, G, rank) if a2a else None for s in range(S)]
    if a2a:
        true_load = _all_reduce(torch.stack([_counts(trace.step(s)[rows], E)
                                             for s, rows in enumerate(own)]), device, group)
    else:
        true_load = trace.counts()  # [S, L, E]
    segments = _broadcast_plan(true_load, cfg, trace, rank, group)

    gens = make_rank_generators(cfg.rng, cfg.seed, G, device, cfg.drift_p, ranks=[rank])
    moe = make_toy_moe(L, E, cfg.hidden, cfg.seed, device) if not a2a else None
    P = segments[0].placement.num_slots
    slot_load = torch.zeros(S, L, P, dtype=torch.int64)
    counters = Counters.zeros(S, L, G)
    agreed, valid, mult, error, drifted = (counters.agreed, counters.valid, counters.mult,
                                           counters.error, counters.drift)
    for start, stop, placement in placement_epochs(segments):
        view = rank_view(cfg.view, placement, rank).to(device)
        slot_gpu = placement.slot_gpu.to(device)
        for s in range(start, stop):
            if fault is not None and fault.rank == rank and fault.step == s:
                _inject(fault)
            ids = trace.step(s).to(device)  # [T, L, K] every token
            mine = ids if own[s] is None else ids[own[s].to(device)]  # [T_r, L, K]
            hit = drift_before_step(gens, [mine.shape[0] * K])[0]
            drifted[s] = _all_gather(torch.tensor([int(hit)], device=device), group).view(G).bool()
            ctx = DispatchContext(s, 0, rank, cfg.seed, gens.generators[0], cfg.mode,
                                  cfg.rank_offset)
            phys = dispatch_step(policy, mine, view, ctx).long()  # [T_r, L, K]
            check_choices(phys, mine, placement, policy)
            if a2a:
                executed_by_me = None
                counted_pairs = mine >= 0  # this rank's pairs, each executed once where sent
            else:
                chosen_all = _all_gather(phys, group)  # [G, T, L, K]
                executed_by_me = (slot_gpu[phys.clamp(min=0)] == rank) & (ids >= 0)
                counted_pairs = executed_by_me
                agreed[s] = ((chosen_all == chosen_all[0]).all(0) & (ids >= 0)).sum((0, 2)).cpu()
            counted = torch.bincount(flat_index(phys, P)[counted_pairs],
                                     minlength=L * P).view(L, P)
            slot_load[s] = _all_reduce(counted, device, group).cpu()
            valid_pairs = (mine >= 0).sum((0, 2))  # [L]
            valid[s] = (_all_reduce(valid_pairs, device, group) if a2a else valid_pairs).cpu()
            if a2a:
                mult[s, :, 1] = valid[s]
                continue
            c = _all_reduce(executed_by_me.long(), device, group)  # [T, L, K] multiplicity
            mult[s] = M.multiplicity_counts(c, ids >= 0)
            error[s] = _all_reduced_error(moe, s, ids, executed_by_me, device, group)
    if rank != 0:
        return None
    return measured(cfg, slot_load, true_load.cpu(), segments, counters)


def _own_rows(trace: Trace, s: int, num_ranks: int, rank: int) -> torch.Tensor:
    """Rows of step `s` owned by `rank` in "a2a" (`ranks.token_owners`)."""
    owners = token_owners(int(trace.step_offsets[s + 1] - trace.step_offsets[s]), num_ranks,
                          trace.step_src_rank(s))
    return (owners == rank).nonzero().squeeze(1)


def _counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed pairs per (layer, expert) of ids `[T, L, K]`: int64 `[L, E]`."""
    L = ids.shape[1]
    return torch.bincount(flat_index(ids, num_experts)[ids >= 0],
                          minlength=L * num_experts).view(L, num_experts)


def _all_reduced_error(moe: Any, step: int, ids: torch.Tensor, executed_by_me: torch.Tensor,
                       device: torch.device, group: Any) -> torch.Tensor:
    """This rank's partial toy-MoE outputs (the pairs it executes), all-reduced over the group,
    against the exact output: `(||Y - Y_exact||^2, ||Y_exact||^2)` per layer, float64 `[L, 2]`."""
    T, L, K = ids.shape
    x, gates = token_inputs(moe, step, T, K)
    pairs = [pair_outputs(moe, layer, ids[:, layer], x, gates) for layer in range(L)]
    partial = torch.stack([(p * executed_by_me[:, layer].unsqueeze(-1)).sum(1)
                           for layer, p in enumerate(pairs)])  # [L, T, D]
    summed = _all_reduce(partial, device, group)
    out = [error_terms(summed[layer] - p.sum(1), p.sum(1)) for layer, p in enumerate(pairs)]
    return torch.tensor(out, dtype=torch.float64).view(L, 2)


def _broadcast_plan(true_load: torch.Tensor, cfg: ReplayConfig, trace: Trace, rank: int,
                    group: Any) -> tuple[Segment, ...]:
    """Rank 0 solves the schedule; every rank receives the placements (`phy2log`) and the
    segment bounds. Rank 0 keeps its full segments (best placements, rebalance records)."""
    topo = Topology(cfg.num_gpus, cfg.gpus_per_node)
    segments = plan(true_load.cpu(), cfg, topo, cfg.num_groups or trace.num_groups or 1) \
        if rank == 0 else None
    box = [None if segments is None else
           [(s.start, s.stop, s.placement.phy2log.tolist()) for s in segments]]
    dist.broadcast_object_list(box, src=0, group=group)
    if rank == 0:
        return segments
    placements: dict[str, Placement] = {}
    out = []
    for start, stop, phy2log in box[0]:
        key = json.dumps(phy2log)
        placement = placements.setdefault(key, Placement(torch.tensor(phy2log),
                                                         trace.num_experts, topo))
        out.append(Segment(start, stop, placement, placement, None))
    return tuple(out)


def _all_reduce(tensor: torch.Tensor, device: torch.device, group: Any) -> torch.Tensor:
    out = tensor.to(device).clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """`[...]` from every rank -> `[G, ...]` in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def _inject(fault: Fault) -> None:
    if fault.kind == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        time.sleep(3600)
    raise RuntimeError(f"injected fault on rank {fault.rank} at step {fault.step}")


# ----------------------------------------------------------------------------- a group

def rank_main(rank: int, world_size: int, source: TraceSource, configs: list[ReplayConfig],
              timeout: float, device_kind: str, fault: Fault | None = None) -> list[dict]:
    """Everything one rank does once the default group is initialised: run every
    configuration; then rank 0, alone, runs the in-process simulation of each and returns the
    report rows (`report_row`); [] elsewhere."""
    device = _device(device_kind, rank)
    trace = source.load()
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout))
    backend = dist.get_backend(group)
    configs = [replace(cfg, device=str(device)) for cfg in configs]
    measured_here = [run_rank(trace, cfg, rank, device, group, fault if i == 0 else None)
                     for i, cfg in enumerate(configs)]
    dist.barrier(group)
    if rank != 0:
        return []
    return [report_row(real, replay(trace, cfg), world_size, backend)
            for real, cfg in zip(measured_here, configs)]


def report_row(real: Results, sim: Results, world_size: int, backend: str) -> dict[str, Any]:
    """One configuration's report: labels, `metrics` side by side and whether all match."""
    metrics = compare_metrics(real.metrics, sim.metrics)
    return {**{k: v for k, v in real.row().items() if k in ("policy", "solver", "mode", "view",
                                                          "rng")},
            "world_size": world_size, "backend": backend, "metrics": metrics,
            "match": all(m["match"] for m in metrics.values())}


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _spawned(rank: int, world_size: int, init_method: str, source: TraceSource,
             configs: list[ReplayConfig], timeout: float, device_kind: str, out_dir: str,
             fault: Fault | None) -> None:
    """The body of one spawned process: join the group and run; rank 0 writes the report to
    `out_dir/report.json`; a rank that fails writes `rankN.error` (one line) first."""
    torch.set_num_threads(1)
    backend = "nccl" if device_kind == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=STARTUP_SECONDS))
        try:
            rows = rank_main(rank, world_size, source, configs, timeout, device_kind, fault)
        finally:
            dist.destroy_process_group()
    except Exception as exc:
        text = " ".join(str(exc).split()) or "no message"
        Path(out_dir, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {text}")
        raise
    if rank == 0:
        Path(out_dir, "report.json").write_text(json.dumps(rows))


def launch(source: TraceSource, configs: list[ReplayConfig], world_size: int, *,
           device: str = "cpu", port: int = 0, timeout: float = 60.0,
           fault: Fault | None = None) -> list[dict]:
    """Spawn `world_size` local processes on 127.0.0.1 (`port`, 0: a free one), run every
    configuration on them, and return rank 0's report rows. GroupFailure when the group cannot
    finish, naming the rank at fault; every process is gone when this returns or raises.
    `timeout` bounds each collective (seconds)."""
    import torch.multiprocessing as mp
    if world_size < 1:
        raise InputError(f"the world size must be a positive integer, got {world_size}")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda asked for CUDA (NCCL), but torch sees no CUDA device")
    port = port or _free_port()
    _check_port(port)
    with tempfile.TemporaryDirectory(prefix="eplbsim-ranks-") as tmp:
        args = (world_size, f"tcp://127.0.0.1:{port}", source, configs, timeout, device, tmp,
                fault)
        processes = mp.start_processes(_spawned, args=args, nprocs=world_size, join=False,
                                       start_method="spawn").processes
        try:
            stopped = _wait(processes, grace=min(timeout, 10.0) + 2.0)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join()
        if stopped is not None:
            raise GroupFailure(_failure(processes, stopped, Path(tmp), port, timeout))
        return json.loads(Path(tmp, "report.json").read_text())


def _wait(processes: list, grace: float) -> list[int] | None:
    """Wait for every process to exit. None when all exited with status 0; else, after the
    first failure, give the others `grace` seconds to fail on their own (a peer's collective
    fails soon after it), kill the rest and return their ranks (those that hung)."""
    from multiprocessing.connection import wait
    while any(p.exitcode is None for p in processes):
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        wait([p.sentinel for p in processes if p.exitcode is None], timeout=1.0)
    if all(p.exitcode == 0 for p in processes):
        return None
    deadline = time.monotonic() + grace
    while any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
        wait([p.sentinel for p in processes if p.exitcode is None], timeout=0.2)
    stopped = [rank for rank, p in enumerate(processes) if p.exitcode is None]
    for rank in stopped:
        processes[rank].kill()
        processes[rank].join()
    return stopped


# errors a rank raises because a peer failed, not because it did
_CONSEQUENCES = ("connection closed by peer", "connection reset by peer", "timed out",
                 "timeout")


def _failure(processes: list, stopped: list[int], tmp: Path, port: int,
             timeout: float) -> str:
    """One line naming the rank at fault: a rank's own error first, then a rank that died,
    then ranks that stopped responding; a port taken while starting is said as such."""
    errors = {rank: path.read_text() for rank in range(len(processes))
              if (path := tmp / f"rank{rank}.error").exists()}
    own = {r: e for r, e in errors.items() if not any(c in e.lower() for c in _CONSEQUENCES)}
    if any("address already in use" in e.lower() for e in errors.values()):
        return f"port {port} on 127.0.0.1 is in use; choose another with --port or leave it 0"
    for rank, error in sorted(own.items()):
        name, _, detail = error.partition(": ")
        cause = detail if name == "InputError" else error
        return f"rank {rank} failed: {cause}; the group was stopped"
    for rank, process in enumerate(processes):
        code = process.exitcode
        if rank in stopped or rank in errors or code == 0:
            continue
        how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        return f"rank {rank} {how}; the group was stopped"
    first = min(errors) if errors else 0
    detail = errors.get(first, "no message")
    if stopped:
        hung = ", ".join(map(str, stopped))
        return (f"rank {hung} stopped responding: rank {first}'s collective timed out after "
                f"{timeout:g} s ({detail}); the group was stopped")
    return f"rank {first}: {detail}; the group was stopped"


def join_launched(source: TraceSource, configs: list[ReplayConfig], *, device: str = "cpu",
                  timeout: float = 60.0) -> list[dict]:
    """Join the group `torchrun` launched (one process per rank; `env://` rendezvous) and run
    every configuration; rank 0 returns the report rows, the others []."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://",
                            timeout=timedelta(seconds=STARTUP_SECONDS))
    try:
        return rank_main(rank, world_size, source, configs, timeout, device)
    except RuntimeError as exc:
        raise GroupFailure(f"rank {rank}: {' '.join(str(exc).split())}") from None
    finally:
        dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """True in a process `torchrun` started (its rendezvous variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise GroupFailure(f"port {port} on 127.0.0.1 is in use; choose another with "
                               f"--port or leave it 0 for a free one") from None
