"""Exercise 21, solved: a draft tree's mask, each node's ancestors walked up to its root."""

import numpy as np


def tree_mask(parents, kv_len):  # parents [n]
    """``[n, kv_len]`` bool: row ``i`` is what node ``i`` sees."""
    n = len(parents)
    committed = kv_len - n
    mask = np.zeros((n, kv_len), dtype=bool)
    mask[:, :committed] = True
    for i in range(n):
        node = i
        while node >= 0:
            mask[i, committed + node] = True
            node = parents[node]
    return mask
