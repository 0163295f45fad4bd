"""Every `notebooks/*.ipynb` runs top to bottom in a fresh kernel, is committed without outputs,
and states no number its cells do not compute or check.

The kernel is an ipykernel on the interpreter running pytest (the venv's python when pytest runs
as `.venv/bin/python -m pytest`), whatever kernelspecs are installed for the user or the system:
nothing needs `ipykernel install`, and a stray `python3` spec elsewhere cannot take over.

Each notebook is executed once per session (`executed`); the prose checks read that execution.
"""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from nbformat.v4 import new_code_cell, new_notebook  # noqa: E402
from traitlets import default  # noqa: E402

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Every notebook is checked, in two files of alternate notebooks (this one's, then
# `test_notebooks_second.py`'s), so pytest-xdist's `--dist loadfile` gives each worker half.
FIRST, SECOND = NOTEBOOKS[0::2], NOTEBOOKS[1::2]
CELL_TIMEOUT_S = 300


class ThisPythonKernelSpecs(KernelSpecManager):
    """Resolves every kernel name to ipykernel on `sys.executable`."""

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(
            name=kernel_name, display_name=f"Python 3 ({sys.executable})", language="python",
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"])


class ThisPythonKernelManager(AsyncKernelManager):
    """nbclient's default kernel manager, with the kernelspec pinned to this interpreter."""

    @default("kernel_spec_manager")
    def _pinned_specs(self):
        return ThisPythonKernelSpecs(data_dir=self.data_dir)


def execute(nb, cwd: Path):
    """Run `nb` in place in a fresh kernel started in `cwd`; CellExecutionError on any error."""
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", kernel_manager_class=ThisPythonKernelManager,
        timeout=CELL_TIMEOUT_S, allow_errors=False,
        resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


_EXECUTED: dict = {}  # path -> the executed notebook, or the error its execution raised


def executed(path: Path):
    """`path` read and executed in a fresh kernel started in its folder, once per session: every
    test of a notebook reads the same execution (the error, re-raised, if it failed)."""
    if path not in _EXECUTED:
        nb = nbformat.read(path, as_version=4)  # a copy: the file on disk is never rewritten
        try:
            _EXECUTED[path] = execute(nb, path.parent)
        except Exception as exc:  # kept, to re-raise for every test of the notebook
            _EXECUTED[path] = exc
    result = _EXECUTED[path]
    if isinstance(result, Exception):
        raise result
    return result


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"


def test_kernel_is_this_python(tmp_path):
    nb = new_notebook(cells=[new_code_cell("import os, sys\nprint(sys.executable)\n"
                                           "print(os.getcwd())")])
    execute(nb, tmp_path)
    executable, cwd = nb.cells[0].outputs[0]["text"].split()
    assert Path(executable) == Path(sys.executable)
    assert Path(cwd).resolve() == tmp_path.resolve()


def test_a_failing_cell_fails(tmp_path):
    nb = new_notebook(cells=[new_code_cell("raise RuntimeError('boom')")])
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="boom"):
        execute(nb, tmp_path)


def test_the_halves_hold_every_notebook_once():
    assert sorted(FIRST + SECOND) == NOTEBOOKS and not set(FIRST) & set(SECOND)


def check_runs(path: Path) -> None:
    """`path` ran top to bottom: every code cell executed."""
    nb = executed(path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)


def check_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


# Prose against output ------------------------------------------------------------------------
#
# A notebook's text may state a number only where a cell beside it computes it: every number in a
# markdown cell must appear, as the same literal (`6.0` is not `6.0000`, `43%` is not `0.43`), in
# the source of some code cell (comments excluded: an `assert`, its message, an argument) or in
# some output of the executed notebook (what a cell printed or returned). Not counted as numbers:
# heading numbering and numbered list items, section marks (`§4`), notebook references
# ("notebooks 05 and 07") and digits that belong to a name (`top-8`, `H200`, `OLMoE-1B-7B`,
# `log2phy`). A duration ("10 s", "a minute") must appear with its unit in an output: times are
# measured, never guessed. Small integers pass almost anywhere; the check is for the figures a
# text reads off a table (a skew, a share, a percentage, a speedup), which go stale silently.
#
# And every `##` section whose cells show output holds an `assert`: what the text says about a
# result is checked where it is shown (the title section, which sets up, is exempt). Which claim
# an assertion checks is for review to judge; that a section checks something, this test does.

NUMBER = re.compile(r"\d+(?:\.\d+)?%?")
DURATION = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?(ms|s|seconds?|minutes?|min|hours?)\b")
WORD_DURATION = re.compile(r"\b(?:an?|one|half an?)\s+(?:minute|hour)s?\b", re.IGNORECASE)
HEADING = re.compile(r"^\s{0,3}#+\s*(?:\d+(?:\.\d+)*\.?\s)?")
LIST_ITEM = re.compile(r"^\s*\d+\.\s")
NOTEBOOK_REF = re.compile(r"\bnotebooks?\s+\d+(?:(?:\s*,\s*|\s+and\s+|\s+or\s+)\d+)*",
                          re.IGNORECASE)
SECTION = re.compile(r"^##\s+(.+)$", re.MULTILINE)


def prose_numbers(markdown: str) -> list[str]:
    """The numbers a markdown cell states, as written (`0.45`, `43%`, `8` of `8x`)."""
    numbers = []
    for line in markdown.splitlines():
        line = NOTEBOOK_REF.sub("", LIST_ITEM.sub("", HEADING.sub("", line)))
        for match in NUMBER.finditer(line):
            before, after = line[:match.start()], line[match.end():]
            if before[-1:] and (before[-1].isalnum() or before[-1] in "_.§"):
                continue  # inside a name (log2phy, H200) or a section mark (§4)
            if before[-1:] == "-" and before[-2:-1].isalpha():
                continue  # a name: top-8, OLMoE-1B-7B
            if (after[:1].isalpha() or after[:1] == "_") and not (
                    after[:1] == "x" and not after[1:2].isalnum()):
                continue  # a name (7B), but a factor (8x) is a number
            numbers.append(match.group())
    return numbers


def _code(source: str) -> str:
    """A code cell's source without IPython magics."""
    return "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


def code_text(source: str) -> str:
    """A code cell's tokens without its comments (a number in a comment is not computed)."""
    code = _code(source)
    try:
        tokens = tokenize.generate_tokens(io.StringIO(code).readline)
        return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)
    except (tokenize.TokenError, SyntaxError):
        return code


