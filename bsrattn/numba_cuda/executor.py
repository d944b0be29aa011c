"""The shipped kernel, over the core (:mod:`.core`): a persistent grid, the gather a tile ahead, the affine path.

What it adds to the core's kernel, which runs one block per work item and gathers, then computes: one block per
(plan CTA, KV head) walking that CTA's items, so the launch is fixed by the plan; the next tile's K and V in flight
while the microkernel runs on this one; rows whose KV is one run of slots read affinely, without the indices;
deterministic mode (:mod:`.runner`: items of one chunk of the grid, a KV tile that no plan changes).

Matches :func:`bsrattn.reference.executor.execute`, CTA for CTA. The grid is fixed by the plan, not by the
batch: ``(work_plan.num_ctas, num_kv_heads)`` blocks. Block ``(c, h)`` walks CTA ``c``'s items
``cta_indptr[c]:cta_indptr[c+1]`` in order, for KV head ``h`` and its ``G`` query heads (where their queries
alone would overflow shared memory, as MLA's 128 heads over one 576-wide latent head do, each KV head's heads
are shared among ``cfg.head_groups`` blocks, which read the same tiles). For each item, and
each sub-tile of its query rows, it loops over the item's KV range one ``tile_kv`` tile at a time::

    load_rows      next tile's K and V rows -> registers (in flight from here)   gather.py
    turn_keys      fused RoPE only: the K tile turned at its positions           microkernel.py
    scores         q . k, scale, soft cap, ALiBi, masks                          microkernel.py
    probabilities  p = exp(s - m_new), alpha = exp(m - m_new) (or sigmoid)      microkernel.py
    accumulate     acc = alpha acc + P V, l = alpha l + sum p                    microkernel.py
    store_rows     registers -> shared memory: the next tile is ready            gather.py
    resolve_rows   storage rows of the tile after it (sparse or affine path)      gather.py

with a block-wide barrier after scores, probabilities, accumulate and the store. The gather runs one tile
ahead of the microkernel, through registers, so a block always has loads in flight while it computes.

Then the item writes its state: an unsplit item writes ``out``/``lse`` directly; an item of a split tile
writes its partial ``(o, lse)`` into its plan-assigned workspace rows, which the merge kernel
(:func:`.merge.plan_merge_kernel`) folds afterwards in the plan's order. No atomics anywhere, so the result
is a pure function of the inputs and the plan.

Kernels are specialised per :class:`~bsrattn.numba_cuda.config.Config` (head_dim, the value width dim_vo, GQA
group, dtypes, storage order, which variant features are on): the shapes of shared and local arrays must be
compile-time constants in CUDA, and features that are off compile away.

How the kernel got here, one rung at a time (a copy that waited for each load; the two-phase copy; ``while``
for ``range()`` in the innermost loops; query sub-tiles sized by the plan; the gather one tile ahead through
registers, this file): what each rung added, what it measured and its commit are the numba tier's ladder in
``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from bsrattn.items import ITEM
from bsrattn.numba_cuda import launch
from bsrattn.numba_cuda.config import Config
from bsrattn.numba_cuda.gather import make_gather
from bsrattn.numba_cuda.microkernel import make_microkernel

# Columns of the item rows (bsrattn.items.ITEM_FIELDS), as compile-time constants of the kernel.
QO_START, QO_END, KV_START, KV_END = ITEM["qo_start"], ITEM["qo_end"], ITEM["kv_start"], ITEM["kv_end"]
PARTIAL, QO_FIRST, QO_LEN, KV_LEN = ITEM["partial"], ITEM["qo_first"], ITEM["qo_len"], ITEM["kv_len"]
BLOCK_START, FIRST_SLOT, MASK_START = ITEM["block_start"], ITEM["first_slot"], ITEM["mask_start"]
ROPE_OFFSET = ITEM["rope_offset"]


@functools.cache
def persistent_kernel(cfg: Config):
    """The compiled-on-first-launch attention kernel for ``cfg``."""
    resolve_rows, load_rows, store_rows = make_gather(cfg)
    load_queries, turn_keys, scores, probabilities, accumulate, flag_rows, finish = make_microkernel(cfg)
    compute, word, element = cfg.compute, cfg.word, cfg.element
    head_dim, group_size, tile_kv, head_groups = cfg.head_dim, cfg.group_size, cfg.tile_kv, cfg.head_groups
    tile_rows, max_nq = cfg.tile_rows, cfg.max_nq
    row_stride, v_row_stride, acc_per_thread = cfg.row_stride, cfg.v_row_stride, cfg.acc_per_thread
    words_per_thread, v_words_per_thread = cfg.words_per_thread, cfg.v_words_per_thread
    seen_shape = (max_nq, tile_kv) if cfg.hidden_keys else (1, 1)
    rope = cfg.rope
    turned_shape = (tile_kv, head_dim) if rope else (1, 1)

    def persistent(q, k_words, v_words, out, lse, part_o, part_lse, cta_indptr, items, kv_indices, mask,
                   block_size, num_kv_heads, score_scale, v_scale, window_left, cap, alibi_slopes, rope_freq, rope_q,
                   sigmoid_bias):
        """One block per (CTA, head group), walking the CTA's work items: head group ``y`` is query heads
        ``y * G .. y * G + G - 1`` (``G``: ``cfg.group_size``) of KV head ``y // cfg.head_groups``.

        q [nnz_qo, Hq, D]; k_words [rows, row_words], v_words [rows, v_row_words] (storage rows, see
        gather.rows_view; v's are Dv = cfg.dim_vo wide); out [nnz_qo, Hq, Dv]; lse [nnz_qo, Hq]; part_o [P, Hq, Dv];
        part_lse [P, Hq]; cta_indptr [num_ctas+1];
        items [W, ITEM_STRIDE] (bsrattn.items); kv_indices [nnz]; mask [sum qo_len*kv_len] (custom mask);
        alibi_slopes [Hq]; rope_freq [D/2] and rope_q [nnz_qo] (fused RoPE: the frequencies, each query row's
        position; an item's keys sit at its row's rope_offset plus their slot).
        """
        cta, head_group, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        kv_head = head_group // head_groups  # the KV head whose tiles the block reads
        # Shared memory, one allocation per purpose (the simulator pays for each allocation site).
        q_tile = cuda.shared.array((max_nq, head_dim), compute)
        k_tile = cuda.shared.array((tile_kv, row_stride), word)        # the gathered K rows
        v_tile = cuda.shared.array((tile_kv, v_row_stride), word)      # and V rows
        weights = cuda.shared.array((2, max_nq, tile_kv), compute)     # scores s, then probabilities p
        state = cuda.shared.array((5, max_nq), compute)                # per query: m, m_new, l, alpha, bad
        kv_rows_s = cuda.shared.array(tile_kv, np.int64)
        seen = cuda.shared.array(seen_shape, np.uint8)                 # visible (query, key) pairs of a tile
        k_turned = cuda.shared.array(turned_shape, compute)            # fused RoPE: the K tile, turned
        s_tile, p_tile = weights[0], weights[1]
        m_run, m_next, l_run, alpha, bad = state[0], state[1], state[2], state[3], state[4]
        acc = cuda.local.array(acc_per_thread, compute)
        k_staged = cuda.local.array(words_per_thread, word)
        v_staged = cuda.local.array(v_words_per_thread, word)
        k_el, v_el = k_tile.view(element), v_tile.view(element)

        for w in range(cta_indptr[cta], cta_indptr[cta + 1]):
            item_q0, item_q1 = items[w, QO_START], items[w, QO_END]
            kv_start, kv_end = items[w, KV_START], items[w, KV_END]
            part_row0 = items[w, PARTIAL]
            row_q_start, qo_len, kv_len = items[w, QO_FIRST], items[w, QO_LEN], items[w, KV_LEN]
            block_start, first_slot, mask_start = items[w, BLOCK_START], items[w, FIRST_SLOT], items[w, MASK_START]
            rope_offset = items[w, ROPE_OFFSET]
            for q_row0 in range(item_q0, item_q1, tile_rows):
                nq = min(tile_rows, item_q1 - q_row0) * group_size
                load_queries(t, q_tile, m_run, l_run, bad, acc, q, q_row0, nq, head_group, rope_freq, rope_q)
                resolve_rows(t, kv_rows_s, kv_indices, block_start, first_slot, block_size, num_kv_heads,
                             kv_head, kv_start, kv_end)
                cuda.syncthreads()
                load_rows(t, k_staged, v_staged, k_words, v_words, kv_rows_s)
                cuda.syncthreads()  # every thread has read kv_rows_s before it is overwritten
                store_rows(t, k_staged, v_staged, k_tile, v_tile)
                resolve_rows(t, kv_rows_s, kv_indices, block_start, first_slot, block_size, num_kv_heads,
                             kv_head, kv_start + tile_kv, kv_end)
                cuda.syncthreads()
                for kv0 in range(kv_start, kv_end, tile_kv):
                    # Issue the next tile's loads now; they travel while this tile is computed.
                    load_rows(t, k_staged, v_staged, k_words, v_words, kv_rows_s)
                    if rope:
                        turn_keys(t, k_turned, k_el, kv0, kv_end, rope_offset, rope_freq)
                        cuda.syncthreads()
                    scores(t, s_tile, seen, q_tile, k_el, k_turned, nq, kv0, kv_end, q_row0, row_q_start, qo_len,
                           kv_len, head_group, score_scale, window_left, cap, alibi_slopes, mask_start, mask)
                    cuda.syncthreads()
                    probabilities(t, s_tile, p_tile, m_run, m_next, alpha, nq, sigmoid_bias)
                    cuda.syncthreads()
                    accumulate(t, acc, m_run, l_run, m_next, alpha, p_tile, seen, v_el, nq)
                    cuda.syncthreads()
                    store_rows(t, k_staged, v_staged, k_tile, v_tile)
                    resolve_rows(t, kv_rows_s, kv_indices, block_start, first_slot, block_size,
                                 num_kv_heads, kv_head, kv0 + 2 * tile_kv, kv_end)
                    cuda.syncthreads()
                flag_rows(t, acc, bad, nq)
                cuda.syncthreads()
                finish(t, acc, m_run, l_run, bad, nq, q_row0, head_group, v_scale, out, lse, item_q0, part_o,
                       part_lse, part_row0)
                cuda.syncthreads()

    return launch.kernel(persistent, cfg.num_threads, cfg.min_blocks)
