"""MkDocs hook: the notebook pages show the notebooks executed, with their outputs, pictures and math.

Where the executed notebooks come from:

- by default, ``mkdocs build`` executes every ``notebooks/NN_*.py`` top to bottom (:func:`execute`: in
  ``notebooks/``, so their helper modules import; one kernel per core, at most four at a time) and fails on the
  first error;
- ``BSRATTN_DOCS_NOTEBOOKS=DIR``: from ``DIR/NN_*.ipynb``, notebooks executed beforehand (``tests/test_notebooks.py``
  executes them once, checks them, and builds the site from them);
- ``BSRATTN_DOCS_EXECUTE=false``: not executed — code and text only, in seconds, for ``mkdocs serve`` while writing.

The kernels' channels are encrypted (CurveZMQ, where jupyter_client and pyzmq offer it), so ipykernel has no
plain-TCP warning to print; and mkdocs-jupyter's ``Converting notebook (execute=False)`` line, true of its own
rendering but read as "not executed", is left out for notebooks executed here or given: this hook logs what ran.

Math: a markdown cell writes TeX between ``$`` (inline) and ``$$`` (display), which nbconvert passes through as
text. :func:`wrap_notebook_math` wraps it as ``pymdownx.arithmatex`` wraps the pages' math, so the one MathJax
that the site serves (``docs/_hooks/mathjax.py``) typesets both; nbconvert's MathJax 2 loader (an empty script URL
and a version 2 configuration) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
PATTERN = "[0-9][0-9]_*.py"
TIMEOUT_PER_CELL_S = 180
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours of IPython tracebacks

log = logging.getLogger("mkdocs.hooks.notebook_outputs")

_MATHJAX_2 = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", flags=re.DOTALL)
_VERBATIM = re.compile(r"(<(pre|code|script|style)\b.*?</\2>)", flags=re.DOTALL | re.IGNORECASE)
_TAG = re.compile(r"(<[^>]*>)")
_MARKDOWN = re.compile(r'(<div class="[^"]*\bjp-RenderedMarkdown\b[^"]*"[^>]*>)(.*?)(</div>)', flags=re.DOTALL)
_DISPLAY = re.compile(r"\$\$(.+?)\$\$", flags=re.DOTALL)
_INLINE = re.compile(r"(?<![\\$])\$(?=\S)((?:[^$\\\n]|\\.|\n(?!\s*\n))+?)(?<=\S)\$")


class Executed(NamedTuple):
    """One notebook run: the executed notebook (nbformat), its wall time, and the error text of a failed cell."""

    notebook: object
    seconds: float
    error: str | None


def paths() -> list:
    """The notebooks, in order."""
    return sorted(NOTEBOOKS.glob(PATTERN))


def kernel_config():
    """The kernel managers' configuration: CurveZMQ-encrypted channels where this jupyter_client and pyzmq offer
    them (``transport_encryption="auto"`` provisions keys for a kernel whose kernelspec supports them)."""
    import zmq
    from jupyter_client.manager import KernelManager
    from traitlets.config import Config

    if "transport_encryption" in KernelManager.class_trait_names() and zmq.has("curve"):
        return Config({"KernelManager": {"transport_encryption": "auto"}})
    return Config()


async def _run(path: Path, gate: asyncio.Semaphore) -> Executed:
    import jupytext
    import nbclient

    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT_PER_CELL_S, config=kernel_config(),
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    async with gate:
        start = time.perf_counter()
        try:
            await client.async_execute()
        except Exception as exc:  # the failing cell's error goes to whoever asked for this notebook
            return Executed(nb, time.perf_counter() - start, ANSI.sub("", f"{type(exc).__name__}: {exc}"))
        return Executed(nb, time.perf_counter() - start, None)


def execute(selected, workers: int | None = None) -> dict:
    """``{path: Executed}`` for the notebooks ``selected``, each in its own python3 kernel, ``workers`` at once.

    A notebook's time is mostly its kernel (importing torch, Numba and matplotlib, then running): the kernels
    are separate processes, so one event loop here drives them all. ``workers`` defaults to the cores, at most 4.
    """
    selected = [Path(p) for p in selected]
    workers = workers or max(1, min(4, os.cpu_count() or 1))

    async def run_all():
        gate = asyncio.Semaphore(workers)
        return await asyncio.gather(*(_run(path, gate) for path in selected))

    return dict(zip(selected, asyncio.run(run_all())))


def write(executed: dict, folder: Path) -> None:
    """Write each executed notebook as ``folder/<name>.ipynb``."""
    import nbformat

    folder.mkdir(parents=True, exist_ok=True)
    for path, run in executed.items():
        nbformat.write(run.notebook, folder / f"{path.stem}.ipynb")


def _wrap_text(text: str) -> str:
    text = _DISPLAY.sub(lambda m: f'<span class="arithmatex">\\[{m.group(1)}\\]</span>', text)
    return _INLINE.sub(lambda m: f'<span class="arithmatex">\\({m.group(1)}\\)</span>', text)


def wrap_math(html: str) -> str:
    """``html`` with the ``$...$`` and ``$$...$$`` of its text wrapped for MathJax, as arithmatex writes them.

    Only text is touched: not tags, nor the insides of ``pre``, ``code``, ``script`` and ``style`` elements.

    >>> wrap_math('<p>keys $I$ and <code>$x$</code></p>')
    '<p>keys <span class="arithmatex">\\\\(I\\\\)</span> and <code>$x$</code></p>'
    >>> wrap_math('<p>$$o = v_j$$</p>')
    '<p><span class="arithmatex">\\\\[o = v_j\\\\]</span></p>'
    """
    out = []
    for i, part in enumerate(_VERBATIM.split(html)):
        # split() returns text, then for each match its two groups: the element, and the tag name.
        if i % 3 == 0:
            out.append("".join(piece if piece.startswith("<") else _wrap_text(piece) for piece in _TAG.split(part)))
        elif i % 3 == 1:
            out.append(part)
    return "".join(out)


def wrap_notebook_math(html: str) -> str:
    """:func:`wrap_math` on the markdown of a rendered notebook (its markdown cells and markdown outputs) only.

    Code, its copy-to-clipboard text and text outputs keep every ``$`` they hold.
    """
    return _MARKDOWN.sub(lambda m: m.group(1) + wrap_math(m.group(2)) + m.group(3), html)


def _source() -> str:
    if os.environ.get("BSRATTN_DOCS_NOTEBOOKS"):
        return "given"
    return "executed" if os.environ.get("BSRATTN_DOCS_EXECUTE", "true").lower() not in ("false", "0", "no") else "text"


_executed_dir = None  # this build's executed notebooks, removed after the build


def _not_unexecuted(record: logging.LogRecord) -> bool:
    """Drop mkdocs-jupyter's ``Converting notebook (execute=False)`` of a notebook that was executed."""
    return _source() == "text" or not record.getMessage().startswith("Converting notebook (execute=False)")


