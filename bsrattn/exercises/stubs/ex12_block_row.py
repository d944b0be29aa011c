"""Attention of one block row: the gather (exercise 11), then the online softmax (exercise 10), tile by tile.

What the kernel does for block row r of a layout: gather the row's keys and values, then run every one of the row's
queries, in every head, through the online softmax over tiles of tile_kv keys, with the scores
s = (q . k) / sqrt(D) and, when causal, the bottom-right causal mask of exercise 6:

    q     [qo_len, H, D]     the row's queries          k, v   [num_blocks, Bc, H, D]   the pool (NHD)
    keys of row r, gathered:   [ tile_kv keys ][ tile_kv keys ][ ... ]   ->  one running state per (query, head)
    out   [qo_len, H, D]     lse [qo_len, H], natural log;  a query that sees no key: o = 0, lse = -inf

Query head h reads KV head h here (as many query heads as KV heads; exercise 23 is GQA). Vectorise over queries and
heads as you like: the tiles are the point. `layout` is a `ba.BSRLayout` (its `kv_slots(r)` may serve the gather).
Match `ba.attention(q, k, v, layout, variant=ba.Variant(causal=causal), return_lse=True)`.

Check it: python -m bsrattn.exercises check 12
"""

import numpy as np


def attend_row(q, k, v, layout, r, causal, tile_kv):  # q [qo_len, H, D]; k, v [num_blocks, Bc, H, D]
    """``(o [qo_len, H, D], lse [qo_len, H])`` of row ``r``'s queries over its keys."""
    raise NotImplementedError("exercise 12: gather the row, then the online softmax over tiles of tile_kv keys")
