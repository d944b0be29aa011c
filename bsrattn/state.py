"""Attention states ``(o, lse)`` handed back to the caller: into their buffers when they gave some."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from bsrattn._types import Array
from bsrattn.validation import lse_dtype

if TYPE_CHECKING:
    from bsrattn.backends import Backend


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


def merge_sinks(backend: Backend, o: Array, s: Array, sinks: tuple, kept: dict | None = None) -> tuple[Array, Array]:
    """``(o, s) ⊕ (0, sinks[h])``: attention sinks joining each row's softmax denominator once.

    A sink receives no value, so it is the state ``(o = 0, lse = sink[h])`` (see :mod:`bsrattn.variant`);
    merged into a row's final state, after every split chunk, cascade level and rank has been folded, it counts
    once however the work was cut. The sink state is made beside ``o``: torch tensors on its device, else
    NumPy (which a tier moves where it needs it).

    Parameters
    ----------
    backend : Backend
        The tier whose ``merge_state`` merges.
    o : array, ``[nnz_qo, num_qo_heads, head_dim]``
        The rows' output.
    s : array, ``[nnz_qo, num_qo_heads]``
        Their ``lse``.
    sinks : tuple of float, ``[num_qo_heads]``
        The sink logits.
    kept : dict, optional
        Where the sink state is kept between calls of the same shapes: made once, eagerly, it is only read
        when a CUDA graph captures a later call (a copy from the host could not be captured), and nothing is
        allocated on the way.

    Returns
    -------
    (o, lse)
        The merged state, new arrays.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> o, s = merge_sinks(ba.get_backend("reference"), np.ones((1, 1, 2)), np.zeros((1, 1)), (0.0,))
    >>> o.tolist(), np.round(s, 4).tolist()
    ([[[0.5, 0.5]]], [[0.6931]])
    """
    kept = {} if kept is None else kept
    torch_arrays = hasattr(o, "new_zeros")
    key = (sinks, tuple(o.shape), tuple(s.shape), o.dtype, s.dtype, o.device if torch_arrays else None)
    if key not in kept:
        shape = tuple(int(n) for n in s.shape)
        if torch_arrays:
            kept[key] = o.new_zeros(o.shape), s.new_tensor(sinks).expand(shape)
        else:
            kept[key] = (np.zeros(tuple(int(n) for n in o.shape), dtype=o.dtype),
                         np.broadcast_to(np.asarray(sinks, dtype=lse_dtype(s)), shape))
    zero, sink = kept[key]
    return backend.merge_state(o, s, zero, sink)
