"""Where an app's independent tasks run: spawned local processes, or Ray (DESIGN.md §6).

`sweep` runs its cells and `workers` the step ranges of one trace on the same two executors:
- "local": a pool of processes spawned here (`local_pool`); each ends when this process dies,
  so a killed run leaves no worker behind;
- "ray": tasks on the Ray cluster at an address, or on a local instance of `workers` CPUs
  (`ray_session`), Ray being the `ray` extra.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..base.errors import InputError

EXECUTORS = ("local", "ray")


def check_executor(executor: str, address: str | None, workers: int | None = None) -> None:
    """InputError for an unknown executor, an address given to anything but Ray, or (a sweep,
    whose workers are a cluster's CPUs) an address with a worker count."""
    if executor not in EXECUTORS:
        raise InputError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    if address is not None and executor != "ray":
        raise InputError("--address is for --executor ray")
    if address is not None and workers is not None:
        raise InputError("--address is for --executor ray, and then the cluster's CPUs are "
                         "the workers (no --workers)")


def _exit_with_parent(initializer: Callable[..., None] | None, *args: Any) -> None:
    """Pool initializer: end the worker when its parent dies (a killed run leaves no worker
    waiting for tasks forever), then run `initializer(*args)`."""
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
    if initializer is not None:
        initializer(*args)


def local_pool(workers: int, initializer: Callable[..., None] | None = None,
               initargs: tuple = ()) -> ProcessPoolExecutor:
    """`workers` spawned processes, each running `initializer(*initargs)` once when it
    starts (its arguments pickled once per process)."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_exit_with_parent,
                               initargs=(initializer, *initargs))


@contextmanager
def ray_session(workers: int, address: str | None) -> Iterator[Any]:
    """Ray, initialized on the cluster at `address` or on a local instance of `workers` CPUs
    (unless this process already is), shut down after the block when it started it: yields
    the `ray` module. Ray's usage statistics stay off unless the environment turns them on
    (its report waits for the network: a local instance without one started in about 35 s
    instead of 8)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise InputError("--executor ray needs Ray: install the ray extra: "
                         "pip install 'eplbsim[ray]'") from None
    started = not ray.is_initialized()
    if started and address is not None:
        ray.init(address=address, logging_level="warning", log_to_driver=False)
    elif started:
        ray.init(num_cpus=workers, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level="warning", log_to_driver=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
