"""Exercise 6, solved: the bottom-right causal mask."""

import numpy as np


def causal_mask(qo_len, kv_len):
    """``[qo_len, kv_len]`` bool, True where query ``i`` sees key ``j``."""
    q_pos = kv_len - qo_len + np.arange(qo_len)[:, None]
    return np.arange(kv_len)[None, :] <= q_pos
