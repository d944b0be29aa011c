"""Attention states ``(o, lse)``: the ⊕ of two (:func:`merge_state`) or many (:func:`merge_states`) through the
backend flag, and states handed back to the caller, into their buffers when they gave some."""

from __future__ import annotations

import numpy as np

from bsrattn._types import Array
from bsrattn.backends import Backend, get_backend
from bsrattn.validation import FLOAT_DTYPES, check_array, dtype_name, lse_dtype, shape_of

__all__ = ["merge_state", "merge_states", "write_into", "merge_sinks"]


def write_into(o: Array, s: Array | None, out: Array | None = None,
               lse: Array | None = None) -> tuple[Array, Array | None]:
    """Copy ``o`` into ``out`` and ``s`` into ``lse`` where given; return the arrays the caller should see.

    Works for any array kind whose slices assign (NumPy, torch, Numba device arrays): a full slice ``[:]``, which
    Numba's device arrays take (on a GPU they have no ``[...]`` assignment).

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
        out[:] = o
        o = out
    if lse is not None:
        lse[:] = s
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


def _check_floats(**states):
    """Raise unless each of ``states`` is an array of real floats (not ints, bools or complex numbers)."""
    for name, x in states.items():
        check_array(name, x)
        if dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {dtype_name(x)}; attention states are real floats of one of the "
                            f"dtypes {FLOAT_DTYPES}")


def _check_state(name_o, o, name_lse, lse):
    if len(shape_of(o)) < 2 or shape_of(lse) != shape_of(o)[:-1]:
        raise ValueError(f"{name_o} has shape {shape_of(o)} and {name_lse} {shape_of(lse)}: "
                         f"need {name_o} [..., H, D] and {name_lse} [..., H]")


def merge_state(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array, *,
                backend: str | Backend | None = None) -> tuple[Array, Array]:
    """The ⊕ operator: merge two attention states over disjoint keys. See :mod:`bsrattn.reference.merge`.

    ``o_a``, ``o_b`` ``[..., H, D]`` and ``lse_a``, ``lse_b`` ``[..., H]`` are arrays of real floats (float64,
    float32, float16, bfloat16); anything else, an integer, bool or complex array included, raises
    ``TypeError`` naming it, before any tier is called.

    An empty state (``lse = -inf``) is the identity whatever its ``o`` holds, NaN included; an ``lse`` of NaN
    or ``+inf`` in either state gives NaN ``o`` and ``lse``; a NaN in a non-empty state's ``o`` reaches the
    result. The same on every tier.

    Parameters
    ----------
    o_a, o_b : arrays, ``[..., H, D]``
        The two states' outputs, of one shape.
    lse_a, lse_b : arrays, ``[..., H]``
        Their log-sum-exps, natural log.
    backend : str or Backend, optional
        The tier that merges; default: the flag (see :mod:`bsrattn.backends`).

    Returns
    -------
    (o, lse)
        The merged state: ``o [..., H, D]``, ``lse [..., H]``, of the inputs' array kind.

    Raises
    ------
    TypeError
        An input that is not an array of real floats.
    ValueError
        ``lse_a``/``lse_b`` not ``o_a``/``o_b``'s shape without its last axis, or ``o_a`` and ``o_b`` of
        different shapes.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> o, s = ba.merge_state(np.ones((1, 1, 2)), np.zeros((1, 1)), 3 * np.ones((1, 1, 2)), np.zeros((1, 1)))
    >>> o.tolist(), np.round(s, 4).tolist()
    ([[[2.0, 2.0]]], [[0.6931]])
    """
    _check_floats(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    _check_state("o_a", o_a, "lse_a", lse_a)
    _check_state("o_b", o_b, "lse_b", lse_b)
    if shape_of(o_a) != shape_of(o_b):
        raise ValueError(f"o_a {shape_of(o_a)} and o_b {shape_of(o_b)} must have the same shape")
    return get_backend(backend).merge_state(o_a, lse_a, o_b, lse_b)


def merge_states(o: Array, lse: Array, *, backend: str | Backend | None = None) -> tuple[Array, Array]:
    """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order. See :mod:`bsrattn.reference.merge`.

    The fold is ``((s_0 ⊕ s_1) ⊕ s_2) ⊕ …``, always in that order, on every tier (see :func:`merge_state`).
    ``o`` and ``lse`` must be arrays of real floats, as in :func:`merge_state`.

    Parameters
    ----------
    o : array, ``[n, S, H, D]``
        ``S`` states' outputs for each of ``n`` rows.
    lse : array, ``[n, S, H]``
        Their log-sum-exps, natural log.
    backend : str or Backend, optional
        The tier that merges; default: the flag (see :mod:`bsrattn.backends`).

    Returns
    -------
    (o, lse)
        The folded state: ``o [n, H, D]``, ``lse [n, H]``.

    Raises
    ------
    TypeError
        ``o`` or ``lse`` not an array of real floats.
    ValueError
        Shapes other than ``[n, S, H, D]`` and ``[n, S, H]``, or ``S == 0``.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> o = np.stack([np.full((1, 1, 2), x) for x in (1.0, 2.0, 6.0)], axis=1)   # [n=1, S=3, H=1, D=2]
    >>> out, lse = ba.merge_states(o, np.zeros((1, 3, 1)))                        # three equal-weight states
    >>> out.tolist(), bool(np.isclose(lse[0, 0], np.log(3)))
    ([[[3.0, 3.0]]], True)
    """
    _check_floats(o=o, lse=lse)
    if len(shape_of(o)) != 4 or shape_of(lse) != shape_of(o)[:3]:
        raise ValueError(f"merge_states needs o [n, S, H, D] and lse [n, S, H]; got {shape_of(o)} and {shape_of(lse)}")
    if shape_of(o)[1] == 0:
        raise ValueError("merge_states needs at least one state (S >= 1)")
    return get_backend(backend).merge_states(o, lse)
