"""The shared index helpers of :mod:`bsrattn.indexing`, re-decorated as Triton device functions.

The source is written once (minitorch's habit); here each function is compiled by ``triton.jit``. The
Triton interpreter finds ``triton.language`` through a function's globals, which the shared module does not
import (it must stay free of GPU packages), so each function is rebuilt over its own globals plus ``tl``.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl

from bsrattn import indexing as _shared


def _device_function(fn):
    scope = dict(fn.__globals__, tl=tl)
    return triton.jit(types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__))


query_position = _device_function(_shared.query_position)
key_visible = _device_function(_shared.key_visible)
mask_offset = _device_function(_shared.mask_offset)
tile_query = _device_function(_shared.tile_query)
tile_head = _device_function(_shared.tile_head)
