"""A layout as the dense mask it stands for: which pool slot each query row attends.

Every layout is a compressed description of one [nnz_qo, num_slots] boolean matrix. Query row q of block row r
attends pool slot j when j is one of the row's slots (exercise 5), the row's custom mask allows it (a tree,
exercise 21) and, with causal, the key's position is visible from the query's (exercise 6). Positions are logical:
key i of the row sits at position i, whatever pool slot holds it.

    paged, page_size 4: one block row of 2 queries over page [1], kv_len 3, causal

                       pool slots   0 1 2 3 | 4 5 6 7
        q0 (position 1)             . . . . | x x . .
        q1 (position 2)             . . . . | x x x .

This is the picture `ba.BSRLayout.to_dense_mask(variant)` draws, and the spec every layout is tested against:
attention over the layout equals dense attention under its dense mask. `layout` is a `ba.BSRLayout`: use its
`kv_slots(r)`, `row_mask(r)`, `qo_lens`, `kv_lens` and `qo_indptr`.

Check it: python -m bsrattn.exercises check 24
"""

import numpy as np


def dense_mask(layout, causal):
    """``[nnz_qo, num_slots]`` bool."""
    raise NotImplementedError("exercise 24: for each row, its queries x its slots, under the masks")
