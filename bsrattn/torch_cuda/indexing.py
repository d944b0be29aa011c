"""The shared index helpers of :mod:`bsrattn.indexing`, re-decorated as Triton device functions.

The source is written once (minitorch's habit); here each function is compiled by ``triton.jit``. The
Triton interpreter finds ``triton.language`` through a function's globals, which the shared module does not
import (it must stay free of GPU packages), so each function is rebuilt over its own globals plus ``tl``.
The offsets of an item row's fields (:data:`bsrattn.items.ITEM`) are here too, as compile-time constants, and
:func:`load_item`, the item-row loads both attention kernels start with.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl

from bsrattn import indexing as _shared
from bsrattn.items import ITEM, ITEM_STRIDE


def _device_function(fn):
    scope = dict(fn.__globals__, tl=tl)
    return triton.jit(types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__))


ceil_div = _device_function(_shared.ceil_div)
query_position = _device_function(_shared.query_position)
key_visible = _device_function(_shared.key_visible)
mask_offset = _device_function(_shared.mask_offset)
tile_query = _device_function(_shared.tile_query)
tile_head = _device_function(_shared.tile_head)

# Offsets of the item-row fields (bsrattn.items.ITEM_FIELDS), as compile-time constants of the kernels.
_STRIDE = tl.constexpr(ITEM_STRIDE)
_QO_START, _QO_END = tl.constexpr(ITEM["qo_start"]), tl.constexpr(ITEM["qo_end"])
_KV_START, _KV_END = tl.constexpr(ITEM["kv_start"]), tl.constexpr(ITEM["kv_end"])
_PARTIAL, _MERGE = tl.constexpr(ITEM["partial"]), tl.constexpr(ITEM["merge"])
_PARTS_LO, _PARTS_HI = tl.constexpr(ITEM["parts_lo"]), tl.constexpr(ITEM["parts_hi"])
_QO_FIRST, _QO_LEN, _KV_LEN = tl.constexpr(ITEM["qo_first"]), tl.constexpr(ITEM["qo_len"]), tl.constexpr(ITEM["kv_len"])
_BLOCK_START, _FIRST_SLOT = tl.constexpr(ITEM["block_start"]), tl.constexpr(ITEM["first_slot"])
_MASK_START, _ROPE_OFFSET = tl.constexpr(ITEM["mask_start"]), tl.constexpr(ITEM["rope_offset"])


@triton.jit
def load_item(item, MERGES: tl.constexpr):  # item: the first element of an item row [ITEM_STRIDE] i32
    """``(qo_start, qo_end, kv_start, kv_end, partial, merge, qo_first, qo_len, kv_len, block_start, first_slot)``:
    the fields of an item row a program reads before its KV loop (one 64-byte row, one round trip to memory);
    ``partial`` and ``merge`` only with ``MERGES``, else -1 (a kernel that needs them after its KV loop alone loads
    them there). The fields only some launches read (a custom mask's, fused RoPE's) each kernel loads itself."""
    qo_start = tl.load(item + _QO_START)
    qo_end = tl.load(item + _QO_END)
    kv_start = tl.load(item + _KV_START)
    kv_end = tl.load(item + _KV_END)
    partial = -1
    merge = -1
    if MERGES:
        partial = tl.load(item + _PARTIAL)
        merge = tl.load(item + _MERGE)
    return (qo_start, qo_end, kv_start, kv_end, partial, merge, tl.load(item + _QO_FIRST), tl.load(item + _QO_LEN),
            tl.load(item + _KV_LEN), tl.load(item + _BLOCK_START), tl.load(item + _FIRST_SLOT))
