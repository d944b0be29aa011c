"""A plan bound to its spec, index arrays resident on the device; and the one-shot call.

``run`` launches the persistent kernel (:mod:`.executor`) and, when the plan split any tile, the merge kernel
(:mod:`.merge`).
"""

from __future__ import annotations

import threading

import numpy as np

from bsrattn import scheduler
from bsrattn.items import item_table
from bsrattn.numba_cuda import arrays, config, launch
from bsrattn.numba_cuda.config import Config, choose_tiles, plan_options
from bsrattn.numba_cuda.executor import persistent_kernel
from bsrattn.numba_cuda.formats import compute_format, format_of, numpy_dtype
from bsrattn.numba_cuda.gather import copy_word, rows_view
from bsrattn.numba_cuda.merge import plan_merge_kernel


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
        heights = work_plan.item_qo_end - work_plan.item_qo_start
        if spec.split_size is not None and work_plan.num_items and \
                int((work_plan.item_kv_end - work_plan.item_kv_start).max()) > spec.split_size:
            raise ValueError(f"the numba tier's deterministic kernel runs items of one chunk of the grid "
                             f"(split_size={spec.split_size}); this plan has longer ones: plan with the tier's "
                             f"own options (BatchAttention.plan)")
        # Deterministic mode: the KV tile must not depend on the plan (config.choose_tiles sizes it by the query
        # rows it holds), so every plan takes the tallest query tile's.
        self.item_rows = (config.query_tile_rows(spec.group_size) if spec.split_size is not None
                          else int(heights.max()) if heights.size else 1)
        variant = spec.variant
        rope_q, rope_offsets = spec.rope_frame() if variant.use_rope else ([], None)
        self._plan_args = (arrays.resident(work_plan.cta_indptr, np.int32),
                           arrays.resident(item_table(work_plan, layout, rope_offsets), np.int32)
                           if work_plan.num_items else None,
                           arrays.resident(layout.kv_indices, np.int32),
                           arrays.resident(layout.custom_mask if layout.custom_mask is not None else [], np.bool_))
        self._merge_args = tuple(arrays.resident(a, np.int32) for a in (
            work_plan.merge_indptr, work_plan.merge_partials, work_plan.merge_qo_start, work_plan.merge_qo_end))
        self._alibi = arrays.resident(variant.alibi_slopes if variant.alibi_slopes is not None else [], np.float64)
        self._rope = arrays.resident(variant.rope_frequencies(spec.head_dim) if variant.use_rope else [], np.float64)
        self._rope_q = arrays.resident(rope_q, np.int32)
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
                                          word_size, np.dtype(compute_name).itemsize, self.item_rows,
                                          variant.use_rope)
        return Config(head_dim=spec.head_dim, group=spec.group_size, q_format=q_format, kv_format=kv_format,
                      compute_name=compute_name, kv_hnd=kv_view == "HND", causal=variant.causal,
                      window=variant.window_left >= 0, soft_cap=variant.logits_soft_cap > 0,
                      alibi=variant.alibi_slopes is not None,
                      sigmoid=variant.use_sigmoid, rope=variant.use_rope,
                      custom_mask=spec.layout.custom_mask is not None,
                      word_size=word_size, num_threads=config.NUM_THREADS, tile_kv=tile_kv, tile_rows=tile_rows,
                      min_blocks=config.MIN_BLOCKS_PER_SM)

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
                out_dev, lse_dev, part_o, part_lse, *self._plan_args,
                spec.layout.block_size, spec.num_kv_heads, compute(spec.sm_scale * (k_scale or 1.0)),
                compute(v_scale or 1.0), variant.window_left, compute(variant.logits_soft_cap or 1.0), self._alibi,
                self._rope, self._rope_q, compute(variant.sigmoid_bias or 0.0))
        if work_plan.num_merges:
            merge = plan_merge_kernel(cfg.compute_name, cfg.q_format, spec.head_dim, cfg.sigmoid,
                                      config.MERGE_THREADS)
            launch.run(merge, (work_plan.num_merges, spec.num_qo_heads), config.MERGE_THREADS,
                       part_o, part_lse, out_dev, lse_dev, *self._merge_args)


def make_runner(spec, work_plan, previous=None):
    """Bind ``work_plan`` to ``spec`` (index arrays uploaded once; ``previous``'s workspace reused)."""
    return Runner(spec, work_plan, previous)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """Plan with :func:`~bsrattn.numba_cuda.config.plan_options`, then run: see :func:`bsrattn.attention`."""
    layout = spec.layout
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, **plan_options(spec))
    return Runner(spec, work_plan).run(q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale,
                                       v_scale=v_scale)
