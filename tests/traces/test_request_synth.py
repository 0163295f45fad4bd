"""The synthetic request sets (`traces.request_synth`): seeded, shaped as documented."""

import numpy as np
import pytest

from eplbsim.base.errors import InputError
from eplbsim.traces.request_synth import REQUEST_SCENARIOS, request_options, synthesize_requests

SIZES = dict(layers=2, experts=32, top_k=4)


@pytest.mark.parametrize("name", sorted(REQUEST_SCENARIOS))
def test_every_request_scenario_is_seeded_and_valid(name):
    a, b = (synthesize_requests(name, seed=3, **SIZES) for _ in range(2))
    c = synthesize_requests(name, seed=4, **SIZES)
    assert all(np.array_equal(x.ids, y.ids) for x, y in zip(a.requests, b.requests))
    assert any(not np.array_equal(x.ids, y.ids) for x, y in zip(a.requests, c.requests))
    for r in a.requests:
        assert r.ids.shape[1:] == (2, 4) and r.prompt_len >= 1 and r.output_len >= 1
        rows = np.sort(r.ids, -1)
        assert (np.diff(rows, axis=-1) > 0).all()  # distinct experts a token


def test_templated_requests_share_their_prefix_rows_and_topics_move_the_hot_experts():
    reqs = synthesize_requests("requests", seed=0, num_requests=40, template_share=1.0,
                               templates=1, template_len=16, topics=2, sigma=2.0, **SIZES)
    heads = {r.ids[:16].tobytes() for r in reqs.requests}
    assert len(heads) == 1  # one system prompt, the same rows in every request
    plain = synthesize_requests("requests", seed=0, num_requests=40, template_share=0.0,
                                topics=2, sigma=2.0, **SIZES)
    assert len({r.ids[:16].tobytes() for r in plain.requests}) == 40
    hot = [np.bincount(r.ids[:, 0].ravel(), minlength=32).argmax() for r in plain.requests]
    assert len(set(hot)) > 1  # the hottest expert differs between requests


def test_request_scenario_options_are_checked():
    assert "num_requests" in request_options("requests")
    with pytest.raises(InputError, match="has no option colour"):
        synthesize_requests("requests", seed=0, colour=1, **SIZES)
    with pytest.raises(InputError, match="template_share must be in"):
        synthesize_requests("requests", seed=0, template_share=2, **SIZES)
