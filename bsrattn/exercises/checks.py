"""How a grader states its cases: each one named, the first one that fails reported with what was expected.

A grader runs the learner's functions inside ``with case("what this case is"):`` blocks and compares with
:func:`same` (exact: ints, bools, or floats bit for bit) or :func:`close` (floats, to a tolerance). Whatever goes
wrong inside a block — a wrong value, a wrong shape, the stub's ``NotImplementedError``, any other exception — leaves
it as a :class:`Failure` that names the case, so the learner reads which input broke and how.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

import bsrattn as ba


class Failure(Exception):
    """A case the learner's code got wrong.

    Parameters
    ----------
    case : str
        What the case is (its inputs, in words).
    detail : str
        What went wrong: the value that differs and the one expected, or the exception raised.
    """

    def __init__(self, case: str, detail: str) -> None:
        super().__init__(f"{case}: {detail}")
        self.case, self.detail = case, detail


class Mismatch(AssertionError):
    """A value that is not the one expected; its message says where and by how much."""


@contextlib.contextmanager
def case(description: str) -> Iterator[None]:
    """Run one case: anything raised inside becomes a :class:`Failure` named ``description``.

    Parameters
    ----------
    description : str
        The case's inputs, in words.

    Yields
    ------
    None
    """
    try:
        yield
    except Failure:
        raise
    except Mismatch as err:
        raise Failure(description, str(err)) from err
    except Exception as err:  # the learner's code raised: the stub's NotImplementedError, or a bug
        raise Failure(description, f"raised {type(err).__name__}: {err}") from err


def fmt(x: Any) -> str:
    """A short one-line picture of a value for a message (arrays cut to their first and last entries).

    Parameters
    ----------
    x : any
        The value.

    Returns
    -------
    str
    """
    if isinstance(x, np.ndarray) or (isinstance(x, (list, tuple)) and x and not isinstance(x[0], tuple)):
        try:
            text = np.array2string(np.asarray(x), precision=4, threshold=16, edgeitems=3, separator=", ")
        except (TypeError, ValueError):  # a ragged nested list
            text = repr(x)
    else:
        text = repr(x)
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


def _array(got: Any, what: str) -> np.ndarray:
    if got is None:
        raise Mismatch(f"{what} is None: return it")
    try:
        return np.asarray(got)
    except (TypeError, ValueError) as err:
        raise Mismatch(f"{what} is not an array: {fmt(got)} ({err})") from None


def _shaped(got: Any, want: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    got_a, want_a = _array(got, what), np.asarray(want)
    if got_a.shape != want_a.shape:
        shown = f" ({fmt(got_a)})" if got_a.size <= 16 else ""
        raise Mismatch(f"{what} has shape {got_a.shape}{shown}, expected {want_a.shape}")
    return got_a, want_a


def _at(index: tuple) -> str:
    return f"[{', '.join(str(int(i)) for i in index)}]" if index else ""


def same(got: Any, want: Any, what: str) -> None:
    """Raise :class:`Mismatch` unless ``got`` equals ``want`` exactly (shape and values; NaN equals NaN).

    Parameters
    ----------
    got : array_like
        The learner's value.
    want : array_like
        The expected one.
    what : str
        Its name, for the message.

    Returns
    -------
    None
    """
    got_a, want_a = _shaped(got, want, what)
    try:
        equal = got_a == want_a
        if want_a.dtype.kind in "fc" and got_a.dtype.kind in "fc":
            equal = equal | (np.isnan(got_a) & np.isnan(want_a))
    except TypeError as err:
        raise Mismatch(f"{what} cannot be compared with the expected {want_a.dtype} values: {fmt(got)} "
                       f"({err})") from None
    if not np.all(equal):
        at = np.unravel_index(int(np.argmin(np.reshape(equal, -1))), want_a.shape) if want_a.ndim else ()
        message = f"{what}{_at(at)} is {fmt(got_a[at])}, expected {fmt(want_a[at])}"
        if want_a.ndim and want_a.size <= 64:
            message += f"\n  got      {fmt(got_a)}\n  expected {fmt(want_a)}"
        raise Mismatch(message)


def close(got: Any, want: Any, what: str, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Raise :class:`Mismatch` unless ``got`` matches ``want`` to ``atol + rtol * |want|``, with every NaN and
    infinity exactly where ``want`` has one.

    Parameters
    ----------
    got : array_like
        The learner's value.
    want : array_like
        The expected one (float).
    what : str
        Its name, for the message.
    rtol, atol : float
        The tolerance.

    Returns
    -------
    None
    """
    got_a, want_a = _shaped(got, want, what)
    try:
        got_a = got_a.astype(np.float64)
    except (TypeError, ValueError) as err:
        raise Mismatch(f"{what} is not made of numbers: {fmt(got)} ({err})") from None
    want_a = want_a.astype(np.float64)
    finite = np.isfinite(want_a)
    special = ~finite & ~((got_a == want_a) | (np.isnan(got_a) & np.isnan(want_a)))
    if special.any():
        at = np.unravel_index(int(np.argmax(np.reshape(special, -1))), want_a.shape) if want_a.ndim else ()
        raise Mismatch(f"{what}{_at(at)} is {got_a[at]!r}, expected {want_a[at]!r}")
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(got_a - want_a), 0.0)
    bad = finite & ~(err <= atol + rtol * np.abs(want_a))   # a NaN got is bad too
    if bad.any():
        at = np.unravel_index(int(np.argmax(np.reshape(bad, -1))), want_a.shape) if want_a.ndim else ()
        worst = float(np.nanmax(np.where(finite, err, 0.0))) if np.isfinite(err).all() else float("nan")
        raise Mismatch(f"{what}{_at(at)} is {got_a[at]!r}, expected {want_a[at]!r} (allowed: {atol:g} + {rtol:g} x "
                       f"|expected|; worst |error| {worst:.3g}, {int(bad.sum())} of {bad.size} entries off)")


def parts(got: Any, count: int, what: str) -> tuple:
    """``got`` as a tuple of ``count`` values, or :class:`Mismatch` saying what came back instead.

    Parameters
    ----------
    got : any
        The learner's return value, expected to be a tuple or list of ``count`` items.
    count : int
        How many.
    what : str
        What they are, for the message (``"(o, lse)"``).

    Returns
    -------
    tuple
    """
    if not isinstance(got, (tuple, list)) or len(got) != count:
        raise Mismatch(f"expected {count} values back, {what}; got {fmt(got)}")
    return tuple(got)


def seeded(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_paged(rng, batch, page_size, max_len, num_pages, spare=1):
    """``(page_tables, kv_lens)``: random lengths, random page ids (pages may be shared), up to ``spare`` unused
    pages at the end of each table."""
    kv_lens = rng.integers(0, max_len + 1, size=batch)
    tables = [rng.integers(0, num_pages, size=-(-int(n) // page_size) + int(rng.integers(0, spare + 1))).tolist()
              for n in kv_lens]
    return tables, kv_lens.tolist()


def paged_layout(tables, kv_lens, page_size, num_pages, qo_lens=None):
    qo_lens = [1] * len(kv_lens) if qo_lens is None else qo_lens
    return ba.layouts.paged(qo_lens, tables, kv_lens, page_size, num_pages)
