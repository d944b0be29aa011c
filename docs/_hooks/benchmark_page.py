"""MkDocs hook: the benchmark page shows what ``benchmarks/results/`` holds, and nothing else.

``docs/benchmarks.md`` carries the marker ``<!-- benchmark-results -->``. At build time the marker becomes:

1. ``benchmarks/results/README.md`` when it exists (written by ``benchmarks/report.py`` from the H200 runs),
   its headings moved one level down and its links to images in ``benchmarks/results/`` pointed at copies
   placed in the site;
2. else, when ``benchmarks/results/*.json`` exist, the same report rendered from them now;
3. else a note that no results are committed yet.

The torch tier's tuning sweep (``benchmarks/results/tune.json``, from ``python3 -m benchmarks.tune``) is no workload:
it is copied into the site as it is and linked from the page, not tabulated.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
PAGE = "benchmarks.md"
MARKER = "<!-- benchmark-results -->"
IMAGE_SUFFIXES = (".png", ".svg", ".jpg")
SWEEP = RESULTS_DIR / "tune.json"
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
NO_RESULTS = ("!!! note \"No results committed yet\"\n"
              "    `benchmarks/results/` holds no results in this version of the repository. They are measured on "
              "the H200 with `python3 -m benchmarks.run_all` and committed; this page then shows them.")


def _images():
    return [p for p in sorted(RESULTS_DIR.glob("*")) if p.suffix in IMAGE_SUFFIXES] if RESULTS_DIR.is_dir() else []


def on_files(files, config):
    """Copy the result images and the tuning sweep into the site, at ``benchmarks/results/<name>``."""
    for path in _images() + ([SWEEP] if SWEEP.is_file() else []):
        files.append(File(path.relative_to(ROOT).as_posix(), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def _relink(markdown: str) -> str:
    """Relative links of the results README: images to the site's copies, anything else named by its repo path."""
    images = {p.name for p in _images()}

    def fix(match):
        bang, text, target = match.groups()
        if re.match(r"^[a-z]+:|^#|^/", target):
            return match.group(0)
        if target in images:
            return f"{bang}[{text}](benchmarks/results/{target})"
        return f"{text} (`benchmarks/results/{target}`)"

    return LINK.sub(fix, markdown)


def _demote(markdown: str) -> str:
    """Headings one level down, so the README's title sits under this page's."""
    return re.sub(r"^(#{1,5}) ", r"#\1 ", markdown, flags=re.MULTILINE)


def results_markdown() -> str:
    readme = RESULTS_DIR / "README.md"
    if readme.is_file():
        return _demote(_relink(readme.read_text()))
    if not RESULTS_DIR.is_dir() or not any(RESULTS_DIR.glob("*.json")):
        return NO_RESULTS
    if "benchmarks" not in sys.modules:  # the repository's folder, not an installed package: imported by its path
        spec = importlib.util.spec_from_file_location("benchmarks", ROOT / "benchmarks" / "__init__.py")
        sys.modules["benchmarks"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["benchmarks"])
    from benchmarks import harness, report

    return _demote(_relink(report.render(harness.load_results(RESULTS_DIR), RESULTS_DIR)))


def sweep_markdown() -> str:
    """A paragraph linking the tuning sweep's records, when they are committed; else nothing."""
    if not SWEEP.is_file():
        return ""
    return ("\n\n## The tuning sweep\n\n`python3 -m benchmarks.tune` times the torch tier's tile and schedule choices "
            "(tile widths, warps, pipeline stages, CTAs per SM) on cases of W1-W3. Its last run is not a workload, "
            "so it is not tabulated here: its records are [`tune.json`](benchmarks/results/tune.json), and "
            "`benchmarks/NOTES.md` says what was chosen from them.\n")


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/{PAGE} must contain the marker {MARKER}")
    return markdown.replace(MARKER, results_markdown() + sweep_markdown())
