"""Exercise 23, solved: GQA's head maps, and the expansion a kernel avoids."""

import numpy as np


def kv_head(qo_head, num_qo_heads, num_kv_heads):
    """The KV head query head ``qo_head`` reads, an int."""
    return qo_head // (num_qo_heads // num_kv_heads)


def tile_rows(kv_head, group, num_rows):
    """``(query [num_rows], head [num_rows])``: the query (counted from the tile's first) and query head of each row."""
    i = np.arange(num_rows)
    return i // group, kv_head * group + i % group


def expand_kv(k, num_qo_heads):  # k [n, num_kv_heads, D]
    """``[n, num_qo_heads, D]``: each query head's copy of the KV head it reads."""
    return np.repeat(k, num_qo_heads // k.shape[1], axis=1)
