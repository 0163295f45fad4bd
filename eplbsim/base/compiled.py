"""Compiled loops, handed to numba when one first runs: importing eplbsim, and with it every
`eplbsim ... --help`, does not import numba (about 0.4 s).

`jit(**options)` marks a function as a compiled loop (options as `numba.jit`'s; `JIT` is every
loop's). The function stays a plain Python function until the loop is first called, from Python
or from another loop being compiled: then numba is imported, the loop becomes a numba
dispatcher, and every placeholder among its module's globals (`prange`, other compiled loops,
`deferred` intrinsics) is swapped for what it stands for, so numba sees its own objects when it
types the code, as if they had been there from the start. Write `prange` (from here) where a
loop would write `numba.prange`, `threads()` for `numba.get_num_threads()` and
`set_threads(n)` for `numba.set_num_threads`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

JIT = dict(nopython=True, nogil=True, cache=True)  # every compiled loop's options


class Deferred:
    """A placeholder for an object of numba's (`make()` builds it, numba imported), put in
    place of the placeholder in the globals of a compiled loop's module when it compiles."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._made: Any = None

    def materialize(self) -> Any:
        if self._made is None:
            self._made = self._make()
        return self._made


class Compiled(Deferred):
    """A compiled loop before and after numba: calling it calls the numba dispatcher."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        super().__init__(self._compile)
        self.py_func, self.options = fn, options
        functools.update_wrapper(self, fn)

    def _compile(self) -> Any:
        import numba

        dispatcher = numba.jit(**self.options)(self.py_func)
        self._made = dispatcher  # before its callees: loops that call each other
        scope = self.py_func.__globals__
        for name, value in list(scope.items()):
            if isinstance(value, Deferred):
                scope[name] = value.materialize()
        return dispatcher

    def __call__(self, *args: Any) -> Any:
        return self.materialize()(*args)


def jit(**options: Any) -> Callable[[Callable[..., Any]], Compiled]:
    """`numba.jit(**options)`, applied when the loop first runs (module doc)."""
    return lambda fn: Compiled(fn, options)


def _prange() -> Any:
    import numba

    return numba.prange


prange = Deferred(_prange)  # numba.prange, in compiled loops


def threads() -> int:
    """`numba.get_num_threads()`: the threads a parallel loop runs on."""
    import numba

    return numba.get_num_threads()


def set_threads(count: int) -> None:
    """Parallel loops on `count` threads (at least 1, at most numba's pool)."""
    import numba

    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))
