"""The engines' own weight movers on real ranks: one `torch.distributed` process a rank (gloo,
127.0.0.1), the proof that the single-process path (`migration.migrate`, threads answering the
point-to-point calls) moves what real processes move. Each process builds its own weights and,
for SGLang, its own metadata, runs the same `move_rank` as the simulation with the real
`batch_isend_irecv`, and records each send it posts (source, destination, bytes) as the
simulation does; the parent reads every rank's weights back (`weights_only` loads) and returns a
`Moved` like `migrate`'s for each engine asked (one process group moves for all, in turn).
`recording` wraps `batch_isend_irecv` in torch.distributed and in the engine modules that
imported it (`Mover.owners`).
"""

from __future__ import annotations

import multiprocessing
import socket
import tempfile
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ..base.errors import InputError
from ..placement.topology import Topology
from . import Moved, prepare
from .weights import SHAPES, given_to_engine, rank_weights

TIMEOUT_S = 120.0  # the whole group's limit; a rank still running then is stopped


@contextmanager
def recording(sent: list, rank: int, owners: Sequence[Any]) -> Iterator[None]:
    """Every send `batch_isend_irecv` is given during the block, as `(rank, peer, bytes)` in
    `sent`; `owners` are the modules whose `batch_isend_irecv` name is wrapped (torch.distributed,
    an engine module that imported it)."""
    real = dist.batch_isend_irecv

    def batch(ops: list) -> list:
        for op in ops:
            if op.op == dist.isend:
                peer = op.group_peer if getattr(op, "group_peer", None) is not None else op.peer
                sent.append((rank, int(peer), op.tensor.numel() * op.tensor.element_size()))
        return real(ops)
    saved = [(m, m.batch_isend_irecv) for m in owners if hasattr(m, "batch_isend_irecv")]
    try:
        for m, _ in saved:
            m.batch_isend_irecv = batch
        yield
    finally:
        for m, value in saved:
            m.batch_isend_irecv = value


def _rank(rank: int, world: int, port: int, engines: Sequence[str], old: torch.Tensor,
          new: torch.Tensor, num_experts: int, per_node: int, sources: Any,
          shapes: Sequence[Sequence[int]], chunks: Any, drop: Sequence[int], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        parts = [_move_here(engine, rank, world, old, new, num_experts, per_node, sources,
                            shapes, chunks, drop) for engine in engines]
        torch.save(parts, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _move_here(engine: str, rank: int, world: int, old: torch.Tensor, new: torch.Tensor,
               num_experts: int, per_node: int, sources: Any,
               shapes: Sequence[Sequence[int]], chunks: Any, drop: Sequence[int]) -> dict:
    """This process's rank moved by `engine` from fresh weights holding `old` (`prepare`, as
    the simulation moves each rank): its weights after the move and the sends it posted."""
    from ..engines import adapter
    run = adapter(engine, sources)
    weights = rank_weights(old, num_experts, world, shapes)[rank]
    mover = prepare(engine, run, old, new, num_experts, Topology(world, per_node), [rank],
                    chunks)
    sent: list = []
    with run.modules.active(), recording(sent, rank, [dist, *mover.owners]):
        mover.move(rank, given_to_engine(weights, drop), dist.group.WORLD)
    return {"weights": weights, "sent": sent}


def migrate_on_processes(engines: Sequence[str], old: torch.Tensor, new: torch.Tensor,
                         num_experts: int, topology: Topology, sources: Any = (),
                         shapes: Sequence[Sequence[int]] = SHAPES,
                         chunks: Sequence[Sequence[int]] | None = None,
                         drop: Sequence[int] = ()) -> list[Moved]:
    """`migration.migrate` on `topology.num_gpus` real gloo processes (module doc), once for
    each of `engines` in turn (one process group for all), each from fresh weights holding
    `old`; their maps are left None (each process keeps its own). InputError when a rank
    fails or the group outlasts `TIMEOUT_S`."""
    G = topology.num_gpus
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="eplbsim-migrate-") as out:
        procs = [ctx.Process(target=_rank, args=(r, G, port, tuple(engines), old.long(),
                                                  new.long(), num_experts,
                                                  topology.gpus_per_node, sources, shapes,
                                                  chunks, tuple(drop), out))
                 for r in range(G)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if failed:
            raise InputError(f"the real ranks' move failed on rank(s) {failed} (exit status "
                             f"{[procs[r].exitcode for r in failed]})")
        ranks = [torch.load(Path(out) / f"{r}.pt", weights_only=True) for r in range(G)]
    return [Moved.read([parts[i]["weights"] for parts in ranks], new.long(), num_experts,
                       [tuple(x) for parts in ranks for x in parts[i]["sent"]])
            for i in range(len(engines))]
