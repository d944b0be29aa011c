"""A :class:`~bsrattn.scheduler.WorkPlan` executed by one persistent Triton kernel, merge folded in.

Must match :func:`bsrattn.reference.executor.execute`. The launch is a fixed launch grid
``(num_ctas, num_kv_heads x HEAD_GROUPS)``: program ``(c, h)`` walks CTA ``c``'s items in plan order for head group
``h``, the ``G`` query heads ``h * G .. h * G + G - 1`` of KV head ``h // HEAD_GROUPS``. For each item:

1. **GQA head-group fusion.** The tile's M dimension packs the item's query rows x the ``G`` query heads of the
   group (row ``m`` is query row ``qo_start + m // G``, head ``h * G + m % G``), so each K/V byte is read once
   per group, not once per query head. A KV head's query heads are one group (``HEAD_GROUPS = 1``) unless they
   overflow a decode tile (``config.head_groups``: multi-head latent attention's 128 heads over one latent head),
   when its groups' programs read the same K/V tiles side by side. Items with more rows than ``BLOCK_M`` loop
   over M sub-tiles.
2. **Block skipping.** Causal masking ends the KV loop after the tile's last query position, a sliding
   window starts it at the first query position minus ``window_left``; tiles outside are never loaded.
3. The microkernel (:func:`~bsrattn.torch_cuda.microkernel.attend_range`) over the item's KV range (``v``, the
   accumulator, the output and the partial states ``HEAD_DIM_VO`` wide, ``q`` and ``k`` ``HEAD_DIM``). With fused
   RoPE the tile's queries are loaded in two halves (dims ``[0, D/2)`` and ``[D/2, D)``) and turned once per
   tile (:func:`~bsrattn.torch_cuda.microkernel.rope_turn`) at their positions in the plan's ``rope_q``
   section, and every K tile at its slots' positions plus the item's ``rope_offset`` (a Cascade's later levels).
   Where ``v`` is the first ``HEAD_DIM_VO`` columns of ``k`` (``BLOCK_DR > 0``: multi-head latent attention's value
   ``ckv`` in its key ``ckv ⊕ kpe``), ``q`` and each K tile are loaded in two parts, those columns and the rest,
   and the first part of the K tile is the V tile: one load, and no tile padded past the key's width.
   In deterministic mode (``SPLIT_SIZE``) the range runs chunk by chunk of a canonical chunk grid, the chunks'
   states folded in KV order (:mod:`~bsrattn.torch_cuda.deterministic`).
4. An unsplit item writes the output and LSE (with ``PRIOR``, an earlier Cascade level's state folded in first,
   as into a merge's output: :mod:`~bsrattn.torch_cuda.prior`). A split item writes its partial state to its fixed
   workspace rows, then bumps its tile's integer counter (acquire-release, GPU scope); the program whose
   bump completes the count is the last to finish, and it folds the tile's partial states **in the plan's
   order** (:func:`~bsrattn.torch_cuda.merge.fold_partials`) into the output. Which program merges depends
   on timing; what it computes does not, so the result is bitwise deterministic, with no floating-point
   atomics and no second launch for the merge. The merging program sets the counter back to zero, and the
   ``REDO`` launch (5.) each flag it reads, so every launch leaves ``sync`` as it found it: zero, as allocated,
   with no clearing kernel before every launch. A launch is never interrupted part-way while the process can
   still launch: the one way to stop between passes, an exception in Python, clears ``sync`` in stream order
   (:class:`~bsrattn.torch_cuda.launch.Launch`).
5. **Hidden keys' NaNs.** Under masks that hide keys from some queries (causal, window, custom mask), a
   hidden key's NaN or infinity would reach ``p @ v`` as ``0 * NaN``. Dropping such values in every masked
   tile puts ``v`` through registers, and even an inlined second pass, never run on finite inputs, slows a
   prefill. So the launch only flags each item (or merge) whose output came out non-finite, and a second launch
   of the same kernel (``REDO``) computes just the flagged ones again, dropping hidden values (``DROP_HIDDEN``),
   and merges again the merges they belong to.
   On finite inputs the second launch reads one flag per item and stops.

The kernel's runtime arguments are :data:`~bsrattn.torch_cuda.kernel_args.RUNTIME_ARGS`, its compile-time ones
:func:`constexprs`; :func:`passes` lists a call's launches (this kernel, or the item kernel of
:mod:`~bsrattn.torch_cuda.item_kernel`, then ``REDO``), which :mod:`~bsrattn.torch_cuda.launch` makes. No program
waits for another, so the launch grid needs no co-residency. Everything that changes between plans
is read from device buffers (:mod:`~bsrattn.torch_cuda.plan_buffers`), so a CUDA graph captured around a
launch replays correctly after the buffers are refilled.

How the kernel got here, rung by rung, with what each rung added, its figures and its commit: the tables under
"Torch tier, how the kernel got here" in ``benchmarks/NOTES.md`` (the persistent kernel, the item kernel, the
host side of a launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bsrattn.torch_cuda import item_kernel, microkernel
from bsrattn.torch_cuda.deterministic import chunk_grid, fold_chunk
from bsrattn.torch_cuda.gather import block_size_constexpr
from bsrattn.torch_cuda.indexing import _MASK_START, _PARTS_HI, _PARTS_LO, _ROPE_OFFSET, _STRIDE, load_item, \
    query_position, tile_head, tile_query
from bsrattn.torch_cuda.kernel_args import call_args, plan_args
from bsrattn.torch_cuda.merge import fold_partials, last_to_arrive
from bsrattn.torch_cuda.microkernel import KVRow, QueryTile, Switches, Tile, store_state
from bsrattn.torch_cuda.prior import prior_state, store_output


@triton.jit
def persistent_attention(
        # kernel_args.CALL_ARGS: the call's tensors, their strides, the block size, the scalars ...
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, prior_o, prior_lse,
        q_strides, k_strides, v_strides, out_strides, lse_strides, block_size, scalars,
        # ... then kernel_args.PLAN_ARGS: what the plan's buffers and the configuration fix.
        part_o, part_lse, sync, cta_indptr, items, merge_partials, kv_indices, mask_ptr, alibi_ptr, rope_ptr, rope_q,
        part_o_strides, part_lse_strides, window_left, head_programs, merge_rows,
        HEAD_DIM: tl.constexpr, HEAD_DIM_VO: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        SOFT_CAP: tl.constexpr,
        ALIBI: tl.constexpr, SIGMOID: tl.constexpr, ROPE: tl.constexpr, CUSTOM_MASK: tl.constexpr,
        STORE_LSE: tl.constexpr, AFFINE_ROWS: tl.constexpr, MERGES: tl.constexpr, PRECISION: tl.constexpr,
        DETERMINISTIC: tl.constexpr, SPLIT_SIZE: tl.constexpr, PRIOR: tl.constexpr, REDO: tl.constexpr,
        HEAD_GROUPS: tl.constexpr):
    # sync, in blocks of merge_rows rows (the buffers' merge capacity): the first counts a merge's partial
    # states as they land, the second the same in the second launch, the third flags the merges whose output
    # came out non-finite; then one row per item flags such items.
    HIDDEN_KEYS: tl.constexpr = CAUSAL or HAS_WINDOW or CUSTOM_MASK
    TILE: tl.constexpr = Tile(HEAD_DIM, HEAD_DIM_VO, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_H, BLOCK_SIZE,
                              AFFINE_ROWS, PRECISION, BLOCK_DR)
    VARIANT: tl.constexpr = Switches(CAUSAL, HAS_WINDOW, SOFT_CAP, ALIBI, SIGMOID, ROPE, CUSTOM_MASK)
    merge_flags = sync + 2 * merge_rows * head_programs
    item_flags = sync + 3 * merge_rows * head_programs
    cta = tl.program_id(0)
    head_group = tl.program_id(1)  # GROUP_SIZE query heads of KV head head_group // HEAD_GROUPS
    stride_qn, stride_qh, stride_qd = q_strides
    k_head = k_ptr + head_group // HEAD_GROUPS * k_strides[2]
    v_head = v_ptr + head_group // HEAD_GROUPS * v_strides[2]
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)  # v's and the output's columns
    half = tl.arange(0, BLOCK_H)  # fused RoPE: q and k in halves, dims [0, D/2) and [D/2, D)
    rope_freq = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ROPE:
        rope_freq = tl.load(rope_ptr + half, mask=half < HEAD_DIM // 2, other=0.0)
    for w in range(tl.load(cta_indptr + cta), tl.load(cta_indptr + cta + 1)):
        item = items + w * _STRIDE
        qo_start, qo_end, kv_start, kv_end, partial, merge, qo_first, qo_len, kv_len, block_start, first_slot = \
            load_item(item, MERGES)
        mask_start = 0
        if CUSTOM_MASK:
            mask_start = tl.load(item + _MASK_START)
        rope_offset = 0
        if ROPE:
            rope_offset = tl.load(item + _ROPE_OFFSET)
        row = KVRow(k_head, v_head, k_strides, v_strides, kv_indices, block_start, first_slot, block_size, kv_len,
                    mask_ptr, mask_start, window_left, rope_offset, rope_freq)
        n_rows = (qo_end - qo_start) * GROUP_SIZE
        compute = True
        joins = merge >= 0
        if REDO:
            compute = tl.load(item_flags + w * head_programs + head_group) != 0
            if compute:  # read by this program alone: cleared for the next launch
                tl.store(item_flags + w * head_programs + head_group, 0)
            if MERGES:
                joins = (merge >= 0) & (tl.load(merge_flags + tl.maximum(merge, 0) * head_programs + head_group) != 0)
            n_rows = tl.where(compute, n_rows, 0)
        for m0 in range(0, n_rows, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            valid_m = m < n_rows
            rel = tile_query(m, GROUP_SIZE)
            head = tile_head(head_group, GROUP_SIZE, m)
            q_local = qo_start - qo_first + rel
            q_pos = query_position(qo_len, kv_len, q_local)
            lo = kv_start
            hi = kv_end
            if CAUSAL:
                last_local = qo_start - qo_first + tile_query(tl.minimum(m0 + BLOCK_M, n_rows) - 1, GROUP_SIZE)
                hi = tl.minimum(hi, query_position(qo_len, kv_len, last_local) + 1)
            if HAS_WINDOW:
                # From the KV tile holding the window's first key: tiles start at the chunk's multiples of
                # BLOCK_N whatever the query tile, so a row's keys fall into the same tiles in every plan.
                first_local = qo_start - qo_first + tile_query(m0, GROUP_SIZE)
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
            elif BLOCK_DR > 0:  # the key's value columns, then the rest (Tile.block_dr)
                rest = tl.arange(0, BLOCK_DR)
                q = tl.load(q_row_ptr + d[None, :] * stride_qd, mask=valid_m[:, None] & (d[None, :] < HEAD_DIM_VO),
                            other=0.0)
                q2 = tl.load(q_row_ptr + (HEAD_DIM_VO + rest[None, :]) * stride_qd,
                             mask=valid_m[:, None] & (rest[None, :] < HEAD_DIM - HEAD_DIM_VO), other=0.0)
            else:
                q = tl.load(q_row_ptr + d[None, :] * stride_qd, mask=valid_m[:, None] & (d[None, :] < HEAD_DIM),
                            other=0.0)
                q2 = q
            slopes = tl.zeros([BLOCK_M], dtype=tl.float32)
            if ALIBI:
                slopes = tl.load(alibi_ptr + head, mask=valid_m, other=0.0)
            query = QueryTile(q, q2, q_pos, q_local, valid_m, slopes)
            # One pass over lo:hi (a loop of one trip, which the compiler removes), or in deterministic mode the
            # chunk grid's chunks, each chunk's state folded into the item's (deterministic.py).
            chunk_lo = lo
            chunk_step = hi - lo
            n_chunks = 1
            if DETERMINISTIC:
                chunk_lo, chunk_step, n_chunks = chunk_grid(lo, hi, kv_start, SPLIT_SIZE)
            o = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            for c in range(0, n_chunks):
                c0 = chunk_lo + c * chunk_step
                o_c, lse_c = microkernel.attend_range(query, row, tl.maximum(lo, c0), tl.minimum(hi, c0 + chunk_step),
                                                      scalars, TILE, VARIANT, DETERMINISTIC, REDO)
                if DETERMINISTIC:
                    o, lse = fold_chunk(o, lse, o_c, lse_c, SIGMOID)
                else:
                    o, lse = o_c, lse_c
            if HIDDEN_KEYS and not REDO:
                if tl.sum(tl.sum(o * 0.0, 1), 0) != 0.0:  # a non-finite row: the second launch redoes the item
                    tl.store(item_flags + w * head_programs + head_group, 1)
            if partial < 0:
                store_output(out_ptr, lse_ptr, out_strides, lse_strides, prior_o, prior_lse, qo_start + rel, head,
                             valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)
            elif MERGES:
                store_state(part_o, part_lse, partial + rel, head, valid_m, dv, o, lse,
                            (part_o_strides[0], part_o_strides[1], 1), part_lse_strides, HEAD_DIM_VO, not SIGMOID)
        if MERGES and joins:
            n_rows = (qo_end - qo_start) * GROUP_SIZE
            parts_lo = tl.load(item + _PARTS_LO)
            parts_hi = tl.load(item + _PARTS_HI)
            counter = sync + ((merge_rows if REDO else 0) + merge) * head_programs + head_group
            if last_to_arrive(counter, parts_hi - parts_lo):
                # Every other item of the merge has arrived, and read the merge's flag, which goes back to zero
                # for the next launch as the counter did.
                if REDO:
                    tl.store(merge_flags + merge * head_programs + head_group, 0)
                for m0 in range(0, n_rows, BLOCK_M):
                    m = m0 + tl.arange(0, BLOCK_M)
                    valid_m = m < n_rows
                    rel = tile_query(m, GROUP_SIZE)
                    head = tile_head(head_group, GROUP_SIZE, m)
                    o, lse = fold_partials(part_o, part_lse, merge_partials, parts_lo, parts_hi, rel, head,
                                           valid_m, dv, part_o_strides, part_lse_strides, HEAD_DIM_VO, SIGMOID)
                    if HIDDEN_KEYS and not REDO:
                        if tl.sum(tl.sum(o * 0.0, 1), 0) != 0.0:
                            tl.store(merge_flags + merge * head_programs + head_group, 1)
                    store_output(out_ptr, lse_ptr, out_strides, lse_strides, prior_o, prior_lse, qo_start + rel,
                                 head, valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)


def constexprs(config, q_dtype, redo: bool = False) -> dict:
    """The compile-time arguments of :func:`persistent_attention` for ``config`` and a ``q`` of ``q_dtype``."""
    return dict(HEAD_DIM=config.head_dim, HEAD_DIM_VO=config.head_dim_vo, GROUP_SIZE=config.tile_group,
                BLOCK_SIZE=block_size_constexpr(config.block_size), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                BLOCK_D=config.block_d, BLOCK_DV=config.block_dv, BLOCK_DR=config.block_dr,
                BLOCK_H=max(16, config.block_d // 2),
                CAUSAL=config.causal, HAS_WINDOW=config.window_left >= 0, SOFT_CAP=config.soft_cap, ALIBI=config.alibi,
                SIGMOID=config.sigmoid, ROPE=config.rope, CUSTOM_MASK=config.custom_mask, STORE_LSE=config.store_lse,
                AFFINE_ROWS=config.affine_rows, MERGES=config.merges,
                PRECISION="ieee" if q_dtype == torch.float32 else "tf32", DETERMINISTIC=config.deterministic,
                SPLIT_SIZE=max(config.split_size, 1), PRIOR=config.prior, REDO=redo, HEAD_GROUPS=config.head_groups)


def launch_args(q, k, v, out, lse, buffers, config, scalars, prior=None):
    """``(launch_grid, args, kwargs)`` of a plain launch of :func:`persistent_attention`:
    :func:`~bsrattn.torch_cuda.kernel_args.call_args` (``prior`` a state ``(o, lse)``, or None for the buffers'
    ``no_prior``), :func:`~bsrattn.torch_cuda.kernel_args.plan_args`, then :func:`constexprs` and the launch
    options as keywords."""
    kwargs = dict(constexprs(config, q.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
                  enable_fp_fusion=not config.deterministic)
    args = call_args(q, k, v, out, lse, *prior_state(buffers, prior), config, scalars) + plan_args(buffers, config)
    return (config.num_ctas, config.head_programs), args, kwargs


def passes(config, q_dtype, item_capacity: int, tma: bool = False) -> list:
    """``(kernel, launch_grid, constexprs)`` of each launch of a call, in order: the first pass (the persistent
    kernel, or the item kernel of :mod:`~bsrattn.torch_cuda.item_kernel` where ``config.item_kernel`` says so,
    reading affine rows through tensor descriptors when ``tma``), then, under masks that hide keys, the persistent
    kernel's ``REDO`` over the items the first flagged. ``item_capacity`` is the buffers' (the item kernel's
    launch grid)."""
    launch_grid = (config.num_ctas, config.head_programs)
    first = ((item_kernel.item_attention, (item_capacity, config.head_programs),
              item_kernel.constexprs(config, q_dtype, tma))
             if config.item_kernel else (persistent_attention, launch_grid, constexprs(config, q_dtype)))
    redo = [(persistent_attention, launch_grid, constexprs(config, q_dtype, True))] if config.hidden_keys else []
    return [first, *redo]
