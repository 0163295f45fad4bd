"""Shared fixtures: the devices to test on (CUDA only where torch sees one)."""

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
