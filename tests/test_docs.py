"""The documentation site builds with no warnings, its examples run, and every public name has an example.

The build is ``mkdocs build --strict`` (warnings are errors) into a temporary folder, in a subprocess whose path
shadows torch, numba and triton with packages that refuse to import: the site, including its API reference,
must be built from the sources alone. The notebooks are rendered unexecuted (``tests/test_notebooks.py`` runs
them).
"""

import doctest
import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("mkdocs_jupyter")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PUBLIC_MODULES = ("bsrattn", "bsrattn.layouts", "bsrattn.scheduler", "bsrattn.backends", "bsrattn.testing",
                  "bsrattn.indexing")
BLOCKED = ("torch", "numba", "triton")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site's folder."""
    tmp = tmp_path_factory.mktemp("docs")
    for name in BLOCKED:
        (tmp / "blocked" / name).mkdir(parents=True)
        (tmp / "blocked" / name / "__init__.py").write_text(
            f"raise ImportError('the docs build must not import {name}')\n")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(tmp / "blocked"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("BSRATTN_DOCS_EXECUTE", None)
    out = tmp / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_every_page_of_the_nav_is_built(site):
    for page in ("index.html", "concepts/merge/index.html", "tiers/index.html", "gpu/index.html",
                 "benchmarks/index.html", "api/bsrattn/index.html", "api/scheduler/index.html"):
        assert (site / page).is_file(), page
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    assert len(notebooks) == 10
    for stem in notebooks:
        assert (site / "notebooks" / stem / "index.html").is_file(), stem


def test_api_reference_renders_the_docstrings(site):
    page = (site / "api" / "bsrattn" / "index.html").read_text()
    for name in ("bsrattn.attention", "bsrattn.BatchAttention", "bsrattn.merge_state", "bsrattn.BSRLayout",
                 "bsrattn.Variant", "bsrattn.Cascade"):
        assert f'id="{name}"' in page, name
    # The example of attention() is rendered as a code block, not as running text.
    code = [re.sub(r"<[^>]+>", "", block) for block in re.findall(r"<pre.*?</pre>", page, flags=re.DOTALL)]
    assert any(">>> out, lse = ba.attention(q, k, v, layout" in block.replace("&gt;", ">") for block in code)


def test_benchmark_page_shows_the_committed_results_or_says_there_are_none(site):
    page = (site / "benchmarks" / "index.html").read_text()
    results = ROOT / "benchmarks" / "results"
    if (results / "README.md").is_file() or any(results.glob("*.json")):
        assert "No results committed yet" not in page
        assert "Reproduce" in page
        for image in results.glob("*.png"):
            assert (site / "benchmarks" / "results" / image.name).is_file(), image.name
    else:
        assert "No results committed yet" in page


def _pycon_blocks(path):
    return re.findall(r"```pycon\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("path", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_examples_run(path):
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for i, block in enumerate(_pycon_blocks(path)):
        test = parser.get_doctest(block, {}, f"{path.name}[{i}]", str(path), 0)
        result = runner.run(test, out=lambda text: print(text, end=""))
        assert result.failed == 0, f"{path.relative_to(ROOT)}: example {i} failed (see the output above)"


def _public_names():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        # A module without __all__ exports the functions and classes it defines under public names.
        names = getattr(module, "__all__", None) or [
            n for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module_name]
        for name in names:
            obj = getattr(module, name)
            if not inspect.ismodule(obj) and (inspect.isclass(obj) or callable(obj)):
                yield f"{module_name}.{name}", obj


@pytest.mark.parametrize("name, obj", list(_public_names()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_public_name_has_a_numpydoc_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert re.search(r"^Examples\n--------\n", doc, flags=re.MULTILINE), f"{name}: no numpydoc Examples section"
    assert ">>>" in doc.split("Examples\n--------\n", 1)[1], f"{name}: its Examples section has no >>> example"
    if inspect.isclass(obj):
        undocumented = [attr for attr, value in vars(obj).items() if not attr.startswith("_")
                        and (callable(value) or isinstance(value, property))
                        and not inspect.getdoc(value.fget if isinstance(value, property) else value)]
        assert not undocumented, f"{name}: public members without a docstring: {undocumented}"
