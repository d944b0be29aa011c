"""Every public function and method is annotated and documents every parameter (numpydoc).

The public API walked here: ``bsrattn.__all__`` and the public names of the modules in :data:`MODULES` (their
``__all__`` where they have one, else every public name they define). For each function, method and property:

- annotations for every parameter (``self``/``cls`` excluded) and for the return;
- a numpydoc ``Parameters`` section with an entry and a non-empty description for every parameter (entries
  ``a, b : type`` count for both; ``*args``/``**kwargs`` are written with their stars). A class's constructor
  is documented in the class docstring, as numpydoc does it (``Attributes`` serves for a dataclass's fields);
- a ``Returns`` (or, for a generator or a context manager, ``Yields``) section unless it returns None.

:mod:`bsrattn.indexing` is exempt from the annotations only: its functions are re-decorated as device functions
(``numba.cuda.jit(device=True)`` in ``bsrattn/numba_cuda``, ``triton.jit`` in ``bsrattn/torch_cuda/indexing.py``,
which compiles their source, annotations included) and take ints or arrays alike.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

import bsrattn

MODULES = ("bsrattn.api", "bsrattn.layout", "bsrattn.cascade", "bsrattn.coerce", "bsrattn.passed", "bsrattn.layouts",
           "bsrattn.variant",
           "bsrattn.backends",
           "bsrattn.scheduler", "bsrattn.makespan", "bsrattn.state", "bsrattn.indexing", "bsrattn.testing",
           "bsrattn.draw", "bsrattn.compiled", "bsrattn.integrations.paged", "bsrattn.items")
UNANNOTATED = {"bsrattn.indexing"}
PROPERTIES: set[str] = set()
SECTION = re.compile(r"^(\w[\w ]*)\n-{3,}$", re.MULTILINE)


def _sections(doc: str | None) -> dict[str, str]:
    """``{title: body}`` of a numpydoc docstring's sections (the text after each underlined title)."""
    doc = inspect.cleandoc(doc or "")
    heads = list(SECTION.finditer(doc))
    return {m.group(1): doc[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(doc)]
            for i, m in enumerate(heads)}


def documented(doc: str | None, section: str = "Parameters") -> dict[str, str]:
    """``{name: description}`` of a section's ``name : type`` entries (a bare ``name`` line too)."""
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in _sections(doc).get(section, "").splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            names = [n.strip() for n in line.split(" : ")[0].split(",")]
            entries.update({n: "" for n in names})
        else:
            entries.update({n: (entries[n] + " " + line.strip()).strip() for n in names})
    return entries


def _param_name(p: inspect.Parameter) -> str:
    return {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name


def _is_generated_init(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) and cls.__init__.__code__.co_filename.startswith("<")


def public_api() -> list[tuple[str, str, object, str | None]]:
    """``(module, qualified name, function, docstring holding its Parameters)`` of every public callable."""
    objects = [("bsrattn", name, getattr(bsrattn, name)) for name in bsrattn.__all__]
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        objects += [(module_name, name, getattr(module, name)) for name in names]
    found, seen = [], set()
    for _, name, obj in objects:
        home = getattr(obj, "__module__", None)
        if inspect.ismodule(obj) or home not in MODULES or (home, name) in seen:
            continue
        seen.add((home, name))
        if inspect.isfunction(obj):
            found.append((home, name, obj, obj.__doc__))
        elif inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if attr == "__init__":
                    if not _is_generated_init(obj):
                        found.append((home, f"{name}.__init__", value, obj.__doc__))
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if isinstance(value, property):
                    value = value.fget
                    PROPERTIES.add(f"{home}.{name}.{attr}")
                if inspect.isfunction(value):
                    found.append((home, f"{name}.{attr}", value, value.__doc__))
            if _is_generated_init(obj):
                found.append((home, f"{name}.__init__", obj.__init__, obj.__doc__))
    return found


API = public_api()


def test_the_walk_finds_the_public_api():
    names = {f"{module}.{name}" for module, name, _, _ in API}
    assert {"bsrattn.api.attention", "bsrattn.api.BatchAttention.run", "bsrattn.layout.BSRLayout.kv_slots",
            "bsrattn.scheduler.plan", "bsrattn.makespan.compare", "bsrattn.indexing.sparse_slot",
            "bsrattn.draw.layout", "bsrattn.compiled.Compiled.__init__"} <= names
    assert len(API) > 80


def test_the_docstring_parser_reads_numpydoc():
    doc = """Summary.

    Parameters
    ----------
    a, b : int
        Two numbers,
        described together.
    c : str
    **kwargs : Any
        The rest.

    Returns
    -------
    int
    """
    assert documented(doc) == {"a": "Two numbers, described together.", "b": "Two numbers, described together.",
                               "c": "", "**kwargs": "The rest."}
    assert documented(doc, "Returns") == {"int": ""}


@pytest.mark.parametrize("module, name, fn, doc", API, ids=[f"{m}.{n}" for m, n, _, _ in API])
def test_public_function_is_annotated_and_documented(module, name, fn, doc):
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    is_init = name.endswith(".__init__")
    if module not in UNANNOTATED:
        missing = [p.name for p in params if p.annotation is p.empty]
        assert not missing, f"{module}.{name}: parameters without annotations: {missing}"
        assert signature.return_annotation is not signature.empty, f"{module}.{name}: no return annotation"
    if params:
        entries = documented(doc)
        if is_init and not entries:
            entries = documented(doc, "Attributes")
        undocumented = [_param_name(p) for p in params if not entries.get(_param_name(p))]
        assert not undocumented, (f"{module}.{name}: parameters without a described numpydoc Parameters entry: "
                                  f"{undocumented}")
    returns_none = signature.return_annotation in (None, "None")
    if not (is_init or returns_none or f"{module}.{name}" in PROPERTIES):
        sections = _sections(fn.__doc__)
        assert "Returns" in sections or "Yields" in sections, f"{module}.{name}: no Returns section"
