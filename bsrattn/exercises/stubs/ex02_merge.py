"""⊕, the merge of two attention states, and its identity, the empty state (lse = -inf).

A state (o, lse) is the attention of one query (one head) over a set of keys: o its output [D], lse the
natural-log LSE of its scores (exercise 1). Two states over disjoint sets of keys merge into the state over
their union, with no need to see the keys again:

    m   = max(lse_a, lse_b)
    w_a = exp(lse_a - m),   w_b = exp(lse_b - m)
    o   = (w_a o_a + w_b o_b) / (w_a + w_b)
    lse = m + log(w_a + w_b)

    keys   0 . . . . . . . 9 | 10 . . . . 15
          [     state a      ][   state b   ]
          [            a ⊕ b                ]      the state over keys 0..15

The max shift keeps exp in range (an lse can be 800). The state over no key, (0, -inf), is the identity:
s ⊕ empty = empty ⊕ s = s, bit for bit, whatever the empty state's o holds (a kernel never reads it: it may be
left NaN). Two empty states merge to (0, -inf). `ba.merge_state` is the library's ⊕, over arrays of states;
write it here for one query and head.

Check it: python -m bsrattn.exercises check 2
"""

import numpy as np


def merge_state(o_a, lse_a, o_b, lse_b):  # o_a, o_b [D] float64; lse_a, lse_b float
    """``(o_a, lse_a) ⊕ (o_b, lse_b)``: returns ``(o [D], lse)``."""
    raise NotImplementedError("exercise 2: shift by m = max(lse_a, lse_b), weigh, normalise")


def empty_state(head_dim):
    """The state over no key: ``(o [head_dim] of zeros, lse = -inf)``."""
    raise NotImplementedError("exercise 2: the identity of ⊕")
