"""The item kernel: one program per work item, for plans of one-tile items (prefills that split no row, and decodes
of tall tiles or of chains of short items), whose split items merge as the persistent kernel's do.

Must match :func:`bsrattn.reference.executor.execute` for the plans :func:`~bsrattn.torch_cuda.config.item_kernel_for`
gives it: every item one query tile, at most a causal mask and a soft cap (no fused RoPE, ALiBi, custom mask,
sliding window or FlashSigmoid), not deterministic, and no split row where the causal mask hides keys. Such are
what a prefill of at least as many query tiles as CTAs gets (``config.plan_options``: no row split), and the
decodes :func:`~bsrattn.torch_cuda.config.decode_on_items` picks; for them the persistent kernel
(:mod:`~bsrattn.torch_cuda.executor`) carries what they never use: its loop over a CTA's items keeps an item's
fields live through both KV loops (more registers a thread, and stack at the decode tile, where this kernel needs
none), and it runs a CTA's items one after another, each restarting the KV pipeline, where the hardware overlaps
one program's start with another's loads. A split item writes its partial state; the last of a merge's items to
land folds them in the plan's order (:func:`~bsrattn.torch_cuda.merge.last_to_arrive`,
:func:`~bsrattn.torch_cuda.merge.fold_partials`).

Program ``(w, h)`` runs item ``w`` for head group ``h`` (the persistent kernel's) and stops. The launch is
``capacity x head_programs`` programs, the buffers' item capacity (fixed while re-plans fit the buffers, so a
captured CUDA graph replays any of them); the programs past the plan's items return at once. The hardware starts
each program as an SM frees up, which evens out the causal triangle's unequal tiles as they run. The tile loop is
the microkernel's (:func:`~bsrattn.torch_cuda.microkernel.attend_range`: tiles wholly below the diagonal run without
masks). Its
runtime arguments are the persistent kernel's (:data:`~bsrattn.torch_cuda.kernel_args.RUNTIME_ARGS`), so one
launcher call serves both.

``TMA``: an affine row's K and V tiles come through tensor descriptors, one per row and KV head, made by the
program (Hopper's bulk tensor copies: no per-slot addresses, and the copy engine zero-fills past the row's
end); other rows keep the gathered loads, chosen per row at run time, as the persistent kernel chooses its
affine path. It pays for long rows only (``config.ITEM_TMA_MIN_KV``); :func:`tma_ready` says which calls can
(the dtypes, the view, the strides' alignment).

As in the persistent kernel, a hidden key's non-finite value is not dropped here: an item whose output comes
out non-finite is flagged, and the persistent kernel's second launch (``REDO``) computes it again, dropping such
values. The rungs this kernel climbed, and their figures, are in ``benchmarks/NOTES.md`` (the torch tier's
ladder).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from bsrattn.torch_cuda import microkernel
from bsrattn.torch_cuda.config import ITEM_KERNEL_TMA
from bsrattn.torch_cuda.gather import block_size_constexpr, kv_strides
from bsrattn.torch_cuda.indexing import _MERGE, _PARTIAL, _PARTS_HI, _PARTS_LO, _STRIDE, load_item, query_position, \
    tile_head, tile_query
from bsrattn.torch_cuda.merge import fold_partials, last_to_arrive
from bsrattn.torch_cuda.microkernel import KVRow, QueryTile, Switches, Tile, store_state
from bsrattn.torch_cuda.prior import store_output


@triton.jit
def _attend_tma(q, q_pos, valid_m, k_row, v_row, k_slot_stride, v_slot_stride, kv_start, kv_end, scalars,
                HEAD_DIM: tl.constexpr, HEAD_DIM_VO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, SOFT_CAP: tl.constexpr,
                PRECISION: tl.constexpr):
    """:func:`~bsrattn.torch_cuda.microkernel.attend_range` over slots ``kv_start:kv_end`` of an affine row whose
    slot ``i`` of K is at ``k_row + i * k_slot_stride`` (V likewise), its tiles copied by the tensor-memory engine."""
    qk_scale, soft_cap = scalars.qk_scale, scalars.soft_cap
    k_desc = tl.make_tensor_descriptor(k_row, [kv_end, HEAD_DIM], [k_slot_stride, 1], [BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(v_row, [kv_end, HEAD_DIM_VO], [v_slot_stride, 1], [BLOCK_N, BLOCK_DV])
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    mid = kv_start
    if CAUSAL:
        # Tiles wholly below the diagonal (before the tile's first query position) need no mask.
        mid = kv_start + tl.maximum(tl.minimum(kv_end, tl.min(q_pos, 0) + 1) - kv_start, 0) // BLOCK_N * BLOCK_N
        for start in range(kv_start, mid, BLOCK_N):
            s = microkernel.scores(q, k_desc.load([start, 0]), q, q, q_pos, q_pos, q_pos, qk_scale, soft_cap,
                                   SOFT_CAP, False, False, PRECISION)
            acc, m_i, l_i = microkernel.softmax_update(acc, m_i, l_i, s, s, v_desc.load([start, 0]), False,
                                                       PRECISION, False)
    for start in range(mid, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        s = microkernel.scores(q, k_desc.load([start, 0]), q, q, q_pos, k_pos, q_pos, qk_scale, soft_cap, SOFT_CAP,
                               False, False, PRECISION)
        # The copy engine fills slots past kv_end with zeros: finite, and masked here.
        vis = microkernel.visible(q_pos, k_pos, valid_m, k_pos < kv_end, q_pos, kv_end, -1, k_row, 0, CAUSAL, False,
                                  False)
        acc, m_i, l_i = microkernel.softmax_update(acc, m_i, l_i, s, vis, v_desc.load([start, 0]), True, PRECISION,
                                                   False)
    return microkernel.finish(acc, m_i, l_i, tl.zeros([BLOCK_M], dtype=tl.float32), scalars.v_scale, False)


@triton.jit
def item_attention(
        # kernel_args.RUNTIME_ARGS, the persistent kernel's (one launcher call serves both kernels). Unused here:
        # the merges' flags of sync, window_left, the custom mask, ALiBi and fused RoPE.
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, prior_o, prior_lse,
        q_strides, k_strides, v_strides, out_strides, lse_strides, block_size, scalars,
        part_o, part_lse, sync, cta_indptr, items, merge_partials, kv_indices, mask_ptr, alibi_ptr, rope_ptr, rope_q,
        part_o_strides, part_lse_strides, window_left, head_programs, merge_rows,
        HEAD_DIM: tl.constexpr, HEAD_DIM_VO: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        CAUSAL: tl.constexpr, SOFT_CAP: tl.constexpr, STORE_LSE: tl.constexpr, AFFINE_ROWS: tl.constexpr,
        PRECISION: tl.constexpr, NUM_CTAS: tl.constexpr, TMA: tl.constexpr, MERGES: tl.constexpr,
        PRIOR: tl.constexpr, HEAD_GROUPS: tl.constexpr):
    # Split items and hidden keys are never planned together here (config.item_kernel_for): a split item whose
    # state came out non-finite would need the merge flags of the persistent kernel's second launch.
    tl.static_assert(not (MERGES and CAUSAL))
    TILE: tl.constexpr = Tile(HEAD_DIM, HEAD_DIM_VO, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_D, BLOCK_SIZE,
                              AFFINE_ROWS, PRECISION)
    VARIANT: tl.constexpr = Switches(CAUSAL, False, SOFT_CAP, False, False, False, False)
    w = tl.program_id(0)
    head_group = tl.program_id(1)  # GROUP_SIZE query heads of KV head head_group // HEAD_GROUPS
    if w < tl.load(cta_indptr + NUM_CTAS):  # programs past the plan's items stop here
        item_flags = sync + 3 * merge_rows * head_programs
        item = items + w * _STRIDE
        qo_start, qo_end, kv_start, kv_end, _, _, qo_first, qo_len, kv_len, block_start, first_slot = \
            load_item(item, False)
        n_rows = (qo_end - qo_start) * GROUP_SIZE  # at most BLOCK_M: item_kernel_for's condition
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)  # v's and the output's columns
        m = tl.arange(0, BLOCK_M)
        valid_m = m < n_rows
        rel = tile_query(m, GROUP_SIZE)
        head = tile_head(head_group, GROUP_SIZE, m)
        q_local = qo_start - qo_first + rel
        q_pos = query_position(qo_len, kv_len, q_local)
        hi = kv_end
        if CAUSAL:
            hi = tl.minimum(hi, query_position(qo_len, kv_len, qo_start - qo_first + tile_query(n_rows - 1,
                                                                                                GROUP_SIZE)) + 1)
        stride_qn, stride_qh, stride_qd = q_strides
        q = tl.load(q_ptr + (qo_start + rel).to(tl.int64)[:, None] * stride_qn + head[:, None] * stride_qh
                    + d[None, :] * stride_qd, mask=valid_m[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        k_head = k_ptr + head_group // HEAD_GROUPS * k_strides[2]
        v_head = v_ptr + head_group // HEAD_GROUPS * v_strides[2]
        none = tl.zeros([BLOCK_M], dtype=tl.float32)
        query = QueryTile(q, q, q_pos, q_local, valid_m, none)
        row = KVRow(k_head, v_head, k_strides, v_strides, kv_indices, block_start, first_slot, block_size, kv_len,
                    kv_indices, 0, -1, 0, none)
        if TMA:
            if first_slot >= 0:
                # Slot i of an affine row is pool slot first_slot + i, one stride apart within a block and across
                # blocks (tma_ready).
                k_slots = k_strides[0] if BLOCK_SIZE == 1 else k_strides[1]
                v_slots = v_strides[0] if BLOCK_SIZE == 1 else v_strides[1]
                first = first_slot.to(tl.int64)
                o, lse = _attend_tma(q, q_pos, valid_m, k_head + first * k_slots, v_head + first * v_slots, k_slots,
                                     v_slots, kv_start, hi, scalars, HEAD_DIM, HEAD_DIM_VO, BLOCK_M, BLOCK_N, BLOCK_D,
                                     BLOCK_DV, CAUSAL, SOFT_CAP, PRECISION)
            else:
                o, lse = microkernel.attend_range(query, row, kv_start, hi, scalars, TILE, VARIANT, False, False)
        else:
            o, lse = microkernel.attend_range(query, row, kv_start, hi, scalars, TILE, VARIANT, False, False)
        redo = False
        if CAUSAL:
            redo |= tl.sum(tl.sum(o * 0.0, 1), 0) != 0.0  # a non-finite row: computed again, hidden values dropped
        partial = -1
        if MERGES:
            partial = tl.load(item + _PARTIAL)
        if redo:
            tl.store(item_flags + w * head_programs + head_group, 1)
        elif partial < 0:
            store_output(out_ptr, lse_ptr, out_strides, lse_strides, prior_o, prior_lse, qo_start + rel, head,
                         valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)
        else:
            # A split item: its partial state, then the merge's fold by the last of its items to land, in the
            # plan's order (executor.py, step 4).
            store_state(part_o, part_lse, partial + rel, head, valid_m, dv, o, lse,
                        (part_o_strides[0], part_o_strides[1], 1), part_lse_strides, HEAD_DIM_VO, True)
            merge = tl.load(item + _MERGE)
            parts_lo = tl.load(item + _PARTS_LO)
            parts_hi = tl.load(item + _PARTS_HI)
            if last_to_arrive(sync + merge * head_programs + head_group, parts_hi - parts_lo):
                o, lse = fold_partials(part_o, part_lse, merge_partials, parts_lo, parts_hi, rel, head, valid_m, dv,
                                       part_o_strides, part_lse_strides, HEAD_DIM_VO, False)
                store_output(out_ptr, lse_ptr, out_strides, lse_strides, prior_o, prior_lse, qo_start + rel,
                             head, valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)


def constexprs(config, q_dtype, tma: bool) -> dict:
    """The compile-time arguments of :func:`item_attention` for ``config``, a ``q`` of ``q_dtype`` and whether the
    call's affine rows go through tensor descriptors (:func:`tma_ready`)."""
    return dict(HEAD_DIM=config.head_dim, HEAD_DIM_VO=config.head_dim_vo, GROUP_SIZE=config.tile_group,
                BLOCK_SIZE=block_size_constexpr(config.block_size), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                BLOCK_D=config.block_d, BLOCK_DV=config.block_dv, CAUSAL=config.causal, SOFT_CAP=config.soft_cap,
                STORE_LSE=config.store_lse, AFFINE_ROWS=config.affine_rows,
                PRECISION="ieee" if q_dtype == torch.float32 else "tf32",
                NUM_CTAS=config.num_ctas, TMA=tma, MERGES=config.merges, PRIOR=config.prior,
                HEAD_GROUPS=config.head_groups)


