"""`--help` imports nothing heavy: `import eplbsim` and `import eplbsim.cli` bring in none of
torch, numba, matplotlib or scipy, and after its first time every command's help is read from
the cache (`cli.help_cache`), the same text argparse prints, without them. Checked on what
modules a fresh interpreter loads, not on time."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from eplbsim.cli import build_parser, help_cache, main
from eplbsim.cli.help_cache import commands

HEAVY = ("torch", "numba", "matplotlib", "scipy")
PATHS = [p for p, _ in commands(build_parser())]


def _loaded(code: str, cache: str) -> dict:
    """Run `code` in a fresh interpreter with the help cache at `cache`; it prints a JSON
    object, read back, with the heavy modules loaded under "heavy"."""
    probe = f"import json, sys\n{code}\nout['heavy'] = [m for m in {HEAVY!r} if m in sys.modules]\n" \
            "print(json.dumps(out))"
    env = {**os.environ, "XDG_CACHE_HOME": cache, "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["eplbsim", "eplbsim.cli"])
def test_importing_the_package_or_the_command_loads_nothing_heavy(tmp_path, module):
    assert _loaded(f"import {module}\nout = {{}}", str(tmp_path))["heavy"] == []


def test_every_help_after_the_first_loads_nothing_heavy_and_says_what_argparse_says(tmp_path):
    code = ("import contextlib, io\nfrom eplbsim.cli import main\nout = {}\n"
            f"for path in {PATHS!r}:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf):\n"
            "        assert main([*path, '--help']) == 0\n"
            "    out[' '.join(path)] = buf.getvalue()\n")
    first = _loaded(code, str(tmp_path))
    assert set(first["heavy"]) >= {"torch"}  # the first builds the parser, and caches every help
    again = _loaded(code, str(tmp_path))
    assert again.pop("heavy") == []
    first.pop("heavy")
    assert again == first and len(again) == len(PATHS)
    assert again["run"].startswith("usage: eplbsim run") and "--policies" in again["run"]


def test_a_help_among_other_flags_is_argparse_s(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert help_cache.asked(["run", "--gpus", "8", "--help"]) is None
    assert help_cache.asked(["trace", "info", "-h"]) == ("trace", "info")
    assert help_cache.asked(["--help"]) == ()
    assert main(["run", "--gpus", "8", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: eplbsim run")
    assert not (tmp_path / "eplbsim").exists()  # nothing cached: argparse answered


def test_an_unknown_command_s_help_is_argparse_s_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["nonsense", "--help"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_cache_that_cannot_be_read_or_written_is_passed_over(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # eplbsim/ cannot be made under it
    assert main(["run", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: eplbsim run")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "eplbsim").mkdir()
    (tmp_path / "eplbsim" / f"help-{help_cache.fingerprint()}.json").write_text("[1, 2")
    assert main(["solve", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: eplbsim solve")
    cached = json.loads((tmp_path / "eplbsim" / f"help-{help_cache.fingerprint()}.json")
                        .read_text())
    assert cached["solve"].startswith("usage: eplbsim solve")  # the broken file replaced


def test_a_changed_source_file_is_a_new_fingerprint(tmp_path, monkeypatch):
    before = help_cache.fingerprint()
    monkeypatch.setattr(help_cache, "PACKAGE", tmp_path)
    (tmp_path / "x.py").write_text("A = 1\n")
    one = help_cache.fingerprint()
    (tmp_path / "x.py").write_text("A = 12\n")
    assert len({before, one, help_cache.fingerprint()}) == 3


def test_the_version_is_what_argparse_says_and_loads_nothing_heavy(tmp_path):
    code = ("import contextlib, io\nfrom eplbsim.cli import main\nbuf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n    assert main(['--version']) == 0\n"
            "out = {'printed': buf.getvalue()}\n")
    loaded = _loaded(code, str(tmp_path))
    assert loaded["heavy"] == [] and not (tmp_path / "eplbsim").exists()
    parsed = io.StringIO()
    with contextlib.redirect_stdout(parsed), pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert loaded["printed"] == parsed.getvalue()
