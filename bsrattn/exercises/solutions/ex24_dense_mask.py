"""Exercise 24, solved: a layout drawn as its dense [nnz_qo, num_slots] mask."""

import numpy as np


def dense_mask(layout, causal):
    """``[nnz_qo, num_slots]`` bool."""
    mask = np.zeros((layout.nnz_qo, layout.num_slots), dtype=bool)
    for r in range(layout.num_rows):
        qo_len, kv_len = int(layout.qo_lens[r]), int(layout.kv_lens[r])
        visible = np.ones((qo_len, kv_len), dtype=bool)
        if causal:
            visible &= np.arange(kv_len)[None, :] <= kv_len - qo_len + np.arange(qo_len)[:, None]
        custom = layout.row_mask(r)
        if custom is not None:
            visible &= custom
        mask[layout.qo_indptr[r]:layout.qo_indptr[r + 1], layout.kv_slots(r)] = visible
    return mask
