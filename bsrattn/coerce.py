"""Arguments coerced to what the library computes with, or an error naming the argument: the ground floor.

Every module that takes integers, lengths or index arrays from a caller checks them here, so a float id is never
truncated, a length never wraps in int32, and every message names the argument and its value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
"""The int32 range: ids, lengths and offsets that every tier indexes with int32 must fit it."""


def as_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int: a Python or NumPy integer, never a bool or a float (not even ``2.0``).

    ``minimum``/``maximum`` bound it (inclusive); a value outside raises ``ValueError`` naming ``name``.

    Parameters
    ----------
    name : str
        The argument's name, for the error messages.
    value : int
        The value to check.
    minimum, maximum : int, optional
        Inclusive bounds; None: unbounded.

    Returns
    -------
    int

    Raises
    ------
    TypeError
        ``value`` not a Python or NumPy integer (a bool, a float, anything else).
    ValueError
        ``value`` outside ``minimum..maximum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def as_lengths(name: str, values: ArrayLike, size: int | None = None, of: str | None = None) -> np.ndarray:
    """``[B]`` lengths (query rows, KV slots) as an int64 array: a 1-D sequence of integers in ``0..2**31-1``.

    Parameters
    ----------
    name : str
        The argument's name, for the error messages.
    values : array_like of int
        The lengths; floats are refused, even integral ones (:func:`as_index_array`).
    size, of : int and str, optional
        The count ``values`` must have, and the argument that has it (named, with ``name``, when they differ).

    Returns
    -------
    numpy.ndarray
        ``[B]`` int64.

    Raises
    ------
    TypeError
        An entry that is not an integer.
    ValueError
        Not 1-D, a negative length or one beyond int32, or ``size`` given and not met.
    """
    arr = as_index_array(name, values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of ints, got shape {arr.shape}")
    if (arr < 0).any():
        i = int(np.argmax(arr < 0))
        raise ValueError(f"{name} must be >= 0, got {name}[{i}]={arr[i]}")
    if size is not None and arr.size != size:
        raise ValueError(f"{name} has {arr.size} entries and {of} has {size}: they need one entry per request each")
    return arr.astype(np.int64)


def as_index_array(name: str, values: ArrayLike) -> np.ndarray:
    """``values`` as a NumPy integer array whose entries fit in int32, or ``TypeError``/``ValueError`` naming ``name``.

    Only integers are accepted (Python ints, NumPy integer arrays): floats are refused, even integral ones
    like ``2.0``, so that a fractional or NaN id is never truncated; bools and strings are refused too.

    Parameters
    ----------
    name : str
        The argument's name, for the error messages.
    values : array_like of int
        A rectangular (nested) sequence or array of integers, of any shape.

    Returns
    -------
    numpy.ndarray
        ``values``' integer array (its own dtype; int64 for an empty sequence).

    Raises
    ------
    TypeError
        An entry that is not an integer.
    ValueError
        A ragged nested sequence, or an entry outside int32.
    """
    try:
        arr = np.asarray(values)
    except ValueError as err:  # a ragged nested sequence
        raise ValueError(f"{name} must be a rectangular array of integers: {err}") from None
    if arr.dtype.kind not in "iu" and arr.size:
        if arr.dtype.kind == "O" and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr.flat):
            # Python ints too large for any NumPy integer type: NumPy keeps them as objects.
            _out_of_int32(name, arr, [not INT32_MIN <= x <= INT32_MAX for x in arr.flat])
        flat = arr.reshape(-1)
        at = 0  # the first offending entry
        if arr.dtype.kind == "O":
            at = next(i for i, x in enumerate(flat) if isinstance(x, bool) or not isinstance(x, (int, np.integer)))
        elif arr.dtype.kind == "f":
            at = int(np.argmax(~np.isfinite(flat) | (flat != np.trunc(flat))))
        value = flat[at].item() if isinstance(flat[at], np.generic) else flat[at]
        integral = arr.dtype.kind == "f" and float(value).is_integer()
        raise TypeError(f"{name} must hold integers, got {value!r}"
                        + (" (floats are refused, even integral ones)" if integral else ""))
    if arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        _out_of_int32(name, arr, (arr < INT32_MIN) | (arr > INT32_MAX))
    return arr if arr.dtype.kind in "iu" else arr.astype(np.int64)  # an empty sequence is float64 to NumPy


def _out_of_int32(name, arr, outside):
    at = np.unravel_index(int(np.argmax(np.reshape(outside, -1))), arr.shape)
    raise ValueError(f"{name} must fit in int32 ({INT32_MIN}..{INT32_MAX}), got {name}[{', '.join(map(str, at))}]="
                     f"{arr[at]}")


def as_real(name: str, value: Any) -> float:
    """``value`` as a float: a Python or NumPy integer or float, never a bool, a string or None.

    Parameters
    ----------
    name : str
        The argument's name, for the error message.
    value : int or float
        The value to check.

    Returns
    -------
    float

    Raises
    ------
    TypeError
        ``value`` not a Python or NumPy real number (a bool, a string, None, anything else).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def indptr_of(lengths: ArrayLike) -> np.ndarray:
    """``[len(lengths)+1]`` int64: the indptr of rows of these ``lengths``, ``0, l_0, l_0+l_1, …``.

    Parameters
    ----------
    lengths : array_like of int, ``[R]``
        Each row's length (not checked).

    Returns
    -------
    numpy.ndarray
        ``[R+1]`` int64 offsets.
    """
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out
