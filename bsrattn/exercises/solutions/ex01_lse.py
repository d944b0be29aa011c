"""Exercise 1, solved: the natural-log LSE of a row, shifted by its max."""

import numpy as np


def lse(s):  # s [n] float64, -inf for a masked key
    """The natural-log LSE of the scores ``s``: a float, ``-inf`` when ``s`` is empty or all ``-inf``."""
    s = np.asarray(s, dtype=np.float64)
    m = s.max(initial=-np.inf)
    if m == -np.inf:  # no visible score: s - m would be -inf - (-inf) = NaN
        return -np.inf
    return float(m + np.log(np.exp(s - m).sum()))
