"""Exercise 22, solved: the scale, the soft cap, then ALiBi."""

import numpy as np


def transform(qk, q_pos, k_pos, sm_scale, soft_cap, alibi_slope):
    # qk [n, m] the products q . k; q_pos [n], k_pos [m] positions; soft_cap 0 is off; alibi_slope None is off
    """``[n, m]`` scores: scaled, capped, biased."""
    s = sm_scale * np.asarray(qk, dtype=np.float64)
    if soft_cap > 0:
        s = soft_cap * np.tanh(s / soft_cap)
    if alibi_slope is not None:
        s = s + alibi_slope * (np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None])
    return s
