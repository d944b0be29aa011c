"""Exercise 4, solved: a ragged batch's BSR arrays, one slot per block."""

import numpy as np


def ragged_layout(qo_lens, kv_lens):  # qo_lens, kv_lens [B]
    """``(qo_indptr [B+1], kv_indptr [B+1], kv_indices [nnz], kv_last_len [B])``, integer arrays."""
    qo_lens, kv_lens = np.asarray(qo_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)])
    return (np.concatenate([[0], np.cumsum(qo_lens)]), kv_indptr, np.arange(kv_indptr[-1]),
            np.minimum(kv_lens, 1))
