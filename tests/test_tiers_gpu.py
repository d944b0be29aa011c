"""The cross-tier checks of ``test_tiers.py`` at real sizes, on a GPU (marked ``gpu``; skipped without one).

head_dim 128, 32 query heads over 8 KV heads, hundreds to thousands of keys, in float32, float16, bfloat16
and fp8 KV, for the numba and torch tiers, against the float64 reference. Run on the H200 with::

    python -m pytest tests/test_tiers_gpu.py -m gpu -q -rs

A tier that documents a dtype as unsupported (a TypeError naming the dtype and saying it is not supported)
is skipped for that dtype with its own message; any other error fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import assert_close, scattered_page_tables
from helpers import assert_matches_reference
from test_tiers import NUMPY_DTYPES, load_tier

pytestmark = pytest.mark.gpu

GPU_TIERS = ("numba", "torch")
DTYPES = ("float32", "float16", "bfloat16")
FP8 = ("float8_e4m3fn", "float8_e5m2")
HQ, HKV, D, PAGE = 32, 8, 128, 16


@pytest.fixture(scope="module", params=GPU_TIERS)
def gpu_backend(request):
    return load_tier(request.param)


EXPECTED_UNSUPPORTED = {("numba", "bfloat16"), ("numba", "float8_e4m3fn"), ("numba", "float8_e5m2")}
"""(tier, dtype) pairs a tier refuses by design on device inputs: Numba has no bf16 or fp8 type."""


def _supported_or_skip(tier, call):
    """Run ``call``; only a listed (tier, dtype) refusal with the tier's own 'does not support' becomes a skip."""
    try:
        return call()
    except TypeError as err:
        refused = [d for (name, d) in EXPECTED_UNSUPPORTED if name == tier.name and d in str(err)]
        if refused and "does not support" in str(err):
            pytest.skip(f"{tier.name}: {err}")
        raise


def _rng(seed):
    return np.random.default_rng(seed)


def _pages(rng, kv_lens, extra=8):
    """Shuffled page tables over one pool for ``kv_lens``; returns ``(tables, num_pages)``."""
    return scattered_page_tables(rng, kv_lens, PAGE, spare_pages=extra)


def _kv(rng, num_blocks, block_size, hkv=HKV, d=D):
    return rng.standard_normal((2, num_blocks, block_size, hkv, d))


