"""Fill numba's on-disk cache before the test processes start, on a clean clone.

Every compiled loop is `cache=True`, but on a fresh checkout the cache is empty, and each
pytest-xdist worker, and every process a test starts before a worker has compiled what it needs
(ranks, sweep workers, notebook kernels, `eplbsim run` in a subprocess), compiles the same
loops again: about 80 s of the suite's wall time on a 2-core machine. `conftest.py` calls
`warm()` in the xdist controller before the workers start: when a loop listed in `SIGNATURES`
has no cache index yet, it compiles the listed signatures in two processes at once (split by
loop, so no two processes write one index), and every later process loads them from the cache.

Nothing here changes what a test runs or checks: a loop or signature missing from the list (or
one whose source changed since) compiles when first called, as it would without this file; one
that no longer types is skipped. `python tests/numba_warmup.py --record` rewrites the list from
the cache a full test run left in the tree. `EPLBSIM_NUMBA_WARMUP=0` turns the warm-up off.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> loop -> the argument types of each signature the test suite compiles, as numba
# prints them (evaluated in `numba.types`). Loops only ever called from other loops (with a
# literal argument) are left out: compiling their callers compiles them.
SIGNATURES: dict[str, dict[str, list[str]]] = {}  # filled below from numba_signatures.txt

_LIST = Path(__file__).with_name("numba_signatures.txt")


def _read_list() -> dict[str, dict[str, list[str]]]:
    table: dict[str, dict[str, list[str]]] = {}
    if not _LIST.exists():
        return table
    for line in _LIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, loop, sig = line.split("\t")
            table.setdefault(module, {}).setdefault(loop, []).append(sig)
    return table


SIGNATURES.update(_read_list())


def _dispatcher(obj):
    """The numba dispatcher of a compiled loop (a `Compiled`, or the dispatcher a module's
    global became once a loop of its module compiled); None for anything else."""
    from eplbsim.base.compiled import Compiled
    if isinstance(obj, Compiled):
        return obj.materialize()
    if hasattr(obj, "py_func") and hasattr(obj, "_cache"):
        return obj
    return None


def _loops():
    """(module, loop name, its dispatcher) for every listed loop that still exists."""
    for module_name, loops in SIGNATURES.items():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # moved, or broken mid-edit: its tests will say so
            continue
        for name in loops:
            loop = _dispatcher(getattr(module, name, None))
            if loop is not None and loop.py_func.__module__ == module_name:
                yield module_name, name, loop


def cold() -> bool:
    """True when some listed loop has no cache index (a fresh clone, or its source changed
    place). Makes numba dispatchers, compiles nothing."""
    try:
        for _, _, loop in _loops():
            cache = loop._cache
            if not os.path.exists(cache._cache_file._index_path):
                return True
        return False
    except Exception:  # numba's internals moved: warm up, which is always safe
        return True


def _package(module_name: str) -> str:
    return ".".join(module_name.split(".")[:2])


def shares(parts: int) -> list[set[str]]:
    """The subpackages (`eplbsim.ranks`, ...) each process compiles: a subpackage's loops call
    each other, so one process compiles them all; the subpackages spread by their signatures'
    argument counts (a rough cost), the largest first onto the least loaded process."""
    cost: dict[str, int] = {}
    for module_name, loops in SIGNATURES.items():
        package = _package(module_name)
        cost[package] = cost.get(package, 0) + sum(
            sig.count("Array(") + sig.count("int64,") + 1 for sigs in loops.values()
            for sig in sigs)
    loads, out = [0] * parts, [set() for _ in range(parts)]
    for package in sorted(cost, key=lambda p: (-cost[p], p)):
        i = loads.index(min(loads))
        loads[i] += cost[package]
        out[i].add(package)
    return out


def compile_part(part: int, parts: int) -> None:
    """Compile every listed signature of the loops in this process's share."""
    import numba.types

    namespace = vars(numba.types)
    mine = shares(parts)[part]
    for module_name, name, dispatcher in sorted(_loops(), key=lambda x: x[:2]):
        if _package(module_name) not in mine:
            continue
        for sig in SIGNATURES[module_name][name]:
            try:
                dispatcher.compile(eval(sig, namespace))  # noqa: S307 - our own list
            except Exception as exc:  # the loop changed: it compiles when first called
                print(f"numba warm-up: skipped {name}{sig[:60]}: "
                      f"{type(exc).__name__}", file=sys.stderr)


def warm(parts: int = 2) -> float:
    """Compile the listed signatures in `parts` processes at once when the cache is cold;
    returns the seconds spent (0 when warm or turned off)."""
    if os.environ.get("EPLBSIM_NUMBA_WARMUP", "1") == "0" or not SIGNATURES or not cold():
        return 0.0
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "NUMBA_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--part", f"{i}/{parts}"], env=env,
                              cwd=ROOT) for i in range(parts)]
    for proc in procs:
        proc.wait()
    return time.perf_counter() - start


def record() -> None:
    """Rewrite `numba_signatures.txt` from the cache indexes of the loops (the tree's cache after
    a full test run)."""
    import pickle

    lines = []
    for path in sorted((ROOT / "eplbsim").rglob("*.py")):
        module_name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if "jit(" not in path.read_text():
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        for name in sorted(vars(module)):
            loop = _dispatcher(getattr(module, name))
            if loop is None or loop.py_func.__module__ != module_name:
                continue
            index = loop._cache._cache_file._index_path
            if not os.path.exists(index):
                continue
            with open(index, "rb") as f:
                pickle.load(f)  # numba's version
                _, overloads = pickle.loads(f.read())
            for key in overloads:
                sig = str(key[0])
                if "Literal" not in sig:
                    lines.append(f"{module_name}\t{name}\t{sig}")
    _LIST.write_text("# written by `python tests/numba_warmup.py --record`\n"
                     + "\n".join(sorted(set(lines))) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:] == ["--record"]:
        record()
    elif sys.argv[1:2] == ["--part"]:
        part, parts = map(int, sys.argv[2].split("/"))
        compile_part(part, parts)
    else:
        sys.exit(f"usage: {sys.argv[0]} --record | --part I/N")