def output_text(cell) -> str:
    """What a code cell printed or returned, as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
    return "\n".join(parts)


def has_assert(source: str) -> bool:
    try:
        return any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(_code(source))))
    except SyntaxError:
        return re.search(r"^\s*assert\b", source, re.MULTILINE) is not None


UNITS = {"ms": "ms", "s": "s", "second": "s", "seconds": "s", "min": "min", "minute": "min",
         "minutes": "min", "hour": "h", "hours": "h"}


def _durations(text: str) -> set[str]:
    """The durations in `text`, as `"<number> <unit>"` (`10 seconds` is `10 s`)."""
    return {f"{number} {UNITS[unit]}" for number, unit in DURATION.findall(text)}


def prose_problems(nb) -> list[str]:
    """Where `nb` (executed) states a number or a duration no cell shows or checks, and the `##`
    sections that show output without an assertion."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = "\n".join(output_text(c) for c in code)
    known = set(NUMBER.findall("\n".join(code_text(c.source) for c in code) + "\n" + outputs))
    measured = _durations(outputs)
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for number in prose_numbers(cell.source):
            if number not in known:
                problems.append(f"cell {i} states {number}, which no code cell computes or checks "
                                "and no output shows: print it, assert it, or drop it")
        for duration in sorted(_durations(cell.source) - measured):
            problems.append(f"cell {i} states the duration {duration!r}, which no output shows: "
                            "measure it in the cell, or drop it")
        for words in WORD_DURATION.findall(cell.source):
            problems.append(f"cell {i} states the duration {words!r}: measure it, or drop it")
    title, shows, checks = None, False, False
    for cell in [*nb.cells, nbformat.v4.new_markdown_cell("## (end)")]:
        if cell.cell_type == "markdown" and SECTION.search(cell.source):
            if title is not None and shows and not checks:
                problems.append(f"section {title!r} shows output but asserts nothing about it")
            title, shows, checks = SECTION.search(cell.source).group(1).strip(), False, False
        elif cell.cell_type == "code":
            shows = shows or bool(cell.get("outputs"))
            checks = checks or has_assert(cell.source)
    return problems


def check_prose(path: Path) -> None:
    """What `path`'s prose states is computed or checked beside it (`prose_problems`)."""
    problems = prose_problems(executed(path))
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", FIRST, ids=[p.name for p in FIRST])
@pytest.mark.parametrize("check", [check_runs, check_committed_without_outputs, check_prose])
def test_notebook(path, check):
    check(path)


def _notebook(markdown: str, source: str = "x = 1", printed: str = ""):
    """A small executed-looking notebook: one markdown cell, then one code cell that printed."""
    cell = new_code_cell(source)
    if printed:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
    return new_notebook(cells=[nbformat.v4.new_markdown_cell(markdown), cell])


def test_prose_number_must_be_shown_or_checked():
    claim = "`skew_max` is 6.0 for every policy, and `row` leaves 43% idle."
    problems = prose_problems(_notebook(claim, printed="skew_max 6.0000\nidle 0.43\n"))
    assert [p.split(",")[0] for p in problems] == ["cell 0 states 6.0", "cell 0 states 43%"]
    assert not prose_problems(_notebook(claim, printed="6.0 43%"))
    checked = "assert skew == 6.0\nassert idle > 0.4, 'row leaves 43% idle'"
    assert not prose_problems(_notebook(claim, checked, printed="done"))
    assert prose_problems(_notebook(claim, "assert skew == 6  # 6.0\nassert idle > 0.43",
                                    printed="done"))


def test_prose_names_and_references_are_not_numbers():
    prose = ("## 4. Section\n\n1. DESIGN.md §4, notebooks 05 and 07, the top-8 of 64 experts of\n"
             "OLMoE-1B-7B on H200 (`log2phy`), a factor 8x, steps 16-31")
    assert prose_numbers(prose) == ["64", "8", "16", "31"]


def test_prose_duration_must_be_measured():
    assert prose_problems(_notebook("It takes about 10 s.", printed="10 figures"))
    assert not prose_problems(_notebook("It takes about 10 s.", printed="built in 10 s"))
    assert prose_problems(_notebook("It runs in well under a minute.", printed="ok"))


def test_section_with_output_needs_an_assert():
    nb = _notebook("## 1. Shown", printed="1.3628")
    assert prose_problems(nb) == ["section '1. Shown' shows output but asserts nothing about it"]
    nb.cells[1].source = "x = 1.3628\nassert x > 1"
    assert not prose_problems(nb)
    assert not prose_problems(_notebook("## 1. Nothing shown"))
    assert not prose_problems(_notebook("# Title, which sets up", printed="1.3628"))
