"""A ragged batch as BSR with Bc = 1: its qo_indptr, kv_indptr, kv_indices and kv_last_len.

Variable-length requests packed back to back, without padding: queries in one q [nnz_qo, H, D], keys in one
k [sum(kv_lens), H, D]. Each request is a block row whose blocks are single slots (Bc = 1), its indices
consecutive — the dense, affine path of the load module:

    qo_lens = [3, 1, 2],  kv_lens = [3, 4, 2]          a prefill, a decode, an append

    KV buffer slots    0 1 2 | 3 4 5 6 | 7 8
                       req 0 | req 1   | req 2

    qo_indptr   = [0, 3, 4, 6]                 row r's queries are q[qo_indptr[r]:qo_indptr[r+1]]
    kv_indptr   = [0, 3, 7, 9]                 one block per slot
    kv_indices  = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    kv_last_len = [1, 1, 1]                    each last block holds one slot; 0 for a request with no key

`ba.layouts.ragged` builds the same arrays, inside a `ba.BSRLayout`.

Check it: python -m bsrattn.exercises check 4
"""

import numpy as np


def ragged_layout(qo_lens, kv_lens):  # qo_lens, kv_lens [B]
    """``(qo_indptr [B+1], kv_indptr [B+1], kv_indices [nnz], kv_last_len [B])``, integer arrays."""
    raise NotImplementedError("exercise 4: prefix sums of the lengths, and one slot per block")
