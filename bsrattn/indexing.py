"""Index math shared by every tier, written once.

Each helper is plain arithmetic on integers, so the same source serves three ways: the reference calls it
on NumPy arrays (vectorised), and the numba tier re-decorates it with ``cuda.jit(device=True)`` to call it
on scalars inside a kernel (minitorch's habit). Keep them free of Python control flow on array values.

Their signatures carry no annotations: every argument is an int or an integer array alike, and Triton, which
compiles their source for the torch tier, reads a parameter's annotation as its type (``tl.constexpr``, say).
"""


def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative integers.

    Parameters
    ----------
    a : int or array of int
        The dividend, ``>= 0``.
    b : int or array of int
        The divisor, ``>= 1``.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> from bsrattn import indexing
    >>> indexing.ceil_div(20, 16), indexing.ceil_div(32, 16)
    (2, 2)
    """
    return (a + b - 1) // b


def sparse_slot(kv_indices, row_block_start, block_size, i):
    """Pool slot of logical KV slot ``i`` of a row (the BSR "sparse path").

    ``j = kv_indices[row_block_start + i // Bc] * Bc + i % Bc``, where ``row_block_start = kv_indptr[r]``.

    Parameters
    ----------
    kv_indices : array of int, ``[nnz]``
        The layout's KV block ids.
    row_block_start : int
        ``kv_indptr[r]``, the row's first entry of ``kv_indices``.
    block_size : int
        Bc, slots per block.
    i : int or array of int
        Logical KV slots of the row, in ``[0, kv_len)``.

    Returns
    -------
    int or array of int
        Pool slots, ``i``'s shape.

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import indexing
    >>> indexing.sparse_slot(np.array([7, 2]), 0, 16, np.array([0, 15, 16, 19])).tolist()
    [112, 127, 32, 35]
    """
    return kv_indices[row_block_start + i // block_size] * block_size + i % block_size


def affine_slot(row_slot_start, i):
    """Pool slot of logical KV slot ``i`` of a row whose KV is contiguous (the affine path).

    Parameters
    ----------
    row_slot_start : int
        The pool slot of the row's first key.
    i : int or array of int
        Logical KV slots of the row.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> from bsrattn import indexing
    >>> indexing.affine_slot(40, 3)
    43
    """
    return row_slot_start + i


def query_position(qo_len, kv_len, i):
    """Position of query ``i`` of a row: bottom-right aligned, ``kv_len - qo_len + i``.

    Parameters
    ----------
    qo_len, kv_len : int
        The row's query rows and KV slots.
    i : int or array of int
        Query rows of the row, in ``[0, qo_len)``.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> from bsrattn import indexing
    >>> indexing.query_position(3, 10, 0)     # the first of 3 queries appended to 7 cached keys
    7
    """
    return kv_len - qo_len + i


def key_visible(q_pos, k_pos, causal, window_left):
    """Whether a key at ``k_pos`` is visible from a query at ``q_pos`` under the position masks.

    Causal: ``k_pos <= q_pos``. Sliding window (``window_left >= 0``): ``q_pos - k_pos <= window_left``.

    Parameters
    ----------
    q_pos, k_pos : int or array of int
        Positions of the query and the key (broadcast together).
    causal : bool
        Apply the causal mask.
    window_left : int
        The inclusive sliding window; ``-1`` disables it.

    Returns
    -------
    bool or array of bool

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import indexing
    >>> indexing.key_visible(5, np.arange(8), True, 2).astype(int).tolist()
    [0, 0, 0, 1, 1, 1, 0, 0]
    """
    return ((k_pos <= q_pos) | (not causal)) & ((window_left < 0) | (q_pos - k_pos <= window_left))


def mask_offset(mask_row_start, kv_len, i, j):
    """Flat index of element ``(i, j)`` of a row's ``[qo_len, kv_len]`` custom mask.

    Parameters
    ----------
    mask_row_start : int
        ``mask_indptr[r]``, the row's first element of ``custom_mask``.
    kv_len : int
        The row's KV slots (the mask's row length).
    i, j : int or array of int
        Query row and logical KV slot of the row.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> from bsrattn import indexing
    >>> indexing.mask_offset(100, 5, 2, 3)
    113
    """
    return mask_row_start + i * kv_len + j


def nhd_row(slot, head, num_kv_heads):
    """Row of (pool slot, KV head) in NHD storage ``[num_blocks, Bc, Hkv, D]`` seen as ``[rows, D]``.

    Parameters
    ----------
    slot : int or array of int
        The pool slot, ``block * Bc + offset``.
    head : int or array of int
        The KV head.
    num_kv_heads : int
        Hkv.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import indexing
    >>> k = np.arange(3 * 4 * 2).reshape(3, 4, 2, 1)        # [num_blocks=3, Bc=4, Hkv=2, D=1]
    >>> bool(k.reshape(-1, 1)[indexing.nhd_row(9, 1, 2), 0] == k[9 // 4, 9 % 4, 1, 0])
    True
    """
    return slot * num_kv_heads + head


def hnd_row(slot, head, num_kv_heads, block_size):
    """Row of (pool slot, KV head) in HND storage ``[num_blocks, Hkv, Bc, D]`` seen as ``[rows, D]``.

    Parameters
    ----------
    slot : int or array of int
        The pool slot, ``block * Bc + offset``.
    head : int or array of int
        The KV head.
    num_kv_heads : int
        Hkv.
    block_size : int
        Bc, slots per block.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import indexing
    >>> k = np.arange(3 * 2 * 4).reshape(3, 2, 4, 1)        # [num_blocks=3, Hkv=2, Bc=4, D=1]
    >>> bool(k.reshape(-1, 1)[indexing.hnd_row(9, 1, 2, 4), 0] == k[9 // 4, 1, 9 % 4, 0])
    True
    """
    return (slot // block_size * num_kv_heads + head) * block_size + slot % block_size


def tile_query(i, group_size):
    """Query row, counted from the tile's first, of row ``i`` of a GQA tile.

    A tile's rows are (query row, query head of the KV head's group) pairs, query-major: row ``i`` is query
    ``i // G`` and head ``kv_head * G + i % G`` (:func:`tile_head`), so the ``G`` heads that read one KV head
    share every K/V tile.

    Parameters
    ----------
    i : int or array of int
        Rows of the tile, ``>= 0``.
    group_size : int
        G, query heads per KV head.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import indexing
    >>> indexing.tile_query(np.arange(6), 4).tolist()
    [0, 0, 0, 0, 1, 1]
    """
    return i // group_size


def tile_head(kv_head, group_size, i):
    """Query head of row ``i`` of a GQA tile over KV head ``kv_head`` (see :func:`tile_query`).

    Parameters
    ----------
    kv_head : int
        The tile's KV head.
    group_size : int
        G, query heads per KV head.
    i : int or array of int
        Rows of the tile, ``>= 0``.

    Returns
    -------
    int or array of int

    Examples
    --------
    >>> import numpy as np
    >>> from bsrattn import indexing
    >>> indexing.tile_head(1, 4, np.arange(6)).tolist()
    [4, 5, 6, 7, 4, 5]
    """
    return kv_head * group_size + i % group_size
