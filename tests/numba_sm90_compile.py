"""Compile every numba-tier kernel for sm_90 without a GPU, with the argument types real calls launch it with.

The CUDA simulator runs kernels as Python, so it accepts code that Numba's CUDA compiler rejects (a type that
does not unify, an unsupported call). This script runs the tier's real host code on representative calls
(every layout kind, every variant feature, each dtype and storage order, plan splits, the merges) with
device allocation replaced by NumPy arrays and each launch *recorded* instead of executed, then compiles
each recorded kernel with ``numba.cuda.compile_ptx(..., cc=(9, 0))`` for the recorded argument types.

Run it without the simulator (``NUMBA_ENABLE_CUDASIM`` unset); it needs ``numba-cuda[cu13]`` (NVVM), not a
GPU. Exit status 0: all compiled; 1: a kernel failed; 77: no CUDA compiler here.

    python tests/numba_sm90_compile.py
"""

from __future__ import annotations

import os
import sys
import types

import ml_dtypes
import numpy as np

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    sys.exit("run without NUMBA_ENABLE_CUDASIM: the simulator has no compiler")

import numba  # noqa: E402
from numba import cuda  # noqa: E402

SM90 = types.SimpleNamespace(compute_capability=(9, 0))


def _compiler_available() -> bool:
    def probe(x):
        x[0] = 1.0

    try:
        cuda.compile_ptx(probe, (numba.float32[::1],), cc=(9, 0))
    except Exception as err:  # noqa: BLE001 - any failure here means "no CUDA compiler"
        print(f"no CUDA compiler: {type(err).__name__}: {err}")
        return False
    return True


