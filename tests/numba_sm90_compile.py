"""Compile every numba-tier kernel for sm_90 without a GPU, with the argument types real calls launch it with.

The CUDA simulator runs kernels as Python, so it accepts code that Numba's CUDA compiler rejects (a type that
does not unify, an unsupported call). This script runs the tier's real host code on representative calls
(every layout kind, every variant feature, each dtype and storage order, plan splits, the merges) with
device allocation replaced by NumPy arrays and each launch *recorded* instead of executed, then compiles
each recorded kernel with ``numba.cuda.compile_ptx(..., cc=(9, 0))`` for the recorded argument types.

Run it without the simulator (``NUMBA_ENABLE_CUDASIM`` unset); it needs ``numba-cuda[cu13]`` (NVVM), not a
GPU. Exit status 0: all compiled; 1: a kernel failed; 77: no CUDA compiler here. With ``--part i/n`` it
compiles the i-th of n shares of the distinct kernels (every n-th, in the order the calls first launch them),
so that n processes compile them all at once. It imports the installed ``bsrattn`` (``pip install -e .``), or
the one ``PYTHONPATH`` names, as ``tests/test_numba_compile.py`` runs it.

    python tests/numba_sm90_compile.py [--part 0/2]
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import ml_dtypes
import numpy as np

import numba
from numba import cuda

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
    from numba.cuda import dispatcher

    # The tier loads only where its kernels can run (numba_cuda.launch.where_kernels_run): here they are only
    # compiled, for a GPU this machine does not have.
    cuda.is_available = lambda: True
    from bsrattn.numba_cuda import arrays, config, launch, runner

    # Device functions (array.view, scalar .view) are compiled for the current device's compute
    # capability; with no device, name sm_90 ourselves.
    dispatcher.get_current_device = lambda: SM90
    cuda.to_device = lambda a: np.array(a, copy=True)
    cuda.device_array = lambda shape, dtype: np.zeros(shape, dtype)
    config.num_ctas = lambda num_kv_heads: max(1, 132 * config.CTAS_PER_SM // num_kv_heads)
    recorded = []

    def record(kernel, grid, threads, *args):
        recorded.append((kernel, args))

    launch.run = record
    runner.launch.run = record
    arrays.deliver = lambda dev, fmt, like, buffer=None: dev
    return recorded


def _calls():
    """Representative calls through the public API, ``(description, thunk)``: together they switch on every
    compile-time feature of the attention kernel (each variant feature, custom mask, sigmoid, dense and sparse
    paths, NHD / HND / 3-D storage, every dtype, GQA ratios, query sub-tiles, values narrower than keys: MLA's
    small and DeepSeek's shapes) and reach every merge kernel."""
    import bsrattn as ba

    rng = np.random.default_rng(0)
    d = 128

    def tensors(layout, hq, hkv, q_dtype, kv_dtype, storage="NHD"):
        q = rng.standard_normal((layout.nnz_qo, hq, d)).astype(q_dtype)
        shape = {"NHD": (layout.num_blocks, layout.block_size, hkv, d), "flat": (layout.num_slots, hkv, d),
                 "HND": (layout.num_blocks, hkv, layout.block_size, d)}[storage]
        k, v = (rng.standard_normal(shape).astype(kv_dtype) for _ in range(2))
        return q, k, v

    def planned(layout, hq, hkv, variant, q_dtype, kv_dtype, storage="NHD", **run_kwargs):
        attn = ba.BatchAttention(backend="numba")
        attn.plan(layout, hq, hkv, d, variant=variant, kv_layout="HND" if storage == "HND" else "NHD", num_ctas=4,
                  fixed_split_size=16)
        return attn.run(*tensors(layout, hq, hkv, q_dtype, kv_dtype, storage), return_lse=not variant.use_sigmoid,
                        **run_kwargs)

    def quest_decode(num_kv_heads, group_size, dtype):
        layout = ba.layouts.quest([[3, 1, 0, 2]], [60], [[[0, 2]] * num_kv_heads], 16, 4, num_kv_heads)
        q = rng.standard_normal((1, num_kv_heads * group_size, d)).astype(dtype)
        k, v = (rng.standard_normal((4, num_kv_heads, 16, d)).astype(dtype) for _ in range(2))
        return ba.attention(*ba.layouts.per_head_views(q, k, v, num_kv_heads), layout, backend="numba")

    def core(layout, hq, hkv, variant, q_dtype, kv_dtype, storage="NHD", **run_kwargs):
        """The core kernel (``numba_cuda/core.py``) on a plan that splits rows: its kernel and the plan's merge."""
        from bsrattn.numba_cuda import core
        from bsrattn.validation import spec_from_inputs

        q, k, v = tensors(layout, hq, hkv, q_dtype, kv_dtype, storage)
        spec = spec_from_inputs(q, k, v, layout, variant, "HND" if storage == "HND" else "NHD", **run_kwargs)
        work_plan = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=4, tile_q=2, fixed_split_size=16)
        return core.make_runner(spec, work_plan).run(q, k, v, return_lse=not variant.use_sigmoid, **run_kwargs)

    def mla(layout, heads, dc, dr, dtype, kernel=None):
        """Multi-head latent attention (``bsrattn.mla``: keys ``dc + dr`` wide, values ``dc``) on a plan that splits
        rows: the kernel and the plan's merge with ``head_dim_vo``."""
        pool = (layout.num_blocks, layout.block_size)
        q_nope, q_pe = (rng.standard_normal((layout.nnz_qo, heads, n)).astype(dtype) for n in (dc, dr))
        ckv, kpe = (rng.standard_normal(pool + (n,)).astype(dtype) for n in (dc, dr))
        attn = ba.BatchMLAAttention(backend="numba", kernel=kernel)
        attn.plan(layout, heads, dc, dr, variant=ba.Variant(causal=True), num_ctas=4, fixed_split_size=16)
        return attn.run(q_nope, q_pe, ckv, kpe, return_lse=True)

    paged = ba.layouts.paged([1, 3, 2], [[5, 1, 7], [0, 3], [6, 4]], [40, 20, 30], 16, 8)
    tree = ba.layouts.tree([[-1, 0, 0, 1]], [[2, 0, 1]], [40], 16, 3)
    ragged = ba.layouts.ragged([4, 1], [60, 9])
    every_softmax_feature = ba.Variant(causal=True, window_left=8, logits_soft_cap=30.0, alibi_slopes=[0.5] * 8)
    return [
        ("paged fp16, every softmax feature", lambda: planned(paged, 8, 2, every_softmax_feature, np.float16,
                                                              np.float16)),
        ("paged fp16/e4m3, fused RoPE", lambda: planned(paged, 8, 2, ba.Variant(causal=True, rope_theta=1e4),
                                                        np.float16, ml_dtypes.float8_e4m3fn, k_scale=0.5, v_scale=2.0)),
        ("tree fp16/e4m3, mask, sigmoid", lambda: planned(tree, 8, 2, ba.Variant(sigmoid_bias=-1.0), np.float16,
                                                          ml_dtypes.float8_e4m3fn, k_scale=0.5, v_scale=2.0)),
        ("ragged fp64, affine path, 3-D", lambda: planned(ragged, 4, 4, ba.Variant(causal=True), np.float64,
                                                         np.float64, "flat")),
        ("paged HND bf16/e5m2", lambda: planned(paged, 8, 2, ba.Variant(), ml_dtypes.bfloat16, ml_dtypes.float8_e5m2,
                                                "HND", k_scale=0.5, v_scale=2.0)),
        ("paged bf16/bf16", lambda: ba.attention(*tensors(paged, 8, 1, ml_dtypes.bfloat16, ml_dtypes.bfloat16), paged,
                                                 backend="numba")),
        ("quest fp32, GQA 4", lambda: quest_decode(2, 4, np.float32)),
        ("quest fp16 decode, 32 heads (W1)", lambda: quest_decode(32, 1, np.float16)),
        ("MLA fp16, keys 24 values 16", lambda: mla(paged, 8, 16, 8, np.float16)),
        ("MLA bf16, DeepSeek 576/512, 16 heads", lambda: mla(paged, 16, 512, 64, ml_dtypes.bfloat16)),
        ("MLA fp16, DeepSeek 576/512, 128 heads shared among blocks", lambda: mla(paged, 128, 512, 64, np.float16)),
        ("merge_state fp16", lambda: ba.merge_state(
            np.zeros((3, 8, d), np.float16), np.zeros((3, 8), np.float32), np.ones((3, 8, d), np.float16),
            np.zeros((3, 8), np.float32), backend="numba")),
        ("merge_states bf16", lambda: ba.merge_states(
            rng.standard_normal((3, 4, 8, d)).astype(ml_dtypes.bfloat16), np.zeros((3, 4, 8), np.float32),
            backend="numba")),
        ("add_states fp32", lambda: ba.get_backend("numba").add_states(np.zeros((3, 8, d), np.float32),
                                                                       np.ones((3, 8, d), np.float32))),
        ("core: paged fp16, softmax features", lambda: core(paged, 8, 2, every_softmax_feature, np.float16,
                                                            np.float16)),
        ("core: paged fp16/e4m3, RoPE", lambda: core(paged, 8, 2, ba.Variant(causal=True, rope_theta=1e4), np.float16,
                                                     ml_dtypes.float8_e4m3fn, k_scale=0.5, v_scale=2.0)),
        ("core: tree bf16/e5m2, mask, sigmoid", lambda: core(tree, 8, 2, ba.Variant(sigmoid_bias=-1.0),
                                                             ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, k_scale=0.5)),
        ("core: ragged fp64, 3-D", lambda: core(ragged, 4, 4, ba.Variant(causal=True), np.float64, np.float64,
                                                "flat")),
        ("core: paged HND fp32, GQA 8", lambda: core(paged, 8, 1, ba.Variant(), np.float32, np.float32, "HND")),
        ("core: MLA fp32, keys 24 values 16", lambda: mla(paged, 8, 16, 8, np.float32, "core")),
        ("core: MLA fp16, DeepSeek 576/512", lambda: mla(paged, 16, 512, 64, np.float16, "core")),
    ]


def _local_memory_lines(ptx: str) -> list:
    return [line.strip() for line in ptx.splitlines() if "ld.local" in line or "st.local" in line]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="0/1", help="i/n: compile the i-th of n shares of the kernels")
    part, parts = map(int, parser.parse_args(argv).part.split("/"))
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        sys.exit("run without NUMBA_ENABLE_CUDASIM: the simulator has no compiler")
    if not _compiler_available():
        return 77
    recorded = _install_recorder()
    failures, compiled, seen = [], {}, set()
    for description, call in _calls():
        recorded.clear()
        call()
        for kernel, args in recorded:
            signature = tuple(numba.typeof(a) for a in args)
            key = (id(kernel), signature)
            if key in seen:
                continue
            seen.add(key)
            if len(seen) % parts != part:
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
    print(f"{len(compiled)} of {len(seen)} kernels compiled for sm_90, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
