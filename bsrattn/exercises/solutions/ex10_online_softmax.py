"""Exercise 10, solved: the online softmax's update and its end."""

import numpy as np


def softmax_step(state, s, v):  # state (m, l, acc [D]); s [n] the tile's scores; v [n, D] its values
    """The state after the tile: ``(m, l, acc)``."""
    m, l, acc = state
    s = np.asarray(s, dtype=np.float64)
    m_new = max(m, s.max(initial=-np.inf))
    m_safe = 0.0 if m_new == -np.inf else m_new  # no visible key yet: exp(-inf - 0) = 0, not NaN
    alpha = np.exp(m - m_safe)
    p = np.exp(s - m_safe)
    return m_new, alpha * l + p.sum(), alpha * acc + p @ v


def finish(state):  # state (m, l, acc [D])
    """``(o [D], lse)`` of the final state; ``(zeros, -inf)`` when no key was visible."""
    m, l, acc = state
    if l == 0:
        return np.zeros_like(acc), -np.inf
    return acc / l, m + np.log(l)
