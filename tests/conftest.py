"""Shared fixtures: the devices to test on (CUDA only where torch sees one); hypothesis drawing
the same examples on every run (the `derandomized` profile), so a test's verdict and its time do
not change from one CI run to the next (`HYPOTHESIS_PROFILE=explore` draws new ones); and, when
pytest-xdist runs a worker process per core, one thread in each worker and in every process it
starts (notebook kernels, ranks, sweep workers), so they do not fight over the cores."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # set before torch and numba start their threads
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[name] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("derandomized", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def pytest_configure(config):
    """In the pytest-xdist controller, before the workers start: on a clean clone, fill numba's
    cache once, in two processes, instead of in every worker and process that a test starts
    (`numba_warmup.py` says why; `EPLBSIM_NUMBA_WARMUP=0` turns it off)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    if getattr(config.option, "dist", "no") == "no":
        return
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from numba_warmup import warm
    seconds = warm()
    if seconds:
        print(f"numba's cache was cold: compiled the tests' loops in {seconds:.0f} s",
              file=sys.stderr)
