"""Real ranks: the dispatch on `G` torch.distributed processes, checked against the simulation.

Dimensions: `S` steps, `T` tokens in a step, `L` layers, `E` logical experts, `K` top-k,
`P` physical slots, `G` ranks = GPUs, `D` hidden size of the toy MoE layer.

Each rank is one process holding only what an EP rank of a serving engine holds: its rank id,
its view of the placement, its own random stream (related to the others' as `independent`,
`shared` or `drift`, exactly as in the simulation), and in "a2a" only its own tokens (it
dispatches its rows alone). It runs the very step the simulation runs (`ranks.MODES`, through
`replay.run_steps`) with the group's all-reduce and all-gather as its `Collectives`, so per
step (all layers at once):
  - "none": every rank dispatches every token; the ranks' choices are all-gathered
    (agreement); each rank executes the pairs it sent to itself with the toy MoE layer and the
    partial outputs `[L, T, D]` are all-reduced, exactly the mechanism that corrupts outputs
    when ranks disagree; the executed masks are all-reduced into the multiplicity `c`;
  - "a2a": each rank dispatches its own tokens (each pair goes to one GPU, `c = 1`);
    agreement and output error are undefined, as in the simulation;
  - the executed slot loads are all-reduced.
The routed counts are all-reduced before the run (each rank counts the tokens it owns) and
rank 0 solves the schedule and broadcasts every placement, as an engine's rebalancer does.
Rank 0 turns what it gathered into `Results`, runs the in-process simulation of the same spec,
and reports both side by side. Toy-MoE pair outputs lie on a dyadic grid (`moe.GRID_BITS`) so
the all-reduce sums exactly and every metric is expected to match bit for bit.

Backends: gloo on CPU, NCCL on CUDA. `launch` spawns `G` local processes (127.0.0.1, a free
port); `join_launched` joins a group started by `torchrun` (environment `RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`), so one command runs across hosts. A rank that dies or raises, a
port in use, or a collective that hangs past `timeout` ends the whole group with one
`GroupFailure` message; `launch` leaves no process behind. `EPLBSIM_RANK_HOOK=module:function`
(`RANK_HOOK`) is called with the rank id in every spawned rank before it joins the group: a
place for instrumentation (the tests inject their faults through it).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..base.errors import InputError
from ..base.progress import Progress, bar, run_label
from ..placement import Placement
from ..ranks import Collectives, token_owners
from ..ranks.traffic import source_counts
from ..runspec import RunSpec
from ..schedule.plan import Segment
from ..traces import TokenTrace
from . import replay_quiet, results_of, run_steps, schedule_of
from .results import Results

STARTUP_SECONDS = 300  # how long ranks may take to start and meet (imports are slow)
RANK_HOOK = "EPLBSIM_RANK_HOOK"  # "module:function", called with the rank id in each spawned rank


class GroupFailure(Exception):
    """The process group could not finish: a rank died or raised, a port was taken, or a
    collective timed out. The message says which and why, in one line."""


def compare_metrics(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{key: {"real", "sim", "match"}}` for every metric key of `real`; `match` is exact
    equality (multiplicity compared key by key), None matching None."""
    return {key: {"real": value, "sim": sim.get(key), "match": value == sim.get(key)}
            for key, value in real.items()}


def torch_collectives(group: Any, device: torch.device) -> Collectives:
    """The group's all-reduce (sum) and all-gather, on `device` (NCCL needs CUDA tensors)."""
    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(device).clone()
        dist.all_reduce(out, group=group)
        return out

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(device).contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts)

    return Collectives(all_reduce, all_gather)


# ----------------------------------------------------------------------------- one rank

def run_rank(trace: TokenTrace, spec: RunSpec, rank: int, device: torch.device,
             group: Any = None, progress: Progress | None = None) -> Results | None:
    """Run `spec` as rank `rank` of the initialised process group (`G` = its size, which must
    equal the spec's GPUs). Returns rank 0's Results, None elsewhere. `progress` is told of
    each step done."""
    G = dist.get_world_size(group)
    if spec.topology.gpus != G:
        raise InputError(f"the configuration has {spec.topology.gpus} GPUs; the group has "
                         f"{G} ranks")
    comm = torch_collectives(group, device)
    true_load = comm.all_reduce(_own_counts(trace, rank, G)).cpu()  # [S, L, E]
    segments = _broadcast_plan(trace, spec, true_load, rank, group)
    slot_load, counters = run_steps(trace, spec, segments, own_ranks=[rank], comm=comm,
                                    device=str(device), progress=progress)
    return results_of(trace, spec, slot_load, true_load, segments, counters) if rank == 0 \
        else None


