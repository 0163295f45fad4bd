"""`torch.distributed`'s point-to-point calls for ranks simulated in one process: each rank runs
the engine's updater in a thread of its own, and a send is matched to a receive by (source,
destination) in posting order, as NCCL and gloo match untagged point-to-point operations.

What an engine's updater calls is answered per thread (`SimWorld.run` says which rank a thread
is): `get_rank`, `get_world_size`, `isend`, `irecv`, `batch_isend_irecv`, `barrier`,
`all_reduce` (a sum, every rank's tensor in rank order: vLLM's async worker agrees on a flag by
it), and a
`P2POp` of the fields engines pass (`op`, `tensor`, `peer` or `group_peer`, `group`, `tag`).
A send copies its tensor when it is posted (the engines leave a sent tensor untouched until the
batch completes); a receive copies the matched message into its tensor when it is waited on. A
receive that no rank's send ever matches, or a send no receive takes, is an `InputError` naming
the ranks: the engine's own plan disagreeing with itself.

Every send is recorded (`SimWorld.sent`: source, destination, bytes), the transfer plan the
engine made.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ..base.errors import InputError
from ..base.patching import patched

WAIT_S = 30.0  # by default a receive waits this long for its send before the plan is broken


@dataclass
class P2POp:
    """One point-to-point operation as the engines build it (`torch.distributed.P2POp`)."""

    op: Callable
    tensor: torch.Tensor
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None


class _Work:
    def __init__(self, finish: Callable[[], None] | None = None) -> None:
        self._finish = finish

    def wait(self, timeout: Any = None) -> bool:
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True

    def is_completed(self) -> bool:
        return self._finish is None


class SimWorld:
    """`world_size` ranks in one process (module doc)."""

    def __init__(self, world_size: int, wait_s: float = WAIT_S) -> None:
        self.world_size, self.wait_s = world_size, wait_s
        self._local = threading.local()
        self._boxes: dict[tuple[int, int], deque] = {}
        self._cond = threading.Condition()
        self.sent: list[tuple[int, int, int]] = []  # (source, destination, bytes)
        self._barrier = threading.Barrier(world_size)
        self._reducing = threading.Barrier(world_size)  # all_reduce's own, apart from barrier()
        self._partials: list[torch.Tensor | None] = [None] * world_size

    # -- what the engine calls ---------------------------------------------------------------

    def get_rank(self, group: Any = None) -> int:
        return self._local.rank

    def get_world_size(self, group: Any = None) -> int:
        return self.world_size

    def barrier(self, group: Any = None, **kwargs: Any) -> None:
        self._barrier.wait(self.wait_s)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                   async_op: bool = False) -> _Work | None:
        if op is not None and op != torch.distributed.ReduceOp.SUM:
            raise InputError(f"an all_reduce with {op}: only sums are simulated")
        self._partials[self._local.rank] = tensor.detach().clone()
        self._reducing.wait(self.wait_s)  # every rank's part is in
        total = self._partials[0].clone()
        for part in self._partials[1:]:
            total += part
        self._reducing.wait(self.wait_s)  # every rank has read them
        tensor.copy_(total)
        return _Work() if async_op else None

    def isend(self, tensor: torch.Tensor, dst: int | None = None, group: Any = None,
              tag: int = 0, group_dst: int | None = None) -> _Work:
        src, dst = self._local.rank, self._peer(dst, group_dst)
        with self._cond:
            self._boxes.setdefault((src, dst), deque()).append(tensor.detach().clone())
            self.sent.append((src, dst, tensor.numel() * tensor.element_size()))
            self._cond.notify_all()
        return _Work()

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None,
              tag: int = 0, group_src: int | None = None) -> _Work:
        me, src = self._local.rank, self._peer(src, group_src)

        def finish() -> None:
            with self._cond:
                box = self._boxes.setdefault((src, me), deque())
                if not self._cond.wait_for(lambda: box, self.wait_s):
                    raise InputError(f"rank {me} waits for a message from rank {src} that no "
                                     f"send of the engine's plan matches")
                message = box.popleft()
            if message.shape != tensor.shape or message.dtype != tensor.dtype:
                raise InputError(f"rank {me} receives a {tuple(message.shape)} "
                                 f"{message.dtype} message from rank {src} into a "
                                 f"{tuple(tensor.shape)} {tensor.dtype} tensor: the engine's "
                                 f"sends and receives are out of step")
            tensor.copy_(message)
        return _Work(finish)

    def batch_isend_irecv(self, ops: Sequence[Any]) -> list[_Work]:
        out = []
        for op in ops:
            peer = op.group_peer if getattr(op, "group_peer", None) is not None else op.peer
            if op.op == self.isend:  # bound methods: equal, not identical
                out.append(self.isend(op.tensor, peer))
            elif op.op == self.irecv:
                out.append(self.irecv(op.tensor, peer))
            else:
                raise InputError(f"a P2POp of {op.op!r}: only isend and irecv are simulated")
        return out

    @staticmethod
    def _peer(peer: int | None, group_peer: int | None) -> int:
        return group_peer if group_peer is not None else peer

    # -- running ranks ---------------------------------------------------------------------

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """`fn(rank)` for every rank, each in its own thread answering as that rank; their
        results in rank order. The first exception of any rank is raised after all ended; an
        unmatched send left behind is an InputError."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def body(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # handed to the caller below
                errors[rank] = exc
                self._barrier.abort()
                self._reducing.abort()
        threads = [threading.Thread(target=body, args=(r,), daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        broken = [e for e in errors if isinstance(e, threading.BrokenBarrierError)]
        for exc in [e for e in errors if e is not None and e not in broken] + broken:
            raise exc  # the cause first: the others broke the barriers it left
        left = {k: len(v) for k, v in self._boxes.items() if v}
        if left:
            (src, dst), n = next(iter(left.items()))
            raise InputError(f"rank {src} sent {n} message(s) to rank {dst} that no receive "
                             f"of the engine's plan took")
        return results


@contextmanager
def simulated(world: SimWorld, modules: Sequence[Any] = ()) -> Iterator[None]:
    """`torch.distributed`'s point-to-point calls answered by `world` during the block, and the
    names an engine module imported from it (`P2POp`, `batch_isend_irecv`, `isend`, `irecv`) in
    each of `modules`' globals; everything put back after."""
    dist = torch.distributed
    names = {"get_rank": world.get_rank, "get_world_size": world.get_world_size,
             "isend": world.isend, "irecv": world.irecv, "barrier": world.barrier,
             "all_reduce": world.all_reduce,
             "batch_isend_irecv": world.batch_isend_irecv, "P2POp": P2POp}
    targets = [(dist, k, v) for k, v in names.items() if hasattr(dist, k)]
    targets += [(m, k, v) for m in modules for k, v in names.items() if k in vars(m)]
    with patched(targets):
        yield
