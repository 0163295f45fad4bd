"""Faults for the real-rank tests, injected through `distributed.RANK_HOOK`.

`EPLBSIM_TEST_FAULT=RANK:KIND:STEP` makes rank RANK, when it reaches step STEP of a run, die
(`die`: killed by SIGKILL), hang (`hang`: sleeps, never joining the next collective) or raise
(`raise`). `install` is the hook: it wraps the rank step of every mode in the spawned process.
"""

import os
import signal
import time

from eplbsim import ranks

FAULT = "EPLBSIM_TEST_FAULT"


def install(rank: int) -> None:
    target, kind, at = os.environ[FAULT].split(":")
    if rank != int(target):
        return
    for name, step_fn in list(ranks.MODES.items()):
        def faulty(epoch, step, *args, _step_fn=step_fn):
            if step == int(at):
                if kind == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "hang":
                    time.sleep(3600)
                raise RuntimeError(f"injected fault on rank {rank} at step {step}")
            return _step_fn(epoch, step, *args)
        ranks.MODES[name] = faulty
