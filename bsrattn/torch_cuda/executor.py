"""A :class:`~bsrattn.scheduler.WorkPlan` executed by one persistent Triton kernel, merge folded in.

Must match :func:`bsrattn.reference.executor.execute`. The launch is a fixed grid ``(num_ctas,
num_kv_heads)``: program ``(c, h)`` walks CTA ``c``'s items in plan order for KV head ``h``. For each item:

1. **GQA head-group fusion.** The tile's M dimension packs the item's query rows x the ``G`` query heads of
   KV head ``h`` (row ``m`` is query row ``qo_start + m // G``, head ``h * G + m % G``), so each K/V byte
   is read once per KV head, not once per query head. Items with more rows than ``BLOCK_M`` loop over
   M sub-tiles.
2. **Block skipping.** Causal masking ends the KV loop after the tile's last query position, a sliding
   window starts it at the first query position minus ``window_left``; tiles outside are never loaded.
3. The microkernel (:func:`~bsrattn.torch_cuda.microkernel.attend_range`) over the item's KV range. With fused
   RoPE the tile's queries are loaded in two halves (dims ``[0, D/2)`` and ``[D/2, D)``) and turned once per
   tile (:func:`~bsrattn.torch_cuda.microkernel.rope_turn`) at their positions in the plan's ``rope_q``
   section, and every K tile at its slots' positions plus the item's ``rope_offset`` (a Cascade's later levels).
4. An unsplit item writes the output and LSE (with ``PRIOR``, an earlier Cascade level's state folded in first,
   as into a merge's output). A split item writes its partial state to its fixed
   workspace rows, then bumps its tile's integer counter (acquire-release, GPU scope); the program whose
   bump completes the count is the last to finish, and it folds the tile's partial states **in the plan's
   order** (:func:`~bsrattn.torch_cuda.merge.fold_partials`) into the output. Which program merges depends
   on timing; what it computes does not, so the result is bitwise deterministic, with no floating-point
   atomics and no second launch for the merge. The merging program sets the counter back to zero, and the
   ``REDO`` launch (5.) each flag it reads, so every launch leaves ``sync`` as it found it: zero, as allocated.
   (Cleared by a kernel of its own before every launch, it cost a small decode 1.3-1.6 us of GPU time in a
   graph and 12 us of host time eagerly, on the H200.) A launch is never interrupted part-way while the
   process can still launch: the one way to stop between passes, an exception in Python, clears ``sync`` in
   stream order (:class:`Launch`).
5. **Hidden keys' NaNs.** Under masks that hide keys from some queries (causal, window, custom mask), a
   hidden key's NaN or infinity would reach ``p @ v`` as ``0 * NaN``. Dropping such values in every masked
   tile puts ``v`` through registers and cost 44% at prefill (W3 16 x 1024 on the H200, NOTES.md); an
   inlined second pass, never run on finite inputs, still cost 17-20%. So the launch only flags each item (or merge)
   whose output came out non-finite, and a second launch of the same kernel (``REDO``) computes just the
   flagged ones again, dropping hidden values (``DROP_HIDDEN``), and merges again the merges they belong to.
   On finite inputs the second launch reads one flag per item and stops.

Eager calls launch through a :class:`Launch`, which keeps the kernel Triton compiled for each kind of launch and
hands its launcher the arguments directly; ``torch.compile``'d calls go through the custom op and
:func:`launch`. No program waits for another, so the grid needs no co-residency. Everything that changes between plans
is read from device buffers (:mod:`~bsrattn.torch_cuda.plan_buffers`), so a CUDA graph captured around a
launch replays correctly after the buffers are refilled.

How the kernel got here (H200, graph mode; ``benchmarks/NOTES.md`` has each step's prediction and the sweeps).
Decode: W1 Quest 32k at 64 / 512 pages a head; prefill: W3 bf16 causal 16 x 1024 / 1 x 8192, in us:

1. ``379c24e`` persistent kernel over the plan's items, merge folded in (last arrival folds): decode 48.0 /
   78.4 us.
2. ``4e29cf4`` decode chunks of whole KV tiles, at least 256 slots, 2 stages: 21.1 / 60.3 us; prefill 128 x 64
   tiles, 8 warps, every tile masked: 860 / 2115 us.
3. ``2ce0eb8`` one 64-byte item row per item: 20.5 / 61.6 us.
4. ``967968f`` KV tiles every query of the tile sees run without masks: prefill 589 / 1469 us.
5. ``10a010b`` block ids loaded a tile ahead (the sparse path had one tile in flight), one load path chosen per
   row, 3 stages, 8 warps for plans with fewer busy programs than SMs, 4 CTAs per SM at prefill: decode 18.2 /
   57.1 us, prefill 578 / 1480 us (238 / 372 TF/s).
6. ``5cb738d`` hidden keys' non-finite values dropped in every masked tile: prefill 836 / 1773 us; ``e5321cd``
   only in an inlined second pass over a tile that came out non-finite: 692 / 1742 us.
7. ``91dab24`` the second pass as a second launch of this kernel (``REDO``) over the flagged items
   only: prefill 646 / 1584 us (213 / 347 TF/s); decode 17.3-17.7 us at W2 1 x 1024. ``824d743`` planned a
   small decode batch for one 8-warp CTA per SM (W2 1 x 16384 55 -> 42 us) and was backed out (``75896a1``): it
   made the grid, which a CUDA graph records, depend on the batch.
8. A small decode batch balanced over one CTA per SM inside the usual grid (``scheduler.plan``'s
   ``busy_ctas``), the other CTAs empty, 8 warps: W4 batch 1 55.2 -> 40.9 us, W1 budget 512 59.8 -> 57.4 us.
9. A plan that splits no row runs the kernel without merges (``MERGES``, ``LaunchConfig.merges``), and a
   prefill with as many query tiles as CTAs splits no row: the prefill tile's 255 registers and 80 bytes of
   stack become 252 and none on sm_90 (the merge's fold was the high-water mark): prefill 643 -> 609 /
   1560 -> 1478 us (16 x 1024 / 1 x 8192, one lease).

10. ``73425e7`` deterministic mode (``DETERMINISTIC``): the running sum as ``p @ 1`` on the tensor cores and no
    FMA fusion, so a row's bits do not depend on its tile; the normal tiles kept. W4 (fp16 decode, KV ~
    U(4k, 16k)) 1.01x the normal call at batch 1, 1.26-1.32x from batch 8: the grid's partial states (a
    fixed 64-row tile for every plan, tried first, cost 1.4-2x).
11. ``67008a7``-``2776a14`` deterministic items of several chunks of the grid, each chunk's state folded into
    the item's in registers (``GRID``), so only the cuts the batch needs write partial states; a row's first
    item covers the normal plan's chunk rounded onto the grid, the rest one chunk each (an exact left fold).
    W4 1.09x / 1.10x / 1.03x / 1.08x the normal call at batch 1 / 8 / 32 / 256 with every item several
    chunks (``bb2f3d6``, whose merge regrouped the fold); the shipped plan 1.10x / 1.21x / 1.04x / 1.06-1.15x
    (``5b2fd14``). W3 1.19-1.29x. Tried: the fold inside the tile loops, pipelined across a chunk's end: the
    decode tile spills (255 registers + 208 bytes), 1.04x / 1.33x / 1.26x / 1.07x. At batch 256 the cost is the
    restart at each chunk: with one chunk a row the same kernel runs at the normal call's speed.

12. ``536d2e9`` plans that split no row, with at most a causal mask and a soft cap, run the item kernel of
    :mod:`~bsrattn.torch_cuda.prefill` instead (one program per item; tensor descriptors for the dense rows of
    long plans): prefill 551 / 1290 us (250 / 426 TF/s); this kernel's ``REDO`` launch still serves them.

13. ``a959952`` the merge counters and flags set back to zero by the launch that used them, not by a clearing
    kernel before every launch (one graph node fewer): decode W1 budget 64 / 512 19.8 -> 18.4 / 57.1 -> 55.5 us,
    W2 1 x 1024 17.4 -> 16.1 us (one lease).

14. ``2624976`` decode tiles of more than 16 rows (a cascade's shared-prefix level: a batch's queries in one
    block row) planned on two CTAs per SM, not balanced over one as a few 16-row decodes are (8.): W5's prefix
    level over 32k keys for 64 queries 236 -> 182 us, over 8k 74 -> 76 us.

15. Decode plans of tiles taller than 16 rows, or whose CTAs would each run two or more items of at most 256
    KV slots on average, run the item kernel with this kernel's merges (``config.decode_on_items``): one
    program per item, the last of a merge's items to land folds its partial states. One level alone, persistent
    -> item kernel: W5's suffix level (8 items of 256 slots a CTA) 111.2 -> 50.7 us, its prefix level over 8k /
    32k keys 76.2 -> 67.8 / 181.1 -> 163.3 us. The item kernel loses on long items (W2 1 x 16384 42.4 against
    52.5 us, 64 x 4096 273.9 against 330.0), which stay here.

16. ``4ac8e4f`` a Cascade's last level folds the levels before it into every row it writes out (``PRIOR``:
    :func:`~bsrattn.torch_cuda.merge.fold_prior` before an unsplit item's store and a merge's, here and in the
    item kernel), in place of a merge launch and a copy after the levels. Prediction: the merge's 6.6 us of W5.
    Measured in the suite (W5, whole cascade): 53.7 / 147.0 / 244.5 -> 51.1 / 146.9 / 243.8 us at 1k x 16 /
    8k x 64 / 32k x 64; 2.6 us at the smallest, within a run's spread at the others.

Fused RoPE (``330c3c6``, ``3d9e593``) costs 3-4x at both shapes (W10: its angles are computed per K element
per query tile).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import replace
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from bsrattn.torch_cuda import microkernel, prefill
from bsrattn.torch_cuda.config import interpreter_turn, interpreting
from bsrattn.torch_cuda.gather import block_size_constexpr, kv_strides
from bsrattn.torch_cuda.indexing import _BLOCK_START, _FIRST_SLOT, _KV_END, _KV_LEN, _KV_START, _MASK_START, _MERGE, \
    _PARTIAL, _PARTS_HI, _PARTS_LO, _QO_END, _QO_FIRST, _QO_LEN, _QO_START, _ROPE_OFFSET, _STRIDE, query_position, \
    tile_head, tile_query
from bsrattn.torch_cuda.merge import fold_partials, fold_prior, last_to_arrive, merge_pair
from bsrattn.torch_cuda.microkernel import store_state


@triton.jit
def persistent_attention(
        # The call's tensors and scalars (call_args) ...
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,  # q, out [nnz_qo, Hq, D]; k, v: storage view; lse [nnz_qo, Hq]
        prior_o, prior_lse,  # PRIOR: an earlier level's state, folded into every output row (merge.fold_prior)
        stride_qn, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_on, stride_oh, stride_od,
        stride_ln, stride_lh, block_size,  # block_size: read where the BLOCK_SIZE constexpr is 0 (gather.py)
        qk_scale, v_scale, soft_cap, sigmoid_bias,
        # ... then what the plan's buffers and the configuration fix (plan_args).
        part_o, part_lse, sync,  # [partial_rows, Hq, D] f32; [partial_rows, Hq] f32; [3*M + W, Hkv] i32
        cta_indptr, items, merge_partials,  # [num_ctas+1]; [W, ITEM_STRIDE]; [P]
        kv_indices, mask_ptr, alibi_ptr, rope_ptr, rope_q,  # [nnz] i32; [mask elements] u8; [Hq] f32; [D/2] f32;
        # [nnz_qo] i32 (fused RoPE: each query row's position)
        stride_pn, stride_ph, stride_pln, stride_plh,
        window_left, num_kv_heads, merge_rows,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
        ALIBI: tl.constexpr, SIGMOID: tl.constexpr, ROPE: tl.constexpr, CUSTOM_MASK: tl.constexpr,
        STORE_LSE: tl.constexpr, DENSE_ROWS: tl.constexpr, MERGES: tl.constexpr, PRECISION: tl.constexpr,
        DETERMINISTIC: tl.constexpr, GRID: tl.constexpr, PRIOR: tl.constexpr, REDO: tl.constexpr):
    # sync, in blocks of merge_rows rows (the buffers' merge capacity): the first counts a merge's partial
    # states as they land, the second the same in the second launch, the third flags the merges whose output
    # came out non-finite; then one row per item flags such items.
    HIDDEN_KEYS: tl.constexpr = CAUSAL or HAS_WINDOW or CUSTOM_MASK
    merge_flags = sync + 2 * merge_rows * num_kv_heads
    item_flags = sync + 3 * merge_rows * num_kv_heads
    cta = tl.program_id(0)
    kv_head = tl.program_id(1)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    d = tl.arange(0, BLOCK_D)
    half = tl.arange(0, BLOCK_H)  # fused RoPE: q and k in halves, dims [0, D/2) and [D/2, D)
    rope_freq = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ROPE:
        rope_freq = tl.load(rope_ptr + half, mask=half < HEAD_DIM // 2, other=0.0)
    for w in range(tl.load(cta_indptr + cta), tl.load(cta_indptr + cta + 1)):
        item = items + w * _STRIDE
        qo_start = tl.load(item + _QO_START)
        qo_end = tl.load(item + _QO_END)
        kv_start = tl.load(item + _KV_START)
        kv_end = tl.load(item + _KV_END)
        partial = -1
        merge = -1
        if MERGES:
            partial = tl.load(item + _PARTIAL)
            merge = tl.load(item + _MERGE)
        qo_first = tl.load(item + _QO_FIRST)
        qo_len = tl.load(item + _QO_LEN)
        kv_len = tl.load(item + _KV_LEN)
        row_block_start = tl.load(item + _BLOCK_START)
        first_slot = tl.load(item + _FIRST_SLOT)
        mask_start = 0
        if CUSTOM_MASK:
            mask_start = tl.load(item + _MASK_START)
        rope_offset = 0
        if ROPE:
            rope_offset = tl.load(item + _ROPE_OFFSET)
        n_rows = (qo_end - qo_start) * GROUP
        compute = True
        joins = merge >= 0
        if REDO:
            compute = tl.load(item_flags + w * num_kv_heads + kv_head) != 0
            if compute:  # read by this program alone: cleared for the next launch
                tl.store(item_flags + w * num_kv_heads + kv_head, 0)
            if MERGES:
                joins = (merge >= 0) & (tl.load(merge_flags + tl.maximum(merge, 0) * num_kv_heads + kv_head) != 0)
            n_rows = tl.where(compute, n_rows, 0)
        for m0 in range(0, n_rows, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            valid_m = m < n_rows
            rel = tile_query(m, GROUP)
            head = tile_head(kv_head, GROUP, m)
            q_local = qo_start - qo_first + rel
            q_pos = query_position(qo_len, kv_len, q_local)
            lo = kv_start
            hi = kv_end
            if CAUSAL:
                last_local = qo_start - qo_first + tile_query(tl.minimum(m0 + BLOCK_M, n_rows) - 1, GROUP)
                hi = tl.minimum(hi, query_position(qo_len, kv_len, last_local) + 1)
            if HAS_WINDOW:
                # From the KV tile holding the window's first key: tiles start at the chunk's multiples of
                # BLOCK_N whatever the query tile, so a row's keys fall into the same tiles in every plan.
                first_local = qo_start - qo_first + tile_query(m0, GROUP)
                first_key = tl.maximum(lo, query_position(qo_len, kv_len, first_local) - window_left)
                lo = lo + (first_key - lo) // BLOCK_N * BLOCK_N
            q_row_ptr = q_ptr + (qo_start + rel).to(tl.int64)[:, None] * stride_qn + head[:, None] * stride_qh
            if ROPE:
                q_half = q_row_ptr + half[None, :] * stride_qd
                in_half = valid_m[:, None] & (half[None, :] < HEAD_DIM // 2)
                q, q2 = microkernel.rope_turn(tl.load(q_half, mask=in_half, other=0.0),
                                              tl.load(q_half + HEAD_DIM // 2 * stride_qd, mask=in_half, other=0.0),
                                              tl.load(rope_q + qo_start + rel, mask=valid_m, other=0), rope_freq,
                                              q_ptr.dtype.element_ty)
            else:
                q = tl.load(q_row_ptr + d[None, :] * stride_qd, mask=valid_m[:, None] & (d[None, :] < HEAD_DIM),
                            other=0.0)
                q2 = q
            slopes = tl.zeros([BLOCK_M], dtype=tl.float32)
            if ALIBI:
                slopes = tl.load(alibi_ptr + head, mask=valid_m, other=0.0)
            # Deterministic mode: the item's KV in the grid's chunks, each chunk's state folded into the item's,
            # left to right: the states and the order of a plan that cuts the row at every grid point, whose
            # merge folds them with the same ⊕. Normal mode: one pass over lo:hi (a loop of one trip, which the
            # compiler removes).
            chunk_lo = lo
            chunk_step = hi - lo
            n_chunks = 1
            if DETERMINISTIC:
                chunk_lo = kv_start + (lo - kv_start) // GRID * GRID
                chunk_step = GRID
                n_chunks = tl.cdiv(hi - chunk_lo, GRID)
            o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            for c in range(0, n_chunks):
                c0 = chunk_lo + c * chunk_step
                o_c, lse_c = microkernel.attend_range(
                    q, q2, q_pos, q_local, valid_m, slopes, rope_freq, rope_offset, k_head, v_head, kv_indices,
                    row_block_start, first_slot, block_size, tl.maximum(lo, c0), tl.minimum(hi, c0 + chunk_step),
                    kv_len, mask_ptr, mask_start, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                    qk_scale, v_scale, soft_cap, window_left, sigmoid_bias,
                    HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_H=BLOCK_H,
                    BLOCK_SIZE=BLOCK_SIZE, DENSE_ROWS=DENSE_ROWS, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                    SOFT_CAP=SOFT_CAP, ALIBI=ALIBI, SIGMOID=SIGMOID, ROPE=ROPE, CUSTOM_MASK=CUSTOM_MASK,
                    PRECISION=PRECISION, DETERMINISTIC=DETERMINISTIC, DROP_HIDDEN=REDO)
                if not DETERMINISTIC:
                    o, lse = o_c, lse_c
                elif SIGMOID:
                    o = o + o_c
                else:
                    o, lse = merge_pair(o, lse, o_c, lse_c)
            if HIDDEN_KEYS and not REDO:
                if tl.sum(tl.sum(o * 0.0, 1), 0) != 0.0:  # a non-finite row: the second launch redoes the item
                    tl.store(item_flags + w * num_kv_heads + kv_head, 1)
            if partial < 0:
                if PRIOR:
                    o, lse = fold_prior(prior_o, prior_lse, qo_start + rel, head, valid_m, d, o, lse,
                                        num_kv_heads * GROUP, HEAD_DIM)
                store_state(out_ptr, lse_ptr, qo_start + rel, head, valid_m, d, o, lse, stride_on, stride_oh,
                            stride_od, stride_ln, stride_lh, HEAD_DIM, STORE_LSE)
            elif MERGES:
                store_state(part_o, part_lse, partial + rel, head, valid_m, d, o, lse, stride_pn, stride_ph, 1,
                            stride_pln, stride_plh, HEAD_DIM, not SIGMOID)
        if MERGES and joins:
            n_rows = (qo_end - qo_start) * GROUP
            parts_lo = tl.load(item + _PARTS_LO)
            parts_hi = tl.load(item + _PARTS_HI)
            counter = sync + ((merge_rows if REDO else 0) + merge) * num_kv_heads + kv_head
            if last_to_arrive(counter, parts_hi - parts_lo):
                # Every other item of the merge has arrived, and read the merge's flag, which goes back to zero
                # for the next launch as the counter did.
                if REDO:
                    tl.store(merge_flags + merge * num_kv_heads + kv_head, 0)
                for m0 in range(0, n_rows, BLOCK_M):
                    m = m0 + tl.arange(0, BLOCK_M)
                    valid_m = m < n_rows
                    rel = tile_query(m, GROUP)
                    head = tile_head(kv_head, GROUP, m)
                    o, lse = fold_partials(part_o, part_lse, merge_partials, parts_lo, parts_hi, rel, head,
                                           valid_m, d, stride_pn, stride_ph, stride_pln, stride_plh, HEAD_DIM,
                                           SIGMOID)
                    if HIDDEN_KEYS and not REDO:
                        if tl.sum(tl.sum(o * 0.0, 1), 0) != 0.0:
                            tl.store(merge_flags + merge * num_kv_heads + kv_head, 1)
                    if PRIOR:
                        o, lse = fold_prior(prior_o, prior_lse, qo_start + rel, head, valid_m, d, o, lse,
                                            num_kv_heads * GROUP, HEAD_DIM)
                    store_state(out_ptr, lse_ptr, qo_start + rel, head, valid_m, d, o, lse, stride_on,
                                stride_oh, stride_od, stride_ln, stride_lh, HEAD_DIM, STORE_LSE)


def call_args(q, k, v, out, lse, prior_o, prior_lse, config, scalars) -> tuple:
    """The arguments of :func:`persistent_attention` that a call gives: its tensors, their strides, the scalars.

    ``config`` is a :class:`~bsrattn.torch_cuda.config.LaunchConfig` and ``scalars`` a
    :class:`~bsrattn.torch_cuda.config.Scalars`; ``lse`` is the buffers' ``no_lse`` when ``config.store_lse``
    is false, ``prior_o`` and ``prior_lse`` their ``no_prior`` when ``config.prior`` is false. Shapes, dtypes
    and devices are the caller's to check.
    """
    return (q, k, v, out, lse, prior_o, prior_lse, *q.stride(), *kv_strides(k, config.kv_view),
            *kv_strides(v, config.kv_view), *out.stride(), *lse.stride(), config.block_size, scalars.qk_scale,
            scalars.v_scale, scalars.soft_cap, scalars.sigmoid_bias)


def constexpr_names(kernel) -> tuple:
    """The compile-time parameters of ``kernel`` (a ``triton.jit`` function), in order (they follow the others)."""
    return tuple(name for name, p in inspect.signature(kernel.fn).parameters.items()
                 if "constexpr" in str(p.annotation))  # a string here, as annotations are in this module


def plan_args(buffers, config) -> tuple:
    """The arguments of :func:`persistent_attention` that the plan's buffers (a :class:`PlanBuffers`) and
    ``config`` fix: the same for every call over them, and for every plan they are refilled with."""
    sec = buffers.section
    return (buffers.part_o, buffers.part_lse, buffers.sync, sec("cta_indptr"), sec("items"), sec("merge_partials"),
            sec("kv_indices"), buffers.mask, buffers.alibi, buffers.rope, sec("rope_q"), *buffers.part_o.stride()[:2],
            *buffers.part_lse.stride(),
            config.window_left, config.num_kv_heads, buffers.merge_rows)


def constexprs(config, q_dtype, redo: bool = False) -> dict:
    """The compile-time arguments of :func:`persistent_attention` for ``config`` and a ``q`` of ``q_dtype``."""
    return dict(HEAD_DIM=config.head_dim, GROUP=config.group_size, BLOCK_SIZE=block_size_constexpr(config.block_size),
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=config.block_d,
                BLOCK_H=max(16, config.block_d // 2), CAUSAL=config.causal, HAS_WINDOW=config.window_left >= 0,
                SOFT_CAP=config.soft_cap, ALIBI=config.alibi, SIGMOID=config.sigmoid, ROPE=config.rope,
                CUSTOM_MASK=config.custom_mask,
                STORE_LSE=config.store_lse, DENSE_ROWS=config.dense_rows, MERGES=config.merges,
                PRECISION="ieee" if q_dtype == torch.float32 else "tf32", DETERMINISTIC=config.deterministic,
                GRID=max(config.grid, 1), PRIOR=config.prior, REDO=redo)


def launch_args(q, k, v, out, lse, buffers, config, scalars, prior=None):
    """``(grid, args, kwargs)`` of :func:`persistent_attention`: :func:`call_args` (``prior`` a state ``(o, lse)``,
    or None for the buffers' ``no_prior``), :func:`plan_args`, then :func:`constexprs` and the launch options as
    keywords."""
    kwargs = dict(constexprs(config, q.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
                  enable_fp_fusion=not config.deterministic)
    args = call_args(q, k, v, out, lse, *buffers.prior_state(prior), config, scalars) + plan_args(buffers, config)
    return (config.num_ctas, config.num_kv_heads), args, kwargs


def passes(config, q_dtype, item_capacity: int, tma: bool = False) -> list:
    """``(kernel, grid, constexprs)`` of each launch of a call, in order: the first pass (the persistent kernel, or
    the item kernel of :mod:`~bsrattn.torch_cuda.prefill` where ``config.prefill`` says so, reading dense rows
    through tensor descriptors when ``tma``), then, under masks that hide keys, the persistent kernel's ``REDO``
    over the items the first flagged. ``item_capacity`` is the buffers' (the item kernel's grid)."""
    grid = (config.num_ctas, config.num_kv_heads)
    first = ((prefill.prefill_attention, (item_capacity, config.num_kv_heads), prefill.constexprs(config, q_dtype, tma))
             if config.prefill else (persistent_attention, grid, constexprs(config, q_dtype)))
    redo = [(persistent_attention, grid, constexprs(config, q_dtype, True))] if config.hidden_keys else []
    return [first, *redo]


def launch(q, k, v, out, lse, prior_o, prior_lse, buffers, config, scalars):
    """Launch each of :func:`passes` (arguments as :func:`call_args` and :func:`plan_args`): a :class:`Launch` made
    for the one call (the custom op's path, which ``torch.compile``'d code takes)."""
    Launch(buffers, config)(q, k, v, out, lse, prior_o, prior_lse, scalars)


def _specialised(x):
    """What Triton's NVIDIA backend specialises a kernel on for argument ``x``: for a pointer, its dtype and whether
    it is 16-byte aligned; for an int, whether it is 1, whether 16 divides it, and the integer type it is
    passed as; a float, nothing."""
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    if isinstance(x, int):
        return x == 1, x % 16 == 0, -2**31 <= x < 2**31, x < 2**63
    return None


class KeptKernel(NamedTuple):
    """A pass Triton compiled, kept to be launched without it: its runner (``compiled[grid]``, which reads the
    launch hooks and, given no stream, the current one) and what that runner hands the compiled launcher."""

    run: Callable
    launcher: Callable
    grid: tuple
    function: int
    metadata: object
    tail: tuple  # the constexpr values, the launcher's last arguments
    descriptors: bool  # whether the kernel makes tensor descriptors (it then needs Triton's allocator set)

    @classmethod
    def of(cls, compiled, grid, tail, descriptors) -> "KeptKernel":
        grid = (*grid, 1)  # a compiled kernel's launcher takes all three grid dimensions
        run = compiled[grid]  # loads the module: the function handle exists from here on
        return cls(run, compiled.run, grid, compiled.function, compiled.packed_metadata, tail, descriptors)


def _hook_holder():
    """Where this Triton keeps its launch hooks, which its runners read: its runtime knobs (Triton 3.4 on), or
    before them ``CompiledKernel``'s class attributes."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if hasattr(runtime, "launch_enter_hook"):
        return runtime
    from triton.compiler.compiler import CompiledKernel

    return CompiledKernel


