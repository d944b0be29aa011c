"""Deterministic mode, over the core's one pass per item: an item's KV cut on a fixed chunk grid, folded in KV order.

A launch with ``LaunchConfig.split_size`` (``AttentionSpec.split_size``) computes every item chunk by chunk of a
chunk grid fixed at absolute positions, ``split_size`` slots from the row's first, and folds the chunks' states into
the item's left to right (:func:`chunk_grid`, :func:`fold_chunk`): the states and the order of a plan that cuts the
row at every grid point, whose merge folds them with the same ⊕. So a row's bits do not depend on how the batch
around it was planned, and only the cuts the batch needs write partial states. The rest of the mode acts where it
must: the running sum as ``p @ 1`` on the tensor cores and the interpreter's ordered dots
(:mod:`~bsrattn.torch_cuda.microkernel`, ``DETERMINISTIC``), no FMA fusion (the launch options), and a plan whose
rows' first items cover the normal plan's chunk rounded onto the chunk grid (``scheduler.plan``'s ``lead_items``).
``LaunchConfig.split_size`` says why each is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from bsrattn.torch_cuda.indexing import ceil_div
from bsrattn.torch_cuda.merge import merge_pair


@triton.jit
def chunk_grid(lo, hi, kv_start, SPLIT_SIZE: tl.constexpr):
    """``(first, step, count)`` of the chunk grid's chunks that cover slots ``lo:hi`` of a row starting at ``kv_start``:
    from the chunk holding ``lo``, ``SPLIT_SIZE`` slots each."""
    first = kv_start + (lo - kv_start) // SPLIT_SIZE * SPLIT_SIZE
    return first, SPLIT_SIZE, ceil_div(hi - first, SPLIT_SIZE)


@triton.jit
def fold_chunk(o, lse, o_c, lse_c, SIGMOID: tl.constexpr):  # o, o_c [BLOCK_M, BLOCK_D] f32; lse, lse_c [BLOCK_M]
    """The item's state after its next chunk's, ``(o, lse) ⊕ (o_c, lse_c)``; FlashSigmoid's sum."""
    if SIGMOID:
        return o + o_c, lse
    return merge_pair(o, lse, o_c, lse_c)
