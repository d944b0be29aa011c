"""Exercise 19, solved: the online-softmax update of a tile, one block per query row, one thread per dimension."""

import math

from numba import cuda


@cuda.jit
def online_softmax_tile(s, v, m, l, acc):  # s [nq, T]; v [T, D]; m, l [nq]; acc [nq, D]
    """Fold the tile ``(s, v)`` into the running state of query row ``cuda.blockIdx.x``."""
    i = cuda.blockIdx.x
    d = cuda.threadIdx.x
    m_old = m[i]
    m_new = m_old
    for j in range(s.shape[1]):
        m_new = max(m_new, s[i, j])
    m_safe = m_new if m_new != -math.inf else 0.0
    alpha = math.exp(m_old - m_safe)
    total = 0.0
    weighted = 0.0
    for j in range(s.shape[1]):
        p = math.exp(s[i, j] - m_safe)
        total += p
        weighted += p * v[j, d]
    acc[i, d] = alpha * acc[i, d] + weighted
    cuda.syncthreads()  # every thread has read m[i]: thread 0 may now replace it
    if d == 0:
        l[i] = alpha * l[i] + total
        m[i] = m_new
