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
