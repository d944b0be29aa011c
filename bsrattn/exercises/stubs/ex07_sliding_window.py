"""A sliding window: the keys a query sees when it looks back at most window_left positions.

With the queries at positions kv_len - qo_len + i (bottom-right aligned, exercise 6), a key at position k_pos is
inside the window when q_pos - k_pos <= window_left: inclusive, so window_left = 0 keeps the key at the query's own
position, and -1 turns the window off. Causality is a separate switch: without it, keys after the query stay
visible.

    qo_len = 2, kv_len = 6, window_left = 2, causal

                  k:  0 1 2 3 4 5
        q0 (pos 4)    . . x x x .
        q1 (pos 5)    . . . x x x

Match `ba.Variant(causal=causal, window_left=window_left).position_mask(qo_len, kv_len)`.

Check it: python -m bsrattn.exercises check 7
"""

import numpy as np


def window_mask(qo_len, kv_len, window_left, causal):
    """``[qo_len, kv_len]`` bool, True where query ``i`` sees key ``j`` under the window (and causality)."""
    raise NotImplementedError("exercise 7: q_pos - k_pos <= window_left, unless window_left < 0")
