"""A BSR gather: one block row's keys (or values), in logical order, copied out of the pool.

The paper's load module: before the dense microkernel runs, the KV rows a block row selects are copied from
wherever they sit in the pool into contiguous fast memory. With k stored NHD, [num_blocks, Bc, Hkv, D], pool slot
j is k[j // Bc, j % Bc]:

    pool      block 0     block 1     block 2        row r: kv_indices [2, 0], kv_last_len 3, Bc = 4
             [a b c d]   [e f g h]   [w x y z]
    row r gathers   w x y z a b c                    -> [7, Hkv, D]

The row's length is a full block for every block but the last, which holds kv_last_len slots (a row with no
blocks has none); each slot's pool slot is exercise 5's. The layout handed here has only the fields kv_indptr,
kv_indices, kv_last_len and block_size of a `ba.BSRLayout`, so its `kv_slots` and `kv_lens` are not there to lean on.

Check it: python -m bsrattn.exercises check 11
"""

import numpy as np


def gather_rows(x, layout, r):  # x [num_blocks, block_size, Hkv, D]
    """``[kv_len, Hkv, D]``: row ``r``'s rows of ``x``, in the row's logical order."""
    raise NotImplementedError("exercise 11: the row's length, its pool slots, then index the pool")
