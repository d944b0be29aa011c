"""A cascade: a shared prefix as one block row of every request's queries, then each request's suffix.

When every request continues one prefix (a system prompt), storing it once is not enough: a kernel that gives each
request its own block row still loads the prefix once per request. A cascade is two layouts over the same pool,
whose states merge with ⊕ (exercise 2):

    level 0, the prefix:   ONE block row holding every request's queries, over the prefix pages
    level 1, the suffixes: one block row per request, over its own pages

    qo_lens [1, 2]; prefix pages [0, 1], prefix_len 20; suffix pages [[2], [3]], suffix_lens [5, 9]; page_size 16

    level 0   qo_indptr [0, 3]      kv_indptr [0, 2]      kv_indices [0, 1]   kv_last_len [4]
    level 1   qo_indptr [0, 1, 3]   kv_indptr [0, 1, 2]   kv_indices [2, 3]   kv_last_len [5, 9]

The prefix row has qo_len = sum(qo_lens): its queries share one load of every prefix page. Each level is a paged
layout (exercise 3 computes its KV arrays). Match the levels of `ba.layouts.shared_prefix`.

Check it: python -m bsrattn.exercises check 8
"""

import numpy as np


def cascade_levels(qo_lens, prefix_pages, prefix_len, suffix_page_tables, suffix_lens, page_size):
    """``(prefix_level, suffix_level)``, each ``(qo_indptr, kv_indptr, kv_indices, kv_last_len)`` integer arrays."""
    raise NotImplementedError("exercise 8: a paged layout of one row over the prefix, one of B rows over the suffixes")
