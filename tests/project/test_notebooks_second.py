"""The second half of the notebooks, checked as `test_notebooks.py` checks the first (that file
says why the notebooks are split)."""

import pytest

from test_notebooks import SECOND, check_committed_without_outputs, check_prose, check_runs


@pytest.mark.parametrize("path", SECOND, ids=[p.name for p in SECOND])
@pytest.mark.parametrize("check", [check_runs, check_committed_without_outputs, check_prose])
def test_notebook(path, check):
    check(path)
