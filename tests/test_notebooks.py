"""Every notebook runs top to bottom on a machine without a GPU, shows its pictures, and the site shows them too.

Each ``notebooks/NN_*.py`` (jupytext percent format) is executed once, by the docs build's own executor
(``docs/_hooks/notebook_outputs.py``: a python3 kernel per notebook, in ``notebooks/`` so ``import tiers`` works,
one per core at a time); the notebook itself switches on the CUDA simulator and the Triton interpreter when there
is no GPU. A cell that raises fails the test with the cell's error. A cell that calls ``plt.show()`` must have
produced a PNG, except a cell tagged ``needs-results``, which draws the committed benchmark results and must
produce one exactly when GPU results exist.

The executed notebooks are then written out and the site is built from them (``mkdocs build --strict`` with
``BSRATTN_DOCS_NOTEBOOKS``): every notebook page must hold its figures and its math typeset-ready, as
``mkdocs build`` makes them, and no link or source of the site may lead nowhere (``test_docs.broken_links``: the
executed notebooks' outputs hold links that the unexecuted site of ``tests/test_docs.py`` does not).
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
_spec = importlib.util.spec_from_file_location("notebook_outputs", ROOT / "docs" / "_hooks" / "notebook_outputs.py")
outputs = sys.modules["notebook_outputs"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(outputs)
PATHS = outputs.paths()


@pytest.fixture(scope="module")
def executed(request):
    """Every notebook selected in this session, executed once, at the same time."""
    selected = [item.callspec.params["path"] for item in request.session.items
                if getattr(item, "module", None) is not None and item.module.__name__ == __name__
                and hasattr(item, "callspec") and "path" in item.callspec.params]
    return outputs.execute(selected or PATHS)


def gpu_results_exist() -> bool:
    """Whether ``benchmarks/results`` holds results measured on a GPU (they record the device's ceilings)."""
    return any(json.loads(p.read_text()).get("ceilings") for p in RESULTS.glob("*.json"))


def test_the_thirteen_notebooks_exist():
    assert [p.name[:2] for p in PATHS] == [f"{i:02d}" for i in range(1, 14)], [p.name for p in PATHS]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_and_draws(path, executed):
    run = executed[path]
    assert run.error is None, f"{path.name} failed after {run.seconds:.0f} s:\n{run.error}"
    code = [c for c in run.notebook.cells if c.cell_type == "code"]
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
    print(f"{path.name}: {run.seconds:.1f} s")


def _markdown_math(path) -> int:
    """How many ``$``-delimited formulas the notebook's markdown cells hold."""
    text = "\n".join(c.source for c in jupytext.read(path).cells if c.cell_type == "markdown")
    text = re.sub(r"`[^`]*`", "", text)
    return len(re.findall(r"\$\$.+?\$\$", text, flags=re.DOTALL)) + len(re.findall(r"(?<!\$)\$[^$\s][^$]*?\$", text))


def test_the_site_shows_every_notebook_executed(executed, tmp_path):
    if any(run.error for run in executed.values()) or set(executed) != set(PATHS):
        pytest.skip("needs every notebook executed without error (see test_notebook_runs_and_draws)")
    pytest.importorskip("mkdocs")
    outputs.write(executed, tmp_path / "executed")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", BSRATTN_DOCS_NOTEBOOKS=str(tmp_path / "executed"))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for path in PATHS:
        page = (site / "notebooks" / path.stem / "index.html").read_text()
        figures = len(re.findall(r'<img [^>]*src="data:image/png;base64,', page))
        drawn = sum("image/png" in o.get("data", {}) for c in executed[path].notebook.cells for o in c.get("outputs", []))
        assert figures == drawn > 0, f"{path.stem}: {figures} figures on the page, {drawn} in the executed notebook"
        # Every formula of the markdown cells is wrapped for MathJax, and no raw $...$ is left in their text.
        formulas = len(re.findall(r'<span class="arithmatex">', page))
        assert formulas >= _markdown_math(path), f"{path.stem}: {formulas} of {_markdown_math(path)} formulas wrapped"
        markdown = "".join(re.findall(r'<div class="[^"]*jp-RenderedMarkdown[^"]*"[^>]*>(.*?)</div>', page, re.DOTALL))
        text = re.sub(r"<[^>]+>", " ", re.sub(r"<(pre|code)\b.*?</\1>", "", markdown, flags=re.DOTALL))
        assert not re.search(r"\$[^$\s][^$]*\$", text), f"{path.stem}: raw $...$ math in its markdown"
        assert "../../assets/mathjax/tex-mml-chtml.js" in page and "x-mathjax-config" not in page, path.stem
    from test_docs import broken_links

    broken = broken_links(site)
    assert not broken, f"{len(broken)} links lead nowhere:\n" + "\n".join(broken[:40])
