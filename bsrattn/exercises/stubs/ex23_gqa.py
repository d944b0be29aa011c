"""Grouped-query attention: G query heads share one KV head, and a kernel reads it once for all of them.

With num_qo_heads = G * num_kv_heads, query head h reads KV head h // G; consecutive query heads share:

    query heads    0 1 2 3 | 4 5 6 7          G = 4
    KV head           0    |    1

A kernel lays a tile's rows out as (query, head of the group) pairs, query-major, so the G heads that read one KV
head share every K/V tile it loads: row i of a tile over KV head g is query i // G in query head g * G + i % G
(`bsrattn.indexing.tile_query`, `tile_head`).

Write the three maps: the KV head of a query head; a tile's rows; and the expansion of k [n, Hkv, D] to
[n, Hq, D] that a naive implementation makes (and the kernel avoids). np.tile gets it wrong: query head h does not
read KV head h % Hkv.

Check it: python -m bsrattn.exercises check 23
"""

import numpy as np


def kv_head(qo_head, num_qo_heads, num_kv_heads):
    """The KV head query head ``qo_head`` reads, an int."""
    raise NotImplementedError("exercise 23: h // G")


def tile_rows(kv_head, group, num_rows):
    """``(query [num_rows], head [num_rows])``: the query (counted from the tile's first) and query head of each row."""
    raise NotImplementedError("exercise 23: query-major rows, the group's heads side by side")


def expand_kv(k, num_qo_heads):  # k [n, num_kv_heads, D]
    """``[n, num_qo_heads, D]``: each query head's copy of the KV head it reads."""
    raise NotImplementedError("exercise 23: repeat each KV head G times, in place")