def on_files(files, config):
    """Point each notebook page at its executed ``.ipynb``, executing the notebooks first if need be."""
    from mkdocs.exceptions import PluginError

    global _executed_dir
    source = _source()
    if source == "text":
        return files
    logging.getLogger("mkdocs.mkdocs-jupyter").addFilter(_not_unexecuted)  # kept once, however many builds
    pages = [f for f in files if f.src_uri.startswith("notebooks/") and Path(f.src_uri).match(PATTERN)]
    if source == "given":
        folder = Path(os.environ["BSRATTN_DOCS_NOTEBOOKS"])
        log.info(f"Rendering the {len(pages)} notebooks executed in {folder}")
    else:
        _executed_dir = tempfile.TemporaryDirectory(prefix="bsrattn-notebooks-")
        folder = Path(_executed_dir.name)
        executed = execute([NOTEBOOKS / Path(f.src_uri).name for f in pages])
        failed = {p.name: run.error for p, run in executed.items() if run.error}
        if failed:
            name, error = next(iter(failed.items()))
            raise PluginError(f"notebooks that failed: {sorted(failed)}; {name}:\n{error}")
        for path, run in executed.items():
            log.info(f"Executed notebooks/{path.name} in {run.seconds:.0f} s")
        write(executed, folder)
    for f in pages:
        notebook = folder / f"{Path(f.src_uri).stem}.ipynb"
        if not notebook.is_file():
            raise PluginError(f"{notebook} is missing: BSRATTN_DOCS_NOTEBOOKS must hold every executed notebook")
        f.abs_src_path = str(notebook)
    return files


def on_page_content(html, page, config, files):
    if not (page.file.src_uri.startswith("notebooks/") and Path(page.file.src_uri).match(PATTERN)):
        return html
    return wrap_notebook_math(_MATHJAX_2.sub("", html))


def on_post_build(config):
    global _executed_dir
    if _executed_dir is not None:
        _executed_dir.cleanup()
        _executed_dir = None
