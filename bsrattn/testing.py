"""One tolerance table per (op, dtype), and the comparison every test and benchmark uses.

The budget is relative, after flash-attention's tests: a tier's output may be at most ``factor`` times
further from the float64 reference than the same-precision naive computation is (its rounding of the
inputs and of the output alone), plus ``atol``. Rather than run a naive computation in every test, the
table states that budget directly, from the unit roundoff ``u`` of the output dtype:

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

Comparisons report the worst error, where it is, and NaN / ±inf disagreements separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def tolerance(op: str, dtype: str) -> tuple:
    """``(atol, rtol)`` for ``op`` in ``dtype``.

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


@dataclass
class Comparison:
    """The outcome of :func:`compare`: worst error, where, and special-value disagreements.

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


def compare(actual, expected, atol: float, rtol: float, name: str = "output") -> Comparison:
    """Elementwise ``|a - e| <= atol + rtol * |e|``, with NaN and ±inf required to agree exactly.

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


def assert_close(actual, expected, op: str = "attention", dtype: str = "float64", name: str | None = None):
    """Raise ``AssertionError`` with the worst error and its place unless ``actual`` matches ``expected``.

    ``op`` and ``dtype`` pick the tolerance from :data:`TOLERANCES`. Returns the :class:`Comparison`.

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
