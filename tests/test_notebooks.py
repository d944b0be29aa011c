"""Every notebook runs top to bottom on a machine without a GPU, and shows its pictures.

Each ``notebooks/NN_*.py`` (jupytext percent format) is converted to a notebook and executed with nbclient
in a python3 kernel, in ``notebooks/`` (so ``import pictures, tiers`` work), with the CUDA simulator and the
Triton interpreter switched on by the notebook itself. A cell that raises fails the test with the cell's
traceback; a cell that calls ``plt.show()`` must have produced a PNG.
"""

import os
import pathlib
import time

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
TIMEOUT_PER_CELL_S = 120


def test_the_ten_notebooks_exist():
    assert [p.name[:2] for p in PATHS] == [f"{i:02d}" for i in range(1, 11)], [p.name for p in PATHS]


def execute(path):
    """The executed notebook and its run time in seconds."""
    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT_PER_CELL_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    client.execute()
    return nb, time.perf_counter() - start


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_and_draws(path):
    nb, seconds = execute(path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    not_run = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not not_run, f"{path.name}: code cells {not_run} did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    drawing = [i for i, c in enumerate(code) if "plt.show()" in c.source]
    assert drawing, f"{path.name} draws no picture"
    blank = [i for i in drawing if not any("image/png" in o.get("data", {}) for o in code[i].outputs)]
    assert not blank, f"{path.name}: code cells {blank} call plt.show() but produced no image"
    print(f"{path.name}: {seconds:.1f} s")
