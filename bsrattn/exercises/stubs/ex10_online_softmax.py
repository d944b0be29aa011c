"""The online softmax: attention over keys that arrive one tile at a time, in a single pass.

A kernel cannot hold a long row's scores at once: it reads keys tile by tile and keeps, per query, a running state:
m, the largest score so far; l, the sum of exp(s - m); acc, the sum of exp(s - m) v. When a tile brings a larger
score, everything seen so far was weighed against the old max and must shrink:

    m_new = max(m, max_j s_j)
    alpha = exp(m - m_new)                      how much the old state shrinks
    p_j   = exp(s_j - m_new)
    l     = alpha * l + sum_j p_j
    acc   = alpha * acc + sum_j p_j v_j
    m     = m_new

    start  (m, l, acc) = (-inf, 0, zeros(D))          end  o = acc / l,  lse = m + log(l)

    tiles  [ s0 s1 s2 s3 ] [ s4 s5 s6 s7 ] [ s8 s9 ]     one state, updated three times

A masked key has the score -inf and weighs exp(-inf) = 0. Mind a query that has not seen a visible key yet:
m = -inf, and exp(-inf - (-inf)) is NaN, so shift by 0 instead. A query that never sees one ends as the empty
state, o = 0 and lse = -inf. A tile may hold no key at all.

Check it: python -m bsrattn.exercises check 10
"""

import numpy as np


def softmax_step(state, s, v):  # state (m, l, acc [D]); s [n] the tile's scores; v [n, D] its values
    """The state after the tile: ``(m, l, acc)``."""
    raise NotImplementedError("exercise 10: the new max, the rescale alpha, then l and acc")


def finish(state):  # state (m, l, acc [D])
    """``(o [D], lse)`` of the final state; ``(zeros, -inf)`` when no key was visible."""
    raise NotImplementedError("exercise 10: o = acc / l, lse = m + log(l)")
