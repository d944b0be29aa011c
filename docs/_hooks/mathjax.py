"""MkDocs hook: the site serves MathJax itself, so its math renders offline.

MathJax 3 comes from the ``django-static-mathjax`` package (in the ``docs`` extra): its files and nothing else,
whatever its name. The site gets, under ``assets/mathjax/``, the one combined component it loads
(``tex-mml-chtml.js``, configured by ``docs/javascripts/mathjax.js``) and what that component fetches on demand
next to itself: the CHTML fonts, TeX extensions, the menu and the accessibility tools.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

DEST = "assets/mathjax"
ENTRY = "tex-mml-chtml.js"
ON_DEMAND = ("input/tex/extensions", "input/mml", "output/chtml", "ui", "a11y", "sre", "adaptors")


def mathjax_dir() -> Path:
    """MathJax's ``es5`` folder in the installed package."""
    spec = importlib.util.find_spec("mathjax")
    folder = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5" if spec else None
    if folder is None or not (folder / ENTRY).is_file():
        raise PluginError("the site serves MathJax from the django-static-mathjax package, which is not installed: "
                          "pip install -e '.[docs]'")
    return folder


def on_files(files, config):
    es5 = mathjax_dir()
    sources = [es5 / ENTRY] + [p for sub in ON_DEMAND for p in sorted((es5 / sub).rglob("*")) if p.is_file()]
    for path in sources:
        files.append(File.generated(config, f"{DEST}/{path.relative_to(es5).as_posix()}", abs_src_path=str(path)))
    return files
