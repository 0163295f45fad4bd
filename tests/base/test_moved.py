"""eplbsim.base.moved: every old module path (`OLD_NAMES`) still imports, for one release, as the
very module at its new path (never a second copy), with a DeprecationWarning; nothing is left
at the old path; and `import eplbsim` imports none of them."""

import subprocess
import sys
from pathlib import Path

import pytest

import eplbsim
from eplbsim.base.moved import OLD_NAMES

ROOT = Path(eplbsim.__file__).parent


def _run(code: str) -> str:
    """`code` in a fresh interpreter (no module imported before it), its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_new_path_is_a_module_and_no_old_path_is_left():
    for old, new in OLD_NAMES.items():
        path = ROOT.joinpath(*new.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), new
        gone = ROOT.joinpath(*old.split("."))
        assert not gone.with_suffix(".py").exists() and not gone.exists(), old


def test_every_old_path_imports_the_very_module_of_its_new_path():
    """In one fresh interpreter: each old name, imported by `import` and by `from ... import`,
    is the new module itself, whose name and spec stay its own; no file is loaded twice."""
    code = f"""
import importlib, sys, warnings
import eplbsim
old_names = {dict(OLD_NAMES)!r}
assert not any(f"eplbsim.{{o}}" in sys.modules for o in old_names)  # imported on demand only
for old, new in old_names.items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(f"eplbsim.{{old}}")
    fresh = [w for w in seen if issubclass(w.category, DeprecationWarning)]
    assert module is importlib.import_module(f"eplbsim.{{new}}"), old
    assert module.__name__ == module.__spec__.name == f"eplbsim.{{new}}", old
    assert fresh and f"eplbsim.{{new}}" in str(fresh[0].message), old
files = {{}}
for name, module in list(sys.modules.items()):
    if name.startswith("eplbsim") and getattr(module, "__file__", None):
        assert files.setdefault(module.__file__, module) is module, ("loaded twice", name)
print(len(old_names))
"""
    assert _run(code).strip() == str(len(OLD_NAMES))


@pytest.mark.parametrize("statement", [
    "from eplbsim.rank_epoch import Epoch as old; from eplbsim.ranks.epoch import Epoch as new",
    "from eplbsim.errors import InputError as old; from eplbsim import InputError as new",
    "from eplbsim.spec.runspec import run_knobs as old\n"
    "from eplbsim.runspec.run import run_knobs as new",
    "from eplbsim.spec import RunSpec as old; from eplbsim import RunSpec as new",
    "import eplbsim.spec.values; import eplbsim.runspec.values as new; old = eplbsim.spec.values",
    "import eplbsim; old = eplbsim.topology.Topology; from eplbsim import Topology as new",
    "import eplbsim.workers; from eplbsim.replay import workers as new; old = eplbsim.workers",
])
def test_a_notebook_written_against_an_old_path_gets_the_same_objects(statement):
    assert _run(f"import warnings; warnings.simplefilter('ignore')\n{statement}\n"
                "assert old is new\nprint('same')").strip() == "same"


def test_an_old_path_warns_and_an_unknown_name_is_an_attribute_error():
    with pytest.warns(DeprecationWarning, match="eplbsim.review_measures moved to "
                      "eplbsim.review.measures"):
        _run_in_process("eplbsim.review_measures")
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        eplbsim.no_such_module  # noqa: B018


def _run_in_process(name: str) -> None:
    """Import `name` here, forgetting it first so that the finder answers again."""
    import importlib
    sys.modules.pop(name, None)
    importlib.import_module(name)
