"""The attention-state merge operator ⊕, as NumPy.

With states ``(o_a, lse_a)`` and ``(o_b, lse_b)`` over disjoint key sets:

    m   = max(lse_a, lse_b)
    w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
    o   = (w_a o_a + w_b o_b) / (w_a + w_b)
    lse = m + log(w_a + w_b)

The max shift keeps ``exp`` in range. A state with ``lse = -inf`` (no keys) is the identity, whatever its
``o`` holds (a NaN there too: an empty state's ``o`` is never read), and two empty states merge to
``o = 0``, ``lse = -inf``. An ``lse`` of NaN or ``+inf`` in either state makes the merged ``o`` and ``lse``
NaN (``exp(inf - inf)``: a state of infinite weight has no defined merge); a NaN in the ``o`` of a non-empty
state reaches the merged ``o``. ⊕ is associative and commutative in exact arithmetic, not in floating point:
fold order changes the last bits, so a fold order is fixed. Arithmetic runs in the inputs' precision, at
least float32.
"""

from __future__ import annotations

import numpy as np

from bsrattn.validation import lse_dtype


def _compute_dtype(*arrays):
    return np.result_type(*(a.dtype for a in arrays), np.float32)


def merge_state(o_a, lse_a, o_b, lse_b):
    """``(o_a, lse_a) ⊕ (o_b, lse_b)``: ``o [..., H, D]``, ``lse [..., H]``; returns ``(o, lse)``.

    >>> import numpy as np, bsrattn as ba
    >>> o, s = ba.merge_state(np.ones((1, 1, 2)), np.zeros((1, 1)), np.zeros((1, 1, 2)), np.full((1, 1), -np.inf))
    >>> o.tolist(), s.tolist()
    ([[[1.0, 1.0]]], [[0.0]])
    """
    o_a, lse_a, o_b, lse_b = (np.asarray(x) for x in (o_a, lse_a, o_b, lse_b))
    dt = _compute_dtype(o_a, o_b, lse_a, lse_b)
    la, lb = lse_a.astype(dt), lse_b.astype(dt)
    m = np.maximum(la, lb)                           # NaN if either is NaN
    m_safe = np.where(m == -np.inf, dt.type(0), m)   # two empty states shift by 0, not by -inf
    with np.errstate(invalid="ignore", over="ignore"):
        wa, wb = np.exp(la - m_safe), np.exp(lb - m_safe)   # +inf: exp(inf - inf) = NaN
        # An empty state adds exactly 0, so no value in its o (NaN included) reaches the result.
        ta = np.where((la == -np.inf)[..., None], dt.type(0), wa[..., None] * o_a.astype(dt))
        tb = np.where((lb == -np.inf)[..., None], dt.type(0), wb[..., None] * o_b.astype(dt))
        total = wa + wb
        o = (ta + tb) / np.where(total == 0, dt.type(1), total)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m_safe + np.log(total)
    return o.astype(np.result_type(o_a.dtype, o_b.dtype)), lse.astype(lse_dtype(dt))


def merge_states(o, lse):
    """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order: ``((s0 ⊕ s1) ⊕ s2) ⊕ …``.

    >>> import numpy as np, bsrattn as ba
    >>> o, s = ba.merge_states(np.ones((2, 3, 1, 4)), np.zeros((2, 3, 1)))
    >>> np.allclose(s, np.log(3)), o.shape
    (True, (2, 1, 4))
    """
    o, lse = np.asarray(o), np.asarray(lse)
    if o.ndim != 4 or lse.shape != o.shape[:3]:
        raise ValueError(f"merge_states needs o [n, S, H, D] and lse [n, S, H]; got {o.shape} and {lse.shape}")
    if o.shape[1] == 0:
        raise ValueError("merge_states needs at least one state (S >= 1)")
    acc_o, acc_lse = o[:, 0], lse[:, 0]
    for s in range(1, o.shape[1]):
        acc_o, acc_lse = merge_state(acc_o, acc_lse, o[:, s], lse[:, s])
    return acc_o, acc_lse


def sum_states(o):
    """FlashSigmoid's merge: unnormalised outputs add. Folds ``o [n, S, H, D]`` over ``S`` in index order."""
    o = np.asarray(o)
    acc = o[:, 0]
    for s in range(1, o.shape[1]):
        acc = acc + o[:, s]
    return acc
