"""The work plan as the GPU kernels read it: one int32 row of named fields per work item.

A :class:`~bsrattn.scheduler.WorkPlan` keeps its items as parallel arrays, and the layout keeps its rows'
fields (query rows, lengths, block ranges) in its own arrays. A kernel program that starts an item wants all
of it at once, in one memory round trip, so both GPU tiers read the same packed rows: item ``w``'s row
holds its query and KV range, where its partial state goes and which merge it joins, and the fields of its
block row. The numba tier uploads :func:`item_table`'s array; the torch tier packs the same rows
(:func:`pack_items`) into one section of its persistent plan buffer. The reference tier walks the work plan
itself and reads no item rows.

The functions are explicit loops over NumPy arrays (:class:`~bsrattn.compiled.Compiled` compiles them with
Numba when it is installed): a plan of tens of thousands of items packs in microseconds.
"""

from __future__ import annotations

import numpy as np

from typing import TYPE_CHECKING

from bsrattn.compiled import Compiled
from bsrattn.coerce import INT32_MAX

if TYPE_CHECKING:
    from bsrattn.layout import BSRLayout
    from bsrattn.scheduler import WorkPlan

__all__ = ["ITEM_FIELDS", "ITEM", "ITEM_STRIDE", "first_slots", "pack_items", "mask_starts", "item_table"]

ITEM_FIELDS = (
    "qo_start", "qo_end",  # the item's query rows (absolute rows of q)
    "kv_start", "kv_end",  # its logical KV slots
    "partial",  # first workspace row of its partial state, -1: it writes the output
    "merge",  # the merge its partial state belongs to, -1: none
    "parts_lo", "parts_hi",  # that merge's partials, merge_partials[parts_lo:parts_hi]
    "qo_first", "qo_len", "kv_len",  # the block row's first query row and lengths
    "block_start",  # kv_indptr of the block row
    "first_slot",  # first pool slot when the row's blocks are consecutive (the affine path), else -1
    "mask_start",  # mask_indptr of the block row (0 without a custom mask: then nothing reads it)
    "row",  # the block row
    "rope_offset",  # fused RoPE's position of the block row's first slot (0 but in a Cascade's later levels)
)
"""The int32 fields of an item row, in order; kernels read them by these names (:data:`ITEM`)."""
ITEM = {name: i for i, name in enumerate(ITEM_FIELDS)}
ITEM_STRIDE = 16
"""int32 elements per item row: the fields, padded to 64 bytes."""

_QO_START, _QO_END = ITEM["qo_start"], ITEM["qo_end"]
_KV_START, _KV_END = ITEM["kv_start"], ITEM["kv_end"]
_PARTIAL, _MERGE = ITEM["partial"], ITEM["merge"]
_PARTS_LO, _PARTS_HI = ITEM["parts_lo"], ITEM["parts_hi"]
_QO_FIRST, _QO_LEN, _KV_LEN = ITEM["qo_first"], ITEM["qo_len"], ITEM["kv_len"]
_BLOCK_START, _FIRST_SLOT = ITEM["block_start"], ITEM["first_slot"]
_MASK_START, _ROW, _ROPE_OFFSET = ITEM["mask_start"], ITEM["row"], ITEM["rope_offset"]
_NUM_FIELDS = len(ITEM_FIELDS)


def first_slots(first_slot: np.ndarray, kv_indptr: np.ndarray, kv_indices: np.ndarray, block_size: int) -> bool:
    """``first_slot[r]`` <- the first pool slot of row ``r`` when its blocks are consecutive pool blocks, else -1.

    Such a row's logical slot ``i`` is pool slot ``first_slot[r] + i`` (the affine path,
    :func:`bsrattn.indexing.affine_slot`); every other row, an empty one too, takes the sparse path through
    ``kv_indices``. The last block's ``kv_last_len`` only shortens the run.

    Parameters
    ----------
    first_slot : numpy.ndarray
        ``[R]`` int64, written.
    kv_indptr, kv_indices : numpy.ndarray
        The layout's ``[R+1]`` and ``[nnz]`` block index arrays.
    block_size : int
        Bc, slots per block.

    Returns
    -------
    bool
        Whether any row takes the affine path.
    """
    any_affine = False
    for r in range(kv_indptr.size - 1):
        start = kv_indptr[r]
        end = kv_indptr[r + 1]
        first_slot[r] = -1
        if end > start:
            affine = True
            for i in range(start + 1, end):
                if kv_indices[i] != kv_indices[i - 1] + 1:
                    affine = False  # scattered pages fail at the first step: the scan is short
                    break
            if affine:
                first_slot[r] = kv_indices[start] * block_size
                any_affine = True
    return any_affine


