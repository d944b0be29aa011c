"""The numba tier: the paper's kernel in Python syntax, as Numba CUDA kernels.

Files match the reference tier's, so the two read side by side: :mod:`.gather` (the load module: sparse and
dense paths, the cooperative copy into shared memory), :mod:`.microkernel` (online softmax over gathered
tiles), :mod:`.executor` (the persistent kernel that runs a scheduler plan), :mod:`.merge` (⊕ as kernels, in
a fixed order). :mod:`.formats` decodes bf16/fp8 bits, :mod:`.arrays` moves arrays in and out, and
:mod:`.launch` names the tile sizes. Runs on a GPU, or anywhere under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, at small sizes).

dtypes: q/k/v float16 or float32 (computed in float32) and float64 (computed in float64); bfloat16 q/k/v and
fp8 (e4m3fn, e5m2) k/v with ``k_scale``/``v_scale`` when they come as NumPy (ml_dtypes) arrays, decoded from
their bits in the kernel. A device array of bf16/fp8 (which Numba cannot type) raises TypeError.

Examples
--------
>>> import numpy as np, bsrattn as ba
>>> rng = np.random.default_rng(0)
>>> layout = ba.layouts.paged([1, 2], [[2, 0], [1]], kv_lens=[11, 5], page_size=8, num_pages=3)
>>> q = rng.standard_normal((3, 2, 4)).astype(np.float32)
>>> k, v = rng.standard_normal((2, 3, 8, 1, 4)).astype(np.float32)
>>> out = ba.attention(q, k, v, layout, variant=ba.Variant(causal=True), backend="numba")
>>> bool(np.allclose(out, ba.attention(q, k, v, layout, variant=ba.Variant(causal=True)), atol=1e-5))
True
"""

from __future__ import annotations

from bsrattn import scheduler
from bsrattn.numba_cuda import launch
from bsrattn.numba_cuda.executor import Runner, query_tile_rows
from bsrattn.numba_cuda.merge import add_states, merge_state, merge_states

__all__ = ["Runner", "add_states", "attention", "make_runner", "merge_state", "merge_states", "plan_options"]


def plan_options(spec):
    """Scheduler options for this tier: one wave of resident blocks, query tiles of ``MAX_QUERIES // G`` rows,
    KV chunks in multiples of ``KV_ALIGN`` keys.

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn.validation import make_spec
    >>> spec = make_spec(ba.layouts.ragged([1], [100]), num_qo_heads=8, num_kv_heads=2, head_dim=64)
    >>> sorted(plan_options(spec))
    ['kv_align', 'min_split_size', 'num_ctas', 'tile_q']
    """
    return dict(num_ctas=launch.num_ctas(spec.num_kv_heads), tile_q=query_tile_rows(spec.group_size),
                min_split_size=launch.KV_ALIGN,
                kv_align=launch.KV_ALIGN)


def make_runner(spec, work_plan, previous=None):
    """Bind ``work_plan`` to ``spec`` (index arrays uploaded once; ``previous``'s workspace reused)."""
    return Runner(spec, work_plan, previous)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """Plan with :func:`plan_options`, then run: see :func:`bsrattn.attention`."""
    layout = spec.layout
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, **plan_options(spec))
    return Runner(spec, work_plan).run(q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale,
                                       v_scale=v_scale)