def _own_counts(trace: TokenTrace, rank: int, num_ranks: int) -> torch.Tensor:
    """Routed pairs per (step, layer, expert) of the tokens `rank` owns (`token_owners`):
    int64 `[S, L, E]`; summed over the ranks, every token counts once."""
    out = []
    for s in range(trace.num_steps):
        ids = trace.step(s)  # [T, L, K]
        owners = token_owners(ids.shape[0], num_ranks, trace.step_src_rank(s))
        out.append(source_counts(ids, owners, num_ranks, trace.num_experts)[:, rank])
    return torch.stack(out)


def _broadcast_plan(trace: TokenTrace, spec: RunSpec, true_load: torch.Tensor, rank: int,
                    group: Any) -> tuple[Segment, ...]:
    """Rank 0 solves the schedule; every rank receives the placements (`phy2log`, and the
    replica order a solver published, which SGLang's views read), the segment bounds and the
    ranks' switch steps. Rank 0 keeps its full segments (best placements, rebalance
    records)."""
    segments = schedule_of(trace, spec, true_load) if rank == 0 else None
    box = [None if segments is None else
           [(s.start, s.stop, s.placement.phy2log.tolist(),
             None if s.placement.order is None else s.placement.order.tolist(),
             None if s.switch is None else s.switch.tolist()) for s in segments]]
    dist.broadcast_object_list(box, src=0, group=group)
    if rank == 0:
        return segments
    topo = spec.topology.topology()
    placements: dict[str, Placement] = {}
    out = []
    for start, stop, phy2log, order, switch in box[0]:
        key = json.dumps([phy2log, order])
        placement = placements.setdefault(key, Placement(
            torch.tensor(phy2log), trace.num_experts, topo,
            None if order is None else torch.tensor(order)))
        out.append(Segment(start, stop, placement, placement, None,
                           None if switch is None else np.array(switch, dtype=np.int64)))
    return tuple(out)


# ----------------------------------------------------------------------------- a group

def rank_main(rank: int, world_size: int, load: Callable[[], Any], specs: list[RunSpec],
              timeout: float, device_kind: str) -> list[dict]:
    """Everything one rank does once the default group is initialised: run every
    configuration; then rank 0, alone, runs the in-process simulation of each and returns the
    report rows (`report_row`); [] elsewhere."""
    device = _rank_device(device_kind, rank)
    trace = load()
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout))
    backend = dist.get_backend(group)
    specs = [spec.replace(device=str(device)) for spec in specs]
    real = []
    for spec in specs:  # rank 0 shows the group's progress (every rank runs in step)
        with bar(trace.num_steps, run_label(spec), show=None if rank == 0 else False) as steps:
            real.append(run_rank(trace, spec, rank, device, group, steps.update))
    dist.barrier(group)
    if rank != 0:
        return []
    rows = []
    for mine, spec in zip(real, specs):
        with bar(trace.num_steps, f"{run_label(spec)} (in-process)") as steps:
            rows.append(report_row(mine, replay_quiet(trace, spec, steps.update),
                                   world_size, backend))
    return rows


def report_row(real: Results, sim: Results, world_size: int, backend: str) -> dict[str, Any]:
    """One configuration's report: labels, `metrics` side by side and whether all match."""
    metrics = compare_metrics(real.metrics, sim.metrics)
    return {**{k: v for k, v in real.row().items() if k in ("policy", "solver", "mode", "view",
                                                          "rng", "engine")},
            "world_size": world_size, "backend": backend, "metrics": metrics,
            "match": all(m["match"] for m in metrics.values())}


REPORT_COLUMNS = tuple((h, h, None) for h in (
    "policy", "mode", "rng", "agree", "agree_sim", "c=0", "c=1", "c>=2", "out_err",
    "out_err_sim", "gpu_imb", "gpu_imb_sim", "match"))


