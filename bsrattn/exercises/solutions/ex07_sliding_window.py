"""Exercise 7, solved: an inclusive sliding window, with or without causality."""

import numpy as np


def window_mask(qo_len, kv_len, window_left, causal):
    """``[qo_len, kv_len]`` bool, True where query ``i`` sees key ``j`` under the window (and causality)."""
    q_pos = kv_len - qo_len + np.arange(qo_len)[:, None]
    k_pos = np.arange(kv_len)[None, :]
    visible = (q_pos - k_pos <= window_left) | (window_left < 0)
    if causal:
        visible &= k_pos <= q_pos
    return visible
