"""Index math shared by every tier, written once.

Each helper is plain arithmetic on integers, so the same source serves three ways: the reference calls it
on NumPy arrays (vectorised), and the numba tier re-decorates it with ``cuda.jit(device=True)`` to call it
on scalars inside a kernel (minitorch's habit). Keep them free of Python control flow on array values.
"""


def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative integers."""
    return (a + b - 1) // b


def sparse_slot(kv_indices, row_block_start, block_size, i):
    """Pool slot of logical KV slot ``i`` of a row (the BSR "sparse path").

    ``j = kv_indices[row_block_start + i // Bc] * Bc + i % Bc``, where ``row_block_start = kv_indptr[r]``.
    """
    return kv_indices[row_block_start + i // block_size] * block_size + i % block_size


def dense_slot(row_slot_start, i):
    """Pool slot of logical KV slot ``i`` of a row whose KV is contiguous (the affine "dense path")."""
    return row_slot_start + i


def query_position(qo_len, kv_len, i):
    """Position of query ``i`` of a row: bottom-right aligned, ``kv_len - qo_len + i``."""
    return kv_len - qo_len + i


def key_visible(q_pos, k_pos, causal, window_left):
    """Whether a key at ``k_pos`` is visible from a query at ``q_pos`` under the position masks.

    Causal: ``k_pos <= q_pos``. Sliding window (``window_left >= 0``): ``q_pos - k_pos <= window_left``.
    """
    return ((k_pos <= q_pos) | (not causal)) & ((window_left < 0) | (q_pos - k_pos <= window_left))


def mask_offset(mask_row_start, kv_len, i, j):
    """Flat index of element ``(i, j)`` of a row's ``[qo_len, kv_len]`` custom mask."""
    return mask_row_start + i * kv_len + j


def nhd_row(slot, head, num_kv_heads):
    """Row of (pool slot, KV head) in NHD storage ``[num_blocks, Bc, Hkv, D]`` seen as ``[rows, D]``."""
    return slot * num_kv_heads + head


def hnd_row(slot, head, num_kv_heads, block_size):
    """Row of (pool slot, KV head) in HND storage ``[num_blocks, Hkv, Bc, D]`` seen as ``[rows, D]``."""
    return (slot // block_size * num_kv_heads + head) * block_size + slot % block_size
