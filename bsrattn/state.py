"""Attention states ``(o, lse)`` handed back to the caller: into their buffers when they gave some."""

from __future__ import annotations

from bsrattn._types import Array


def write_into(o: Array, s: Array | None, out: Array | None = None,
               lse: Array | None = None) -> tuple[Array, Array | None]:
    """Copy ``o`` into ``out`` and ``s`` into ``lse`` where given; return the arrays the caller should see.

    Works for any array kind whose slices assign (NumPy, torch, Numba device arrays).

    Parameters
    ----------
    o : array, ``[nnz_qo, num_qo_heads, head_dim]``
        The computed output.
    s : array or None, ``[nnz_qo, num_qo_heads]``
        The computed ``lse`` (None when there is none, as for FlashSigmoid).
    out, lse : arrays, optional
        The caller's buffers, of ``o``'s and ``s``'s shapes.

    Returns
    -------
    (o, s)
        ``out`` in place of ``o`` and ``lse`` in place of ``s`` where they were given.

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