def report_cells(row: dict[str, Any]) -> dict[str, Any]:
    """A report row as the cells of `REPORT_COLUMNS`: real and simulated side by side."""
    m = row["metrics"]
    mult = m["multiplicity"]["real"] or {}
    wrong = [k for k, v in m.items() if not v["match"]]
    return {"policy": row["policy"], "mode": row["mode"], "engine": row.get("engine"),
            "rng": row["rng"], "agree": m["rank_agreement"]["real"], "agree_sim": m["rank_agreement"]["sim"],
            "c=0": mult.get("0"), "c=1": mult.get("1"), "c>=2": mult.get("2+"),
            "out_err": m["output_rel_error"]["real"],
            "out_err_sim": m["output_rel_error"]["sim"],
            "gpu_imb": m["gpu_imbalance"]["real"], "gpu_imb_sim": m["gpu_imbalance"]["sim"],
            "match": "yes" if not wrong else "NO: " + ",".join(wrong)}


def _rank_device(kind: str, rank: int) -> torch.device:
    """This rank's device: its local GPU for `cuda` (LOCAL_RANK under torchrun), else CPU."""
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _run_hook(rank: int) -> None:
    """Call the `RANK_HOOK` environment variable's `module:function` with the rank, if set."""
    hook = os.environ.get(RANK_HOOK)
    if hook:
        module, _, function = hook.partition(":")
        getattr(importlib.import_module(module), function)(rank)


def _spawned(rank: int, world_size: int, init_method: str, load: Callable[[], Any],
             specs: list[RunSpec], timeout: float, device_kind: str, out_dir: str) -> None:
    """The body of one spawned process: join the group and run; rank 0 writes the report to
    `out_dir/report.json`; a rank that fails writes `rankN.error` (one line) first."""
    torch.set_num_threads(1)
    backend = "nccl" if device_kind == "cuda" else "gloo"
    try:
        _run_hook(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=STARTUP_SECONDS))
        try:
            rows = rank_main(rank, world_size, load, specs, timeout, device_kind)
        finally:
            dist.destroy_process_group()
    except Exception as exc:
        text = " ".join(str(exc).split()) or "no message"
        Path(out_dir, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {text}")
        raise
    if rank == 0:
        Path(out_dir, "report.json").write_text(json.dumps(rows))


def launch(load: Callable[[], Any], specs: list[RunSpec], world_size: int, *,
           device: str = "cpu", port: int = 0, timeout: float = 60.0) -> list[dict]:
    """Spawn `world_size` local processes on 127.0.0.1 (`port`, 0: a free one), each opening
    the trace with `load` (a picklable callable, e.g. a `functools.partial` of `synthesize`
    or of `Source.open`), run every spec on them, and return rank 0's report rows.
    GroupFailure when the group cannot finish, naming the rank at fault; every process is gone
    when this returns or raises. `timeout` bounds each collective (seconds)."""
    import torch.multiprocessing as mp
    if world_size < 1:
        raise InputError(f"the world size must be a positive integer, got {world_size}")
    cap = local_rank_cap()
    if world_size > cap:
        raise InputError(f"{world_size} ranks would take minutes to start on this machine's "
                         f"{os.cpu_count()} cores; spawn at most {cap} here, or start them "
                         f"under torchrun across hosts")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda asked for CUDA (NCCL), but torch sees no CUDA device")
    port = port or _free_port()
    _check_port(port)
    with tempfile.TemporaryDirectory(prefix="eplbsim-ranks-") as tmp:
        args = (world_size, f"tcp://127.0.0.1:{port}", load, specs, timeout, device, tmp)
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
            raise GroupFailure(_group_failure(processes, stopped, Path(tmp), port, timeout))
        return json.loads(Path(tmp, "report.json").read_text())


def local_rank_cap() -> int:
    """How many ranks `launch` spawns on this machine at most: each imports torch and joins a
    gloo group, so four per core (and at least 8)."""
    return max(8, 4 * (os.cpu_count() or 1))


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


def _group_failure(processes: list, stopped: list[int], tmp: Path, port: int,
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


def join_launched(load: Callable[[], Any], specs: list[RunSpec], *, device: str = "cpu",
                  timeout: float = 60.0) -> list[dict]:
    """Join the group `torchrun` launched (one process per rank; `env://` rendezvous) and run
    every spec; rank 0 returns the report rows, the others []."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://",
                            timeout=timedelta(seconds=STARTUP_SECONDS))
    try:
        return rank_main(rank, world_size, load, specs, timeout, device)
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
