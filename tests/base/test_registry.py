"""eplbsim.base.registry: lookup, and what a mistyped name is told: the closest names, every choice,
and the forms a registry takes beyond its names."""

import pytest

from eplbsim.base.errors import InputError
from eplbsim.base.registry import FILE_FORM, Joined, lookup, unknown

from cli_helpers import assert_input_error


class _Files(dict):
    forms = (FILE_FORM,)


def test_a_close_name_is_suggested_and_every_choice_listed():
    registry = {"ordinal": 1, "row": 2}
    assert lookup(registry, "row", "policy") == 2
    with pytest.raises(InputError, match=r"^unknown policy 'ordnal' \(did you mean ordinal\?\); "
                                         r"choose one of ordinal, row$"):
        lookup(registry, "ordnal", "policy")
    with pytest.raises(InputError, match=r"^unknown policy 'xyz'; choose one of ordinal, row$"):
        lookup(registry, "xyz", "policy")
    assert str(unknown("device", "cdua", ("cpu", "cuda"), ("cuda:N",))) == (
        "unknown device 'cdua' (did you mean cuda?); choose one of cpu, cuda, or cuda:N")


def test_the_forms_of_joined_registries_are_listed_and_a_bare_file_is_told_its_form():
    joined = Joined({"row": 1}, {"sglang:dynamic": 2}, _Files())
    assert joined.forms == (FILE_FORM,)
    assert str(unknown("policy", "sglang:dynamc", joined)) == (
        "unknown policy 'sglang:dynamc' (did you mean sglang:dynamic?); choose one of row, "
        f"sglang:dynamic, or a function in a file, {FILE_FORM}")
    assert str(unknown("policy", "mine.py", joined)) == (
        f"policy 'mine.py' names a file but no function in it: write mine.py:FUNCTION (a "
        f"policy in a file is {FILE_FORM})")
    assert "names a file" not in str(unknown("solver", "mine.py", {"lpt": 1}))


@pytest.mark.parametrize("flags, match", [
    (["--policies", "ordnal"], "did you mean ordinal?"),
    (["--solver", "deepseak"], "did you mean deepseek"),
    (["--view", "ful"], "did you mean full?"),
    (["--scenario", "skewd"], "did you mean skewed?"),
    (["--cost", "roofline", "--model", "deepseek-v4"], "did you mean deepseek-v3"),
    (["--cost", "roofline", "--device-profile", "h20"], "did you mean h200?"),
    (["--device", "cdua"], "did you mean cuda?"),
])
def test_a_mistyped_run_name_gets_a_suggestion(capsys, flags, match):
    assert_input_error(capsys, "run", "--steps", "2", "--tokens", "8", *flags, match=match)


@pytest.mark.parametrize("argv", [["run", "--steps", "2", "--policies", "ordnal"],
                                  ["review", "ordnal"], ["review", "row", "--baseline", "ordnal"]])
def test_the_policy_choices_name_engine_algorithms_and_the_file_form(capsys, argv):
    assert_input_error(capsys, *argv, match="did you mean ordinal?")
    assert_input_error(capsys, *argv, match="sglang:dynamic")
    assert_input_error(capsys, *argv, match=f"vllm:hash, or a function in a file, {FILE_FORM}")


@pytest.mark.parametrize("argv", [["run", "--steps", "2", "--policies", "mine.py"],
                                  ["review", "mine.py"]])
def test_a_policy_file_without_its_function_is_told_the_form(capsys, argv):
    assert_input_error(capsys, *argv, match="'mine.py' names a file but no function in it: "
                                            "write mine.py:FUNCTION")


def test_positional_and_choice_names_suggest_too(capsys):
    """`trace synth SCENARIO` and `solve --solver` check their names as the run schema does."""
    from eplbsim.cli import main
    for argv, fragment in ((["trace", "synth", "skewd", "--out", "x.npz"],
                            "unknown scenario 'skewd' (did you mean skewed?)"),
                           (["solve", "--trace", "x.npz", "--solver", "deepsek"],
                            "unknown solver 'deepsek' (did you mean deepseek?)")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert fragment in err[-1] and "choose one of" in err[-1], err
