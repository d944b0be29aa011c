"""The load module, as Triton device functions: a KV tile of ``BLOCK_N`` slots gathered from blocks of ``Bc``.

Storage granularity is decoupled from compute granularity (the paper's point): the kernel's KV tile is a
fixed ``BLOCK_N`` slots whatever the block size ``Bc`` of the layout (1 for ragged and vector-sparse, 16
for a paged cache, anything else), because each slot's address is computed on its own, through the BSR
indices (the sparse path) or by an affine formula (the affine path, for rows whose blocks are consecutive,
chosen per row at run time).
The head dimension stays contiguous and gives the coalescing, so both paths issue the same wide loads,
which Triton pipelines into shared memory ahead of the ``tl.dot`` that consumes them.

Storage views (see :meth:`bsrattn.validation.AttentionSpec.kv_view_of`) reach the kernel as four strides each
of ``k`` and ``v``, never as copies (``v`` may be a view into ``k``'s rows: multi-head latent attention's value,
the key's first ``head_dim_vo`` elements): pool slot ``block * Bc + within`` of KV head ``h``, element ``d`` sits at
``block * stride_block + within * stride_slot + h * stride_head + d * stride_dim``:

| view | shape | stride_block, stride_slot, stride_head |
|---|---|---|
| NHD | ``[num_blocks, Bc, Hkv, D]`` | ``s0, s1, s2`` |
| HND | ``[num_blocks, Hkv, Bc, D]`` | ``s0, s2, s1`` |
| NHD3 (Bc = 1) | ``[N, Hkv, D]`` | ``s0, 0, s1`` |

Must match :mod:`bsrattn.reference.gather` (``row_slots`` + ``gather``; fp8 KV dequantised on load, its
scale folded into the score scale and the output by the microkernel).
"""

from __future__ import annotations

import triton
import triton.language as tl


def kv_strides(x, view: str) -> tuple:
    """``(stride_block, stride_slot, stride_head, stride_dim)`` of ``k`` or ``v`` stored as ``view``."""
    s = x.stride()
    if view == "NHD3":
        return s[0], 0, s[1], s[2]
    return (s[0], s[2], s[1], s[3]) if view == "HND" else (s[0], s[1], s[2], s[3])


def block_size_constexpr(block_size: int) -> int:
    """The kernel's compile-time ``BLOCK_SIZE`` for a layout of ``block_size``: itself when a power of two (the
    slot arithmetic is then shifts and masks), else 0, which reads the runtime ``block_size`` instead, so that a
    cache whose block is a whole request (transformers' ``[B, Hkv, S, D]``, ``S`` growing every step) does not
    compile a kernel per length."""
    return block_size if block_size & (block_size - 1) == 0 else 0


@triton.jit
def _split(slot, block_size, BLOCK_SIZE: tl.constexpr):
    """``(slot // Bc, slot % Bc)``, ``Bc`` the compile-time ``BLOCK_SIZE`` or, when it is 0, ``block_size``."""
    if BLOCK_SIZE == 0:
        return slot // block_size, slot % block_size
    return slot // BLOCK_SIZE, slot % BLOCK_SIZE


@triton.jit
def tile_blocks(kv_indices, row_block_start, row_first_slot, start, kv_end, block_size,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, AFFINE_ROWS: tl.constexpr):
    """``[BLOCK_N]`` block ids of a row's logical KV slots ``start + arange(BLOCK_N)`` (0 past ``kv_end``).

    ``kv_indices[row_block_start + i // Bc]`` (:func:`bsrattn.indexing.sparse_slot`). When ``AFFINE_ROWS``, a
    row with ``row_first_slot >= 0`` (its blocks are consecutive) needs no ids: the load is predicated off.
    """
    i = start + tl.arange(0, BLOCK_N)
    end = kv_end
    if AFFINE_ROWS:
        end = tl.where(row_first_slot < 0, kv_end, 0)
    return tl.load(kv_indices + row_block_start + _split(i, block_size, BLOCK_SIZE)[0], mask=i < end, other=0)


@triton.jit
def slot_offsets(blocks, row_first_slot, i,  # blocks, i: [BLOCK_N]
                 stride_block, stride_slot, block_size, BLOCK_SIZE: tl.constexpr, AFFINE_ROWS: tl.constexpr):
    """``[BLOCK_N]`` int64 element offsets of logical KV slots ``i`` of a row (before the head and dim terms).

    Sparse path: pool slot ``blocks * Bc + i % Bc``, ``blocks`` from :func:`tile_blocks`. Affine path (only
    when ``AFFINE_ROWS``), for a row whose blocks are consecutive (``row_first_slot >= 0``): pool slot
    ``row_first_slot + i`` (:func:`bsrattn.indexing.affine_slot`). The choice is per row, at run time.
    """
    block = blocks
    within = _split(i, block_size, BLOCK_SIZE)[1]
    if AFFINE_ROWS:
        affine = row_first_slot >= 0
        affine_block, affine_within = _split(row_first_slot + i, block_size, BLOCK_SIZE)
        block = tl.where(affine, affine_block, block)
        within = tl.where(affine, affine_within, within)
    return block.to(tl.int64) * stride_block + within.to(tl.int64) * stride_slot


@triton.jit
def load_tile(head_ptr, offsets, valid, d, stride_dim, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              dtype: tl.constexpr, MASKED: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` rows at ``offsets`` from ``head_ptr`` (the KV head's base), cast to ``dtype``.

    Padding (slots past the range when ``MASKED``, dims past ``HEAD_DIM``) loads as 0; an unmasked tile of a
    power-of-two head_dim loads with no predicate at all. The cast is fp8 dequantisation for fp8 KV (exact:
    every e4m3 and e5m2 value is a float16 and a bfloat16) and a no-op otherwise.
    """
    ptrs = head_ptr + offsets[:, None] + d[None, :] * stride_dim
    if MASKED:
        x = tl.load(ptrs, mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D == HEAD_DIM:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
    return x.to(dtype)