def _compare(tier, layout, q, k, v, dtype, *, variant=ba.Variant(), kv_layout="NHD", kv_dtype=None, scales=None,
             runner=None):
    """Round the inputs through the dtypes, run the tier (``ba.attention`` or ``runner``), compare with the
    reference."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    scales = scales or {}
    if kv_dtype in FP8:
        k, v = (x / scales.get(name, 1.0) for x, name in ((k, "k_scale"), (v, "v_scale")))
    q = q.astype(NUMPY_DTYPES[dtype])
    k, v = (x.astype(NUMPY_DTYPES[kv_dtype]) for x in (k, v))
    want_lse = not variant.use_sigmoid
    args = (tier.array(q, dtype), tier.array(k, kv_dtype), tier.array(v, kv_dtype))
    if runner is None:
        got = _supported_or_skip(tier, lambda: ba.attention(*args, layout, variant=variant, kv_layout=kv_layout,
                                                           return_lse=want_lse, backend=tier.name, **scales))
    else:
        got = _supported_or_skip(tier, lambda: runner(*args, return_lse=want_lse, **scales))
    assert_matches_reference(got, q, k, v, layout, kv_dtype if kv_dtype in FP8 else dtype, variant=variant,
                             kv_layout=kv_layout, name=tier.name, **scales)
    return got


# ---- layouts at real sizes ----------------------------------------------------------------------------

def _paged_decode(seed=0, batch=8, lo=100, hi=2048):
    rng = _rng(seed)
    kv_lens = rng.integers(lo, hi, batch)
    tables, num_pages = _pages(rng, kv_lens)
    layout = ba.layouts.paged(np.ones(batch, int), tables, kv_lens, PAGE, num_pages)
    k, v = _kv(rng, num_pages, PAGE)
    return layout, rng.standard_normal((batch, HQ, D)), k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode(gpu_backend, dtype):
    layout, q, k, v = _paged_decode()
    _compare(gpu_backend, layout, q, k, v, dtype, variant=ba.Variant(causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_append_prefill_hnd(gpu_backend, dtype):
    rng = _rng(1)
    qo_lens = rng.integers(1, 129, 4)
    kv_lens = qo_lens + rng.integers(0, 640, 4)
    tables, num_pages = _pages(rng, kv_lens)
    layout = ba.layouts.paged(qo_lens, tables, kv_lens, PAGE, num_pages)
    k, v = (x.transpose(0, 2, 1, 3) for x in _kv(rng, num_pages, PAGE))
    q = rng.standard_normal((int(qo_lens.sum()), HQ, D))
    _compare(gpu_backend, layout, q, np.ascontiguousarray(k), np.ascontiguousarray(v), dtype,
             variant=ba.Variant(causal=True), kv_layout="HND")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_prefill(gpu_backend, dtype):
    rng = _rng(2)
    lens = [300, 200, 77]
    layout = ba.layouts.ragged(lens, lens)
    q = rng.standard_normal((sum(lens), HQ, D))
    k, v = rng.standard_normal((2, sum(lens), HKV, D))
    _compare(gpu_backend, layout, q, k, v, dtype, variant=ba.Variant(causal=True))


@pytest.mark.parametrize("variant", [
    ba.Variant(causal=True, logits_soft_cap=30.0),
    ba.Variant(causal=True, window_left=256),
    ba.Variant(causal=True, alibi_slopes=[2.0 ** -(8 * (h + 1) / HQ) for h in range(HQ)]),
    ba.Variant(sigmoid_bias=-2.0, sm_scale=0.05),
    ba.Variant(sm_scale=0.3),
    ba.Variant(sinks=[0.5 * h - 4.0 for h in range(HQ)]),
    ba.Variant(causal=True, window_left=128, sinks=[1.5 - 0.25 * h for h in range(HQ)]),
    ba.Variant(rope_theta=1e4),
    ba.Variant(rope_theta=5e5, rope_scale=8.0, logits_soft_cap=30.0),
], ids=["soft_cap", "window", "alibi", "sigmoid", "sm_scale", "sinks", "window_sinks", "rope", "rope_scaled"])
def test_variants(gpu_backend, variant):
    layout, q, k, v = _paged_decode(seed=3)
    _compare(gpu_backend, layout, q, k, v, "float16", variant=variant)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rope_prefill_at_long_positions(gpu_backend, dtype):
    """Fused RoPE in a causal prefill appended to long rows (angles of thousands of radians), split."""
    rng = _rng(7)
    qo_lens = np.array([200, 64, 129])
    kv_lens = qo_lens + np.array([7000, 3000, 0])
    tables, num_pages = _pages(rng, kv_lens)
    layout = ba.layouts.paged(qo_lens, tables, kv_lens, PAGE, num_pages)
    k, v = _kv(rng, num_pages, PAGE)
    _compare(gpu_backend, layout, rng.standard_normal((int(qo_lens.sum()), HQ, D)), k, v, dtype,
             variant=ba.Variant(causal=True, rope_theta=1e4))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kv_scales_on_16_bit_kv(gpu_backend, dtype):
    """``k_scale``/``v_scale`` apply to any KV dtype, not only fp8, on a split plan."""
    layout, q, k, v = _paged_decode(seed=6)
    _compare(gpu_backend, layout, q, k, v, dtype, scales=dict(k_scale=0.7, v_scale=1.3))


def test_block_sparse_with_mask(gpu_backend):
    rng = _rng(4)
    M, N, R, C = 256, 1024, 16, 64
    rows, cols = M // R, N // C
    per_row = [np.sort(rng.choice(cols, rng.integers(0, cols // 2), replace=False)) for _ in range(rows)]
    indptr = np.concatenate([[0], np.cumsum([r.size for r in per_row])])
    mask = rng.random((int(indptr[-1]), R, C)) < 0.7
    layout = ba.layouts.block_sparse(indptr, np.concatenate(per_row), M, N, R, C, mask=mask)
    k, v = rng.standard_normal((2, N // C, C, HKV, D))
    _compare(gpu_backend, layout, rng.standard_normal((M, HQ, D)), k, v, "float16", variant=ba.Variant(causal=True))


def test_vector_sparse(gpu_backend):
    rng = _rng(5)
    tokens = [rng.choice(8192, 512, replace=False) for _ in range(8)]
    layout = ba.layouts.vector_sparse(tokens, [1] * 8, num_slots=8192)
    k, v = rng.standard_normal((2, 8192, HKV, D))
    _compare(gpu_backend, layout, rng.standard_normal((8, HQ, D)), k, v, "float16")


def test_quest_per_head_pages(gpu_backend):
    rng = _rng(6)
    kv_lens = rng.integers(1024, 4096, 8)
    tables, num_pages = _pages(rng, kv_lens)
    selected = [[np.sort(rng.choice(len(t), 64, replace=False)) for _ in range(HKV)] for t in tables]
    layout = ba.layouts.quest(tables, kv_lens, selected, PAGE, num_pages, HKV)
    k, v = rng.standard_normal((2, num_pages, HKV, PAGE, D))
    q, k, v = ba.layouts.per_head_views(rng.standard_normal((8, HQ, D)), k, v, HKV)
    _compare(gpu_backend, layout, q, k, v, "float16")


def test_tree_decoding(gpu_backend):
    rng = _rng(7)
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, 32)] for _ in range(4)]
    kv_lens = rng.integers(300, 1200, 4) + 32
    tables, num_pages = _pages(rng, kv_lens)
    layout = ba.layouts.tree(parents, tables, kv_lens, PAGE, num_pages)
    k, v = _kv(rng, num_pages, PAGE)
    q = rng.standard_normal((4 * 32, HQ, D))
    _compare(gpu_backend, layout, q, k, v, "float16", variant=ba.Variant(causal=True))


def test_shared_prefix_cascade(gpu_backend):
    rng = _rng(8)
    suffix_lens = rng.integers(10, 500, 16)
    prefix_len = 2048
    tables, num_pages = _pages(rng, [prefix_len, *suffix_lens])
    cascade = ba.layouts.shared_prefix(np.ones(16, int), tables[0], prefix_len, tables[1:], suffix_lens, PAGE,
                                       num_pages)
    k, v = _kv(rng, num_pages, PAGE)
    _compare(gpu_backend, cascade, rng.standard_normal((16, HQ, D)), k, v, "float16", variant=ba.Variant(causal=True))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_rope_on_a_shared_prefix_cascade(gpu_backend, dtype):
    """Fused RoPE on a cascade: a 4000-key prefix shared by decode and prefill requests, each level turning at
    positions in the whole sequence (the queries thousands of positions in, the suffixes' keys after the
    prefix)."""
    rng = _rng(9)
    qo_lens = np.array([1, 37, 128, 5, 1, 64])
    suffix_lens = qo_lens + rng.integers(0, 600, qo_lens.size)
    prefix_len = 4000
    tables, num_pages = _pages(rng, [prefix_len, *suffix_lens])
    cascade = ba.layouts.shared_prefix(qo_lens, tables[0], prefix_len, tables[1:], suffix_lens, PAGE, num_pages)
    k, v = _kv(rng, num_pages, PAGE)
    _compare(gpu_backend, cascade, rng.standard_normal((int(qo_lens.sum()), HQ, D)), k, v, dtype,
             variant=ba.Variant(causal=True, rope_theta=1e4))


# ---- fp8 KV -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_kv_with_scales(gpu_backend, q_dtype, kv_dtype):
    layout, q, k, v = _paged_decode(seed=9)
    _compare(gpu_backend, layout, q, k, v, q_dtype, kv_dtype=kv_dtype, scales=dict(k_scale=0.5, v_scale=0.25),
             variant=ba.Variant(causal=True))


# ---- plan / run, determinism --------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(), dict(fixed_split_size=256), dict(disable_split_kv=True),
                                     dict(num_ctas=16)], ids=["tier-default", "fixed_split", "no_split", "16_ctas"])
def test_batch_attention(gpu_backend, options):
    layout, q, k, v = _paged_decode(seed=10, batch=16, lo=16, hi=4000)
    attn = ba.BatchAttention(backend=gpu_backend.name)
    attn.plan(layout, HQ, HKV, D, variant=ba.Variant(causal=True), q_dtype="float16", kv_dtype="float16", **options)
    first = _compare(gpu_backend, layout, q, k, v, "float16", variant=ba.Variant(causal=True), runner=attn.run)
    args = [gpu_backend.array(x, "float16") for x in (q, k, v)]
    for _ in range(3):
        again = attn.run(*args, return_lse=True)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(gpu_backend.numpy(a), gpu_backend.numpy(b))


def test_replan_with_new_lengths(gpu_backend):
    attn = ba.BatchAttention(backend=gpu_backend.name)
    for seed in (11, 12, 13):
        layout, q, k, v = _paged_decode(seed=seed, batch=12)
        attn.plan(layout, HQ, HKV, D, variant=ba.Variant(causal=True), q_dtype="float16", kv_dtype="float16")
        _compare(gpu_backend, layout, q, k, v, "float16", variant=ba.Variant(causal=True), runner=attn.run)


def test_same_call_gives_identical_bytes(gpu_backend):
    layout, q, k, v = _paged_decode(seed=14)
    args = [gpu_backend.array(x, "float16") for x in (q, k, v)]
    outs = {gpu_backend.numpy(ba.attention(*args, layout, backend=gpu_backend.name)).tobytes() for _ in range(20)}
    assert len(outs) == 1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_merge_states_real_size(gpu_backend, dtype):
    from bsrattn.reference import merge_states

    rng = _rng(15)
    o = rng.standard_normal((512, 7, HQ, D)).astype(NUMPY_DTYPES[dtype]).astype(np.float64)
    lse = rng.uniform(-20, 20, (512, 7, HQ)).astype(np.float32)
    lse[rng.random(lse.shape) < 0.1] = -np.inf
    got_o, got_lse = _supported_or_skip(gpu_backend, lambda: ba.merge_states(
        gpu_backend.array(o, dtype), gpu_backend.array(lse, "float32"), backend=gpu_backend.name))
    want_o, want_lse = merge_states(o, lse.astype(np.float64))
    assert_close(gpu_backend.numpy(got_o), want_o, "merge", dtype, name="merge_states o")
    assert_close(gpu_backend.numpy(got_lse), want_lse, "merge", "float32", name="merge_states lse")


def _device_buffers(tier_name, shape_o, shape_lse):
    """``out`` and ``lse`` buffers in the device kind a tier's callers hold (Numba device arrays for numba, CUDA
    tensors for torch and for the reference, which takes torch tensors), poisoned with NaN."""
    if tier_name == "numba":
        from numba import cuda

        return (cuda.to_device(np.full(shape_o, np.nan, np.float32)),
                cuda.to_device(np.full(shape_lse, np.nan, np.float32)))
    import torch

    return (torch.full(shape_o, float("nan"), device="cuda"), torch.full(shape_lse, float("nan"), device="cuda"))


def _inputs_of(tier_name, *arrays):
    if tier_name == "numba":
        from numba import cuda

        return [cuda.to_device(np.ascontiguousarray(x)) for x in arrays]
    import torch

    return [torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in arrays]


def _host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else x.cpu().numpy()


@pytest.mark.parametrize("path", ["sinks", "cascade", "cascade and sinks"])
@pytest.mark.parametrize("tier_name", ["reference", "numba", "torch"])
def test_device_buffers_on_every_merged_path(tier_name, path):
    """``out=``/``lse=`` of the device kind a tier's callers hold, on the paths that merge states after the
    kernels (attention sinks, a Cascade's levels, both): written in place, equal to the NumPy call."""
    tier = load_tier(tier_name)
    rng = _rng(11)
    hq, hkv, d = 8, 2, 64
    sinks = tuple(rng.standard_normal(hq).tolist()) if "sinks" in path else None
    variant = ba.Variant(causal=True, sinks=sinks)
    if "cascade" in path:
        layout = ba.layouts.shared_prefix([2, 1], [0, 1], 20, [[2], [3]], [5, 9], page_size=16, num_pages=4)
        pool = 4
    else:
        layout = ba.layouts.paged([2, 1], [[0, 1], [2]], [20, 9], page_size=16, num_pages=3)
        pool = 3
    q = rng.standard_normal((layout.nnz_qo, hq, d)).astype(np.float32)
    k, v = rng.standard_normal((2, pool, 16, hkv, d)).astype(np.float32)
    want_o, want_lse = ba.attention(q, k, v, layout, variant=variant, return_lse=True)
    out, lse = _device_buffers(tier_name, q.shape, q.shape[:2])
    got_o, got_lse = ba.attention(*_inputs_of(tier_name, q, k, v), layout, variant=variant, backend=tier.backend,
                                  out=out, lse=lse, return_lse=True)
    assert got_o is out and got_lse is lse
    assert_close(_host(out), want_o, "attention", "float32")
    assert_close(_host(lse), want_lse, "lse", "float32")
