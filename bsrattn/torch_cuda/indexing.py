"""The shared index helpers of :mod:`bsrattn.indexing`, re-decorated as Triton device functions.

The source is written once (minitorch's habit); here each function is compiled by ``triton.jit``. The
Triton interpreter finds ``triton.language`` through a function's globals, which the shared module does not
import (it must stay free of GPU packages), so each function is rebuilt over its own globals plus ``tl``.
The offsets of an item row's fields (:data:`bsrattn.items.ITEM`) are here too, as compile-time constants.
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
