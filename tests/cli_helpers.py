"""Running the `eplbsim` command in-process from tests."""

from eplbsim.cli import main


def run(capsys, *argv):
    """`eplbsim ARGV...` -> (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_input_error(capsys, *argv, match):
    """The command fails on bad input: status 2 and one stderr line containing `match`."""
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eplbsim: error:"), err
    assert match in lines[0], lines[0]
