"""eplbsim.base.files: what is written follows the umask, as `open` and `mkdir` would make it, not a
temporary file's 0600."""

import os
import stat

import pytest

from eplbsim.base.files import atomic_dir, atomic_file

from cli_helpers import run


@pytest.fixture(params=[0o022, 0o077])
def umask(request):
    """The process's umask set to the parameter for the test, then set back."""
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_have_the_modes_the_umask_gives(tmp_path, umask):
    with atomic_file(tmp_path / "f.txt") as tmp:
        tmp.write_text("x")
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "inner.txt").write_text("y")
    assert _mode(tmp_path / "f.txt") == 0o666 & ~umask
    assert _mode(tmp_path / "d") == 0o777 & ~umask
    assert _mode(tmp_path / "d" / "inner.txt") == 0o666 & ~umask


def test_run_out_writes_files_as_open_would(tmp_path, capsys, umask):
    code, _, err = run(capsys, "run", "--steps", "2", "--tokens", "16", "--layers", "2",
                       "--experts", "8", "--top-k", "2", "--gpus", "2", "--redundant", "2",
                       "--policies", "row", "--mode", "none", "--out", tmp_path / "res")
    written = [p for p in (tmp_path / "res").rglob("*") if p.is_file()]
    assert code == 0 and written, err
    assert {p.name: _mode(p) for p in written} == {p.name: 0o666 & ~umask for p in written}
