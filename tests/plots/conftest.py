"""What the figure tests of this folder share: the small trace they draw from."""

import pytest

from eplbsim.traces import synthesize


@pytest.fixture(scope="module")
def trace():
    """A small templated trace (4 steps of 64 tokens, 2 layers, 16 experts, top-2)."""
    return synthesize("template", steps=4, tokens=64, layers=2, experts=16, top_k=2, seed=0)
