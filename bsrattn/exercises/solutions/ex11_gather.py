"""Exercise 11, solved: a block row's KV rows gathered out of the pool."""

import numpy as np


def gather_rows(x, layout, r):  # x [num_blocks, block_size, Hkv, D]
    """``[kv_len, Hkv, D]``: row ``r``'s rows of ``x``, in the row's logical order."""
    bc = layout.block_size
    start, end = int(layout.kv_indptr[r]), int(layout.kv_indptr[r + 1])
    kv_len = 0 if end == start else (end - start - 1) * bc + int(layout.kv_last_len[r])
    i = np.arange(kv_len)
    slots = np.asarray(layout.kv_indices)[start + i // bc] * bc + i % bc
    return x.reshape(-1, *x.shape[2:])[slots]
