"""The documentation site builds with no warnings and offline, its examples run, every public name has an example.

The build is ``mkdocs build --strict`` (warnings are errors) into a temporary folder, in a subprocess whose path
shadows torch, numba and triton with packages that refuse to import: the site, including its API reference,
must be built from the sources alone. The notebooks are rendered unexecuted here (``BSRATTN_DOCS_EXECUTE=false``);
``tests/test_notebooks.py`` executes them and builds the site from them. The site must load nothing from outside
itself (MathJax is served from it), its math must reach MathJax, and every link and source inside it must lead to
a file of the site, and to its anchor (:func:`broken_links`, which ``tests/test_notebooks.py`` runs on the site it
builds from the executed notebooks too). The README's code and the home page's run as they stand, in a fresh
interpreter: the README's without the simulator variables and on each tier as the README says, the home page's
with them, as each says.
"""

import doctest
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import urllib.parse
from html.parser import HTMLParser

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("mkdocs_jupyter")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PUBLIC_MODULES = ("bsrattn", "bsrattn.layouts", "bsrattn.scheduler", "bsrattn.backends", "bsrattn.testing",
                  "bsrattn.indexing") + (("bsrattn.draw",) if importlib.util.find_spec("matplotlib") else ())
BLOCKED = ("torch", "numba", "triton")
SIMULATORS = ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")


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
    env["BSRATTN_DOCS_EXECUTE"] = "false"
    env.pop("BSRATTN_DOCS_NOTEBOOKS", None)
    out = tmp / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_every_page_of_the_nav_is_built(site):
    for page in ("index.html", "concepts/merge/index.html", "tiers/index.html", "gpu/index.html",
                 "benchmarks/index.html", "api/bsrattn/index.html", "api/scheduler/index.html", "api/draw/index.html",
                 "api/integrations/index.html"):
        assert (site / page).is_file(), page
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    assert len(notebooks) == 13
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


def _pages(site):
    return sorted(site.rglob("*.html"))


