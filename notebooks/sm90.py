"""The torch tier's attention kernel compiled for sm_90 (H100, H200) without a GPU, as text a notebook can read.

Triton compiles for a named target with no device present — ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 64))``, through TTIR, TTGIR, LLVM IR and PTX to a cubin, with the ``ptxas`` it
bundles — but not while its interpreter is on, so :func:`compile_attention` runs this file in a subprocess
without ``TRITON_INTERPRET``. The kernel gets the arguments the tier's launcher passes
(``bsrattn.torch_cuda.executor.launch_args``, on CPU tensors of real shapes), specialised as Triton's JIT
specialises them, so the code is the code a launch on the H200 runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def compile_attention(q_dtype="float16", head_dim=128, group=4, tile_q=4, causal=False) -> dict:
    """``{stage: text}`` (``"ttgir"``, ``"ptx"``) of ``persistent_attention`` for one launch configuration.

    ``group`` query heads per KV head, ``tile_q`` query rows per tile, over a paged cache of 16-slot pages.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    config = dict(q_dtype=q_dtype, head_dim=head_dim, group=group, tile_q=tile_q, causal=causal)
    done = subprocess.run([sys.executable, __file__, json.dumps(config)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode:
        raise RuntimeError(f"compiling for sm_90 failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def specialised(fn, args, kwargs):
    """``(signature, constexprs, attrs)`` of ``fn`` for these arguments, as Triton's JIT makes them (also the
    sm_90 compile check of the tests, ``tests/test_torch_compile.py``)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    signature, constexprs, attrs = {}, {}, {}

    def record(path, kind, value, attr):
        # An argument that is a tuple (a tensor's strides) is specialised element by element, at paths (i, j).
        if isinstance(kind, tuple):
            for j, parts in enumerate(zip(kind, value, attr)):
                record((*path, j), *parts)
        elif kind == "constexpr":
            constexprs[path] = value
        elif attr:
            attrs[path] = BaseBackend.parse_attr(attr)

    for i, name in enumerate(fn.arg_names):
        if name in kwargs:
            kind, value, attr = "constexpr", kwargs[name], ""
        else:
            value = args[i]
            kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        record((i,), kind, value, attr)
    return signature, constexprs, attrs


def _compile(q_dtype, head_dim, group, tile_q, causal):
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bsrattn.torch_cuda import config as cfg
    from bsrattn.torch_cuda.executor import launch_args, persistent_attention
    from bsrattn.torch_cuda.plan_buffers import Capacity, PlanBuffers

    hkv, blocks, block_size = 2, 8, 16
    tiles = cfg.tiles(cfg.block_m(tile_q, group), head_dim, q_dtype)
    config = cfg.LaunchConfig(
        num_ctas=4, num_kv_heads=hkv, group_size=group, head_dim=head_dim, block_size=block_size,
        block_m=tiles.block_m, block_n=tiles.block_n, block_d=cfg.block_d(head_dim), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, kv_view="NHD", causal=causal, window_left=-1, soft_cap=False, alibi=False,
        sigmoid=False, rope=False, custom_mask=False, store_lse=True, affine_rows=True)
    dtype = getattr(torch, q_dtype)
    q = torch.empty((32, hkv * group, head_dim), dtype=dtype)
    k, v = (torch.empty((blocks, block_size, hkv, head_dim), dtype=dtype) for _ in range(2))
    buffers = PlanBuffers(Capacity(4, 64, 16, 64, 64, 256, 64), hkv * group, hkv, head_dim, torch.device("cpu"))
    _, args, kwargs = launch_args(q, k, v, torch.empty_like(q), torch.empty((32, hkv * group)), buffers, config,
                                  cfg.Scalars(head_dim ** -0.5, 1.0, 30.0, 0.0))
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages")}
    source = ASTSource(persistent_attention, *specialised(persistent_attention, args, kwargs))
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options)
    return {stage: kernel.asm[stage] for stage in ("ttgir", "ptx")}


if __name__ == "__main__":
    print(json.dumps(_compile(**json.loads(sys.argv[1]))))
