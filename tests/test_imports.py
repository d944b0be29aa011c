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


# ---- the tiers' files -------------------------------------------------------------------------------------
SHARED_TIER_MODULES = {
    "gather": "the load module",
    "microkernel": "dense attention over a gathered tile",
    "merge": "⊕",
    "executor": "a plan run",
    "runner": "a plan bound to its spec, and the one-shot call",
    "config": "plan options and launch parameters",
    "arrays": "array kinds at the tier's edge",
}
"""The modules every tier has, one concept each, so that the tiers read side by side file by file."""
TIER_ONLY_MODULES = {
    "reference": {"deterministic", "progress", "rows"},
    "numba_cuda": {"core", "formats", "launch"},
    "torch_cuda": {"core", "deterministic", "indexing", "item_kernel", "kernel_args", "launch", "one_shot", "ops",
                   "plan_buffers", "prior"},
}
"""What a tier has beyond them; each says in its docstring's first line what it is for."""


@pytest.mark.parametrize("tier", sorted(TIER_ONLY_MODULES))
def test_every_tier_has_the_same_modules_for_the_same_concepts(tier):
    files = {p.stem: p for p in (PACKAGE / tier).glob("*.py") if p.stem != "__init__"}
    missing = set(SHARED_TIER_MODULES) - set(files)
    assert not missing, f"{tier} lacks {sorted(missing)}: {[SHARED_TIER_MODULES[m] for m in sorted(missing)]}"
    assert set(files) - set(SHARED_TIER_MODULES) == TIER_ONLY_MODULES[tier]
    for name in TIER_ONLY_MODULES[tier]:
        doc = ast.get_docstring(ast.parse(files[name].read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{tier}/{name}.py must say in its first line what it is for"
