"""README.md and its guide pages (`docs/guide/*.md`, in name order after it) are true: every
command in their code blocks runs, and every output they show is what the command prints today.

- ```console blocks: each `$ eplbsim ...` line runs in order, in one scratch folder that sees the
  repository's `traces/` and `sweeps/`; the lines under it, up to the next `$` line, must be
  exactly what it prints (a line `...` stands for any number of lines).
- ```bash blocks (the README's): the second is the test command `.ci/run` runs; the first ends in
  `eplbsim run`, which runs here.
- ```python blocks run as they are, in the same folder.
The command reference in `docs/` is checked against the parsers in the same way: the pages
`python -m eplbsim.cli.reference` writes are the committed ones.
"""

import os
import re
import shlex
from pathlib import Path

import pytest

from eplbsim.cli import main
from eplbsim.cli.reference import pages
from eplbsim.review import EXIT

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GUIDES = sorted((ROOT / "docs" / "guide").glob("*.md"))
DOCS = "\n".join([README, *(p.read_text() for p in GUIDES)])  # in the order the tests run them
ELLIPSIS = "..."
README_LINES = 250  # the README stays readable in one sitting; the guide pages hold the rest


def blocks(kind, text=DOCS):
    """The bodies of the ```kind blocks of `text` (the README and its guides), in order."""
    return re.findall(rf"^```{kind}\n(.*?)^```$", text, re.S | re.M)


