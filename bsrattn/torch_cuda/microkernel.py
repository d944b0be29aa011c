"""The dense microkernel, as Triton device functions: FlashAttention's online softmax over gathered KV tiles.

Must match :mod:`bsrattn.reference.microkernel` (``rope``, ``scores``, ``attend``, ``attend_range``). What differs:

- Tiling: ``q`` is a ``[BLOCK_M, BLOCK_D]`` tile whose rows are (query row, head of the GQA group) pairs, so
  one K/V tile serves the whole group; keys arrive ``BLOCK_N`` at a time and the softmax is online
  (running max ``m``, running sum ``l``, rescaled accumulator), in base 2 (``exp2``) with the scale
  pre-multiplied by ``log2(e)``. LSE comes out in natural log.
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
number of rows around it (on an AVX-512 host, 1400 of 1600 row slices of float32 products of tile shapes differed
from the same rows of a taller product), where the tensor cores' dots do not (``LaunchConfig.deterministic``)."""


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
           SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr,
           DETERMINISTIC: tl.constexpr = False):
    """``[BLOCK_M, BLOCK_N]`` transformed scores times ``log2(e)`` (reference ``scores``, base 2).

    ``s = qk_scale * q.k``; soft cap ``cap * tanh(s / cap)``; ALiBi ``+ slope * (k_pos - q_pos)``. With ``ROPE``,
    ``q``/``k`` are the turned first halves and ``q2``/``k2`` the second (:func:`rope_turn`), and ``q.k`` is the
    sum of the two halves' products.
    """
    s = dot(q, tl.trans(k), PRECISION, DETERMINISTIC)
    if ROPE:
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
def softmax_update(acc, m_i, l_i, s, vis, v,  # acc [BLOCK_M, D] f32; m_i, l_i [BLOCK_M]; s, vis [M, N]; v [N, D]
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
def drop_hidden(v, vis, bad):  # v [BLOCK_N, D]; vis [BLOCK_M, BLOCK_N]; bad [BLOCK_M] f32
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
    """``(o [BLOCK_M, D], lse [BLOCK_M])``: normalised output and natural-log LSE; an empty row gives 0 and -inf.

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


@triton.jit
def attend_tile(acc, m_i, l_i, bad, start, blocks, q, q2, q_pos, q_local, valid_m, slopes, rope_freq, rope_offset,
                k_head, v_head, row_first_slot, block_size, kv_end, kv_len, mask_ptr, mask_start,
                stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                qk_scale, soft_cap, window_left, sigmoid_bias,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, DENSE_ROWS: tl.constexpr, MASKED: tl.constexpr, DROP_HIDDEN: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
                SIGMOID: tl.constexpr, ROPE: tl.constexpr, CUSTOM_MASK: tl.constexpr, PRECISION: tl.constexpr,
                DETERMINISTIC: tl.constexpr):
    """The running state after the KV tile of slots ``start:start+BLOCK_N`` (``blocks``: its block ids, sparse path).

    An unmasked tile (``MASKED`` false) is one the caller knows to lie inside the range and to be visible
    whole to every query of the tile: no bounds, no position or custom mask are evaluated for it. A masked
    tile with ``DROP_HIDDEN`` drops the hidden keys' non-finite values (:func:`drop_hidden`). With ``ROPE`` the
    K tile is loaded in halves and turned at its slots' positions plus ``rope_offset`` (``q``, ``q2``: the turned
    query halves).
    """
    d = tl.arange(0, BLOCK_D)
    k_pos = start + tl.arange(0, BLOCK_N)
    valid_n = k_pos < kv_end
    k_off = gather.slot_offsets(blocks, row_first_slot, k_pos, stride_kb, stride_ks, block_size, BLOCK_SIZE,
                                DENSE_ROWS)
    if ROPE:
        half = tl.arange(0, BLOCK_H)
        k, k2 = rope_turn(
            gather.load_tile(k_head, k_off, valid_n, half, stride_kd, HEAD_DIM // 2, BLOCK_H, q.dtype, MASKED),
            gather.load_tile(k_head + HEAD_DIM // 2 * stride_kd, k_off, valid_n, half, stride_kd, HEAD_DIM // 2,
                             BLOCK_H, q.dtype, MASKED),
            k_pos + rope_offset, rope_freq, q.dtype)
    else:
        k = gather.load_tile(k_head, k_off, valid_n, d, stride_kd, HEAD_DIM, BLOCK_D, q.dtype, MASKED)
        k2 = k
    s = scores(q, k, q2, k2, q_pos, k_pos, slopes, qk_scale, soft_cap, SOFT_CAP, ALIBI, ROPE, PRECISION, DETERMINISTIC)
    vis = valid_n[None, :]
    if MASKED:
        vis = visible(q_pos, k_pos, valid_m, valid_n, q_local, kv_len, window_left, mask_ptr, mask_start,
                      CAUSAL, HAS_WINDOW, CUSTOM_MASK)
    v_off = gather.slot_offsets(blocks, row_first_slot, k_pos, stride_vb, stride_vs, block_size, BLOCK_SIZE,
                                DENSE_ROWS)
    v = gather.load_tile(v_head, v_off, valid_n, d, stride_vd, HEAD_DIM, BLOCK_D, q.dtype, MASKED)
    if MASKED and DROP_HIDDEN:
        v, bad = drop_hidden(v, vis, bad)
    if SIGMOID:
        acc = sigmoid_update(acc, s, vis, sigmoid_bias, v, MASKED, PRECISION)
    else:
        acc, m_i, l_i = softmax_update(acc, m_i, l_i, s, vis, v, MASKED, PRECISION, DETERMINISTIC)
    return acc, m_i, l_i, bad


@triton.jit
def attend_range(q, q2, q_pos, q_local, valid_m, slopes, rope_freq, rope_offset,  # q [BLOCK_M, BLOCK_D]; q_pos [M]
                 k_head, v_head, kv_indices, row_block_start, row_first_slot, block_size, kv_start, kv_end, kv_len,
                 mask_ptr, mask_start,
                 stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                 qk_scale, v_scale, soft_cap, window_left, sigmoid_bias,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, DENSE_ROWS: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, SIGMOID: tl.constexpr,
                 ROPE: tl.constexpr, CUSTOM_MASK: tl.constexpr, PRECISION: tl.constexpr, DETERMINISTIC: tl.constexpr,
                 DROP_HIDDEN: tl.constexpr):
    """State of a query tile over the row's logical KV slots ``kv_start:kv_end`` (reference ``attend_range``).

    With ``ROPE``, ``q`` and ``q2`` are the tile's turned query halves ``[BLOCK_M, BLOCK_H]`` (:func:`rope_turn`),
    ``rope_freq [BLOCK_H]`` the frequencies and ``rope_offset`` the position of the row's first slot; without,
    ``q`` is the tile and ``q2`` unused.

    ``DROP_HIDDEN`` drops hidden keys' non-finite values in the masked tiles (:func:`drop_hidden`): the
    executor's second launch does, for the tiles the first one found non-finite.

    ``k_head``/``v_head`` point at the KV head's first element; ``q_pos`` is non-decreasing along the tile;
    ``row_first_slot >= 0`` takes the dense load path when ``DENSE_ROWS`` (see :mod:`~bsrattn.torch_cuda.gather`).
    Under a causal mask (without a window or a custom mask), the whole tiles before the tile's first query
    position run without masks, as FlashAttention's do, and the rest of the range runs masked. Elsewhere every
    tile runs masked: the masks are then only the range's bounds, and a second loop would cost the kernel
    registers (measured: decode spills at 3 pipeline stages with it). Returns ``(o, lse)`` as :func:`finish`.
    """
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bad = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Sparse path: a tile's block ids are loaded one tile ahead, so no K/V copy waits on an index load of
    # its own iteration and the pipeliner keeps num_stages - 1 tiles in flight.
    blocks = gather.tile_blocks(kv_indices, row_block_start, row_first_slot, kv_start, kv_end, block_size, BLOCK_N,
                                BLOCK_SIZE, DENSE_ROWS)
    mid = kv_start
    if CAUSAL and not (HAS_WINDOW or CUSTOM_MASK):
        # Tiles wholly below the diagonal (before the tile's first query position) need no mask.
        mid = kv_start + tl.maximum(tl.minimum(kv_end, tl.min(q_pos, 0) + 1) - kv_start, 0) // BLOCK_N * BLOCK_N
        for start in range(kv_start, mid, BLOCK_N):
            ahead = gather.tile_blocks(kv_indices, row_block_start, row_first_slot, start + BLOCK_N, kv_end,
                                       block_size, BLOCK_N, BLOCK_SIZE, DENSE_ROWS)
            acc, m_i, l_i, bad = attend_tile(
                acc, m_i, l_i, bad, start, blocks, q, q2, q_pos, q_local, valid_m, slopes, rope_freq, rope_offset,
                k_head, v_head, row_first_slot, block_size, kv_end, kv_len, mask_ptr, mask_start, stride_kb,
                stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, qk_scale, soft_cap, window_left, sigmoid_bias,
                MASKED=False,
                DROP_HIDDEN=False,
                HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_H=BLOCK_H, BLOCK_SIZE=BLOCK_SIZE,
                DENSE_ROWS=DENSE_ROWS, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, SOFT_CAP=SOFT_CAP, ALIBI=ALIBI,
                SIGMOID=SIGMOID, ROPE=ROPE, CUSTOM_MASK=CUSTOM_MASK, PRECISION=PRECISION,
                DETERMINISTIC=DETERMINISTIC)
            blocks = ahead
    for start in range(mid, kv_end, BLOCK_N):
        ahead = gather.tile_blocks(kv_indices, row_block_start, row_first_slot, start + BLOCK_N, kv_end, block_size,
                                   BLOCK_N, BLOCK_SIZE, DENSE_ROWS)
        acc, m_i, l_i, bad = attend_tile(
            acc, m_i, l_i, bad, start, blocks, q, q2, q_pos, q_local, valid_m, slopes, rope_freq, rope_offset,
            k_head, v_head, row_first_slot, block_size, kv_end, kv_len, mask_ptr, mask_start, stride_kb, stride_ks,
            stride_kd, stride_vb, stride_vs, stride_vd, qk_scale, soft_cap, window_left, sigmoid_bias, MASKED=True,
            DROP_HIDDEN=DROP_HIDDEN,
            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_H=BLOCK_H, BLOCK_SIZE=BLOCK_SIZE,
            DENSE_ROWS=DENSE_ROWS, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, SOFT_CAP=SOFT_CAP, ALIBI=ALIBI,
            SIGMOID=SIGMOID, ROPE=ROPE, CUSTOM_MASK=CUSTOM_MASK, PRECISION=PRECISION,
            DETERMINISTIC=DETERMINISTIC)
        blocks = ahead
    return finish(acc, m_i, l_i, bad, v_scale, SIGMOID)


@triton.jit
def store_state(o_ptr, lse_ptr, rows, head, valid, d, o, lse,  # rows, head, valid [BLOCK_M]; o [BLOCK_M, BLOCK_D]
                stride_on, stride_oh, stride_od, stride_ln, stride_lh,
                HEAD_DIM: tl.constexpr, STORE_LSE: tl.constexpr):
    """``o`` and ``lse`` of a tile's rows written to query rows ``rows`` of heads ``head`` (``valid`` rows only)."""
    r = rows.to(tl.int64)
    tl.store(o_ptr + r[:, None] * stride_on + head[:, None] * stride_oh + d[None, :] * stride_od,
             o.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (d[None, :] < HEAD_DIM))
    if STORE_LSE:
        tl.store(lse_ptr + r * stride_ln + head * stride_lh, lse, mask=valid)