def tma_ready(config, q, k, v) -> bool:
    """Whether this call's affine rows can be read through tensor descriptors: the configuration asks for it
    (:data:`~bsrattn.torch_cuda.config.ITEM_KERNEL_TMA`), K and V have ``q``'s 16-bit dtype, an affine row's slots
    are one stride apart (the 3-D view, or NHD with consecutive blocks back to back: not HND, whose heads interleave
    a block's slots), the head dimension is contiguous, and every address and stride the descriptors take is a
    multiple of 16 bytes."""
    if config.item_kernel != ITEM_KERNEL_TMA or config.kv_view == "HND":
        return False
    for x in (k, v):
        if x.dtype != q.dtype or x.element_size() != 2 or x.data_ptr() % 16:
            return False
        stride_block, stride_slot, stride_head, stride_dim = kv_strides(x, config.kv_view)
        slot = stride_block if config.kv_view == "NHD3" else stride_slot
        if config.kv_view == "NHD" and stride_block != config.block_size * stride_slot:
            return False
        if stride_dim != 1 or (slot * 2) % 16 or (stride_head * 2) % 16:
            return False
    return True


@contextlib.contextmanager
def descriptor_scratch(allocator):
    """A context in which to launch a kernel that makes tensor descriptors: Triton asks its allocator for their
    global scratch at every launch, and gets ``allocator``'s (``launch.Launch.scratch``: one buffer per launch
    configuration, so a captured CUDA graph replays a fixed address). Triton's allocator is a context variable,
    which ``triton.set_allocator`` sets for good: here it is set for the launch and restored after it."""
    token = _allocation._allocator.set(allocator)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)
