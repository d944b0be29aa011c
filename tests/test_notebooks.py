"""Every notebook runs top to bottom on a machine without a GPU, and shows its pictures.

Each ``notebooks/NN_*.py`` (jupytext percent format) is converted to a notebook and executed with nbclient in a
python3 kernel, in ``notebooks/`` (so ``import pictures, tiers`` work); the notebook itself switches on the CUDA
simulator and the Triton interpreter when there is no GPU. A cell that raises fails the test with the cell's
error. A cell that calls ``plt.show()`` must have produced a PNG, except a cell tagged ``needs-results``, which
draws the committed benchmark results and must produce one exactly when GPU results exist.

Most of a notebook's time is its kernel importing torch, Numba and matplotlib on one core, so the selected
notebooks run in parallel, one worker process per core (at most four), the first time any test asks for one.
"""

import concurrent.futures
import multiprocessing
import os
import pathlib
import re
import time

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
RESULTS = ROOT / "benchmarks" / "results"
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
TIMEOUT_PER_CELL_S = 180
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours of IPython tracebacks


def execute(path):
    """``(executed notebook, seconds, error text or None)``; runs in a worker process."""
    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT_PER_CELL_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    try:
        client.execute()
    except Exception as exc:  # the failing cell's error goes back to the test that owns the notebook
        return nb, time.perf_counter() - start, ANSI.sub("", f"{type(exc).__name__}: {exc}")
    return nb, time.perf_counter() - start, None


@pytest.fixture(scope="module")
def executed(request):
    """Every notebook selected in this session, executed once, in parallel."""
    selected = [item.callspec.params["path"] for item in request.session.items
                if getattr(item, "module", None) is not None and item.module.__name__ == __name__
                and hasattr(item, "callspec") and "path" in item.callspec.params]
    workers = max(1, min(4, os.cpu_count() or 1, len(selected)))
    # Fresh interpreters, not forks of this one: a kernel's ZMQ sockets must not share a forked context.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {path: pool.submit(execute, path) for path in selected}
        return {path: future.result() for path, future in futures.items()}


def gpu_results_exist() -> bool:
    """Whether ``benchmarks/results`` holds results measured on a GPU (they record the device's ceilings)."""
    import json

    return any(json.loads(p.read_text()).get("ceilings") for p in RESULTS.glob("*.json"))


def test_the_ten_notebooks_exist():
    assert [p.name[:2] for p in PATHS] == [f"{i:02d}" for i in range(1, 11)], [p.name for p in PATHS]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_and_draws(path, executed):
    nb, seconds, error = executed[path]
    assert error is None, f"{path.name} failed after {seconds:.0f} s:\n{error}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    not_run = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not not_run, f"{path.name}: code cells {not_run} did not run"
    drawing = [i for i, c in enumerate(code) if "plt.show()" in c.source]
    assert drawing, f"{path.name} draws no picture"
    has_image = {i: any("image/png" in o.get("data", {}) for o in code[i].outputs) for i in drawing}
    needs_results = {i for i in drawing if "needs-results" in code[i].metadata.get("tags", [])}
    blank = [i for i in drawing if i not in needs_results and not has_image[i]]
    assert not blank, f"{path.name}: code cells {blank} call plt.show() but produced no image"
    want = gpu_results_exist()
    wrong = [i for i in needs_results if has_image[i] != want]
    assert not wrong, (f"{path.name}: cells {wrong} should {'draw' if want else 'draw nothing'}: GPU results "
                       f"{'exist' if want else 'do not exist'} in {RESULTS.relative_to(ROOT)}")
    print(f"{path.name}: {seconds:.1f} s")
