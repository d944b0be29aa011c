"""How close is close enough: an error budget against a naive computation, a tolerance table, one comparison.

**The error budget** (flash-attention's tests), for attention in float32, float16 and bfloat16: a tier's
output may be at most ``factor`` times further from the float64 oracle than the same attention computed
naively in the same precision is, plus a small ``atol`` at the case's scale, measured per case::

    max |tier - oracle|  <=  factor * max |naive - oracle|  +  atol * max(1, max |oracle|)

*Naive* (:func:`naive_attention_row`) is what a framework's unfused attention does in a low precision
``dtype``, given inputs already in ``dtype``: the scores ``q . k`` accumulated in float32, scaled, soft-capped
and biased in float32, then **rounded to dtype**; the softmax in float32 (max, ``exp``, sum); the
probabilities ``P`` **rounded to dtype**; ``P @ V`` accumulated in float32 and **rounded to dtype** (the
output); ``lse = max + log(sum)`` in float32 from the rounded scores. FlashSigmoid rounds its weights
``sigmoid(s + bias)`` where softmax rounds ``P``. In float32 every rounding is the identity: the naive
computation is plain float32 arithmetic. (In float64 naive is the oracle itself; the table's float64 row
applies.) The budget grows with what makes a case hard (long rows, large
scores), and ``atol`` with the size of its outputs (FlashSigmoid's are not normalised), so one
``(factor, atol)`` per (op, dtype) serves every case:

| op | dtype | factor | atol | why atol is what it is |
|---|---|---|---|---|
| attention | float32 | 2 | 1e-5 | a soft cap as ``1 - 2 / (exp(2x) + 1)`` (the torch tier) is ``cap`` x 1e-7 off near 0 |
| attention | float16 | 2 | 1e-3 | ~ 1 ulp (2^-10): a cascade rounds each level's output, then the merged one |
| attention | bfloat16 | 2 | 8e-3 | ~ 1 ulp (2^-7), as float16 |
| lse | float32 | 2 | 1e-5 | as attention |
| lse | float16 / bfloat16 | 2 | 1e-5 | the kernels keep scores in float32, so their error is below naive's |

The factor of 2 is flash-attention's. Measured on the layouts and variants the strategies draw, the tiers
stay within ``2 x naive + atol / 4`` in float32 and ``2 x naive + atol / 6`` in float16. A kernel that adds
1% noise is 12 to 80 times further off than naive, and one that rounds its accumulator to float16 at every
key up to 7 times: both exceed the float16 budget (``tests/test_wrong_implementations.py``).

**The table** (:data:`TOLERANCES`), for float64 and for comparisons with no naive counterpart (merges, two
plans of one tier, the GPU scripts and benchmarks): fixed ``(atol, rtol)`` from the unit roundoff ``u`` of the output
dtype, checked elementwise as ``|a - e| <= atol + rtol * |e|``:

| op | dtype | atol | rtol | why |
|---|---|---|---|---|
| attention | float64 | 1e-10 | 1e-10 | reference vs reference (different fold orders) |
| attention | float32 | 2e-5 | 2e-5 | fp32 accumulate; tf32 dots are not used for fp32 |
| attention | float16 | 4e-3 | 4e-3 | fp16 inputs and output (u = 4.9e-4) and fp16 P in P@V |
| attention | bfloat16 | 3e-2 | 3e-2 | bf16 (u = 3.9e-3), the probabilities rounded to bf16 |
| attention | float8 | 1e-1 | 1e-1 | reference dequantises the same fp8 values, so only P and output rounding remain; kept loose for e5m2's 2 mantissa bits through fp16 P |
| lse | float64 / float32 | 1e-10 / 2e-5 | same | the reference's own precision / fp32 accumulation |
| lse | float16 / bfloat16 | 2e-3 / 1.5e-2 | same | lse is float32, but its scores come from half-precision q.k |
| lse | float8 (e4m3, e5m2) | 5e-2 | 5e-2 | scores from dequantised fp8 keys |
| merge | float64 / float32 | 1e-12 / 1e-5 | same | a few exp/log in the inputs' precision |
| merge | float16 / bfloat16 | 2e-3 / 1.6e-2 | same | the merged output is rounded to its dtype |

Both report the worst error, where it is, and NaN / ±inf disagreements separately.

**Inputs**: :func:`scattered_page_tables`, page tables scattered over one pool as an allocator leaves them, for
the tests and the benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike

from bsrattn._types import Array, DType
from bsrattn.indexing import ceil_div

TOLERANCES = {
    ("attention", "float64"): (1e-10, 1e-10),
    ("attention", "float32"): (2e-5, 2e-5),
    ("attention", "float16"): (4e-3, 4e-3),
    ("attention", "bfloat16"): (3e-2, 3e-2),
    ("attention", "float8_e4m3fn"): (1e-1, 1e-1),
    ("attention", "float8_e5m2"): (1e-1, 1e-1),
    ("lse", "float64"): (1e-10, 1e-10),
    ("lse", "float32"): (2e-5, 2e-5),
    ("lse", "float16"): (2e-3, 2e-3),
    ("lse", "bfloat16"): (1.5e-2, 1.5e-2),
    ("lse", "float8_e4m3fn"): (5e-2, 5e-2),
    ("lse", "float8_e5m2"): (5e-2, 5e-2),
    ("merge", "float64"): (1e-12, 1e-12),
    ("merge", "float32"): (1e-5, 1e-5),
    ("merge", "float16"): (2e-3, 2e-3),
    ("merge", "bfloat16"): (1.6e-2, 1.6e-2),
}


def tolerance(op: str, dtype: DType) -> tuple[float, float]:
    """``(atol, rtol)`` for ``op`` in ``dtype``.

    Parameters
    ----------
    op : {"attention", "lse", "merge"}
        The operation compared.
    dtype : str or torch dtype
        The output's dtype, by name (``"float16"``; ``torch.float16`` is read as its name).

    Returns
    -------
    (atol, rtol)

    Raises
    ------
    KeyError
        No entry of :data:`TOLERANCES` for ``(op, dtype)``.

    Examples
    --------
    >>> from bsrattn import testing
    >>> testing.tolerance("attention", "float16")
    (0.004, 0.004)
    """
    key = (op, str(dtype).removeprefix("torch."))
    if key not in TOLERANCES:
        raise KeyError(f"no tolerance for {key}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[key]


@dataclass(frozen=True)
class Budget:
    """``max |actual - oracle| <= factor * max |naive - oracle| + atol * max(1, max |oracle|)`` (module docstring).

    Parameters
    ----------
    factor : float
        How many times naive's error a tier may be off.
    atol : float
        The absolute slack, scaled by ``max(1, max |oracle|)``.

    Examples
    --------
    >>> from bsrattn import testing
    >>> b = testing.budget("attention", "bfloat16")
    >>> b.factor, b.atol
    (2.0, 0.008)
    """

    factor: float
    atol: float


BUDGETS = {
    ("attention", "float32"): Budget(2.0, 1e-5),
    ("attention", "float16"): Budget(2.0, 1e-3),
    ("attention", "bfloat16"): Budget(2.0, 8e-3),
    ("lse", "float32"): Budget(2.0, 1e-5),
    ("lse", "float16"): Budget(2.0, 1e-5),
    ("lse", "bfloat16"): Budget(2.0, 1e-5),
}

_LOW = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def budget(op: str, dtype: DType) -> Budget:
    """The :class:`Budget` of ``op`` (``"attention"`` or ``"lse"``) in ``dtype``.

    Parameters
    ----------
    op : {"attention", "lse"}
        The operation compared.
    dtype : str or torch dtype
        ``"float32"``, ``"float16"`` or ``"bfloat16"`` (a torch dtype is read as its name).

    Returns
    -------
    Budget

    Raises
    ------
    KeyError
        No entry of :data:`BUDGETS` for ``(op, dtype)``.

    Examples
    --------
    >>> from bsrattn import testing
    >>> testing.budget("attention", "float16")
    Budget(factor=2.0, atol=0.001)
    """
    key = (op, str(dtype).removeprefix("torch."))
    if key not in BUDGETS:
        raise KeyError(f"no error budget for {key}; known: {sorted(BUDGETS)}")
    return BUDGETS[key]


def naive_attention_row(q: ArrayLike, k: ArrayLike, v: ArrayLike, sm_scale: float, dtype: str = "float64", *,
                        soft_cap: float = 0.0, bias: ArrayLike | None = None,
                        sigmoid_bias: float | None = None) -> tuple[np.ndarray, float]:
    """One query's attention over its visible keys, computed naively in ``dtype``; ``(o [D], lse)`` as float64.

    ``q [D]``; ``k, v [m, D]`` (only the keys the query sees); ``bias [m]`` added to the scores after the soft
    cap (ALiBi); ``sigmoid_bias`` for FlashSigmoid (``lse`` is then NaN). ``"float64"`` is the oracle: every
    step in float64. Any other ``dtype`` follows the module docstring's recipe (float32 arithmetic, the scores,
    ``P`` and the output rounded to ``dtype``). No key seen: ``o = 0``, ``lse = -inf``.

    Parameters
    ----------
    q : array_like, ``[head_dim]``
        One query.
    k, v : array_like, ``[m, head_dim]``
        The keys and values it sees.
    sm_scale : float
        The score scale.
    dtype : {"float64", "float32", "float16", "bfloat16"}
        The precision to compute in; ``"float64"`` is the oracle.
    soft_cap : float
        ``cap * tanh(s / cap)`` when positive; 0 disables it.
    bias : array_like, ``[m]``, optional
        Added to the scores after the soft cap (ALiBi).
    sigmoid_bias : float, optional
        FlashSigmoid's bias: weights ``sigmoid(s + bias)``, no normalisation.

    Returns
    -------
    (o, lse)
        ``o [head_dim]`` float64 and ``lse`` a float (NaN for FlashSigmoid).

    Raises
    ------
    KeyError
        A ``dtype`` other than the four above.

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import testing
    >>> q, k, v = np.ones(2), np.array([[1.0, 0.0], [0.0, 0.0]]), np.array([[1.0, 3.0], [2.0, 1.0]])
    >>> o, lse = testing.naive_attention_row(q, k, v, 1.0)
    >>> np.round(o, 4).tolist(), round(lse, 4)
    ([1.2689, 2.4621], 1.3133)
    >>> o16, _ = testing.naive_attention_row(q, k, v, 1.0, "float16")
    >>> o16.tolist()                                     # rounded to float16: 1.2689 is not a float16
    [1.26953125, 2.4609375]
    """
    wide = np.float64 if dtype == "float64" else np.float32
    low = np.float64 if dtype == "float64" else _LOW[str(dtype)]

    def rounded(x):
        return np.asarray(x, dtype=wide).astype(low).astype(wide)

    q, k, v = (np.asarray(x, dtype=wide) for x in (q, k, v))
    if k.shape[0] == 0:
        return np.zeros(v.shape[1]), (math.nan if sigmoid_bias is not None else -math.inf)
    s = (k @ q) * wide(sm_scale)
    if soft_cap > 0:
        s = wide(soft_cap) * np.tanh(s / wide(soft_cap))
    if bias is not None:
        s = s + np.asarray(bias, dtype=wide)
    s = rounded(s)
    if sigmoid_bias is not None:
        w = rounded(1 / (1 + np.exp(-(s + wide(sigmoid_bias)))))
        return rounded(w @ v).astype(np.float64), math.nan
    m = s.max()
    p = np.exp(s - m)
    total = p.sum()
    o = rounded(rounded(p / total) @ v)
    return o.astype(np.float64), float(m + np.log(total))


@dataclass
class Comparison:
    """The outcome of :func:`compare`: worst error, where, and special-value disagreements.

    Parameters
    ----------
    ok : bool
        Whether every element is within tolerance and NaN/±inf agree.
    max_abs : float
        The largest ``|a - e|`` over elements finite in both.
    max_excess : float
        The largest ``|a - e| - (atol + rtol * |e|)``: positive when some element is out of tolerance.
    where : tuple
        The index of that element.
    nan_mismatch : int
        Elements NaN in one array only.
    inf_mismatch : int
        Elements infinite in one array, or of opposite signs, without a NaN.
    message : str
        All of the above, for an assertion.

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import testing
    >>> c = testing.compare(np.array([1.0, np.nan]), np.array([1.0, 2.0]), atol=1e-6, rtol=0)
    >>> c.ok, c.nan_mismatch
    (False, 1)
    """

    ok: bool
    max_abs: float
    max_excess: float
    where: tuple
    nan_mismatch: int
    inf_mismatch: int
    message: str


def _to_numpy(x):
    if hasattr(x, "detach"):
        # via float64: NumPy has no bf16/fp8 of its own, so torch cannot hand those over as they are
        x = x.detach().double().cpu()
    elif hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    return np.asarray(x, dtype=np.float64)


def compare(actual: Array, expected: Array, atol: float, rtol: float, name: str = "output") -> Comparison:
    """Elementwise ``|a - e| <= atol + rtol * |e|``, with NaN and ±inf required to agree exactly.

    Parameters
    ----------
    actual, expected : arrays
        Of one shape; NumPy arrays, torch tensors or Numba device arrays (compared in float64).
    atol, rtol : float
        The absolute and relative tolerances.
    name : str
        What is compared, for the message.

    Returns
    -------
    Comparison
        ``ok`` False, not an exception, when the arrays differ (or their shapes do).

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import testing
    >>> c = testing.compare(np.array([1.0, 2.001]), np.array([1.0, 2.0]), atol=1e-6, rtol=1e-6)
    >>> c.ok, round(c.max_abs, 6)
    (False, 0.001)
    """
    a, e = _to_numpy(actual), _to_numpy(expected)
    if a.shape != e.shape:
        return Comparison(False, np.inf, np.inf, (), 0, 0, f"{name}: shape {a.shape} != expected {e.shape}")
    nan_mismatch = int((np.isnan(a) != np.isnan(e)).sum())
    inf_mismatch = int(((np.isinf(a) | np.isinf(e)) & ~((a == e) | np.isnan(a) | np.isnan(e))).sum())
    finite = np.isfinite(a) & np.isfinite(e)
    err = np.abs(np.where(finite, a, 0.0) - np.where(finite, e, 0.0))  # no inf - inf warnings
    excess = err - (atol + rtol * np.abs(np.where(finite, e, 0.0)))
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape) if excess.size else ()
    max_abs = float(err.max()) if err.size else 0.0
    max_excess = float(excess.max()) if excess.size else -np.inf
    ok = nan_mismatch == 0 and inf_mismatch == 0 and max_excess <= 0
    msg = (f"{name}: max |err| {max_abs:.3g}; worst at {tuple(int(i) for i in worst)} "
           f"(got {a[worst] if excess.size else None}, want {e[worst] if excess.size else None}, "
           f"atol {atol:g}, rtol {rtol:g}); NaN mismatches {nan_mismatch}, inf mismatches {inf_mismatch}")
    return Comparison(ok, max_abs, max_excess, worst, nan_mismatch, inf_mismatch, msg)


def assert_close(actual: Array, expected: Array, op: str = "attention", dtype: DType = "float64",
                 name: str | None = None) -> Comparison:
    """Raise ``AssertionError`` with the worst error and its place unless ``actual`` matches ``expected``.

    ``op`` and ``dtype`` pick the tolerance from :data:`TOLERANCES`. Returns the :class:`Comparison`.

    Parameters
    ----------
    actual, expected : arrays
        Of one shape, any array kind (see :func:`compare`).
    op : {"attention", "lse", "merge"}
        The operation compared.
    dtype : str or torch dtype
        The output's dtype.
    name : str, optional
        What is compared, for the message; default ``op``.

    Returns
    -------
    Comparison

    Raises
    ------
    AssertionError
        ``actual`` outside the tolerance, or NaN/±inf disagreeing.
    KeyError
        No tolerance for ``(op, dtype)``.

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import testing
    >>> testing.assert_close(np.float32(1.0) + np.float32(1e-6), 1.0, "attention", "float32").ok
    True
    """
    atol, rtol = tolerance(op, dtype)
    result = compare(actual, expected, atol, rtol, name or op)
    if not result.ok:
        raise AssertionError(result.message)
    return result


def within_budget(actual: Array, expected: Array, naive: Array, op: str, dtype: DType,
                  name: str = "output") -> Comparison:
    """Compare ``actual`` with the oracle ``expected`` under the budget of ``op`` in ``dtype``, ``naive`` being
    the same-precision naive result (:func:`naive_attention_row`): every element within ``factor * max |naive -
    expected| + atol * max(1, max |expected|)``, NaN and ±inf agreeing exactly.

    Parameters
    ----------
    actual : array
        The tier's result.
    expected : array
        The float64 oracle, of ``actual``'s shape.
    naive : array
        The same-precision naive result, of ``actual``'s shape.
    op : {"attention", "lse"}
        The operation compared.
    dtype : str or torch dtype
        ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    name : str
        What is compared, for the message.

    Returns
    -------
    Comparison
        Its message also states the budget.

    Raises
    ------
    KeyError
        No budget for ``(op, dtype)``.

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import testing
    >>> want, naive = np.array([0.5, 2.0]), np.array([0.5, 2.002])   # naive is 2e-3 off: 2 x 2e-3 + 1e-3 x 2
    >>> testing.within_budget(np.array([0.5, 2.005]), want, naive, "attention", "float16").ok
    True
    >>> testing.within_budget(np.array([0.5, 2.007]), want, naive, "attention", "float16").ok
    False
    """
    b = budget(op, dtype)
    e, n = _to_numpy(expected), _to_numpy(naive)
    finite = np.isfinite(e) & np.isfinite(n)
    naive_err = float(np.abs(np.where(finite, n, 0.0) - np.where(finite, e, 0.0)).max()) if e.size else 0.0
    scale = max(1.0, float(np.abs(np.where(finite, e, 0.0)).max()) if e.size else 1.0)
    allowed = b.factor * naive_err + b.atol * scale
    result = compare(actual, expected, allowed, 0.0, name)
    result.message += (f"; budget {b.factor:g} x naive error {naive_err:.3g} + atol {b.atol:g} x scale {scale:.3g} "
                       f"({op}, {dtype})")
    return result


def assert_within_budget(actual: Array, expected: Array, naive: Array, op: str, dtype: DType,
                         name: str | None = None) -> Comparison:
    """:func:`within_budget`, raising ``AssertionError`` with its message when it fails.

    Parameters
    ----------
    actual, expected, naive : arrays
        The tier's result, the float64 oracle and the same-precision naive result, of one shape.
    op : {"attention", "lse"}
        The operation compared.
    dtype : str or torch dtype
        ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    name : str, optional
        What is compared, for the message; default ``op``.

    Returns
    -------
    Comparison

    Raises
    ------
    AssertionError
        ``actual`` outside the budget, or NaN/±inf disagreeing.
    KeyError
        No budget for ``(op, dtype)``.

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import testing
    >>> want, naive = np.array([1.0]), np.array([1.0005])
    >>> testing.assert_within_budget(np.array([1.05]), want, naive, "attention", "float16")
    Traceback (most recent call last):
    ...
    AssertionError: attention: max |err| 0.05; ... budget 2 x naive error 0.0005 + atol 0.001 x scale 1 (attention, float16)
    """
    result = within_budget(actual, expected, naive, op, dtype, name or op)
    if not result.ok:
        raise AssertionError(result.message)
    return result


def scattered_page_tables(rng: np.random.Generator, kv_lens: ArrayLike, page_size: int,
                          spare_pages: int = 0) -> tuple[list, int]:
    """Page tables for ``kv_lens`` whose pages are scattered over one pool, as a serving engine's allocator
    leaves them: a random permutation of ``sum(ceil(kv_len / page_size)) + spare_pages`` pages, cut into one
    table per request, the spare pages left unused.

    Parameters
    ----------
    rng : numpy.random.Generator
        Where the permutation comes from.
    kv_lens : array-like of int, ``[B]``
        Each request's KV length.
    page_size : int
        Slots per page.
    spare_pages : int
        Pool pages no request holds.

    Returns
    -------
    (tables, num_pages)
        ``tables[b]`` the int64 pages of request ``b``, in order; ``num_pages`` the pool's size. Pass both to
        :func:`bsrattn.layouts.paged`.

    Examples
    --------
    >>> import numpy as np
    >>> tables, num_pages = scattered_page_tables(np.random.default_rng(0), [20, 5], page_size=16, spare_pages=1)
    >>> [len(t) for t in tables], num_pages, len(set(np.concatenate(tables).tolist()))
    ([2, 1], 4, 3)
    """
    need = [ceil_div(int(n), int(page_size)) for n in np.asarray(kv_lens).reshape(-1)]
    pool = rng.permutation(sum(need) + int(spare_pages))
    return np.split(pool[:sum(need)], np.cumsum(need)[:-1]), int(pool.size)
