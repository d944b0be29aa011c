"""Griffe extension for the API reference: the docstrings' reStructuredText habits, read as Markdown.

The docstrings are numpydoc, written to read well in a terminal and in Sphinx: they name other objects with
roles (``:func:`plan```, ``:class:`~bsrattn.scheduler.WorkPlan```) and put shapes in double backticks, also in a
parameter's type (``q : ``[nnz_qo, Hq, D]````). mkdocstrings renders docstrings as Markdown, so before they are
parsed this extension turns a role into inline code of the name (the last component for ``~``) and drops the
backticks from parameter types, which are shown as code already.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`(~?)\.?([\w.]+)`")
PARAMETER_LINE = re.compile(r"^(\s*[\w*][\w*, ]* : )(.*``.*)$", flags=re.MULTILINE)


def _role(match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with roles as inline code and parameter types without backticks.

    >>> markdown_docstring("See :func:`~bsrattn.scheduler.plan` and :mod:`.gather`.")
    'See `plan` and `gather`.'
    >>> markdown_docstring("q : ``[nnz_qo, Hq, D]``")
    'q : [nnz_qo, Hq, D]'
    """
    text = ROLE.sub(_role, text)
    return PARAMETER_LINE.sub(lambda m: m.group(1) + m.group(2).replace("``", ""), text)


class RstRoles(griffe.Extension):
    """Rewrite every docstring with :func:`markdown_docstring` as its object is created."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
