"""eplbsim.cli.reference: the pages of the command reference, one section a heading."""

import re
from collections import Counter

from eplbsim.cli.reference import pages


def test_each_heading_stands_once_on_a_page():
    written = pages()
    twice = {name: [h for h, n in Counter(re.findall(r"^## .*$", text, re.M)).items() if n > 1]
             for name, text in written.items()}
    assert not {name: h for name, h in twice.items() if h}
    review = written["review.md"]  # a positional argument and options: one section of both
    section = review.split("## arguments\n", 1)[1].split("\n## ", 1)[0]
    assert "| `CANDIDATE` |" in section and "| `--out" in section


def test_the_api_page_documents_the_helpers_and_its_examples_run(tmp_path, capsys):
    import json
    import numpy as np
    from eplbsim import RunSpec, replay, synthesize
    from eplbsim.ranks.checks import rank_invariance
    from eplbsim.cli import main
    from eplbsim.cli.reference import API_EXAMPLES
    page = pages()["api.md"]
    for name in ("candidate_counts", "replica_slots", "occurrence_index", "DispatchContext",
                 "log2phy", "rank_offset"):
        assert name in page, name
    (policy_code, solver_code) = API_EXAMPLES.values()
    assert policy_code in page and solver_code in page
    mine = tmp_path / "mine.py"
    mine.write_text(policy_code + "\n" + solver_code)
    assert main(["run", "--policies", f"{mine}:spread", "--mode", "none", "--steps", "2",
                 "--tokens", "64", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["rank_agreement"] == 1 and row["output_rel_error"] == 0
    space: dict = {}
    exec(compile(solver_code, "api.md", "exec"), space)
    trace = synthesize("skewed", steps=2, tokens=64, layers=2, experts=16, top_k=4, seed=0)
    result = replay(trace, RunSpec.of(gpus=4, redundant=4, solver=space["hottest_twice"]))
    hot = np.argsort(-trace.counts().sum(0).numpy(), axis=1, kind="stable")[:, :4]
    assert (result.segments[0].placement.phy2log[:, 16:].numpy() == hot).all()
    exec(compile(policy_code, "api.md", "exec"), space)
    placement = result.segments[0].placement
    assert rank_invariance(space["spread"], trace.step(0), placement).invariant
