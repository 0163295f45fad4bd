"""Every `notebooks/*.ipynb` runs top to bottom in a fresh kernel, and is committed without outputs.

The kernel is an ipykernel on the interpreter running pytest (the venv's python when pytest runs
as `.venv/bin/python -m pytest`), whatever kernelspecs are installed for the user or the system:
nothing needs `ipykernel install`, and a stray `python3` spec elsewhere cannot take over.
"""

import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from nbformat.v4 import new_code_cell, new_notebook  # noqa: E402
from traitlets import default  # noqa: E402

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)  # a copy: the file on disk is never rewritten
    execute(nb, NOTEBOOK_DIR)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
