"""Tests of eplbsim.base.compiled: numba is imported when a compiled loop first runs, not with
eplbsim or any --help, and loops that call each other across modules compile as numba's own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np


def test_import_and_every_help_leave_numba_unimported():
    script = textwrap.dedent("""
        import contextlib, io, sys
        import eplbsim
        from eplbsim.cli import COMMANDS, main
        for name in COMMANDS:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                main([name, "--help"])
        print(sorted(m for m in ("numba", "llvmlite") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_loops_across_modules_compile_on_first_call(tmp_path, monkeypatch):
    (tmp_path / "lazy_a.py").write_text(textwrap.dedent("""
        from eplbsim.base.compiled import JIT, jit, prange

        @jit(**JIT)
        def inc(x):
            return x + 1

        @jit(parallel=True, **JIT)
        def fill(out):
            for i in prange(out.shape[0]):
                out[i] = inc(i)
    """))
    (tmp_path / "lazy_b.py").write_text(textwrap.dedent("""
        from eplbsim.base.compiled import JIT, jit
        from lazy_a import inc

        @jit(**JIT)
        def twice(x):
            return inc(inc(x))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import lazy_a
    import lazy_b
    from eplbsim.base.compiled import Compiled

    assert isinstance(lazy_b.twice, Compiled) and isinstance(lazy_b.inc, Compiled)
    assert lazy_b.twice(5) == 7
    assert not isinstance(vars(lazy_b)["inc"], Compiled)  # numba's dispatcher now
    out = np.zeros(6, np.int64)
    lazy_a.fill(out)
    assert out.tolist() == [1, 2, 3, 4, 5, 6]
