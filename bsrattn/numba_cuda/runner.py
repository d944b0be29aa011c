"""A plan bound to its spec, index arrays resident on the device; and the one-shot call.

``run`` launches the persistent kernel (:mod:`.executor`) and, when the plan split any tile, the merge kernel
(:mod:`.merge`), each through a :class:`~bsrattn.numba_cuda.launch.Launch`: after the first launch of a kind,
Numba's typing and argument conversion are not redone for arguments that did not change.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

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


class _Call(NamedTuple):
    """What a call's arrays decide: the kernel configuration and the device arrays the kernels take. ``out`` and
    ``lse`` are None where each call writes a new array (or, for an lse nobody asked for, the runner's scratch)."""

    cfg: Config
    q: object
    k_words: object
    v_words: object
    out: object
    lse: object


def _call_key(q, k, v, out, lse) -> tuple | None:
    """The :func:`~bsrattn.numba_cuda.arrays.tensor_key` of each of a call's arrays (``()`` for an absent buffer),
    when they all are torch tensors on a GPU; None otherwise (NumPy arrays are copied for each call, and Numba
    device arrays are viewed at no cost)."""
    if launch.SIMULATOR:
        return None
    keys = tuple(() if x is None else arrays.tensor_key(x) for x in (q, k, v, out, lse))
    return None if None in keys else keys


class Runner:
    """A :class:`~bsrattn.scheduler.WorkPlan` bound to its spec, its index arrays resident on the device.

    ``run`` launches the persistent kernel (grid ``(num_ctas, num_kv_heads)``) and, when the plan split any
    tile, the merge kernel (grid ``(num_merges, num_qo_heads)``). The workspace for partial states is kept and
    reused by later plans of the same BatchAttention when it is large enough, and so are the two launches
    (:class:`~bsrattn.numba_cuda.launch.Launch`), whose arguments a new plan changes only in part.

    A serving loop calls ``run`` with the same tensors again and again, or with other tensors of the same
    shapes (a model's layers): each call's torch tensors are keyed (:func:`_call_key`), and the device views,
    configuration and word views made for a key are kept for the calls with the same key.
    """

    def __init__(self, spec, work_plan, previous=None, once: bool = False):
        """``once``: the runner runs one call (the one-shot :func:`attention`), so its launches go straight through
        Numba: nothing would launch again with what a ``Launch`` keeps."""
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
        self._scratch_lse = previous._scratch_lse if previous is not None else {}  # compute name -> lse
        self._lock = previous._lock if previous is not None else threading.Lock()
        self._launches = (previous._launches if previous is not None else (launch.run, launch.run) if once
                          else (launch.Launch(), launch.Launch()))
        self._held = None  # (_call_key, _Call) of the last call with a key

    def workspace(self, compute_name: str):
        """``(part_o [P, Hq, Dv], part_lse [P, Hq])`` in the compute dtype (``Dv``: ``spec.dim_vo``), allocated once
        per size."""
        rows = max(1, self.work_plan.num_partial_rows)
        shape = (rows, self.spec.num_qo_heads, self.spec.dim_vo)
        held = self._workspace.get(compute_name)
        if held is None or held[0].shape[0] < rows or tuple(held[0].shape[1:]) != shape[1:]:
            held = (arrays.empty(shape, compute_name), arrays.empty(shape[:2], compute_name))
            self._workspace[compute_name] = held
        return held

    def scratch_lse(self, compute_name: str):
        """The ``lse [nnz_qo, Hq]`` the kernels write when the caller takes none, allocated once per shape: no
        one reads it, so calls share it as they share the workspace."""
        shape = (self.spec.layout.nnz_qo, self.spec.num_qo_heads)
        held = self._scratch_lse.get(compute_name)
        if held is None or tuple(held.shape) != shape:
            held = self._scratch_lse[compute_name] = arrays.empty(shape, compute_name)
        return held

    def config(self, q_format, kv_format, kv_view, word_size) -> Config:
        spec, variant = self.spec, self.spec.variant
        compute_name = compute_format(q_format, kv_format)
        tile_rows, tile_kv, head_groups = choose_tiles(spec.head_dim, spec.group_size,
                                                       numpy_dtype(kv_format).itemsize, word_size,
                                                       np.dtype(compute_name).itemsize, self.item_rows,
                                                       variant.use_rope, spec.dim_vo)
        return Config(head_dim=spec.head_dim, dim_vo=spec.dim_vo, group_size=spec.group_size // head_groups,
                      head_groups=head_groups, q_format=q_format,
                      kv_format=kv_format, compute_name=compute_name, kv_hnd=kv_view == "HND", causal=variant.causal,
                      window=variant.window_left >= 0, soft_cap=variant.logits_soft_cap > 0,
                      alibi=variant.alibi_slopes is not None,
                      sigmoid=variant.use_sigmoid, rope=variant.use_rope,
                      custom_mask=spec.layout.custom_mask is not None,
                      word_size=word_size, num_threads=config.NUM_THREADS, tile_kv=tile_kv, tile_rows=tile_rows,
                      min_blocks=config.MIN_BLOCKS_PER_SM)

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """Attention of ``q [nnz_qo, Hq, D]`` over ``k, v`` (the spec's storage); returns ``(out [nnz_qo, Hq, Dv],
        lse or None)``, ``Dv`` the head dimension of ``v`` (``spec.dim_vo``)."""
        spec = self.spec
        key, held = _call_key(q, k, v, out, lse), self._held
        if key is not None and held is not None and held[0] == key:
            call = held[1]
        else:
            call = self._prepare(q, k, v, out, lse, hold=key is None)
            if key is not None:
                self._held = (key, call)
        cfg = call.cfg
        want_lse = not spec.variant.use_sigmoid and (return_lse or lse is not None)
        lse_shape = (spec.layout.nnz_qo, spec.num_qo_heads)
        out_dev, lse_dev = call.out, call.lse
        if out_dev is None:
            out_dev = arrays.target(out, (*lse_shape, spec.dim_vo), cfg.q_format, "out")
        if lse_dev is None and want_lse:
            lse_dev = arrays.target(lse, lse_shape, cfg.compute_name, "lse")
        with self._lock:
            self._launch(cfg, call.q, call.k_words, call.v_words, out_dev, lse_dev, k_scale, v_scale)
        result_o = arrays.deliver(out_dev, cfg.q_format, q, out)
        return result_o, (arrays.deliver(lse_dev, cfg.compute_name, q, lse) if want_lse else None)

    def _prepare(self, q, k, v, out, lse, hold: bool) -> _Call:
        """The call's configuration and device arrays; a device ``out``/``lse`` viewed, a host one left to ``run``
        (a new device array each call, copied back)."""
        spec = self.spec
        q_format, kv_format = format_of(q), format_of(k)
        q_dev = arrays.device_array(q, "q", hold)
        k_dev, v_dev = (arrays.device_array(x, name, hold, rows=True) for x, name in ((k, "k"), (v, "v")))
        itemsize = numpy_dtype(kv_format).itemsize
        word = copy_word(spec.head_dim * itemsize, spec.dim_vo * itemsize, _address(k_dev), _address(v_dev),
                         arrays.row_stride(k_dev), arrays.row_stride(v_dev))
        cfg = self.config(q_format, kv_format, spec.kv_view_of(k), word.itemsize)
        out_dev, lse_dev = (arrays.device_array(x, name, hold) if x is not None and arrays.is_device(x) else None
                            for x, name in ((out, "out"), (lse, "lse")))
        return _Call(cfg, q_dev, rows_view(k_dev, spec.head_dim, cfg.word), rows_view(v_dev, spec.dim_vo, cfg.word),
                     out_dev, lse_dev)

    def _launch(self, cfg, q_dev, k_words, v_words, out_dev, lse_dev, k_scale, v_scale):
        """The persistent kernel, then the plan's merge, over this runner's workspace (``lse_dev`` None: the
        scratch lse)."""
        spec, work_plan, variant = self.spec, self.work_plan, self.spec.variant
        compute = cfg.compute
        part_o, part_lse = self.workspace(cfg.compute_name)
        if lse_dev is None:
            lse_dev = self.scratch_lse(cfg.compute_name)
        persistent, merge = self._launches
        if work_plan.num_items:
            persistent(persistent_kernel(cfg), (work_plan.num_ctas, spec.num_kv_heads * cfg.head_groups),
                       cfg.num_threads,
                q_dev, k_words, v_words, out_dev, lse_dev, part_o, part_lse, *self._plan_args,
                spec.layout.block_size, spec.num_kv_heads, compute(spec.sm_scale * (k_scale or 1.0)),
                compute(v_scale or 1.0), variant.window_left, compute(variant.logits_soft_cap or 1.0), self._alibi,
                self._rope, self._rope_q, compute(variant.sigmoid_bias or 0.0))
        if work_plan.num_merges:
            merge(plan_merge_kernel(cfg.compute_name, cfg.q_format, spec.dim_vo, cfg.sigmoid, config.MERGE_THREADS),
                  (work_plan.num_merges, spec.num_qo_heads), config.MERGE_THREADS,
                  part_o, part_lse, out_dev, lse_dev, *self._merge_args)


def make_runner(spec, work_plan, previous=None):
    """Bind ``work_plan`` to ``spec`` (index arrays uploaded once; ``previous``'s workspace and launches reused)."""
    return Runner(spec, work_plan, previous)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """Plan with :func:`~bsrattn.numba_cuda.config.plan_options`, then run: see :func:`bsrattn.attention`."""
    layout = spec.layout
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, **plan_options(spec))
    return Runner(spec, work_plan, once=True).run(q, k, v, out=out, lse=lse, return_lse=return_lse,
                                                  k_scale=k_scale, v_scale=v_scale)
