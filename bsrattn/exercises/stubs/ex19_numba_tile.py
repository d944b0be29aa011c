"""One tile of a CUDA kernel, in Numba: each query's online-softmax update over one gathered KV tile.

The numba tier's microkernel (bsrattn/numba_cuda/microkernel.py) is exercise 10 spread over threads. Here, one
block per query row i and one thread per head dimension d; thread d owns acc[i, d]:

    grid (nq,) blocks       block i:   thread 0      thread 1   ...   thread D-1
    block (D,) threads                 acc[i, 0]     acc[i, 1]        acc[i, D-1]   alpha * acc + sum_j p_j v[j, d]
                                       l[i], m[i]    (thread 0 alone, once every thread has read m[i])

    s  [nq, T]   the tile's scores (-inf: masked)      m [nq], l [nq], acc [nq, D]   the running state, updated
    v  [T, D]    the tile's gathered values                                           in place

Every thread computes its row's m_new itself (T reads, no communication), then alpha and the p_j. Thread 0
writes l[i] and m[i] — but only after every thread of the block has read the old m[i]: cuda.syncthreads() is
that barrier. Guard the row that has seen no visible key yet (m_new = -inf): shift by 0, as in exercise 10.
The grader launches online_softmax_tile[nq, D](s, v, m, l, acc) once per tile, then finishes on the host.
Without a GPU it runs in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, which the check command sets), each
thread a Python thread.

Check it: python -m bsrattn.exercises check 19
"""

import math

from numba import cuda


@cuda.jit
def online_softmax_tile(s, v, m, l, acc):  # s [nq, T]; v [T, D]; m, l [nq]; acc [nq, D]
    """Fold the tile ``(s, v)`` into the running state of query row ``cuda.blockIdx.x``."""
    i = cuda.blockIdx.x
    d = cuda.threadIdx.x
    raise NotImplementedError("exercise 19: m_new and alpha, acc[i, d], then after a barrier l[i] and m[i]")
