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

After that, both copy whole ``head_dim`` rows, so the coalescing comes from the head dimension whatever the
block size is: with fp16 and ``head_dim`` 128 a row is 256 bytes, one 8-byte word per lane of a warp.
"""

from __future__ import annotations

import numpy as np

from bsrattn import indexing
from bsrattn.numba_cuda.launch import device

sparse_slot = device(indexing.sparse_slot)
affine_slot = device(indexing.affine_slot)
nhd_row = device(indexing.nhd_row)
hnd_row = device(indexing.hnd_row)


def copy_word(row_bytes: int, *pointers) -> np.dtype:
    """The widest unsigned word (8, 4, 2 or 1 bytes) that divides a row and the alignment of every pointer.

    Examples
    --------
    >>> copy_word(256, 0x7F0000).itemsize, copy_word(12, 0).itemsize, copy_word(256, 0x7F0002).itemsize
    (8, 4, 2)
    """
    for size in (8, 4, 2, 1):
        if row_bytes % size == 0 and all(p % size == 0 for p in pointers):
            return np.dtype(f"u{size}")
    raise AssertionError("unreachable: 1 divides everything")


def rows_view(x, head_dim: int, word: np.dtype):
    """Device ``k`` or ``v`` in any storage, seen as ``[rows, head_dim * itemsize / word]`` words.

    ``x`` is C-contiguous (``arrays.device_array`` checks), but numba's ``reshape`` also refuses a view whose
    inserted size-1 axis has a zero stride (``k[:, None]``); such an array is rebuilt over the same memory.
    """
    shape = (x.size // head_dim, head_dim)
    try:
        flat = x.reshape(*shape)
    except NotImplementedError:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        flat = DeviceNDArray(shape, (head_dim * x.dtype.itemsize, x.dtype.itemsize), x.dtype, gpu_data=x.gpu_data)
    return flat.view(word)


def make_gather(cfg):
    """Device functions ``resolve_rows``, ``load_rows`` and ``store_rows`` for one kernel configuration (see
    ``config.Config``)."""
    tile_kv, threads = cfg.tile_kv, cfg.num_threads
    row_words, tile_words, words_per_thread = cfg.row_words, cfg.tile_kv * cfg.row_words, cfg.words_per_thread
    hnd = cfg.kv_hnd

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
        """Thread ``t``'s words of the rows ``kv_rows`` of ``k_words, v_words [rows, row_words]`` into its
        registers ``k_staged, v_staged [words_per_thread]`` (local); rows past the end read as zero, so a zero
        weight never meets stale NaN bits.

        Every load is issued before any is used, so each thread keeps ``words_per_thread`` loads in flight, and
        the executor issues them a tile ahead: they travel while the previous tile is computed (what
        ``cp.async`` pipelines do in hardware; Numba has no async copy).
        """
        n = 0
        while n < words_per_thread:  # while, not range(): see microkernel's note on Numba's range iterator
            e = t + n * threads
            src = kv_rows[e // row_words] if e < tile_words else -1
            if src >= 0:
                k_staged[n] = k_words[src, e % row_words]
                v_staged[n] = v_words[src, e % row_words]
            else:
                k_staged[n] = 0
                v_staged[n] = 0
            n += 1

    @device
    def store_rows(t, k_staged, v_staged, k_tile, v_tile):
        """Thread ``t``'s staged words into ``k_tile, v_tile [tile_kv, row_words + pad]`` (shared)."""
        n = 0
        while n < words_per_thread:
            e = t + n * threads
            if e < tile_words:
                k_tile[e // row_words, e % row_words] = k_staged[n]
                v_tile[e // row_words, e % row_words] = v_staged[n]
            n += 1

    return resolve_rows, load_rows, store_rows
