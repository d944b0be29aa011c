"""The persistent kernel that executes a :class:`~bsrattn.scheduler.WorkPlan`, then the deterministic merge.

Matches :func:`bsrattn.reference.executor.execute`, CTA for CTA. The grid is fixed by the plan, not by the
batch: ``(work_plan.num_ctas, num_kv_heads)`` blocks. Block ``(c, h)`` walks CTA ``c``'s items
``cta_indptr[c]:cta_indptr[c+1]`` in order, for KV head ``h`` and its ``G`` query heads. For each item, and
each sub-tile of its query rows, it loops over the item's KV range one ``tile_kv`` tile at a time::

    load_rows      next tile's K and V rows -> registers (in flight from here)   gather.py
    scores         q . k, scale, soft cap, ALiBi, masks                          microkernel.py
    probabilities  p = exp(s - m_new), alpha = exp(m - m_new) (or sigmoid)      microkernel.py
    accumulate     acc = alpha acc + P V, l = alpha l + sum p                    microkernel.py
    store_rows     registers -> shared memory: the next tile is ready            gather.py
    resolve_rows   storage rows of the tile after it (sparse or dense path)      gather.py

with a block-wide barrier after scores, probabilities, accumulate and the store. The gather runs one tile
ahead of the microkernel, through registers, so a block always has loads in flight while it computes.

Then the item writes its state: an unsplit item writes ``out``/``lse`` directly; an item of a split tile
writes its partial ``(o, lse)`` into its plan-assigned workspace rows, which the merge kernel
(:func:`.merge.plan_merge_kernel`) folds afterwards in the plan's order. No atomics anywhere, so the result
is a pure function of the inputs and the plan.

Kernels are specialised per :class:`Config` (head_dim, GQA group, dtypes, storage order, which variant
features are on): the shapes of shared and local arrays must be compile-time constants in CUDA, and features
that are off compile away.

How the kernel got here (read off the sm_90 PTX and ``ptxas -v``; GPU timings: ``tests/gpu_numba_check.py``):

1. a copy that waited for each load before the next: one 8-byte load in flight per thread;
2. two-phase copy (all of a thread's loads, then all stores): the loads unroll and travel together;
3. ``while`` instead of ``range()`` in the innermost loops: 4 instructions per dot-product step, not 21;
4. query sub-tiles sized by the plan's tallest item: decode holds 1 query row, not 16, which frees the
   shared memory for 64-key tiles (35 KB a block with fp16, head_dim 128);
5. the gather one tile ahead through registers (this file): loads overlap the microkernel; ~250 registers
   a thread, so 2 blocks of 128 threads per SM (``launch.CTAS_PER_SM``).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
from numba import cuda

from bsrattn.numba_cuda import arrays, launch
from bsrattn.numba_cuda.formats import compute_format, format_of, numpy_dtype, storage_dtype
from bsrattn.numba_cuda.gather import affine_row_starts, copy_word, make_gather, rows_view
from bsrattn.numba_cuda.merge import plan_merge_kernel
from bsrattn.numba_cuda.microkernel import make_microkernel

# Rows of the packed item table ``items [NUM_ITEM_FIELDS, W]`` (the WorkPlan's per-item arrays, stacked).
ITEM_ROW, ITEM_QO_START, ITEM_QO_END, ITEM_KV_START, ITEM_KV_END, ITEM_PARTIAL = range(6)
NUM_ITEM_FIELDS = 6


@dataclass(frozen=True)
class Config:
    """Everything a compiled attention kernel is specialised on."""

    head_dim: int
    group: int              # query heads per KV head
    q_format: str           # also the output's
    kv_format: str
    compute_name: str       # "float32", or "float64" for float64 inputs
    kv_hnd: bool            # k/v stored HND ([blocks, Hkv, Bc, D]) rather than NHD
    dense: bool             # every row's KV is one contiguous run: the affine load path
    causal: bool
    window: bool            # a sliding window (window_left >= 0)
    soft_cap: bool
    alibi: bool
    sigmoid: bool
    custom_mask: bool
    word_size: int          # bytes per copied word
    num_threads: int
    tile_kv: int
    tile_rows: int          # query rows per sub-tile
    min_blocks: int = 0     # launch bound: blocks per SM the compiler must fit (0: its choice)

    @property
    def hidden_keys(self) -> bool:
        """Whether a key inside an item's range can be hidden from some of its queries (causal, window,
        custom mask): such pairs are tracked in shared memory, so that their ``v`` never reaches ``P @ V``."""
        return self.causal or self.window or self.custom_mask

    @property
    def compute(self):
        """The compute scalar type (a NumPy type: a cast in kernels and in the simulator alike)."""
        return np.dtype(self.compute_name).type

    @property
    def word(self) -> np.dtype:
        return np.dtype(f"u{self.word_size}")

    @property
    def element(self) -> np.dtype:
        """How a gathered K/V element is stored (the raw bits for bf16 and fp8)."""
        return np.dtype(storage_dtype(self.kv_format))

    @property
    def row_words(self) -> int:
        return self.head_dim * self.element.itemsize // self.word_size

    @property
    def row_stride(self) -> int:
        """Words per row of a shared K/V tile: one word of padding staggers rows across the memory banks, so
        threads reading different keys' rows do not all queue on one bank."""
        return self.row_words + 1

    @property
    def max_nq(self) -> int:
        return self.tile_rows * self.group

    @property
    def acc_per_thread(self) -> int:
        return -(-self.max_nq * self.head_dim // self.num_threads)

    @property
    def words_per_thread(self) -> int:
        """Words of one K (or V) tile each thread copies."""
        return -(-self.tile_kv * self.row_words // self.num_threads)


def shared_bytes(head_dim, group, tile_rows, tile_kv, row_bytes, word_size, compute_size) -> int:
    """Static shared memory of one block: K and V tiles, queries, scores and probabilities, running state,
    tile rows, and the visible (query, key) pairs of a tile (one byte each)."""
    nq = tile_rows * group
    kv = 2 * tile_kv * (row_bytes + word_size)
    return kv + compute_size * (nq * head_dim + 2 * nq * tile_kv + 5 * nq) + 8 * tile_kv + nq * tile_kv


def query_tile_rows(group: int) -> int:
    """Query rows a block holds at once: ``MAX_QUERIES // G``, at least one (the plan's ``tile_q``).

    Examples
    --------
    >>> from bsrattn.numba_cuda import launch
    >>> query_tile_rows(1) == launch.MAX_QUERIES, query_tile_rows(10 * launch.MAX_QUERIES)
    (True, 1)
    """
    return max(1, launch.MAX_QUERIES // group)


def choose_tiles(head_dim, group, kv_itemsize, word_size, compute_size, item_rows):
    """``(tile_rows, tile_kv)``: :func:`query_tile_rows`, or fewer when no work item has more query rows
    (decode: 1), and the largest power-of-two KV tile up to ``TILE_KV`` whose shared memory fits
    ``SHARED_MEMORY_LIMIT``.

    Examples
    --------
    >>> from bsrattn.numba_cuda import launch
    >>> rows, tile_kv = choose_tiles(128, 1, 2, 8, 4, item_rows=1)   # fp16 decode, head_dim 128
    >>> rows, tile_kv == launch.TILE_KV
    (1, True)
    """
    tile_rows = max(1, min(query_tile_rows(group), item_rows))
    tile_kv = launch.TILE_KV
    while shared_bytes(head_dim, group, tile_rows, tile_kv, head_dim * kv_itemsize, word_size,
                       compute_size) > launch.SHARED_MEMORY_LIMIT:
        if tile_kv == 1:
            raise ValueError(f"head_dim={head_dim} with {group} query heads per KV head does not fit the numba "
                             f"tier's {launch.SHARED_MEMORY_LIMIT} bytes of shared memory per block")
        tile_kv //= 2
    return tile_rows, tile_kv


@functools.cache
def persistent_kernel(cfg: Config):
    """The compiled-on-first-launch attention kernel for ``cfg``."""
    resolve_rows, load_rows, store_rows = make_gather(cfg)
    load_queries, scores, probabilities, accumulate, flag_rows, finish = make_microkernel(cfg)
    compute, word, element = cfg.compute, cfg.word, cfg.element
    head_dim, group, tile_kv, tile_rows, max_nq = cfg.head_dim, cfg.group, cfg.tile_kv, cfg.tile_rows, cfg.max_nq
    row_stride, acc_per_thread, words_per_thread = cfg.row_stride, cfg.acc_per_thread, cfg.words_per_thread
    seen_shape = (max_nq, tile_kv) if cfg.hidden_keys else (1, 1)

    def persistent(q, k_words, v_words, out, lse, part_o, part_lse, cta_indptr, items, qo_indptr, kv_indptr,
                   kv_indices, kv_lens, row_slot_start, mask_indptr, mask, block_size, num_kv_heads, score_scale,
                   v_scale, window_left, cap, alibi_slopes, sigmoid_bias):
        """One block per (CTA, KV head), walking the CTA's work items.

        q [nnz_qo, Hq, D]; k_words, v_words [rows, row_words] (storage rows, see gather.rows_view);
        out [nnz_qo, Hq, D]; lse [nnz_qo, Hq]; part_o [P, Hq, D]; part_lse [P, Hq]; cta_indptr [num_ctas+1];
        items [NUM_ITEM_FIELDS, W]; qo_indptr, kv_indptr [R+1]; kv_indices [nnz]; kv_lens, row_slot_start [R];
        mask_indptr [R+1]; mask [sum qo_len*kv_len] (custom mask); alibi_slopes [Hq].
        """
        cta, kv_head, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        # Shared memory, one allocation per purpose (the simulator pays for each allocation site).
        q_tile = cuda.shared.array((max_nq, head_dim), compute)
        kv_tiles = cuda.shared.array((2, tile_kv, row_stride), word)   # the gathered K and V rows
        weights = cuda.shared.array((2, max_nq, tile_kv), compute)     # scores s, then probabilities p
        state = cuda.shared.array((5, max_nq), compute)                # per query: m, m_new, l, alpha, bad
        tile_rows_s = cuda.shared.array(tile_kv, np.int64)
        seen = cuda.shared.array(seen_shape, np.uint8)                 # visible (query, key) pairs of a tile
        k_tile, v_tile = kv_tiles[0], kv_tiles[1]
        s_tile, p_tile = weights[0], weights[1]
        m_run, m_next, l_run, alpha, bad = state[0], state[1], state[2], state[3], state[4]
        acc = cuda.local.array(acc_per_thread, compute)
        k_staged = cuda.local.array(words_per_thread, word)
        v_staged = cuda.local.array(words_per_thread, word)
        k_el, v_el = k_tile.view(element), v_tile.view(element)

        for w in range(cta_indptr[cta], cta_indptr[cta + 1]):
            r = items[ITEM_ROW, w]
            item_q0, item_q1 = items[ITEM_QO_START, w], items[ITEM_QO_END, w]
            kv_start, kv_end = items[ITEM_KV_START, w], items[ITEM_KV_END, w]
            part_row0 = items[ITEM_PARTIAL, w]
            row_q_start, kv_len = qo_indptr[r], kv_lens[r]
            qo_len = qo_indptr[r + 1] - row_q_start
            for q_row0 in range(item_q0, item_q1, tile_rows):
                nq = min(tile_rows, item_q1 - q_row0) * group
                load_queries(t, q_tile, m_run, l_run, bad, acc, q, q_row0, nq, kv_head)
                resolve_rows(t, tile_rows_s, kv_indices, kv_indptr[r], row_slot_start[r], block_size, num_kv_heads,
                             kv_head, kv_start, kv_end)
                cuda.syncthreads()
                load_rows(t, k_staged, v_staged, k_words, v_words, tile_rows_s)
                cuda.syncthreads()  # every thread has read tile_rows_s before it is overwritten
                store_rows(t, k_staged, v_staged, k_tile, v_tile)
                resolve_rows(t, tile_rows_s, kv_indices, kv_indptr[r], row_slot_start[r], block_size, num_kv_heads,
                             kv_head, kv_start + tile_kv, kv_end)
                cuda.syncthreads()
                for kv0 in range(kv_start, kv_end, tile_kv):
                    # Issue the next tile's loads now; they travel while this tile is computed.
                    load_rows(t, k_staged, v_staged, k_words, v_words, tile_rows_s)
                    scores(t, s_tile, seen, q_tile, k_el, nq, kv0, kv_end, q_row0, row_q_start, qo_len, kv_len,
                           kv_head, score_scale, window_left, cap, alibi_slopes, mask_indptr[r], mask)
                    cuda.syncthreads()
                    probabilities(t, s_tile, p_tile, m_run, m_next, alpha, nq, sigmoid_bias)
                    cuda.syncthreads()
                    accumulate(t, acc, m_run, l_run, m_next, alpha, p_tile, seen, v_el, nq)
                    cuda.syncthreads()
                    store_rows(t, k_staged, v_staged, k_tile, v_tile)
                    resolve_rows(t, tile_rows_s, kv_indices, kv_indptr[r], row_slot_start[r], block_size,
                                 num_kv_heads, kv_head, kv0 + 2 * tile_kv, kv_end)
                    cuda.syncthreads()
                flag_rows(t, acc, bad, nq)
                cuda.syncthreads()
                finish(t, acc, m_run, l_run, bad, nq, q_row0, kv_head, v_scale, out, lse, item_q0, part_o, part_lse,
                       part_row0)
                cuda.syncthreads()

    return launch.kernel(persistent, cfg.num_threads, cfg.min_blocks)


def _address(x) -> int:
    """Device pointer of ``x`` (0 under the simulator, whose arrays are host memory)."""
    return getattr(x, "__cuda_array_interface__", {"data": (0,)})["data"][0]


class Runner:
    """A :class:`~bsrattn.scheduler.WorkPlan` bound to its spec, its index arrays resident on the device.

    ``run`` launches the persistent kernel (grid ``(num_ctas, num_kv_heads)``) and, when the plan split any
    tile, the merge kernel (grid ``(num_merges, num_qo_heads)``). The workspace for partial states is kept and
    reused by later plans of the same BatchAttention when it is large enough.
    """

    def __init__(self, spec, work_plan, previous=None):
        self.spec = spec
        self.work_plan = work_plan
        layout = spec.layout
        starts = affine_row_starts(layout)
        self.dense = starts is not None
        heights = work_plan.item_qo_end - work_plan.item_qo_start
        self.item_rows = int(heights.max()) if heights.size else 1
        self._layout_args = (
            arrays.resident(layout.qo_indptr, np.int32), arrays.resident(layout.kv_indptr, np.int32),
            arrays.resident(layout.kv_indices, np.int32), arrays.resident(layout.kv_lens, np.int32),
            arrays.resident(starts if self.dense else np.zeros(layout.num_rows), np.int32),
            arrays.resident(layout.mask_indptr, np.int64),
            arrays.resident(layout.custom_mask if layout.custom_mask is not None else [], np.bool_))
        items = np.stack([work_plan.item_row, work_plan.item_qo_start, work_plan.item_qo_end,
                          work_plan.item_kv_start, work_plan.item_kv_end, work_plan.item_partial])
        self._plan_args = (arrays.resident(work_plan.cta_indptr, np.int32),
                           arrays.resident(items, np.int32) if items.size else None)
        self._merge_args = tuple(arrays.resident(a, np.int32) for a in (
            work_plan.merge_indptr, work_plan.merge_partials, work_plan.merge_qo_start, work_plan.merge_qo_end))
        variant = spec.variant
        self._alibi = arrays.resident(variant.alibi_slopes if variant.alibi_slopes is not None else [], np.float64)
        # The workspace serves one call at a time: a second thread's launches would overwrite partial states
        # the first call's merge has not read yet (every launch goes to the default stream, in call order).
        self._workspace = previous._workspace if previous is not None else {}
        self._lock = previous._lock if previous is not None else threading.Lock()

    def workspace(self, compute_name: str):
        """``(part_o [P, Hq, D], part_lse [P, Hq])`` in the compute dtype, allocated once per size."""
        rows = max(1, self.work_plan.num_partial_rows)
        shape = (rows, self.spec.num_qo_heads, self.spec.head_dim)
        held = self._workspace.get(compute_name)
        if held is None or held[0].shape[0] < rows or tuple(held[0].shape[1:]) != shape[1:]:
            held = (arrays.empty(shape, compute_name), arrays.empty(shape[:2], compute_name))
            self._workspace[compute_name] = held
        return held

    def config(self, q_format, kv_format, kv_view, word_size) -> Config:
        spec, variant = self.spec, self.spec.variant
        compute_name = compute_format(q_format, kv_format)
        tile_rows, tile_kv = choose_tiles(spec.head_dim, spec.group_size, numpy_dtype(kv_format).itemsize,
                                          word_size, np.dtype(compute_name).itemsize, self.item_rows)
        return Config(head_dim=spec.head_dim, group=spec.group_size, q_format=q_format, kv_format=kv_format,
                      compute_name=compute_name, kv_hnd=kv_view == "HND", dense=self.dense, causal=variant.causal,
                      window=variant.window_left >= 0, soft_cap=variant.logits_soft_cap > 0,
                      alibi=variant.alibi_slopes is not None,
                      sigmoid=variant.use_sigmoid, custom_mask=spec.layout.custom_mask is not None,
                      word_size=word_size, num_threads=launch.NUM_THREADS, tile_kv=tile_kv, tile_rows=tile_rows,
                      min_blocks=launch.MIN_BLOCKS_PER_SM)

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """Attention of ``q [nnz_qo, Hq, D]`` over ``k, v`` (the spec's storage); returns ``(out, lse or None)``."""
        spec, variant = self.spec, self.spec.variant
        q_format, kv_format = format_of(q), format_of(k)
        q_dev, k_dev, v_dev = (arrays.device_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        row_bytes = spec.head_dim * numpy_dtype(kv_format).itemsize
        cfg = self.config(q_format, kv_format, spec.kv_view_of(k),
                          copy_word(row_bytes, _address(k_dev), _address(v_dev)).itemsize)
        lse_format = cfg.compute_name
        nnz_qo, num_qo_heads = spec.layout.nnz_qo, spec.num_qo_heads
        out_dev = arrays.target(out, (nnz_qo, num_qo_heads, spec.head_dim), q_format, "out")
        lse_dev = arrays.target(lse, (nnz_qo, num_qo_heads), lse_format, "lse")
        with self._lock:
            self._launch(cfg, q_dev, k_dev, v_dev, out_dev, lse_dev, k_scale, v_scale)
        result_o = arrays.deliver(out_dev, q_format, q, out)
        want_lse = not variant.use_sigmoid and (return_lse or lse is not None)
        return result_o, (arrays.deliver(lse_dev, lse_format, q, lse) if want_lse else None)

    def _launch(self, cfg, q_dev, k_dev, v_dev, out_dev, lse_dev, k_scale, v_scale):
        """The persistent kernel, then the plan's merge, over this runner's workspace."""
        spec, work_plan, variant = self.spec, self.work_plan, self.spec.variant
        compute = cfg.compute
        part_o, part_lse = self.workspace(cfg.compute_name)
        if work_plan.num_items:
            launch.run(persistent_kernel(cfg), (work_plan.num_ctas, spec.num_kv_heads), cfg.num_threads,
                q_dev, rows_view(k_dev, spec.head_dim, cfg.word), rows_view(v_dev, spec.head_dim, cfg.word),
                out_dev, lse_dev, part_o, part_lse, *self._plan_args, *self._layout_args,
                spec.layout.block_size, spec.num_kv_heads, compute(spec.sm_scale * (k_scale or 1.0)),
                compute(v_scale or 1.0), variant.window_left, compute(variant.logits_soft_cap or 1.0), self._alibi,
                compute(variant.sigmoid_bias or 0.0))
        if work_plan.num_merges:
            merge = plan_merge_kernel(cfg.compute_name, cfg.q_format, spec.head_dim, cfg.sigmoid,
                                      launch.MERGE_THREADS)
            launch.run(merge, (work_plan.num_merges, spec.num_qo_heads), launch.MERGE_THREADS,
                       part_o, part_lse, out_dev, lse_dev, *self._merge_args)
