"""Logical slot -> pool slot: where key i of block row r lives in the KV pool.

A row's logical KV sequence is its blocks in order, the last one cut to kv_last_len. Logical slot i of row r is
in the row's block number i // Bc, at offset i % Bc inside it; that block's id is kv_indices[kv_indptr[r] + i // Bc],
and block b holds the pool slots b * Bc .. b * Bc + Bc - 1:

    pool slot = kv_indices[kv_indptr[r] + i // Bc] * Bc + i % Bc

    Bc = 4, row r's blocks [7, 2]     logical i    0  1  2  3 | 4  5  6
                                      pool slot   28 29 30 31 | 8  9 10

This is the sparse path of the paper's load module (`bsrattn.indexing.sparse_slot`): each slot's address is
computed on its own, so a kernel's tile of keys may cross block boundaries anywhere. Leave out the "* Bc" and
block ids are read as slots.

Check it: python -m bsrattn.exercises check 5
"""

import numpy as np


def pool_slot(kv_indptr, kv_indices, block_size, r, i):  # kv_indptr [R+1]; kv_indices [nnz]; i int or int array
    """The pool slot(s) of logical slot(s) ``i`` of row ``r``: an int, or an array of ``i``'s shape."""
    raise NotImplementedError("exercise 5: the block of slot i, times Bc, plus the offset in it")
