"""The dense microkernel, as Triton device functions: FlashAttention's online softmax over gathered KV tiles.

Must match :mod:`bsrattn.reference.microkernel` (``rope``, ``scores``, ``attend``, ``attend_range``). What differs:

- Tiling: ``q`` is a ``[BLOCK_M, BLOCK_D]`` tile whose rows are (query row, head of the GQA group) pairs, so
  one K/V tile serves the whole group; keys arrive ``BLOCK_N`` at a time and the softmax is online
  (running max ``m``, running sum ``l``, rescaled accumulator), in base 2 (``exp2``) with the scale
  pre-multiplied by ``log2(e)``. LSE comes out in natural log. ``v``, the accumulator and the output are
  ``BLOCK_DV`` wide, ``v``'s own head dimension (``head_dim_vo``: narrower than ``q`` and ``k`` for multi-head
  latent attention; ``BLOCK_D`` otherwise).
- Dtypes: ``q @ k^T`` and ``p @ v`` run in the input dtype with float32 accumulation (fp32 inputs use IEEE
  dots, never TF32); ``p`` is rounded to the input dtype before ``p @ v``. fp8 KV is cast to ``q``'s dtype
  on load; ``k_scale`` is folded into the score scale and ``v_scale`` into the output.
- Masks: position masks (causal, sliding window) use :func:`bsrattn.indexing.key_visible`, re-decorated.
- Numbers that are not numbers follow the reference's rules. ``p @ v`` cannot leave out a hidden pair (its
  weight 0 times a NaN ``v`` is NaN): where masks hide keys from some queries, a tile whose output has a
  non-finite row is computed again (by the executor's second launch) with ``v``'s non-finite values replaced
  by 0, each query recording whether a key it sees had one (``bad``, :func:`drop_hidden`). Elsewhere every
  loaded key is visible and the NaN or infinity reaches the accumulator by itself. A row with a non-finite
  accumulator, or marked ``bad``, is all NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from bsrattn.torch_cuda import gather
from bsrattn.torch_cuda.config import interpreting
from bsrattn.torch_cuda.indexing import key_visible, mask_offset

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
ORDERED_DOTS = tl.constexpr(interpreting())
"""Whether deterministic mode's dots are the products reduced over ``k`` (:func:`dot`): under the Triton
interpreter, whose ``tl.dot`` is NumPy's ``matmul``. A BLAS may round a row of a product differently with the
number of rows around it (most rows did, on an AVX-512 host: ``benchmarks/NOTES.md``), where the tensor cores' dots
do not (``LaunchConfig.split_size``)."""


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, DETERMINISTIC: tl.constexpr):  # a [M, K]; b [K, N]
    """``a @ b`` in float32: ``tl.dot``, or in deterministic mode under the interpreter the products reduced over
    ``k`` (:data:`ORDERED_DOTS`), one element at a time whatever the tile's rows, so that a row's bits do not depend
    on them there either."""
    if DETERMINISTIC and ORDERED_DOTS:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def tanh(x):
    """``tanh`` from ``exp2`` (saturates to +-1 for large ``|x|``), for the logits soft cap."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def rope_turn(lo, hi, pos, freq, dtype: tl.constexpr):  # lo, hi [R, BLOCK_H]; pos [R]; freq [BLOCK_H] f32
    """Fused RoPE (reference ``rope``): rows at positions ``pos``, given as their halves ``lo`` (dims ``[0, D/2)``)
    and ``hi`` (``[D/2, D)``), each pair turned by ``pos * freq``, in float32; the halves back in ``dtype``.

    ``tl.cos``/``tl.sin`` compile to libdevice's ``cosf``/``sinf`` (no ``.approx`` instruction), whose range
    reduction holds for the thousands of radians a long row's angles reach.
    """
    angle = pos.to(tl.float32)[:, None] * freq[None, :]
    c, s = tl.cos(angle), tl.sin(angle)
    lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    return (lo * c - hi * s).to(dtype), (hi * c + lo * s).to(dtype)


