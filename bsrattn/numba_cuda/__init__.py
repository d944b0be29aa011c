"""The numba tier: the paper's kernel in Python syntax, as Numba CUDA kernels.

Files match the reference tier's, so the two read side by side: :mod:`.gather` (the load module: sparse and
affine paths, the cooperative copy into shared memory), :mod:`.microkernel` (online softmax over gathered
tiles), :mod:`.executor` (the persistent kernel that runs a scheduler plan), :mod:`.merge` (⊕ as kernels, in
a fixed order), :mod:`.runner` (a plan bound to its spec, and the one-shot call), :mod:`.config` (tile sizes,
``plan_options``) and :mod:`.arrays` (arrays in and out). :mod:`.formats` decodes bf16/fp8 bits, and
:mod:`.launch` compiles and launches kernels on a GPU or under the simulator. :mod:`.core` is the paper's kernel
at teaching size (``kernel="core"``), which the shipped executor extends. Runs on a GPU, or anywhere under the CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``, at small sizes).

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

from bsrattn.numba_cuda.config import plan_options
from bsrattn.numba_cuda.launch import where_kernels_run
from bsrattn.numba_cuda.merge import add_states, merge_state, merge_states
from bsrattn.numba_cuda.runner import Runner, attention, make_runner

WHERE = where_kernels_run()
"""``"gpu"`` or ``"simulator"``; a process with neither cannot load the tier (``BackendError``, naming the fix)."""

__all__ = ["Runner", "add_states", "attention", "make_runner", "merge_state", "merge_states", "plan_options"]

HEAD_DIM_VO = True
"""The kernels (the core's too, :data:`.core.HEAD_DIM_VO`) take ``v`` and ``out`` of another head dimension than
``q`` and ``k`` (multi-head latent attention, :mod:`bsrattn.mla`), ``v`` as a strided view of the key's first
columns included."""

KERNELS = ("shipped", "core")
"""The shipped kernels, and :mod:`.core`, the paper's kernel at teaching size (``kernel="core"``)."""
