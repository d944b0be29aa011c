"""Exercise 5, solved: the sparse path's address of a logical slot."""

import numpy as np


def pool_slot(kv_indptr, kv_indices, block_size, r, i):  # kv_indptr [R+1]; kv_indices [nnz]; i int or int array
    """The pool slot(s) of logical slot(s) ``i`` of row ``r``: an int, or an array of ``i``'s shape."""
    kv_indices = np.asarray(kv_indices)
    return kv_indices[kv_indptr[r] + np.asarray(i) // block_size] * block_size + np.asarray(i) % block_size