_HOOKS = _hook_holder()


def _no_launch_hooks() -> bool:
    """Whether no launch hook is set (a profiler's): a kept kernel's launcher is then called directly, with what
    its runner would pass it without hooks (no launch metadata), which saves a small decode 2.3 µs of host time
    on the H200; with a hook set, launches go through the runner, which calls it."""
    return not (_calls_something(_HOOKS.launch_enter_hook) or _calls_something(_HOOKS.launch_exit_hook))


def _calls_something(hook) -> bool:
    """Whether a launch hook calls anything: None, or an empty chain of hooks (Triton 3.5 on), does not."""
    return hook is not None and bool(getattr(hook, "calls", True))


_COMPILED = {}
"""What Triton compiled, found again without it: per kind of launch (the configuration, the device, and what
Triton specialises on in every argument, :func:`_specialised`), a :class:`KeptKernel` for each pass."""
_KEEPS_KERNELS = torch.version.hip is None and not interpreting()
"""Whether launches go to kept kernels: on NVIDIA GPUs, compiled (AMD's backend specialises on more, such as
whether a tensor's offsets fit 32 bits; the interpreter compiles nothing)."""


class Launch:
    """:func:`launch` for one plan's buffers and one launch configuration, with Triton's per-call work done once.

    ``persistent_attention[grid](...)`` binds its arguments, works out what to specialise the kernel on and
    looks the kernel up on every call: 54-148 µs of host time on the H200 (Triton 3.6), several times a small
    decode's GPU time. A ``Launch`` reads the arguments its buffers fix (:func:`plan_args`) once. The first
    launch of a new kind goes through Triton, and the compiled kernels it returns are kept for the process
    (:data:`_COMPILED`: a later plan's buffers find them too); a launch of a kind seen before hands their
    launchers its arguments directly, pointers as addresses (through Triton's runner only while a launch hook is
    set, :func:`_no_launch_hooks`). The call's own arguments (pointers, strides) are
    classified only when they differ from the last call's: a model's layers share them.
    """

    __slots__ = ("config", "item_capacity", "sync", "plan", "_plan_ptrs", "_plan_kind", "_last", "_scratch")

    def __init__(self, buffers, config):
        self.config = config
        self.item_capacity = buffers.item_capacity
        self.sync = buffers.sync
        self.plan = plan_args(buffers, config)
        self._plan_ptrs = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in self.plan)
        # Block sizes that are not powers of two share one kernel (gather.block_size_constexpr).
        kernel_config = replace(config, block_size=block_size_constexpr(config.block_size))
        # A kept kernel carries its grid, and the item kernel's is the buffers' item capacity: buffers of another
        # capacity are another kind, or a later plan's items past the first capacity would never run.
        grid = self.item_capacity if config.prefill else 0
        self._plan_kind = (kernel_config, grid, self.sync.device, *map(_specialised, self.plan))
        self._last = (None, None)  # the last call's (dtypes, pointers' alignment, strides) and its kernels
        self._scratch = None

    def scratch(self, size: int, alignment: int, stream) -> torch.Tensor:
        """Triton's allocator for the global scratch of a kernel that makes tensor descriptors
        (``prefill.descriptor_scratch``): one buffer, grown when a launch needs more."""
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8, device=self.sync.device)
        return self._scratch

    def __call__(self, q, k, v, out, lse, prior_o, prior_lse, scalars, stream=None):
        """Launch each pass on the call's tensors (as :func:`call_args` takes them), on ``stream`` (a raw CUDA stream
        handle; None: the current stream, which Triton then reads itself)."""
        view = self.config.kv_view
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), prior_o.data_ptr(),
                prior_lse.data_ptr())
        ints = (*q.stride(), *kv_strides(k, view), *kv_strides(v, view), *out.stride(), *lse.stride(),
                self.config.block_size)
        exact = (q.dtype, k.dtype, v.dtype, out.dtype, lse.dtype, prior_o.dtype, prior_lse.dtype,
                 *(p % 16 for p in ptrs), *ints)
        last, kernels = self._last
        if last != exact:
            # Whether K and V go through tensor descriptors follows from what `exact` holds, beyond what Triton
            # specialises on (a stride's value), so it is part of the kind.
            tma = prefill.tma_ready(self.config, q, k, v)
            kind = (self._plan_kind, *exact[:7], *(p % 16 == 0 for p in ptrs), *map(_specialised, ints), tma)
            kernels = _COMPILED.get(kind)
        try:
            if kernels is None:
                kernels = self._through_triton((q, k, v, out, lse, prior_o, prior_lse), scalars, tma)
                if not _KEEPS_KERNELS:
                    return
                _COMPILED[kind] = kernels
            else:
                args = (*ptrs, *ints, scalars.qk_scale, scalars.v_scale, scalars.soft_cap, scalars.sigmoid_bias,
                        *self._plan_ptrs)
                direct = stream is not None and _no_launch_hooks()
                for kernel in kernels:
                    if direct and not kernel.descriptors:
                        kernel.launcher(*kernel.grid, stream, kernel.function, kernel.metadata, None, None, None,
                                        *args, *kernel.tail)
                    else:
                        with self._scratch_turn(kernel.descriptors):
                            kernel.run(*args, *kernel.tail, stream=stream)
        except BaseException:
            # A first pass launched without its second may leave flags set: cleared in stream order, so that
            # the next launch, or a captured graph's next replay, starts from zeros.
            self.sync.zero_()
            raise
        self._last = (exact, kernels)

    def _scratch_turn(self, descriptors: bool):
        """The context of one kernel's launch: :meth:`scratch` as Triton's allocator for a kernel that makes
        tensor descriptors, nothing for the others."""
        return prefill.descriptor_scratch(self.scratch) if descriptors else contextlib.nullcontext()

    def _through_triton(self, tensors, scalars, tma: bool) -> list:
        """Launch each pass through Triton's JIT on the call's ``tensors`` (as :func:`call_args` takes them; the item
        kernel with tensor descriptors when ``tma``); its compiled kernels' launchers, each with its constexpr
        values and whether it makes tensor descriptors."""
        call = call_args(*tensors, self.config, scalars)
        kernels = []
        with interpreter_turn():
            for fn, grid, tail in passes(self.config, tensors[0].dtype, self.item_capacity, tma):
                descriptors = bool(tail.get("TMA"))
                with self._scratch_turn(descriptors):
                    kernel = fn[grid](*call, *self.plan, **tail, num_warps=self.config.num_warps,
                                      num_stages=self.config.num_stages,
                                      enable_fp_fusion=not self.config.deterministic)
                if _KEEPS_KERNELS:
                    kernels.append(KeptKernel.of(kernel, grid, tuple(tail[name] for name in constexpr_names(fn)),
                                               descriptors))
        return kernels