def examples():
    """`(command, shown output lines)` of every `$` line of the console blocks, in order."""
    out = []
    for block in blocks("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], []))
            else:
                out[-1][1].append(line)
    return out


def matches(shown, printed):
    """Whether `printed` lines are `shown`, a line `...` matching any number of lines."""
    if not shown:
        return not printed
    if shown[0] == ELLIPSIS:
        return any(matches(shown[1:], printed[i:]) for i in range(len(printed) + 1))
    return bool(printed) and shown[0] == printed[0] and matches(shown[1:], printed[1:])


SHARED = ROOT.parent / "shared"  # the project's real data (`../shared/data`), when present
HAVE_DATA = (SHARED / "data").is_dir()  # an empty or partial `../shared` is not the data


def reads_shared(command):
    """Whether `command` reads `../shared/data`, which this checkout may lack."""
    return "../shared/" in command


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch folder with the repository's inputs linked in, and `../shared` beside it when
    the repository has one; the tests run there."""
    where = tmp_path_factory.mktemp("readme") / "repo"
    where.mkdir()
    for name in ("traces", "sweeps"):
        (where / name).symlink_to(ROOT / name)
    if SHARED.is_dir():
        (where.parent / "shared").symlink_to(SHARED)
    before = Path.cwd()
    os.chdir(where)
    yield where
    os.chdir(before)


def run_example(command, capsys):
    """`(status, printed lines)` of one README command, run in-process."""
    argv = shlex.split(command)
    assert argv[0] == "eplbsim", command
    status = main(argv[1:])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


EXAMPLES = examples()
# Each distinct command once, with every output shown for it: the README's short examples are
# commands its guides show in full, run once and checked against both.
RUNS = {}
for _command, _shown in EXAMPLES:
    RUNS.setdefault(_command, []).append(_shown)


def test_the_readme_has_its_examples_and_fits_on_a_screen():
    assert len(EXAMPLES) >= 8 and len(blocks("bash", README)) == 2 and blocks("python", README)
    assert len(README.splitlines()) <= README_LINES
    for page in GUIDES:  # each guide is linked from the README
        assert f"(docs/guide/{page.name})" in README, page.name


@pytest.mark.parametrize("command,shown", RUNS.items(), ids=[c[:60] for c in RUNS])
def test_every_console_example_runs_and_prints_what_is_shown(workdir, capsys, command, shown):
    if reads_shared(command) and not HAVE_DATA:
        pytest.skip("reads the project's real data in ../shared, absent here")
    status, printed, err = run_example(command, capsys)
    if command.startswith("eplbsim review"):  # its status is its verdict's
        verdict = next(line for line in printed if line.startswith("## Verdict: "))
        assert status == EXIT[verdict.removeprefix("## Verdict: ")], err
    else:
        assert status == 0, err
    for one in shown:
        assert matches(one, printed), "\n".join(["printed:", *printed])


def test_the_set_up_commands(workdir, capsys):
    install_and_run, install_and_test = blocks("bash", README)
    assert "constraints-cpu" in install_and_run and "constraints-cpu" in install_and_test
    assert install_and_test.strip().endswith("python -m pytest -n auto --dist loadfile")
    command = install_and_run.strip().split("&&")[-1].strip()
    assert command == ".venv/bin/eplbsim run"
    status, printed, err = run_example("eplbsim run", capsys)
    assert status == 0 and printed[1].split()[:2] == ["policy", "mode"], err


def test_the_python_example_runs(workdir, capsys):
    for block in blocks("python"):
        exec(compile(block, "README.md or a guide", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:2] == ["policy", "mode"]
    assert (workdir / "policies.png").stat().st_size > 1000


def test_the_command_reference_is_current():
    written = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}  # not docs/guide/
    assert written == pages(), "run: python -m eplbsim.cli.reference"


def test_the_numbers_the_prose_states(capsys):
    from eplbsim.replay.sweep import read_spec
    assert "(`sweeps/example.toml`, 144 cells)" in DOCS
    assert len(read_spec(ROOT / "sweeps" / "example.toml").cells) == 144
    assert "(`--redundant -1`: `redundant must be >= 0, got -1`)" in DOCS
    assert main(["run", "--redundant", "-1"]) == 2
    assert "redundant must be >= 0, got -1" in capsys.readouterr().err
    assert "a 512-token profiling pass" in DOCS  # shown by trace info's output above it
    assert "flagged warm-up (every row routed alike, or start-up steps before the first dummy): " \
        "1 step (0), 512 tokens" in DOCS


def test_every_row_of_the_run_examples_keeps_its_gap_under_its_promise(workdir, capsys):
    """Balance has one definition (routed pairs), so a placement's max GPU load over the best
    possible one (`gap`) never exceeds its max over the mean (`promise`)."""
    import json
    runs = [c for c in RUNS if c.startswith("eplbsim run ") and "--out" not in c
            and (HAVE_DATA or not reads_shared(c))]
    assert len(runs) >= 4
    for command in runs:
        status, printed, err = run_example(command + " --json", capsys)
        assert status == 0, err
        for row in json.loads("\n".join(printed)):
            assert row["placement_gap"] <= row["placement_imbalance"] + 1e-12, (command, row)


def test_the_tested_releases_the_prose_names():
    from eplbsim.engines import ENGINES
    assert ENGINES["sglang"].tested == ("0.5.14", "0.5.16", "0.5.17", "0.5.23")
    assert ENGINES["vllm"].tested == ("0.33.0", "0.34.0")
    assert "(no\n  dependencies: SGLang 0.5.14, 0.5.16, 0.5.17, 0.5.23, vLLM 0.33.0, 0.34.0)" \
        in README
    assert "(SGLang 0.5.14, 0.5.16, 0.5.17 and the pinned 0.5.23;\nvLLM the pinned 0.33.0 and " \
        "0.34.0)" in DOCS


def test_the_first_table_says_what_each_column_is():
    """A newcomer meets the README's first table before any guide: the text under it names
    every column it shows, and links the page that defines them all."""
    block = blocks("console", README)[0]
    header = block.splitlines()[2].split()
    assert header[:2] == ["policy", "mode"]
    below = README.split(block, 1)[1].split("\n## ", 1)[0]
    for column in header[2:]:
        assert f"`{column}`" in below, column
    assert "(docs/guide/09-tables.md)" in below
