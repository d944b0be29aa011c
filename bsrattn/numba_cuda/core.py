"""The paper's kernel at teaching size: the BSR gather, the online-softmax microkernel, LSE out, ⊕ in plan order.

It runs a :class:`~bsrattn.scheduler.WorkPlan` as :func:`bsrattn.reference.executor.execute` does: every work
item computes its state, an unsplit item into ``out``/``lse``, an item of a split tile into its workspace rows;
then each merge list folds its partial states in the plan's order. One block per (work item, KV head): its
threads are the item's (query row, query head) pairs of that KV head, query-major
(:func:`bsrattn.indexing.tile_query`), one query per thread, ``tile_rows`` query rows at a time. For each such
sub-tile the block walks the item's KV one ``tile_kv`` tile at a time, with a barrier after the gather and one
after the tile's last key. Each stage is the device function of its name here, but the fold::

    stage       what                                                       matches (bsrattn.reference)
    load_query  the thread's query row, decoded; fused RoPE turns it      microkernel.rope
    gather      the tile's K, V rows through kv_indptr/kv_indices into    gather.row_slots, gather.gather
                shared memory, decoded; fused RoPE turns the keys
    score       visible? (causal, window, custom mask), then q . k,       microkernel.scores, transform;
                scale, soft cap, ALiBi: the one score/mask function      indexing.key_visible
    accumulate  running max, rescale, running sum, P V (or sigmoid)       microkernel.attend
    finish      o = acc / l, lse = m + log l, into out or the workspace   microkernel.attend, executor.execute
    fold        each merge list's partial states folded with ⊕ in the     executor.execute, merge.merge_state
                plan's order (the tier's merge.plan_merge_kernel)

Each visible key updates its query's state on its own (the online softmax of Milakov and Gimelshein), where the
shipped kernel (:mod:`.executor`) updates once per tile; the two agree to rounding. NaN and infinities follow
:mod:`bsrattn.reference.microkernel`'s rules: a hidden key is skipped, never multiplied by a zero weight; a NaN or
``+inf`` score makes ``p`` NaN and so ``l``, ``o`` and ``lse``; a non-finite accumulator (a visible key's NaN or
infinite ``v``, even at weight 0) makes the whole row NaN; a row with ``l = 0`` is empty (``o = 0``, ``lse = -inf``).

dtypes: q/k/v float16 or float32 (computed in float32), float64 (computed in float64); bfloat16 q/k/v and fp8
(e4m3fn, e5m2) k/v given as NumPy (ml_dtypes) arrays are decoded from their bits as the shipped tier decodes them
(:mod:`.formats`). What the core leaves to the shipped kernel: deterministic mode's chunk grid (refused here), a
prior state, the affine path, loads a tile ahead, and host-side caches of views and launches.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from bsrattn import indexing, scheduler
from bsrattn.items import ITEM, item_table
from bsrattn.numba_cuda import arrays, config, launch
from bsrattn.numba_cuda.formats import compute_format, decoder, encoder, format_of, storage_dtype
from bsrattn.numba_cuda.gather import rows_view
from bsrattn.numba_cuda.launch import SIMULATOR, device
from bsrattn.numba_cuda.merge import plan_merge_kernel

# The shared index helpers, re-decorated as device functions.
sparse_slot, nhd_row, hnd_row, query_position, key_visible, mask_offset, tile_query, tile_head = map(device, (
    indexing.sparse_slot, indexing.nhd_row, indexing.hnd_row, indexing.query_position, indexing.key_visible,
    indexing.mask_offset, indexing.tile_query, indexing.tile_head))

QO_START, QO_END, KV_START, KV_END = ITEM["qo_start"], ITEM["qo_end"], ITEM["kv_start"], ITEM["kv_end"]
PARTIAL, QO_FIRST, QO_LEN, KV_LEN = ITEM["partial"], ITEM["qo_first"], ITEM["qo_len"], ITEM["kv_len"]
BLOCK_START, MASK_START, ROPE_OFFSET = ITEM["block_start"], ITEM["mask_start"], ITEM["rope_offset"]

QUERIES = 4 if SIMULATOR else 32  # (query row, head) pairs a block holds: its threads (the simulator runs each)
TILE_KV = 8 if SIMULATOR else 32  # keys gathered per step, at most (tile_kv below)
SHARED_BYTES = 48 * 1024          # static shared memory a block may declare

HEAD_DIM_VO = True  # v and out may be narrower (or wider) than q and k: multi-head latent attention


def tile_rows(group_size: int) -> int:
    """Query rows a block holds at once (the plan's ``tile_q``): ``QUERIES // G``, at least one."""
    return max(1, QUERIES // group_size)


def tile_kv(head_dim: int, dim_vo: int, compute_size: int) -> int:
    """Keys per shared tile: ``TILE_KV``, halved until the K tile (``head_dim`` wide) and the V tile (``dim_vo``)
    fit ``SHARED_BYTES``."""
    size = TILE_KV
    while size > 1 and size * (head_dim + dim_vo) * compute_size > SHARED_BYTES:
        size //= 2
    return size


@functools.cache
def kernels(head_dim, dim_vo, group_size, q_format, kv_format, kv_hnd, causal, soft_cap, alibi, sigmoid, rope,
            custom_mask):
    """``(attend, threads)``: the attention kernel and its block size, specialised on the shapes and dtypes (shared
    and local arrays need compile-time sizes: ``head_dim`` for q and k, ``dim_vo`` for v, the accumulator and out)
    and on the variant features that are on (the others compile away)."""
    compute = np.dtype(compute_format(q_format, kv_format)).type
    half, rows, width = head_dim // 2, tile_rows(group_size), max(head_dim, dim_vo)
    threads, keys = rows * group_size, tile_kv(head_dim, dim_vo, np.dtype(compute).itemsize)
    decode_q, decode_kv, encode_out = decoder(q_format, compute), decoder(kv_format, compute), encoder(q_format)
    neg_inf, zero, one, nan = compute(-math.inf), compute(0.0), compute(1.0), compute(math.nan)

    @device
    def turned(x, partner, d, pos, rope_freq):
        """Fused RoPE of element ``d``: dimensions ``d`` and ``d ± D/2`` turn together by ``pos * f[d mod D/2]``."""
        angle = compute(pos) * compute(rope_freq[d % half])
        sin = partner * math.sin(angle)
        return x * math.cos(angle) + (-sin if d < half else sin)

    @device
    def load_query(q_row, q, row, head, pos, rope_freq):
        """``q_row [D]`` (local) <- ``q[row, head]``, decoded, turned at ``pos`` with fused RoPE."""
        for d in range(head_dim):
            x = decode_q(q[row, head, d])
            if rope:
                x = turned(x, decode_q(q[row, head, (d + half) % head_dim]), d, pos, rope_freq)
            q_row[d] = x

    @device
    def gather(t, k_tile, v_tile, k_rows, v_rows, kv_indices, block_start, block_size, num_kv_heads, kv_head, kv0,
               kv_end, rope_offset, rope_freq):
        """``k_tile [tile_kv, D]``, ``v_tile [tile_kv, Dv]`` (shared) <- logical KV slots ``kv0..`` of the block row
        (pool slot ``kv_indices[kv_indptr[r] + i // Bc] * Bc + i % Bc``), decoded; fused RoPE turns each key at its
        slot plus the row's ``rope_offset``. Slots past ``kv_end`` are left as they are: no query reads them.
        One thread per (key, d), ``d`` over the wider of the two rows."""
        for e in range(t, keys * width, threads):
            j, d = e // width, e % width
            i = kv0 + j
            if i < kv_end:
                slot = sparse_slot(kv_indices, block_start, block_size, i)
                if kv_hnd:
                    row = hnd_row(slot, kv_head, num_kv_heads, block_size)
                else:
                    row = nhd_row(slot, kv_head, num_kv_heads)
                if d < head_dim:
                    x = decode_kv(k_rows[row, d])
                    if rope:
                        x = turned(x, decode_kv(k_rows[row, (d + half) % head_dim]), d, rope_offset + i, rope_freq)
                    k_tile[j, d] = x
                if d < dim_vo:
                    v_tile[j, d] = decode_kv(v_rows[row, d])

    @device
    def score(q_row, k_tile, j, q_pos, k_pos, local_q, head, kv_len, mask_start, mask, window_left, score_scale,
              cap, alibi_slopes):
        """``(visible, s)`` of key ``j`` of the tile (at ``k_pos``) for the thread's query (at ``q_pos``, row
        ``local_q`` of its block row): the position masks and the custom mask, then the score. A visible score
        may be ``-inf``, so visibility is returned apart."""
        visible = key_visible(q_pos, k_pos, causal, window_left)
        if custom_mask and visible:
            visible = mask[mask_offset(mask_start, kv_len, local_q, k_pos)]
        s = neg_inf
        if visible:
            dot = zero
            for d in range(head_dim):
                dot += q_row[d] * k_tile[j, d]
            s = dot * score_scale
            if soft_cap:
                s = cap * math.tanh(s / cap)
            if alibi:
                s += compute(alibi_slopes[head]) * compute(k_pos - q_pos)
        return visible, s

    @device
    def accumulate(acc, m, l, s, v_tile, j, sigmoid_bias):
        """One visible key's score ``s`` and value ``v_tile[j]`` into the state ``(acc [Dv], m, l)``; returns
        ``(m, l)``.

        Softmax: ``m' = max(m, s)``, ``alpha = exp(m - m')``, ``p = exp(s - m')``, ``l' = alpha l + p``,
        ``acc' = alpha acc + p v``. FlashSigmoid: ``acc' = acc + sigmoid(s + bias) v``.
        """
        if sigmoid:
            x = s + sigmoid_bias
            p = one / (one + math.exp(-x)) if x >= zero else math.exp(x) / (one + math.exp(x))  # exp never overflows
            for d in range(dim_vo):
                acc[d] += p * v_tile[j, d]
            return m, l
        m_new = s if s > m else m                        # a NaN score keeps m; its p is NaN
        m_safe = zero if m_new == neg_inf else m_new     # only -inf scores so far: shift by 0, not by -inf
        alpha, p = math.exp(m - m_safe), math.exp(s - m_safe)
        for d in range(dim_vo):
            acc[d] = acc[d] * alpha + p * v_tile[j, d]
        return m_new, l * alpha + p

    @device
    def finish(acc, m, l, v_scale, row, head, part_row, out, lse, part_o, part_lse):
        """Write ``o = acc / l`` and ``lse = m + log l`` (FlashSigmoid: ``acc`` and NaN; ``l = 0``: 0 and ``-inf``;
        a non-finite ``acc``: the row NaN) into ``out [nnz_qo, Hq, Dv]``, ``lse [nnz_qo, Hq]`` when ``part_row < 0``,
        else unencoded into workspace row ``part_row`` of ``part_o [P, Hq, Dv]``, ``part_lse [P, Hq]``."""
        bad = False
        for d in range(dim_vo):
            if not math.isfinite(acc[d]):
                bad = True
        s = nan if sigmoid else m + math.log(l) if l != zero else neg_inf
        weight = one if sigmoid else zero if l == zero else one / l
        for d in range(dim_vo):
            o = zero if weight == zero else nan if bad else acc[d] * weight * v_scale  # empty whatever v held
            if part_row < 0:
                out[row, head, d] = encode_out(o)
            else:
                part_o[part_row, head, d] = o
        if part_row < 0:
            lse[row, head] = s
        else:
            part_lse[part_row, head] = s

    def attend(q, k_rows, v_rows, out, lse, part_o, part_lse, items, kv_indices, mask, block_size, num_kv_heads,
               score_scale, v_scale, window_left, cap, sigmoid_bias, alibi_slopes, rope_freq, rope_q):
        """Block ``(w, kv_head)``: work item ``w`` for KV head ``kv_head`` and its ``G`` query heads.

        q [nnz_qo, Hq, D]; k_rows [rows, D], v_rows [rows, Dv] (the pool's rows, gather.rows_view; Dv = dim_vo);
        out [nnz_qo, Hq, Dv]; lse [nnz_qo, Hq]; part_o [P, Hq, Dv]; part_lse [P, Hq]; items [W, ITEM_STRIDE]
        (bsrattn.items); kv_indices [nnz]; mask [sum qo_len*kv_len] (custom mask); alibi_slopes [Hq];
        rope_freq [D/2]; rope_q [nnz_qo] (fused RoPE: each query row's position).
        """
        w, kv_head, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        k_tile = cuda.shared.array((keys, head_dim), compute)
        v_tile = cuda.shared.array((keys, dim_vo), compute)
        q_row = cuda.local.array(head_dim, compute)
        acc = cuda.local.array(dim_vo, compute)
        item_q0, item_q1, kv_start, kv_end = items[w, QO_START], items[w, QO_END], items[w, KV_START], items[w, KV_END]
        qo_first, qo_len, kv_len = items[w, QO_FIRST], items[w, QO_LEN], items[w, KV_LEN]
        head = tile_head(kv_head, group_size, t)
        for row0 in range(item_q0, item_q1, rows):
            row = row0 + tile_query(t, group_size)
            mine = row < item_q1  # a thread past the item's rows only helps gather
            local_q = row - qo_first
            q_pos = query_position(qo_len, kv_len, local_q)
            m, l = neg_inf, zero
            if mine:
                load_query(q_row, q, row, head, rope_q[row] if rope else 0, rope_freq)
                for d in range(dim_vo):
                    acc[d] = zero
            for kv0 in range(kv_start, kv_end, keys):
                gather(t, k_tile, v_tile, k_rows, v_rows, kv_indices, items[w, BLOCK_START], block_size, num_kv_heads,
                       kv_head, kv0, kv_end, items[w, ROPE_OFFSET], rope_freq)
                cuda.syncthreads()
                if mine:
                    for j in range(min(keys, kv_end - kv0)):
                        visible, s = score(q_row, k_tile, j, q_pos, kv0 + j, local_q, head, kv_len,
                                           items[w, MASK_START], mask, window_left, score_scale, cap, alibi_slopes)
                        if visible:
                            m, l = accumulate(acc, m, l, s, v_tile, j, sigmoid_bias)
                cuda.syncthreads()  # every query is done with the tile before the next gather overwrites it
            if mine:
                part = items[w, PARTIAL]
                finish(acc, m, l, v_scale, row, head, part + row - item_q0 if part >= 0 else -1, out, lse, part_o,
                       part_lse)

    return launch.kernel(attend, threads), threads


def plan_options(spec) -> dict:
    """Scheduler options: the tier's CTA count, query tiles of :func:`tile_rows`, chunks in whole ``TILE_KV`` tiles."""
    return dict(num_ctas=config.num_ctas(spec.num_kv_heads), tile_q=tile_rows(spec.group_size),
                min_split_size=TILE_KV, kv_align=TILE_KV)


class Runner:
    """A work plan bound to its spec: the item table and the variant's arrays on the device, uploaded once."""

    def __init__(self, spec, work_plan):
        if spec.split_size is not None:
            raise ValueError(f"deterministic=True (split_size={spec.split_size}) is not in the numba core: it has no "
                             f"chunk grid; use the shipped kernel")
        self.spec, self.work_plan = spec, work_plan
        layout, variant = spec.layout, spec.variant
        rope_q, rope_offsets = spec.rope_frame() if variant.use_rope else ([], None)
        self._items = arrays.resident(item_table(work_plan, layout, rope_offsets), np.int32)
        self._kv_indices = arrays.resident(layout.kv_indices, np.int32)
        self._mask = arrays.resident(layout.custom_mask if layout.custom_mask is not None else [], np.bool_)
        self._alibi = arrays.resident(variant.alibi_slopes or [], np.float64)
        self._rope_freq = arrays.resident(variant.rope_frequencies(spec.head_dim) if variant.use_rope else [],
                                          np.float64)
        self._rope_q = arrays.resident(rope_q, np.int32)
        self._merges = tuple(arrays.resident(a, np.int32) for a in (
            work_plan.merge_indptr, work_plan.merge_partials, work_plan.merge_qo_start, work_plan.merge_qo_end))

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """Attention of ``q [nnz_qo, Hq, D]`` over ``k, v`` (the spec's storage); returns ``(out [nnz_qo, Hq, Dv],
        lse or None)``, ``Dv`` the head dimension of ``v`` (``spec.dim_vo``)."""
        spec, wp, variant = self.spec, self.work_plan, self.spec.variant
        q_format, kv_format = format_of(q), format_of(k)
        compute_name = compute_format(q_format, kv_format)
        compute = np.dtype(compute_name).type
        attend, threads = kernels(
            spec.head_dim, spec.dim_vo, spec.group_size, q_format, kv_format, spec.kv_view_of(k) == "HND",
            variant.causal, variant.logits_soft_cap > 0, variant.alibi_slopes is not None, variant.use_sigmoid,
            variant.use_rope, spec.layout.custom_mask is not None)
        q_dev = arrays.device_array(q, "q")
        k_dev, v_dev = (arrays.device_array(x, name, rows=True) for x, name in ((k, "k"), (v, "v")))
        shape = (spec.layout.nnz_qo, spec.num_qo_heads, spec.dim_vo)
        want_lse = not variant.use_sigmoid and (return_lse or lse is not None)
        out_dev = arrays.target(out, shape, q_format, "out")
        lse_dev = arrays.target(lse if want_lse else None, shape[:2], compute_name, "lse")
        part_o = arrays.empty((max(1, wp.num_partial_rows),) + shape[1:], compute_name)
        part_lse = arrays.empty(part_o.shape[:2], compute_name)
        element = np.dtype(storage_dtype(kv_format))
        if wp.num_items:
            launch.run(attend, (wp.num_items, spec.num_kv_heads), threads, q_dev,
                       rows_view(k_dev, spec.head_dim, element), rows_view(v_dev, spec.dim_vo, element), out_dev,
                       lse_dev, part_o, part_lse, self._items, self._kv_indices, self._mask, spec.layout.block_size,
                       spec.num_kv_heads, compute(spec.sm_scale * (k_scale or 1.0)), compute(v_scale or 1.0),
                       variant.window_left, compute(variant.logits_soft_cap or 1.0),
                       compute(variant.sigmoid_bias or 0.0), self._alibi, self._rope_freq, self._rope_q)
        if wp.num_merges:
            fold = plan_merge_kernel(compute_name, q_format, spec.dim_vo, variant.use_sigmoid, config.MERGE_THREADS)
            launch.run(fold, (wp.num_merges, spec.num_qo_heads), config.MERGE_THREADS, part_o, part_lse, out_dev,
                       lse_dev, *self._merges)
        return (arrays.deliver(out_dev, q_format, q, out),
                arrays.deliver(lse_dev, compute_name, q, lse) if want_lse else None)


def make_runner(spec, work_plan, previous=None):
    """Bind ``work_plan`` to ``spec``; ``previous`` is accepted for the tier's signature and not used (no reuse)."""
    return Runner(spec, work_plan)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """Plan with :func:`plan_options`, then run: see :func:`bsrattn.attention`."""
    work_plan = scheduler.plan(spec.layout.qo_lens, spec.layout.kv_lens, **plan_options(spec))
    return Runner(spec, work_plan).run(q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale,
                                       v_scale=v_scale)
