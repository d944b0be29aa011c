"""Exercise 3, solved: a paged batch's BSR arrays from its page tables."""

import numpy as np


def page_table_to_bsr(page_tables, kv_lens, page_size):  # page_tables [B][>= pages needed]; kv_lens [B]
    """``(kv_indptr [B+1], kv_indices [nnz], kv_last_len [B])``, integer arrays, of a paged batch."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    n_pages = (kv_lens + page_size - 1) // page_size
    kv_indptr = np.concatenate([[0], np.cumsum(n_pages)])
    kv_indices = np.array([page for table, n in zip(page_tables, n_pages) for page in table[:n]], dtype=np.int64)
    kv_last_len = np.where(kv_lens > 0, kv_lens - (n_pages - 1) * page_size, 0)
    return kv_indptr, kv_indices, kv_last_len
