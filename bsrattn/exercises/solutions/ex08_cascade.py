"""Exercise 8, solved: a shared prefix's two levels, each a paged layout."""

import numpy as np


def _paged(qo_lens, page_tables, kv_lens, page_size):
    """``(qo_indptr, kv_indptr, kv_indices, kv_last_len)`` of a paged batch (exercises 3 and 4)."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    n_pages = (kv_lens + page_size - 1) // page_size
    indices = np.array([page for table, n in zip(page_tables, n_pages) for page in table[:n]], dtype=np.int64)
    return (np.concatenate([[0], np.cumsum(qo_lens)]), np.concatenate([[0], np.cumsum(n_pages)]), indices,
            np.where(kv_lens > 0, kv_lens - (n_pages - 1) * page_size, 0))


def cascade_levels(qo_lens, prefix_pages, prefix_len, suffix_page_tables, suffix_lens, page_size):
    """``(prefix_level, suffix_level)``, each ``(qo_indptr, kv_indptr, kv_indices, kv_last_len)`` integer arrays."""
    prefix = _paged([sum(qo_lens)], [prefix_pages], [prefix_len], page_size)
    return prefix, _paged(qo_lens, suffix_page_tables, suffix_lens, page_size)
