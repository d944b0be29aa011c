"""The standalone Gluon prefill of ``benchmarks/gluon_prefill.py``: its tile table on the CPU, its sm_90 build without
a GPU (Triton bundles ``ptxas``), and its answers against the float64 reference on a Hopper GPU (marked ``gpu``).

Gluon has no interpreter, so on a CPU host the kernel is only compiled: the checks of what it computes are the GPU
test's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import bsrattn as ba
from benchmarks import gluon_prefill
from helpers import assert_matches_reference
from test_torch_compile import _resources

LENGTHS = ([128], [300], [1, 129, 64, 700], [1024, 77], [0, 5, 0])
"""Requests: one whole tile, a tail tile, lengths off the tile size (a request of one query, a tile's keys
reaching into the next request), a long one, empty requests."""


@pytest.mark.parametrize("causal", [True, False])
def test_tile_table_covers_every_query_once_longest_first(causal):
    lens = np.array([1, 129, 0, 64, 700, 256])
    tiles = gluon_prefill.tile_table(lens, causal, block_m=128)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    covered = np.zeros(int(lens.sum()), dtype=int)
    for row0, m0, n in tiles:
        r = int(np.searchsorted(starts, row0, side="right")) - 1
        while lens[r] == 0:  # an empty request shares its start with the next
            r += 1
        assert row0 == starts[r] and n == lens[r] and 0 <= m0 < n and m0 % 128 == 0
        covered[row0 + m0:row0 + min(n, m0 + 128)] += 1
    assert (covered == 1).all()
    work = np.minimum(tiles[:, 2], tiles[:, 1] + 128) if causal else tiles[:, 2]
    assert (np.diff(work) <= 0).all(), "tiles with the most keys first"
    assert tiles.dtype == np.int32


CASES = [(128, "bfloat16", 0, True), (128, "float16", 1, False), (64, "bfloat16", 1, True), (64, "float16", 0, False)]


def _compile(head_dim, dtype, pipe, causal) -> dict:
    """What the sm_90 build of one configuration holds (in a process that is not interpreting: the interpreter
    replaces ``gluon.jit``'s functions, which the compiler then cannot call)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    gdtype, name = {"bfloat16": (gl.bfloat16, "bf16"), "float16": (gl.float16, "fp16")}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([128, head_dim], gdtype)
    desc = f"tensordesc<{name}[128, {head_dim}],{layout!r}>"
    signature = {"q_desc": desc, "k_desc": desc, "v_desc": desc, "out_ptr": f"*{name}", "lse_ptr": "*fp32",
                 "tiles": "*i32", "num_qo_heads": "i32", "qk_scale": "fp32",
                 **{c: "constexpr" for c in ("GROUP", "CAUSAL", "BM", "BN", "D", "NUM_STAGES", "PIPE")}}
    constexprs = {"GROUP": 4, "CAUSAL": causal, "BM": 128, "BN": 128, "D": head_dim, "NUM_STAGES": 2, "PIPE": pipe}
    kernel = triton.compile(GluonASTSource(gluon_prefill.prefill_kernel, signature, constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    stack = _resources(kernel.asm.get("cubin")).get("stack")
    return dict(give=re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx),
                take=re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx),
                products=kernel.asm["ttgir"].count("warp_group_dot "),
                waits=sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
                shared=kernel.metadata.shared, stack=stack)


def test_the_kernel_compiles_for_sm90_warp_specialised():
    reason = gluon_prefill.unavailable()
    if reason and "Gluon" in reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.path.dirname(__file__), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    for case, got in zip(CASES, json.loads(done.stdout.strip().splitlines()[-1])):
        pipe = case[2]
        assert "24" in got["give"] and "240" in got["take"], (case, got, "producer 24 registers, consumers 240")
        # Two products a K/V tile in each consumer; with PIPE=1, a wait that leaves one in flight.
        assert got["products"] == (4 if pipe == 0 else 8), (case, got)
        assert got["waits"] == (["0"] if pipe == 0 else ["0", "1"]), (case, got)
        assert got["shared"] <= 227 * 1024, (case, got)
        assert got["stack"] in (None, 0), (case, got, "no stack")


@pytest.mark.gpu
@pytest.mark.parametrize("pipe", [0, 1])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,head_dim,heads", [("bfloat16", 128, (32, 8)), ("float16", 64, (8, 8)),
                                                  ("bfloat16", 64, (12, 4))])
def test_the_kernel_matches_the_reference(dtype, head_dim, heads, causal, pipe):
    import torch

    reason = gluon_prefill.unavailable()
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    hq, hkv = heads
    for lens in LENGTHS:
        nnz = sum(lens)
        q = torch.randn(nnz, hq, head_dim, device="cuda", dtype=getattr(torch, dtype))
        k, v = (torch.randn(nnz, hkv, head_dim, device="cuda", dtype=q.dtype) for _ in range(2))
        out, lse = gluon_prefill.prefill(q, k, v, lens, causal=causal, pipe=pipe)
        assert_matches_reference((out, lse), q, k, v, ba.layouts.ragged(lens, lens), dtype,
                                 variant=ba.Variant(causal=causal), name=f"lens {lens}")


def test_bad_arguments_are_named():
    torch = pytest.importorskip("torch")
    if gluon_prefill.unavailable() and "Gluon" in gluon_prefill.unavailable():
        pytest.skip(gluon_prefill.unavailable())
    q = torch.zeros(4, 8, 128, dtype=torch.float16)
    k = torch.zeros(4, 2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim=96"):
        gluon_prefill.prefill(q[..., :96].contiguous(), k[..., :96].contiguous(), k[..., :96].contiguous(), [4],
                              causal=True)
    with pytest.raises(TypeError, match="float32"):
        gluon_prefill.prefill(q.float(), k, k, [4], causal=True)
    with pytest.raises(ValueError, match="lens sum to 3"):
        gluon_prefill.prefill(q, k, k, [3], causal=True)
    with pytest.raises(ValueError, match="num_kv_heads"):
        gluon_prefill.prefill(q, torch.zeros(4, 3, 128, dtype=torch.float16), torch.zeros(4, 3, 128,
                              dtype=torch.float16), [4], causal=True)
    with pytest.raises(ValueError, match="pipe=2"):
        gluon_prefill.prefill(q, k, k, [4], causal=True, pipe=2)


def test_a_batch_of_empty_requests_launches_nothing():
    torch = pytest.importorskip("torch")
    reason = gluon_prefill.unavailable()
    if reason and "Gluon" in reason:
        pytest.skip(reason)
    q = torch.zeros(0, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    out, lse = gluon_prefill.prefill(q, k, k, [0, 0], causal=True)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8)


if __name__ == "__main__":
    print(json.dumps([_compile(*case) for case in CASES]))
