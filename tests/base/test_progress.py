"""Progress bars: on stderr when it is a terminal, never on stdout, silent otherwise."""

import fcntl
import json
import os
import struct
import subprocess
import sys
import termios

from eplbsim.base.progress import bar
from eplbsim.replay import compare
from eplbsim.runspec import RunSpec
from eplbsim.traces.synth import synthesize


def test_a_bar_is_silent_unless_stderr_is_a_terminal(capsys):
    with bar(3, "work") as b:
        b.update(3)
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_compare_makes_one_bar_per_replay_and_ticks_every_step():
    trace = synthesize("skewed", seed=0, steps=5, tokens=32, layers=2, experts=8, top_k=2)
    made = []

    class Bar:
        def __init__(self, spec):
            self.label, self.done = (spec.labels()["policy"], spec.dispatch.mode), 0
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.done += n

    spec = RunSpec.of(gpus=2, redundant=2)
    compare(trace, ["row", "static"], ["none", "a2a"], spec, Bar)
    assert [(b.label, b.done) for b in made] == [
        ((p, m), 5) for m in ("none", "a2a") for p in ("row", "static")]


def test_run_draws_its_bar_on_a_terminal_stderr_and_keeps_stdout_clean():
    """stderr a pseudo-terminal, stdout a pipe: the bar goes to the terminal, JSON to stdout."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    try:
        done = subprocess.run(
            [sys.executable, "-m", "eplbsim.cli", "run", "--steps", "6", "--tokens", "32",
             "--layers", "2", "--experts", "8", "--top-k", "2", "--gpus", "2",
             "--redundant", "2", "--policies", "row", "--mode", "none", "--json"],
            stdout=subprocess.PIPE, stderr=follower, timeout=120, check=True)
        os.close(follower)
        follower = -1
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    rows = json.loads(done.stdout)  # nothing but JSON on stdout
    assert [r["policy"] for r in rows] == ["row"]
    assert b"row none" in shown and b"/6 " in shown  # one bar over the 6 steps