@triton.jit
def scores(q, k, q2, k2, q_pos, k_pos, slopes, qk_scale, soft_cap,  # q [BLOCK_M, D]; k [BLOCK_N, D]; slopes [M]
           SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, TWO_PARTS: tl.constexpr, PRECISION: tl.constexpr,
           DETERMINISTIC: tl.constexpr = False):
    """``[BLOCK_M, BLOCK_N]`` transformed scores times ``log2(e)`` (reference ``scores``, base 2).

    ``s = qk_scale * q.k``; soft cap ``cap * tanh(s / cap)``; ALiBi ``+ slope * (k_pos - q_pos)``. With
    ``TWO_PARTS``, ``q``/``k`` hold the first columns and ``q2``/``k2`` the rest, and ``q.k`` is the sum of the two
    parts' products: fused RoPE's turned halves (:func:`rope_turn`), or a key whose first columns are the value
    (:attr:`Tile.block_dr`).
    """
    s = dot(q, tl.trans(k), PRECISION, DETERMINISTIC)
    if TWO_PARTS:
        s += dot(q2, tl.trans(k2), PRECISION, DETERMINISTIC)
    if SOFT_CAP or ALIBI:
        s = s * qk_scale
        if SOFT_CAP:
            s = soft_cap * tanh(s / soft_cap)
        if ALIBI:
            s += slopes[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        s = s * LOG2E
    else:
        s = s * (qk_scale * LOG2E)
    return s


@triton.jit
def visible(q_pos, k_pos, valid_m, valid_n, q_local, kv_len, window_left, mask_ptr, mask_start,  # [BLOCK_M]/[BLOCK_N]
            CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, CUSTOM_MASK: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` bool: which (query, key) pairs count — in range, position masks, custom mask."""
    vis = valid_m[:, None] & valid_n[None, :]
    if CAUSAL or HAS_WINDOW:
        # `!= 0`: the interpreter can hand back key_visible's `tensor | python bool` as int32 data typed int1,
        # which a load mask rejects; compiled, the comparison folds away.
        if HAS_WINDOW:
            vis &= key_visible(q_pos[:, None], k_pos[None, :], CAUSAL, window_left) != 0
        else:
            vis &= key_visible(q_pos[:, None], k_pos[None, :], CAUSAL, -1) != 0
    if CUSTOM_MASK:
        bits = tl.load(mask_ptr + mask_offset(mask_start, kv_len, q_local[:, None], k_pos[None, :]), mask=vis, other=0)
        vis &= bits != 0
    return vis


@triton.jit
def softmax_update(acc, m_i, l_i, s, vis, v,  # acc [BLOCK_M, DV] f32; m_i, l_i [BLOCK_M]; s, vis [M, N]; v [N, DV]
                   MASKED: tl.constexpr, PRECISION: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """One online-softmax step over a KV tile: rescale the running state by the new max, add ``p @ v``.

    ``vis`` is ignored when not ``MASKED`` (a tile every query sees whole). ``DETERMINISTIC`` takes the
    running sum on the tensor cores, ``p @ 1`` over the weights ``p @ v`` uses, whose bits do not depend on how
    the tile is laid out over warps (``tl.sum``'s do; see ``LaunchConfig.deterministic``).
    """
    if MASKED:
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key keeps m = -inf; shifting by 0 instead keeps exp2 free of NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    weights = p.to(v.dtype)
    if DETERMINISTIC:
        # Every column of p @ 1 is the row's sum; their max is that sum exactly.
        ones = tl.full([s.shape[1], 16], 1.0, v.dtype)
        l_i = l_i * alpha + tl.max(dot(weights, ones, PRECISION, DETERMINISTIC), 1)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(weights, v, PRECISION, DETERMINISTIC)
    return acc, m_new, l_i


@triton.jit
def sigmoid_update(acc, s, vis, sigmoid_bias, v, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """FlashSigmoid over a KV tile: ``acc += sigmoid(s + bias) @ v`` (``s`` in base-2 units), no normalisation."""
    w = 1.0 / (1.0 + tl.exp2(-(s + sigmoid_bias * LOG2E)))
    if MASKED:
        w = tl.where(vis, w, 0.0)
    return acc + tl.dot(w.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def drop_hidden(v, vis, bad):  # v [BLOCK_N, DV]; vis [BLOCK_M, BLOCK_N]; bad [BLOCK_M] f32
    """``v`` with its NaNs and infinities replaced by 0, and ``bad`` marking the queries that see such a key.

    The tests are float sums (``x * 0`` is 0 for a finite ``x``, NaN otherwise), not reductions of booleans:
    the compiled kernel then folds no unrelated value into them.
    """
    finite = (v - v) == 0
    row_bad = tl.sum(v.to(tl.float32) * 0.0, 1) != 0.0
    bad += tl.sum(tl.where(vis & row_bad[None, :], 1.0, 0.0), 1)
    return tl.where(finite, v, tl.zeros_like(v)), bad


@triton.jit
def finish(acc, m_i, l_i, bad, v_scale, SIGMOID: tl.constexpr):
    """``(o [BLOCK_M, DV], lse [BLOCK_M])``: normalised output and natural-log LSE; an empty row gives 0 and -inf.

    ``l`` is NaN when a visible score was NaN or ``+inf``: such a row is NaN, never empty. A row whose
    accumulator holds a NaN or an infinity, or that ``bad`` marks, is all NaN: its scale is NaN.
    """
    has_keys = l_i != 0.0
    row_bad = (bad != 0.0) | (tl.sum(acc * 0.0, 1) != 0.0)
    scale = tl.where(row_bad, float("nan"), v_scale)
    if SIGMOID:
        return acc * scale[:, None], m_i
    o = tl.where(has_keys[:, None], acc * (scale / tl.where(has_keys, l_i, 1.0))[:, None], 0.0)
    return o, tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))


class QueryTile(NamedTuple):
    """A query tile as the KV loop reads it: rows are (query row, head of the GQA group) pairs."""

    q: object  # [BLOCK_M, BLOCK_D]; with fused RoPE the turned first halves [BLOCK_M, BLOCK_H] (rope_turn)
    q2: object  # fused RoPE: the turned second halves; a key in two parts (Tile.block_dr): the rest; else q, unused
    pos: object  # [BLOCK_M] positions, non-decreasing along the tile
    local: object  # [BLOCK_M] query rows within the block row (a custom mask's rows)
    valid: object  # [BLOCK_M] rows in range
    slopes: object  # [BLOCK_M] f32 ALiBi slopes (zeros without ALiBi)


class KVRow(NamedTuple):
    """A block row's keys and values for one KV head: where their slots are, and what hides them."""

    k_head: object  # k's first element of the KV head (the storage view, gather.py)
    v_head: object  # v's, likewise
    k_strides: object  # (block, slot, head, dim) of k (gather.kv_strides)
    v_strides: object  # likewise for v
    kv_indices: object  # [nnz] i32 block ids
    block_start: object  # kv_indptr of the row: its first entry of kv_indices
    first_slot: object  # the affine path's first pool slot, or -1: the gathered path (gather.py)
    block_size: object  # Bc, read where Tile.block_size is 0 (gather.block_size_constexpr)
    kv_len: object  # the row's KV slots
    mask_ptr: object  # [mask elements] u8, the custom mask
    mask_start: object  # the row's first element of it
    window_left: object  # the sliding window (with Switches.has_window)
    rope_offset: object  # fused RoPE: the position of the row's first slot
    rope_freq: object  # fused RoPE: [BLOCK_H] f32 frequencies


class Tile(NamedTuple):
    """The compile-time shape of the tile loop: sizes, load path, dot precision."""

    head_dim: int  # of q and k
    head_dim_vo: int  # of v and the output
    block_m: int
    block_n: int
    block_d: int  # q's and k's tile
    block_dv: int  # v's and the accumulator's
    block_h: int  # fused RoPE's half tile
    block_size: int  # Bc when a power of two, else 0 (gather.block_size_constexpr)
    affine_rows: bool  # whether the affine load path is compiled in (gather.py)
    precision: str  # tl.dot's input precision
    block_dr: int = 0  # > 0: v is k's first head_dim_vo columns (block_d their tile), read once; the rest this wide


class Switches(NamedTuple):
    """The variant's compile-time switches."""

    causal: bool
    has_window: bool
    soft_cap: bool
    alibi: bool
    sigmoid: bool
    rope: bool
    custom_mask: bool


@triton.jit
def attend_tile(state, start, blocks, query, row, kv_end, scalars,  # state: (acc, m_i, l_i, bad); blocks [BLOCK_N]
                TILE: tl.constexpr, VARIANT: tl.constexpr, MASKED: tl.constexpr, DROP_HIDDEN: tl.constexpr,
                DETERMINISTIC: tl.constexpr):
    """The running state after the KV tile of slots ``start:start+BLOCK_N`` (``blocks``: its block ids, sparse path).

    ``state`` is ``(acc [BLOCK_M, BLOCK_DV], m_i, l_i, bad [BLOCK_M])``, ``query`` a :class:`QueryTile`, ``row`` a
    :class:`KVRow`, ``scalars`` the launch's :class:`~bsrattn.torch_cuda.config.Scalars`. An unmasked tile
    (``MASKED`` false) is one the caller knows to lie inside the range and to be visible whole to every query of the
    tile: no bounds, no position or custom mask are evaluated for it. A masked tile with ``DROP_HIDDEN`` drops the
    hidden keys' non-finite values (:func:`drop_hidden`). With fused RoPE the K tile is loaded in halves and turned
    at its slots' positions plus ``row.rope_offset`` (``query.q``, ``query.q2``: the turned query halves).
    """
    acc, m_i, l_i, bad = state
    q = query.q
    d = tl.arange(0, TILE.block_d)
    k_pos = start + tl.arange(0, TILE.block_n)
    valid_n = k_pos < kv_end
    k_off = gather.slot_offsets(blocks, row.first_slot, k_pos, row.k_strides[0], row.k_strides[1], row.block_size,
                                TILE.block_size, TILE.affine_rows)
    stride_kd = row.k_strides[3]
    if VARIANT.rope:
        half = tl.arange(0, TILE.block_h)
        k, k2 = rope_turn(
            gather.load_tile(row.k_head, k_off, valid_n, half, stride_kd, TILE.head_dim // 2, TILE.block_h, q.dtype,
                             MASKED),
            gather.load_tile(row.k_head + TILE.head_dim // 2 * stride_kd, k_off, valid_n, half, stride_kd,
                             TILE.head_dim // 2, TILE.block_h, q.dtype, MASKED),
            k_pos + row.rope_offset, row.rope_freq, q.dtype)
    elif TILE.block_dr > 0:  # the key in two parts, the first of which is the value (query.q, query.q2 likewise)
        k = gather.load_tile(row.k_head, k_off, valid_n, d, stride_kd, TILE.head_dim_vo, TILE.block_d, q.dtype,
                             MASKED)
        k2 = gather.load_tile(row.k_head + TILE.head_dim_vo * stride_kd, k_off, valid_n, tl.arange(0, TILE.block_dr),
                              stride_kd, TILE.head_dim - TILE.head_dim_vo, TILE.block_dr, q.dtype, MASKED)
    else:
        k = gather.load_tile(row.k_head, k_off, valid_n, d, stride_kd, TILE.head_dim, TILE.block_d, q.dtype, MASKED)
        k2 = k
    s = scores(q, k, query.q2, k2, query.pos, k_pos, query.slopes, scalars.qk_scale, scalars.soft_cap,
               VARIANT.soft_cap, VARIANT.alibi, VARIANT.rope or TILE.block_dr > 0, TILE.precision, DETERMINISTIC)
    vis = valid_n[None, :]
    if MASKED:
        vis = visible(query.pos, k_pos, query.valid, valid_n, query.local, row.kv_len, row.window_left, row.mask_ptr,
                      row.mask_start, VARIANT.causal, VARIANT.has_window, VARIANT.custom_mask)
    if TILE.block_dr > 0:
        v = k
    else:
        v_off = gather.slot_offsets(blocks, row.first_slot, k_pos, row.v_strides[0], row.v_strides[1],
                                    row.block_size, TILE.block_size, TILE.affine_rows)
        v = gather.load_tile(row.v_head, v_off, valid_n, tl.arange(0, TILE.block_dv), row.v_strides[3],
                             TILE.head_dim_vo, TILE.block_dv, q.dtype, MASKED)
    if MASKED and DROP_HIDDEN:
        v, bad = drop_hidden(v, vis, bad)
    if VARIANT.sigmoid:
        acc = sigmoid_update(acc, s, vis, scalars.sigmoid_bias, v, MASKED, TILE.precision)
    else:
        acc, m_i, l_i = softmax_update(acc, m_i, l_i, s, vis, v, MASKED, TILE.precision, DETERMINISTIC)
    return acc, m_i, l_i, bad


@triton.jit
def _tiles(state, blocks, lo, hi, kv_end, query, row, scalars,  # state and blocks as attend_tile's
           TILE: tl.constexpr, VARIANT: tl.constexpr, MASKED: tl.constexpr, DROP_HIDDEN: tl.constexpr,
           DETERMINISTIC: tl.constexpr):
    """``(state, blocks)`` after the tiles from ``lo`` to ``hi`` of a range that ends at ``kv_end``: each tile's block
    ids are loaded a tile ahead, so no K/V copy waits on an index load of its own iteration and the pipeliner keeps
    ``num_stages - 1`` tiles in flight."""
    for start in range(lo, hi, TILE.block_n):
        ahead = gather.tile_blocks(row.kv_indices, row.block_start, row.first_slot, start + TILE.block_n, kv_end,
                                   row.block_size, TILE.block_n, TILE.block_size, TILE.affine_rows)
        state = attend_tile(state, start, blocks, query, row, kv_end, scalars, TILE, VARIANT, MASKED, DROP_HIDDEN,
                            DETERMINISTIC)
        blocks = ahead
    return state, blocks


@triton.jit
def attend_range(query, row, kv_start, kv_end, scalars,  # query: QueryTile; row: KVRow; scalars: config.Scalars
                 TILE: tl.constexpr, VARIANT: tl.constexpr, DETERMINISTIC: tl.constexpr, DROP_HIDDEN: tl.constexpr):
    """State of a query tile over the row's logical KV slots ``kv_start:kv_end`` (reference ``attend_range``).

    ``query`` is a :class:`QueryTile`, ``row`` a :class:`KVRow`; ``TILE`` (a :class:`Tile`) and ``VARIANT`` (a
    :class:`Switches`) are compile-time. ``DROP_HIDDEN`` drops hidden keys' non-finite values in the masked tiles
    (:func:`drop_hidden`): the executor's second launch does, for the tiles the first one found non-finite.

    ``row.first_slot >= 0`` takes the affine load path when ``TILE.affine_rows`` (see
    :mod:`~bsrattn.torch_cuda.gather`). Under a causal mask (without a window or a custom mask), the whole tiles
    before the tile's first query position run without masks, as FlashAttention's do, and the rest of the range runs
    masked. Elsewhere every tile runs masked: the masks are then only the range's bounds, and a second loop would
    cost the kernel registers (decode spills at 3 pipeline stages with it). Returns ``(o, lse)`` as :func:`finish`.
    """
    state = (tl.zeros([TILE.block_m, TILE.block_dv], dtype=tl.float32),
             tl.full([TILE.block_m], float("-inf"), dtype=tl.float32), tl.zeros([TILE.block_m], dtype=tl.float32),
             tl.zeros([TILE.block_m], dtype=tl.float32))
    blocks = gather.tile_blocks(row.kv_indices, row.block_start, row.first_slot, kv_start, kv_end, row.block_size,
                                TILE.block_n, TILE.block_size, TILE.affine_rows)
    mid = kv_start
    if VARIANT.causal and not (VARIANT.has_window or VARIANT.custom_mask):
        # Tiles wholly below the diagonal (before the tile's first query position) need no mask.
        mid = kv_start + tl.maximum(tl.minimum(kv_end, tl.min(query.pos, 0) + 1) - kv_start, 0) // TILE.block_n * \
            TILE.block_n
        state, blocks = _tiles(state, blocks, kv_start, mid, kv_end, query, row, scalars, TILE, VARIANT, False, False,
                               DETERMINISTIC)
    state, blocks = _tiles(state, blocks, mid, kv_end, kv_end, query, row, scalars, TILE, VARIANT, True, DROP_HIDDEN,
                           DETERMINISTIC)
    acc, m_i, l_i, bad = state
    return finish(acc, m_i, l_i, bad, scalars.v_scale, VARIANT.sigmoid)


@triton.jit
def store_state(o_ptr, lse_ptr, rows, head, valid, d, o, lse,  # rows, head, valid [BLOCK_M]; o [BLOCK_M, BLOCK_DV]
                o_strides, lse_strides,  # (row, head, dim) of o_ptr's rows; (row, head) of lse_ptr's
                HEAD_DIM: tl.constexpr, STORE_LSE: tl.constexpr):
    """``o`` and ``lse`` of a tile's rows written to query rows ``rows`` of heads ``head`` (``valid`` rows only);
    ``HEAD_DIM`` is the output's width, ``v``'s head dimension, and ``d`` its tile's columns."""
    r = rows.to(tl.int64)
    tl.store(o_ptr + r[:, None] * o_strides[0] + head[:, None] * o_strides[1] + d[None, :] * o_strides[2],
             o.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (d[None, :] < HEAD_DIM))
    if STORE_LSE:
        tl.store(lse_ptr + r * lse_strides[0] + head * lse_strides[1], lse, mask=valid)