def test_the_site_loads_nothing_from_outside_itself(site):
    external = re.compile(r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["'](?:https?:)?//|"""
                          r"""<link\b[^>]*\bhref=["'](?:https?:)?//|@import\s+url\(["']?(?:https?:)?//""")
    for page in _pages(site):
        found = external.search(page.read_text())
        assert not found, f"{page.relative_to(site)} loads {found.group(0)!r}"
    # MathJax is the site's own: the component the pages load, and the fonts it fetches next to itself.
    mathjax = site / "assets" / "mathjax"
    assert (mathjax / "tex-mml-chtml.js").is_file()
    assert (mathjax / "output" / "chtml" / "fonts" / "woff-v2" / "MathJax_Main-Regular.woff").is_file()
    for page in ("index.html", "concepts/merge/index.html", "notebooks/07_attention_state_and_merge/index.html"):
        html = (site / page).read_text()
        scripts = re.findall(r'<script src="([^"]*)"', html)
        assert any(src.endswith("assets/mathjax/tex-mml-chtml.js") for src in scripts), (page, scripts)
        assert all(src and (site / page).parent.joinpath(src).resolve().is_file() for src in scripts), (page, scripts)
        assert "x-mathjax-config" not in html, f"{page}: nbconvert's MathJax 2 set-up is left in"


class _LinksAndAnchors(HTMLParser):
    """A page's ``href`` and ``src`` values, and the anchors it defines (``id``, and ``name`` on ``<a>``)."""

    def __init__(self):
        super().__init__()
        self.links, self.anchors = [], set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value and (name == "id" or (name == "name" and tag == "a")):
                self.anchors.add(value)
            elif value and name in ("href", "src"):
                self.links.append((f"<{tag} {name}={value!r}>", value))


def _parse(page):
    parser = _LinksAndAnchors()
    parser.feed(page.read_text())
    return parser


def broken_links(site):
    """``["page: <tag attr='target'> (why)", ...]``: every ``href``/``src`` of the built ``site`` that leads to no
    file of it, or to an anchor its page lacks.

    External targets (``http:``, ``mailto:``, ``data:``, any scheme, and ``//host``) are not followed. A target is
    resolved as a browser would: against the page's folder, or the site's root for ``/...``; a folder means its
    ``index.html``.
    """
    site = pathlib.Path(site).resolve()
    parsed = {}

    def page_of(path):
        if path not in parsed:
            parsed[path] = _parse(path)
        return parsed[path]

    broken = []
    for page in sorted(site.rglob("*.html")):
        for shown, target in page_of(page).links:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//", target):
                continue
            path, _, fragment = target.partition("#")
            path = urllib.parse.unquote(path.split("?")[0])
            if not path:
                dest = page
            else:
                base = site if path.startswith("/") else page.parent
                dest = pathlib.Path(os.path.normpath(base / path.lstrip("/")))
                if dest.is_dir():
                    dest = dest / "index.html"
            where = page.relative_to(site)
            if site not in dest.parents or not dest.is_file():
                broken.append(f"{where}: {shown} (no such file in the site)")
            elif fragment and dest.suffix == ".html" and urllib.parse.unquote(fragment) not in page_of(dest).anchors:
                broken.append(f"{where}: {shown} (no anchor #{fragment} in {dest.relative_to(site)})")
    return broken


def test_every_link_and_source_leads_into_the_site(site):
    broken = broken_links(site)
    assert not broken, f"{len(broken)} links lead nowhere:\n" + "\n".join(broken[:40])


def _text(html):
    """The page's text outside code, scripts and tags."""
    html = re.sub(r"<(pre|code|script|style)\b.*?</\1>", "", html, flags=re.DOTALL)
    return re.sub(r"<[^>]+>", " ", html)


def test_the_math_reaches_mathjax_and_no_tex_is_left_raw(site):
    merge = (site / "concepts" / "merge" / "index.html").read_text()
    assert len(re.findall(r'class="arithmatex"', merge)) > 5
    for page in _pages(site):
        html = page.read_text()
        if "/notebooks/" in page.as_posix():
            # A notebook page's code keeps its dollars; its markdown cells must not.
            html = "".join(re.findall(r'<div class="[^"]*jp-RenderedMarkdown[^"]*"[^>]*>(.*?)</div>', html, re.DOTALL))
        html = re.sub(r'<span class="arithmatex">.*?</span>|<div class="arithmatex">.*?</div>', "", html,
                      flags=re.DOTALL)
        raw = re.search(r"\$[^$\s][^$]*?\$", _text(html))
        assert not raw, f"{page.relative_to(site)}: TeX left raw: {raw.group(0)[:80]!r}"
    notebook = (site / "notebooks" / "07_attention_state_and_merge" / "index.html").read_text()
    assert r'<span class="arithmatex">\(\mathrm{lse} = -\infty\)</span>' in notebook


def test_titles_and_navigation_hold_no_tex(site):
    for page in _pages(site):
        html = page.read_text()
        labels = re.findall(r"<title>(.*?)</title>", html) + re.findall(r'<span class="md-ellipsis">(.*?)</span>', html,
                                                                          flags=re.DOTALL)
        assert not [label for label in labels if "$" in label], page.relative_to(site)


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


def _run(code, env, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_readme_code_runs_without_a_gpu_or_the_simulators(tmp_path):
    blocks = _python_blocks(ROOT / "README.md")
    assert blocks, "the README has no python block"
    env = {k: v for k, v in os.environ.items() if k not in SIMULATORS + ("BSRATTN_BACKEND",)}
    done = _run("\n".join(blocks), env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max |plan/run - attention|" in done.stdout, done.stdout


GPU_EXTRAS_ABSENT = """\
import sys

sys.modules.update(dict.fromkeys(("torch", "triton", "numba", "numba_cuda")))
"""
"""Prepended to a script: torch, triton and numba are not there (``import`` raises ModuleNotFoundError,
``importlib.util.find_spec`` gives None), as after ``pip install -e .`` alone."""


def test_the_readme_code_runs_with_the_gpu_extras_absent(tmp_path):
    """The light install the README describes: numpy and ml_dtypes alone run the Ten lines, on the reference
    tier, which ``"auto"`` picks."""
    env = {k: v for k, v in os.environ.items() if k not in SIMULATORS + ("BSRATTN_BACKEND",)}
    code = GPU_EXTRAS_ABSENT + "\n".join(_python_blocks(ROOT / "README.md")) + (
        "\nprint('auto:', ba.get_backend('auto').name)\nimport sys\n"
        "print('loaded:', sorted({m.split('.')[0] for m, module in sys.modules.items() if module is not None}\n"
        "                        & {'torch', 'triton', 'numba'}))")
    done = _run(code, env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max |plan/run - attention|" in done.stdout and "auto: reference" in done.stdout, done.stdout
    assert "loaded: []" in done.stdout, done.stdout


@pytest.mark.parametrize("tier, simulator, packages", [("numba", "NUMBA_ENABLE_CUDASIM", ("numba",)),
                                                        ("torch", "TRITON_INTERPRET", ("torch", "triton"))])
def test_the_readme_code_runs_on_each_gpu_tier_as_printed(tier, simulator, packages, tmp_path):
    """The README's code, unchanged, with the tier picked by ``BSRATTN_BACKEND`` (and, without a GPU, the tier's
    simulator switched on), as the README's commands run it."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the {tier} tier needs {', '.join(missing)}, not installed here")
    command = f"BSRATTN_BACKEND={tier} {simulator}=1 python"
    assert command in (ROOT / "README.md").read_text(), f"the README no longer says {command!r}"
    env = {k: v for k, v in os.environ.items() if k not in SIMULATORS}
    env["BSRATTN_BACKEND"] = tier
    if not _has_gpu():
        env[simulator] = "1"
    code = "\n".join(_python_blocks(ROOT / "README.md")) + "\nprint('tier:', ba.get_backend().name)"
    done = _run(code, env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max |plan/run - attention|" in done.stdout and f"tier: {tier}" in done.stdout, done.stdout


def test_the_home_page_code_runs_as_the_page_says(tmp_path):
    page = (DOCS / "index.md").read_text()
    assert "NUMBA_ENABLE_CUDASIM=1 TRITON_INTERPRET=1 python" in page
    env = dict(os.environ)
    if not _has_gpu():
        env.update({name: "1" for name in SIMULATORS})
    done = _run("\n".join(_python_blocks(DOCS / "index.md")), env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max |numba - reference|" in done.stdout, done.stdout


def _has_gpu():
    import shutil

    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def test_the_readme_opens_with_its_picture():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.strip()]
    picture = re.fullmatch(r"!\[[^\]]+\]\((docs/assets/[\w.-]+\.png)\)", lines[1])
    assert lines[0] == "# bsrattn" and picture, lines[:2]
    path = ROOT / picture.group(1)
    assert path.is_file() and path.stat().st_size < 100 * 1024, path


# Paths and file names a reader is pointed at: a relative link's target, or a file name in backticks.
FILE_NAME = re.compile(r"`([\w./-]+\.(?:md|py|json|toml|yml|png|txt))`")
LINK = re.compile(r"\]\(((?!https?:|#)[^)\s]+)\)")


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md", "docs/index.md", "docs/benchmarks.md", "docs/gpu.md"])
def test_every_file_named_is_in_the_repository(name):
    path = ROOT / name
    text = path.read_text()
    missing = []
    for target in LINK.findall(text):
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    for target in FILE_NAME.findall(text):
        candidates = [ROOT / target, DOCS / target, ROOT / "benchmarks" / target]
        if "/" not in target:
            candidates += [p for p in ROOT.rglob(target) if ".git" not in p.parts]
        if not any(c.exists() for c in candidates):
            missing.append(target)
    assert not missing, f"{name} names files that are not in the repository: {missing}"


def test_the_hooks_examples_run():
    for hook in sorted((DOCS / "_hooks").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"hook_{hook.stem}", hook)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        result = doctest.testmod(module)
        assert result.failed == 0, f"{hook.name}: {result.failed} examples failed"


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
