"""Attention states ``(o, lse)`` handed back to the caller: into their buffers when they gave some."""

from __future__ import annotations


def write_into(o, s, out=None, lse=None):
    """Copy ``o`` into ``out`` and ``s`` into ``lse`` where given; return the arrays the caller should see.

    Works for any array kind whose slices assign (NumPy, torch, Numba device arrays).

    Examples
    --------
    >>> import numpy as np
    >>> buf = np.zeros(2)
    >>> o, s = write_into(np.ones(2), None, out=buf)
    >>> o is buf, buf.tolist()
    (True, [1.0, 1.0])
    """
    if out is not None:
        out[...] = o
        o = out
    if lse is not None:
        lse[...] = s
        s = lse
    return o, s
