"""The load module: which storage rows a KV tile reads, and the cooperative copy of them into shared memory.

Matches :func:`bsrattn.reference.gather.row_slots` and :func:`~bsrattn.reference.gather.gather`; it differs
in working one tile of ``tile_kv`` logical slots at a time, and in moving the storage's own bits (fp8 and
bf16 are decoded at use, :mod:`.formats`).

The two ways of naming a tile's pool slots sit side by side, as in the paper:

- the **sparse path** goes through the BSR indices, ``j = kv_indices[kv_indptr[r] + i // Bc] * Bc + i % Bc``
  (:func:`bsrattn.indexing.sparse_slot`): paged caches, Quest, vector-sparse KV, trees;
- the **affine path**, ``j = first_slot[r] + i`` (:func:`bsrattn.indexing.affine_slot`), taken by a
  row whose KV is one contiguous run of slots (ragged and dense layouts, consecutive pages): the choice is
  the row's, read from its item row (:func:`bsrattn.items.first_slots`).

After that, both copy whole rows (``head_dim`` wide for K, ``dim_vo`` for V), so the coalescing comes from the
head dimension whatever the block size is: with fp16 and ``head_dim`` 128 a row is 256 bytes, one 8-byte word
per lane of a warp.
"""

from __future__ import annotations

import numpy as np

from bsrattn import indexing
from bsrattn.numba_cuda.arrays import row_stride
from bsrattn.numba_cuda.launch import device

sparse_slot = device(indexing.sparse_slot)
affine_slot = device(indexing.affine_slot)
nhd_row = device(indexing.nhd_row)
hnd_row = device(indexing.hnd_row)


def copy_word(row_bytes: int, *offsets) -> np.dtype:
    """The widest unsigned word (8, 4, 2 or 1 bytes) that divides a row and every other offset given: the other
    rows' sizes (V's beside K's), the rows' strides and the arrays' pointers.

    Examples
    --------
    >>> copy_word(256, 0x7F0000).itemsize, copy_word(12, 0).itemsize, copy_word(256, 0x7F0002).itemsize
    (8, 4, 2)
    """
    for size in (8, 4, 2, 1):
        if row_bytes % size == 0 and all(p % size == 0 for p in offsets):
            return np.dtype(f"u{size}")
    raise AssertionError("unreachable: 1 divides everything")


def rows_view(x, head_dim: int, word: np.dtype):
    """Device ``k`` or ``v`` in any storage, seen as ``[rows, head_dim * itemsize / word]`` words over its own
    memory (``head_dim``: the array's own, ``dim_vo`` for ``v``).

    ``x``'s rows are contiguous and evenly spaced (``arrays.device_array(..., rows=True)`` checks). Numba's
    ``reshape`` refuses an ``x`` that is not C-contiguous (MLA's value, ``k[..., :Dc]``, whose rows lie a key's
    width apart) and a view whose inserted size-1 axis has a zero stride (``k[:, None]``); such an array is
    rebuilt over the same memory with its row stride. (The simulator's arrays are NumPy's, whose ``reshape``
    copies a strided ``x``: the same values, read.)
    """
    shape = (x.size // head_dim, head_dim)
    try:
        flat = x.reshape(*shape)
    except NotImplementedError:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        words = head_dim * x.dtype.itemsize // word.itemsize
        return DeviceNDArray((shape[0], words), (row_stride(x), word.itemsize), word, gpu_data=x.gpu_data)
    return flat.view(word)


def make_gather(cfg):
    """Device functions ``resolve_rows``, ``load_rows`` and ``store_rows`` for one kernel configuration (see
    ``config.Config``)."""
    tile_kv, threads = cfg.tile_kv, cfg.num_threads
    hnd = cfg.kv_hnd

    def staged_copy(row_words, words_per_thread):
        """``(load, store)`` of one tile of rows ``row_words`` wide: K's, or V's (``dim_vo`` wide)."""
        tile_words = tile_kv * row_words

        @device
        def load(t, staged, words, kv_rows):
            n = 0
            while n < words_per_thread:  # while, not range(): see microkernel's note on Numba's range iterator
                e = t + n * threads
                src = kv_rows[e // row_words] if e < tile_words else -1
                if src >= 0:
                    staged[n] = words[src, e % row_words]
                else:
                    staged[n] = 0
                n += 1

        @device
        def store(t, staged, tile):
            n = 0
            while n < words_per_thread:
                e = t + n * threads
                if e < tile_words:
                    tile[e // row_words, e % row_words] = staged[n]
                n += 1

        return load, store

    load_k, store_k = staged_copy(cfg.row_words, cfg.words_per_thread)
    load_v, store_v = staged_copy(cfg.v_row_words, cfg.v_words_per_thread)

    @device
    def resolve_rows(t, kv_rows, kv_indices, row_block_start, row_first_slot, block_size, num_kv_heads, kv_head,
                     kv0, kv_end):
        """Thread ``t``'s share of ``kv_rows [tile_kv]`` (shared) <- the storage row of logical slot ``kv0 + j``
        of the block row, -1 past its end; the affine path when ``row_first_slot >= 0``
        (:func:`bsrattn.items.first_slots`)."""
        for j in range(t, tile_kv, threads):
            i = kv0 + j
            row = -1
            if i < kv_end:
                if row_first_slot >= 0:
                    slot = affine_slot(row_first_slot, i)
                else:
                    slot = sparse_slot(kv_indices, row_block_start, block_size, i)
                if hnd:
                    row = hnd_row(slot, kv_head, num_kv_heads, block_size)
                else:
                    row = nhd_row(slot, kv_head, num_kv_heads)
            kv_rows[j] = row

    @device
    def load_rows(t, k_staged, v_staged, k_words, v_words, kv_rows):
        """Thread ``t``'s words of the rows ``kv_rows`` of ``k_words [rows, row_words]`` and ``v_words [rows,
        v_row_words]`` into its registers ``k_staged [words_per_thread]``, ``v_staged [v_words_per_thread]``
        (local); rows past the end read as zero, so a zero weight never meets stale NaN bits.

        Every load is issued before any is used, so each thread keeps its loads in flight, and the executor issues
        them a tile ahead: they travel while the previous tile is computed (what ``cp.async`` pipelines do in
        hardware; Numba has no async copy).
        """
        load_k(t, k_staged, k_words, kv_rows)
        load_v(t, v_staged, v_words, kv_rows)

    @device
    def store_rows(t, k_staged, v_staged, k_tile, v_tile):
        """Thread ``t``'s staged words into ``k_tile [tile_kv, row_words + pad]`` and ``v_tile [tile_kv,
        v_row_words + pad]`` (shared)."""
        store_k(t, k_staged, k_tile)
        store_v(t, v_staged, v_tile)

    return resolve_rows, load_rows, store_rows
