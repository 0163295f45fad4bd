"""Shared fixtures: the devices to test on (CUDA only where torch sees one); hypothesis drawing
the same examples on every run (the `derandomized` profile), so a test's verdict and its time do
not change from one CI run to the next (`HYPOTHESIS_PROFILE=explore` draws new ones); and, when
pytest-xdist runs a worker process per core, one torch and numba thread in each, so the workers
do not fight over the cores."""

import os

import pytest
import torch
from hypothesis import settings

if os.environ.get("PYTEST_XDIST_WORKER"):  # a process per core (-n auto): one thread each
    import numba
    torch.set_num_threads(1)
    numba.set_num_threads(1)

settings.register_profile("derandomized", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