def pack_items(items: np.ndarray, item_row: np.ndarray, item_qo_start: np.ndarray, item_qo_end: np.ndarray,
               item_kv_start: np.ndarray, item_kv_end: np.ndarray, item_partial: np.ndarray,
               merge_indptr: np.ndarray, merge_partials: np.ndarray, num_partial_rows: int, qo_indptr: np.ndarray,
               kv_indptr: np.ndarray, kv_lens: np.ndarray, mask_indptr: np.ndarray, first_slot: np.ndarray,
               rope_offsets: np.ndarray) -> None:
    """``items[w]`` <- the row of :data:`ITEM_FIELDS` of work item ``w``: its own fields, its merge's, its block
    row's; the padding after the fields is zero.

    Parameters
    ----------
    items : numpy.ndarray
        ``[W, ITEM_STRIDE]`` int32, written.
    item_row, item_qo_start, item_qo_end, item_kv_start, item_kv_end, item_partial : numpy.ndarray
        ``[W]``: the :class:`~bsrattn.scheduler.WorkPlan`'s item arrays.
    merge_indptr, merge_partials : numpy.ndarray
        ``[M+1]`` and ``[P]``: the work plan's merges.
    num_partial_rows : int
        The work plan's workspace rows.
    qo_indptr, kv_indptr : numpy.ndarray
        ``[R+1]``: the layout's.
    kv_lens : numpy.ndarray
        ``[R]``: the layout's.
    mask_indptr : numpy.ndarray
        ``[R+1]``: :func:`mask_starts` of the layout.
    first_slot : numpy.ndarray
        ``[R]``: :func:`first_slots` of the layout.
    rope_offsets : numpy.ndarray
        ``[R]``, or ``[0]`` for zeros: the position of each row's first slot for fused RoPE
        (``AttentionSpec.rope_frame``).
    """
    # The merge a split item's partial state belongs to, by the state's first workspace row.
    merge_of = np.full(max(num_partial_rows, 1), -1, np.int64)
    for m in range(merge_indptr.size - 1):
        for j in range(merge_indptr[m], merge_indptr[m + 1]):
            merge_of[merge_partials[j]] = m
    for w in range(item_row.size):
        r = item_row[w]
        partial = item_partial[w]
        merge = merge_of[partial] if partial >= 0 else -1
        items[w, _QO_START] = item_qo_start[w]
        items[w, _QO_END] = item_qo_end[w]
        items[w, _KV_START] = item_kv_start[w]
        items[w, _KV_END] = item_kv_end[w]
        items[w, _PARTIAL] = partial
        items[w, _MERGE] = merge
        items[w, _PARTS_LO] = merge_indptr[merge] if merge >= 0 else 0
        items[w, _PARTS_HI] = merge_indptr[merge + 1] if merge >= 0 else 0
        items[w, _QO_FIRST] = qo_indptr[r]
        items[w, _QO_LEN] = qo_indptr[r + 1] - qo_indptr[r]
        items[w, _KV_LEN] = kv_lens[r]
        items[w, _BLOCK_START] = kv_indptr[r]
        items[w, _FIRST_SLOT] = first_slot[r]
        items[w, _MASK_START] = mask_indptr[r]
        items[w, _ROW] = r
        items[w, _ROPE_OFFSET] = rope_offsets[r] if rope_offsets.size else 0
        for f in range(_NUM_FIELDS, ITEM_STRIDE):
            items[w, f] = 0


def _table(items, first_slot, item_row, item_qo_start, item_qo_end, item_kv_start, item_kv_end, item_partial,
           merge_indptr, merge_partials, num_partial_rows, qo_indptr, kv_indptr, kv_indices, kv_lens, mask_indptr,
           block_size, rope_offsets):
    first_slots(first_slot, kv_indptr, kv_indices, block_size)
    pack_items(items, item_row, item_qo_start, item_qo_end, item_kv_start, item_kv_end, item_partial, merge_indptr,
               merge_partials, num_partial_rows, qo_indptr, kv_indptr, kv_lens, mask_indptr, first_slot, rope_offsets)


_pack_table = Compiled(_table, first_slots, pack_items)


def mask_starts(layout: BSRLayout) -> np.ndarray:
    """``[R+1]`` int64: ``layout.mask_indptr``, or zeros without a custom mask (a long prefill's
    ``qo_len * kv_len`` may pass int32, and no kernel reads an offset then).

    Parameters
    ----------
    layout : BSRLayout
        The layout a plan is packed for.

    Returns
    -------
    numpy.ndarray
        The custom mask's row offsets, or zeros.

    Raises
    ------
    ValueError
        When the custom mask has more elements than an int32 offset can index.
    """
    if layout.custom_mask is None:
        return np.zeros(layout.num_rows + 1, dtype=np.int64)
    if layout.mask_indptr[-1] > INT32_MAX:
        raise ValueError(f"custom_mask has {layout.mask_indptr[-1]} elements; the GPU kernels index it with int32")
    return layout.mask_indptr


def item_table(work_plan: WorkPlan, layout: BSRLayout, rope_offsets: np.ndarray | None = None) -> np.ndarray:
    """The item rows of ``work_plan`` over ``layout``, in plan order.

    Parameters
    ----------
    work_plan : WorkPlan
        The plan to pack.
    layout : BSRLayout
        The layout the plan was made for.
    rope_offsets : numpy.ndarray, optional
        ``[R]``: fused RoPE's position of each row's first slot (``AttentionSpec.rope_frame``); None: 0.

    Returns
    -------
    numpy.ndarray
        ``[num_items, ITEM_STRIDE]`` int32, one row of :data:`ITEM_FIELDS` per item.

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn.items import ITEM, item_table
    >>> layout = ba.layouts.paged([1, 1], [[4, 5], [2, 0]], [20, 17], page_size=16, num_pages=6)
    >>> rows = item_table(ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=1), layout)
    >>> rows[:, ITEM["first_slot"]].tolist()   # row 0's pages 4, 5 are consecutive; row 1's 2, 0 are not
    [64, -1]
    >>> rows[:, ITEM["kv_len"]].tolist()
    [20, 17]
    """
    wp = work_plan
    items = np.empty((wp.num_items, ITEM_STRIDE), dtype=np.int32)
    _pack_table(items, np.empty(layout.num_rows, dtype=np.int64), wp.item_row, wp.item_qo_start, wp.item_qo_end,
                wp.item_kv_start, wp.item_kv_end, wp.item_partial, wp.merge_indptr, wp.merge_partials,
                wp.num_partial_rows, layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_lens,
                mask_starts(layout), layout.block_size,
                np.zeros(0, np.int64) if rope_offsets is None else np.asarray(rope_offsets, dtype=np.int64))
    return items
