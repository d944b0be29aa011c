"""The numba tier on a GPU at real sizes (marked ``gpu``; skipped, with the reason, where there is none).

head_dim 128 (and 64, 256), thousands of keys, fp16, against the float64 reference with poisoned (NaN)
outputs; bitwise determinism over 100 runs; device arrays and torch tensors in place. Run on the H200::

    python -m pytest tests/test_numba_gpu.py -m gpu -q -rs

(``tests/test_tiers_gpu.py`` covers the other dtypes, variants and layouts at real sizes for both tiers.)
"""

from __future__ import annotations

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import scattered_page_tables
from helpers import assert_matches_reference

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 32, 8, 128, 16
PLAIN = ba.Variant()


@pytest.fixture(scope="module")
def cuda():
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("numba sees no CUDA GPU")
    return cuda


def _paged(rng, kv_lens, qo_lens=None, hq=HQ, hkv=HKV, d=D, dtype=np.float16):
    kv_lens = np.asarray(kv_lens)
    qo_lens = np.ones_like(kv_lens) if qo_lens is None else np.asarray(qo_lens)
    tables, num_pages = scattered_page_tables(rng, kv_lens, PAGE, spare_pages=8)
    layout = ba.layouts.paged(qo_lens, tables, kv_lens, PAGE, num_pages)
    q = rng.standard_normal((layout.nnz_qo, hq, d)).astype(dtype)
    k, v = (rng.standard_normal((num_pages, PAGE, hkv, d)).astype(dtype) for _ in range(2))
    return layout, q, k, v


def _poisoned_run(cuda, layout, q, k, v, variant=PLAIN, **kwargs):
    """``ba.attention`` on device arrays writing into NaN-filled ``out``/``lse``; returns host copies."""
    out = cuda.to_device(np.full(q.shape, np.nan, q.dtype))
    lse = cuda.to_device(np.full(q.shape[:2], np.nan, np.float32))
    ba.attention(*(cuda.to_device(x) for x in (q, k, v)), layout, variant=variant, backend="numba", out=out,
                 lse=lse, return_lse=True, **kwargs)
    return out.copy_to_host(), lse.copy_to_host()


def _check(cuda, layout, q, k, v, variant=PLAIN, **kwargs):
    got = _poisoned_run(cuda, layout, q, k, v, variant, **kwargs)
    assert_matches_reference(got, q, k, v, layout, "float16", variant=variant, **kwargs)


def test_quest_decode_workload(cuda):
    """W1's pattern at budget 64 of a 8192-token cache: 32 heads, each with its own pages."""
    rng = np.random.default_rng(0)
    num_pages, budget = 512, 64
    selected = [np.sort(rng.choice(num_pages, budget, replace=False)) for _ in range(32)]
    layout = ba.layouts.quest([np.arange(num_pages)], [num_pages * PAGE], [selected], PAGE, num_pages, 32)
    q = rng.standard_normal((1, 32, D)).astype(np.float16)
    k, v = (rng.standard_normal((num_pages, 32, PAGE, D)).astype(np.float16) for _ in range(2))
    _check(cuda, layout, *ba.layouts.per_head_views(q, k, v, 32))


@pytest.mark.parametrize("kv_len", [1, 63, 64, 65, 127, 128, 129, 4095])
def test_tile_boundaries(cuda, kv_len):
    rng = np.random.default_rng(kv_len)
    _check(cuda, *_paged(rng, [kv_len, 3 * kv_len // 2 + 1]), variant=ba.Variant(causal=True))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_other_head_dims(cuda, head_dim):
    rng = np.random.default_rng(head_dim)
    _check(cuda, *_paged(rng, [700, 1500, 33], d=head_dim), variant=ba.Variant(causal=True))


def test_prefill_with_query_subtiles(cuda):
    """Rows of 200 queries: items of several query rows, each KV tile shared by the block's GQA heads."""
    rng = np.random.default_rng(1)
    _check(cuda, *_paged(rng, [900, 400], qo_lens=[200, 37]), variant=ba.Variant(causal=True))


def test_gqa_32_to_1(cuda):
    rng = np.random.default_rng(2)
    _check(cuda, *_paged(rng, [2000, 100, 3000], hkv=1), variant=ba.Variant(logits_soft_cap=30.0))


def test_bitwise_identical_over_100_runs(cuda):
    rng = np.random.default_rng(3)
    layout, q, k, v = _paged(rng, rng.integers(100, 4000, 16))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    attn = ba.BatchAttention(backend="numba")
    attn.plan(layout, HQ, HKV, D, variant=ba.Variant(causal=True), q_dtype="float16", kv_dtype="float16")
    assert attn.work_plans[0].num_merges > 0  # the merge's fixed order is part of what is checked
    first_o, first_lse = (x.copy_to_host().tobytes() for x in attn.run(dq, dk, dv, return_lse=True))
    for _ in range(99):
        o, lse = attn.run(dq, dk, dv, return_lse=True)
        assert o.copy_to_host().tobytes() == first_o and lse.copy_to_host().tobytes() == first_lse
    one_shot = {ba.attention(dq, dk, dv, layout, backend="numba").copy_to_host().tobytes() for _ in range(100)}
    assert len(one_shot) == 1


def test_torch_tensors_in_torch_out(cuda):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    rng = np.random.default_rng(4)
    layout, q, k, v = _paged(rng, [500, 1200])
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    out = ba.attention(tq, tk, tv, layout, backend="numba")
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float16
    np.testing.assert_array_equal(out.cpu().numpy(), ba.attention(q, k, v, layout, backend="numba"))