def _install_recorder():
    """Replace device allocation with NumPy and launches with a record of (kernel, args)."""
    import numba.cuda.dispatcher as dispatcher

    from bsrattn.numba_cuda import arrays, executor, launch

    # Device functions (array.view, scalar .view) are compiled for the current device's compute
    # capability; with no device, name sm_90 ourselves.
    dispatcher.get_current_device = lambda: SM90
    cuda.to_device = lambda a: np.array(a, copy=True)
    cuda.device_array = lambda shape, dtype: np.zeros(shape, dtype)
    launch.num_ctas = lambda num_kv_heads: max(1, 132 * launch.CTAS_PER_SM // num_kv_heads)
    recorded = []

    def record(kernel, grid, threads, *args):
        recorded.append((kernel, args))

    launch.run = record
    executor.launch.run = record
    arrays.deliver = lambda dev, fmt, like, buffer=None: dev
    return recorded


def _calls():
    """Representative calls through the public API: (description, thunk)."""
    import bsrattn as ba

    rng = np.random.default_rng(0)
    d, hq, hkv = 128, 8, 2

    def qkv(layout, q_dtype=np.float16, kv_dtype=np.float16, hnd=False, flat=False, heads=(hq, hkv)):
        q = rng.standard_normal((layout.nnz_qo, heads[0], d)).astype(q_dtype)
        shape = ((layout.num_blocks, heads[1], layout.block_size, d) if hnd else
                 (layout.num_slots, heads[1], d) if flat else (layout.num_blocks, layout.block_size, heads[1], d))
        k, v = (rng.standard_normal(shape).astype(kv_dtype) for _ in range(2))
        return q, k, v

    paged = ba.layouts.paged([1, 3, 2], [[5, 1, 7], [0, 3], [6, 4]], [40, 20, 30], 16, 8)
    ragged = ba.layouts.ragged([4, 1], [60, 9])
    tree = ba.layouts.tree([[-1, 0, 0, 1]], [[2, 0, 1]], [40], 16, 3)
    quest = ba.layouts.quest([[3, 1, 0, 2]], [60], [[[0, 2], [1, 3]]], 16, 4, hkv)
    cascade = ba.layouts.shared_prefix([1, 2], [0, 1], 32, [[2], [3]], [5, 9], 16, 4)
    variants = {
        "plain": ba.Variant(), "causal": ba.Variant(causal=True), "window": ba.Variant(causal=True, window_left=8),
        "soft_cap": ba.Variant(logits_soft_cap=30.0), "alibi": ba.Variant(alibi_slopes=[0.5] * hq),
        "sigmoid": ba.Variant(sigmoid_bias=-1.0),
    }
    calls = []
    for name, variant in variants.items():
        calls.append((f"paged fp16 {name}", lambda v=variant: ba.attention(*qkv(paged), paged, variant=v,
                                                                            backend="numba", return_lse=not v.use_sigmoid)))
    for q_dtype, kv_dtype in [(np.float32, np.float32), (np.float64, np.float64), (ml_dtypes.bfloat16,) * 2,
                              (np.float16, ml_dtypes.float8_e4m3fn), (ml_dtypes.bfloat16, ml_dtypes.float8_e5m2)]:
        scales = dict(k_scale=0.5, v_scale=2.0) if np.dtype(kv_dtype).itemsize == 1 else {}
        calls.append((f"paged {np.dtype(q_dtype).name}/{np.dtype(kv_dtype).name}",
                      lambda a=q_dtype, b=kv_dtype, s=scales: ba.attention(*qkv(paged, a, b), paged, backend="numba",
                                                                          return_lse=True, **s)))
    calls.append(("paged HND", lambda: ba.attention(*qkv(paged, hnd=True), paged, kv_layout="HND", backend="numba")))
    calls.append(("ragged (dense path), 3-D k/v", lambda: ba.attention(*qkv(ragged, flat=True), ragged,
                                                                      variant=ba.Variant(causal=True), backend="numba")))
    calls.append(("tree (custom mask)", lambda: ba.attention(*qkv(tree), tree, variant=ba.Variant(causal=True),
                                                             backend="numba")))
    def quest_call():
        q = rng.standard_normal((1, hq, d)).astype(np.float16)
        k, v = (rng.standard_normal((4, hkv, 16, d)).astype(np.float16) for _ in range(2))
        return ba.attention(*ba.layouts.per_head_views(q, k, v, hkv), quest, backend="numba")

    calls.append(("quest per-head views", quest_call))
    calls.append(("GQA 32/1 decode", lambda: ba.attention(*qkv(paged, heads=(32, 1)), paged, backend="numba")))
    calls.append(("cascade", lambda: ba.attention(*qkv(cascade.levels[0]), cascade, backend="numba")))
    calls.append(("sigmoid cascade", lambda: ba.attention(*qkv(cascade.levels[0]), cascade, backend="numba",
                                                          variant=ba.Variant(sigmoid_bias=0.5))))
    calls.append(("merge_states bf16", lambda: ba.merge_states(
        rng.standard_normal((3, 4, hq, d)).astype(ml_dtypes.bfloat16), np.zeros((3, 4, hq), np.float32),
        backend="numba")))
    calls.append(("merge_state fp16", lambda: ba.merge_state(
        np.zeros((3, hq, d), np.float16), np.zeros((3, hq), np.float32), np.ones((3, hq, d), np.float16),
        np.zeros((3, hq), np.float32), backend="numba")))

    def batch_attention(layout, **options):
        attn = ba.BatchAttention(backend="numba")
        attn.plan(layout, hq, hkv, d, variant=ba.Variant(causal=True), **options)
        return attn.run(*qkv(layout), return_lse=True)

    calls.append(("BatchAttention fixed splits", lambda: batch_attention(paged, num_ctas=4, fixed_split_size=16)))
    return calls


def _local_memory_lines(ptx: str) -> list:
    return [line.strip() for line in ptx.splitlines() if "ld.local" in line or "st.local" in line]


def main() -> int:
    if not _compiler_available():
        return 77
    recorded = _install_recorder()
    failures, compiled = [], {}
    for description, call in _calls():
        recorded.clear()
        call()
        for kernel, args in recorded:
            signature = tuple(numba.typeof(a) for a in args)
            key = (id(kernel), signature)
            if key in compiled:
                continue
            bounds = kernel.targetoptions.get("launch_bounds")
            try:
                ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0), launch_bounds=bounds)
            except Exception as err:  # noqa: BLE001 - report every kernel that does not compile
                failures.append(f"{description}: {kernel.py_func.__name__}: {type(err).__name__}: {err}")
                continue
            compiled[key] = ptx
            spills = _local_memory_lines(ptx)
            print(f"ok  {description:32s} {kernel.py_func.__name__:16s} {len(ptx):7d} chars of PTX"
                  f"{'' if not spills else f', {len(spills)} local-memory accesses'}")
    for failure in failures:
        print("FAIL", failure)
    print(f"{len(compiled)} kernels compiled for sm_90, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
