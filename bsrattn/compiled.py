"""Host loops compiled with Numba when it is installed, lazily, so that importing :mod:`bsrattn` never imports it.

The scheduler's core and the torch tier's plan packing are written as explicit loops over NumPy arrays: the
same source runs compiled (``numba.njit``, cached on disk) or, without Numba, as plain Python (correct, slower).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class Compiled:
    """``python`` compiled with ``numba.njit(cache=True)`` at its first call; ``python`` itself without Numba.

    Parameters
    ----------
    python : callable
        A module-level function of explicit loops over NumPy arrays and scalars, which Numba can compile.
    *steps : callable
        Module-level functions ``python`` calls. Numba compiles a call only to a function it can compile, so
        each is registered with Numba (``register_jitable``) before the first compilation: compiled code then
        compiles the steps into itself, while plain Python, :meth:`as_python` included, calls them as they are.

    Examples
    --------
    >>> from bsrattn import indexing
    >>> ceil_div = Compiled(indexing.ceil_div)      # any function of a module (Numba caches by source file)
    >>> ceil_div(20, 16)
    2
    >>> with ceil_div.as_python():                  # the uncompiled source, as when Numba is not installed
    ...     ceil_div(20, 16)
    2
    """

    def __init__(self, python: Callable[..., Any], *steps: Callable[..., Any]) -> None:
        self.python = python
        self.steps = steps
        self._fn = None

    def __call__(self, *args: Any) -> Any:
        if self._fn is None:
            try:
                import numba
            except ImportError:
                self._fn = self.python
            else:
                from numba.extending import register_jitable

                for step in self.steps:
                    register_jitable(step)
                self._fn = numba.njit(cache=True)(self.python)
        return self._fn(*args)

    @contextlib.contextmanager
    def as_python(self) -> Iterator[Compiled]:
        """Run the uncompiled source inside the block (the tests check both give the same results).

        Yields
        ------
        Compiled
            This object, calling ``python`` itself until the block ends.
        """
        saved, self._fn = self._fn, self.python
        try:
            yield self
        finally:
            self._fn = saved
