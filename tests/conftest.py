"""Shared fixtures: the devices to test on (CUDA only where torch sees one); and hypothesis
drawing the same examples on every run (the `derandomized` profile), so a test's verdict and its
time do not change from one CI run to the next. `HYPOTHESIS_PROFILE=explore` draws new ones."""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("derandomized", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
