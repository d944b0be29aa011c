"""The package's import graph: acyclic, and every shared module importable first, on its own.

A cycle between two modules works only while each imports the other lazily or in the right order; the graph
is read from the source (every ``import bsrattn…`` and ``from bsrattn… import``, at any depth, function-level
imports included), so a cycle is caught even where no import order happens to trip it.
"""

from __future__ import annotations

import ast
import graphlib
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "bsrattn"


def _modules() -> dict:
    """Dotted module name -> source path, for every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict:
    """Module -> the package's modules it imports (``from bsrattn import x`` names the submodule ``x`` if any)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("bsrattn"):
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    imported.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.split(".")[0] == "bsrattn")
        graph[name] = imported - {name}
    return graph


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {"bsrattn.layout", "bsrattn.layouts", "bsrattn.reference", "bsrattn.numba_cuda.executor"} <= set(graph)
    assert "bsrattn.layout" in graph["bsrattn.layouts"]


def test_the_package_has_no_import_cycle():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle: {' -> '.join(err.args[1])}")


@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.count(".") == 1))
def test_each_shared_module_imports_first_in_a_fresh_interpreter(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
