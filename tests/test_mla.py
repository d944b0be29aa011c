"""Multi-head latent attention (``bsrattn.mla``) on every tier against a float64 oracle of its own formula.

The oracle below is MLA as DeepSeek writes it, row by row over a layout's slots — ``s_hj = sm_scale * (q_nope[h] .
ckv[j] + q_pe[h] . kpe[j])``, the softmax over the slots a query sees, ``o_h = sum_j p_hj ckv[j]`` — with no
concatenation and no BSR kernel: the tiers' BSR reading of it (one KV head, key ``ckv ⊕ kpe``, value ``ckv``) is
what is under test. Sizes are small (``Dc`` 16, ``Dr`` 8, 8 heads) for the simulator and the interpreter; the
H200 runs DeepSeek's shapes in ``test_mla_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.mla import _as_attention
from bsrattn.testing import assert_close
from helpers import rounded
from test_tiers import CORE_TIERS, TIERS, load_tier

H, DC, DR = 8, 16, 8


@pytest.fixture(scope="module", params=TIERS + CORE_TIERS)
def tier(request):
    return load_tier(request.param)


def oracle(q_nope, q_pe, ckv, kpe, layout, causal=False, sm_scale=None):
    """``(o [nnz_qo, H, Dc], lse [nnz_qo, H])`` in float64, straight from MLA's formula."""
    q_nope, q_pe = np.asarray(q_nope, np.float64), np.asarray(q_pe, np.float64)
    ckv = np.asarray(ckv, np.float64).reshape(-1, q_nope.shape[2])
    kpe = np.asarray(kpe, np.float64).reshape(len(ckv), q_pe.shape[2])
    scale = 1 / np.sqrt(q_nope.shape[2] + q_pe.shape[2]) if sm_scale is None else sm_scale
    o = np.zeros(q_nope.shape)
    lse = np.full(q_nope.shape[:2], -np.inf)
    for r in range(layout.num_rows):
        slots = layout.kv_slots(r)
        qo_len, kv_len = int(layout.qo_lens[r]), int(layout.kv_lens[r])
        mask = layout.row_mask(r)
        for i in range(qo_len):
            row = int(layout.qo_indptr[r]) + i
            seen = np.ones(kv_len, bool) if mask is None else mask[i].copy()
            if causal:
                seen &= np.arange(kv_len) <= kv_len - qo_len + i
            if not seen.any():
                continue
            c, p = ckv[slots[seen]], kpe[slots[seen]]
            s = scale * (q_nope[row] @ c.T + q_pe[row] @ p.T)               # [H, visible]
            m = s.max(axis=1, keepdims=True)
            w = np.exp(s - m)
            o[row] = (w @ c) / w.sum(axis=1, keepdims=True)
            lse[row] = m[:, 0] + np.log(w.sum(axis=1))
    return o, lse


def operands(rng, layout, tier, dtype="float32"):
    """Random ``q_nope, q_pe, ckv, kpe`` for ``layout`` in ``dtype`` and the tier's array kind, with their values
    as float64 NumPy (rounded through ``dtype``)."""
    pool = (layout.num_blocks,) if layout.block_size == 1 else (layout.num_blocks, layout.block_size)
    shapes = ((layout.nnz_qo, H, DC), (layout.nnz_qo, H, DR), pool + (DC,), pool + (DR,))
    values = [rng.standard_normal(s).astype(dtype).astype(np.float64) for s in shapes]
    return [tier.array(x, dtype) for x in values], values


def _paged(page_size, qo_lens, kv_lens, rng):
    pages = [int(np.ceil(n / page_size)) for n in kv_lens]
    order = rng.permutation(sum(pages) + 1)
    tables = np.split(order[:sum(pages)], np.cumsum(pages)[:-1])
    return ba.layouts.paged(qo_lens, tables, kv_lens, page_size=page_size, num_pages=sum(pages) + 1)


LAYOUTS = {
    "decode, page 1": lambda rng: _paged(1, [1, 1, 1], [37, 5, 64], rng),
    "decode, page 16": lambda rng: _paged(16, [1, 1], [70, 16], rng),
    "speculative rows": lambda rng: _paged(16, [3, 4], [40, 21], rng),
    "ragged causal prefill": lambda rng: ba.layouts.ragged([9, 17], [9, 30]),
    "a draft tree's custom mask": lambda rng: ba.layouts.tree([[-1, 0, 0, 1], [-1, 0]], [[2, 0, 4, 1], [3]],
                                                             [15, 4], page_size=4, num_pages=5),
}
CAUSAL = {"speculative rows": True, "ragged causal prefill": True}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_kind_matches_the_formula(tier, name):
    rng = np.random.default_rng(sum(map(ord, name)))
    layout = LAYOUTS[name](rng)
    causal = CAUSAL.get(name, False)
    args, values = operands(rng, layout, tier)
    out, lse = ba.mla_attention(*args, layout, variant=ba.Variant(causal=causal), backend=tier.backend,
                                return_lse=True)
    want_o, want_lse = oracle(*values, layout, causal)
    assert_close(tier.numpy(out), want_o, "attention", "float32", name=f"{tier.name} {name} out")
    assert_close(tier.numpy(lse), want_lse, "lse", "float32", name=f"{tier.name} {name} lse")


def test_deepseeks_widths_at_64_heads_match_the_formula(tier):
    """FlashInfer's grid runs 64 heads of DeepSeek's widths (Dc 512, Dr 64) over one latent head: on the numba
    tier their queries alone overflow one block's shared memory, so the heads are shared among blocks."""
    rng = np.random.default_rng(5)
    layout = _paged(16, [1, 2], [9, 20], rng)
    heads, dc, dr = 64, 512, 64
    pool = (layout.num_blocks, layout.block_size)
    values = [rng.standard_normal(s).astype(np.float16).astype(np.float64) for s in
              ((layout.nnz_qo, heads, dc), (layout.nnz_qo, heads, dr), pool + (dc,), pool + (dr,))]
    out, lse = ba.mla_attention(*(tier.array(x, "float16") for x in values), layout,
                                variant=ba.Variant(causal=True), backend=tier.backend, return_lse=True)
    want_o, want_lse = oracle(*values, layout, causal=True)
    assert_close(tier.numpy(out), want_o, "attention", "float16", name=f"{tier.name} 64 heads out")
    assert_close(tier.numpy(lse), want_lse, "lse", "float16", name=f"{tier.name} 64 heads lse")


def test_split_rows_merge_and_a_plan_runs_again(tier):
    rng = np.random.default_rng(1)
    layout = _paged(16, [1, 2], [150, 90], rng)
    args, values = operands(rng, layout, tier)
    attn = ba.BatchMLAAttention(backend=tier.backend)
    attn.plan(layout, num_heads=H, head_dim_ckv=DC, head_dim_kpe=DR, num_ctas=5, q_dtype="float32",
              kv_dtype="float32")
    assert attn.work_plans[0].num_merges > 0, "the plan splits rows"
    out, lse = attn.run(*args, return_lse=True)
    want_o, want_lse = oracle(*values, layout)
    assert_close(tier.numpy(out), want_o, "attention", "float32", name=f"{tier.name} split out")
    assert_close(tier.numpy(lse), want_lse, "lse", "float32", name=f"{tier.name} split lse")
    again = attn.run(*args)
    assert np.array_equal(tier.numpy(again), tier.numpy(out)), "same plan, same bits"


def test_a_cascade_shares_its_prefix(tier):
    rng = np.random.default_rng(2)
    cascade = ba.layouts.shared_prefix([1, 2], [9, 0, 3, 5, 7, 1, 8, 2, 6, 4], 40, [[10, 12], [11, 13, 14, 15, 16]],
                                       [7, 19], page_size=4, num_pages=17)
    flat = cascade.flatten(causal=False)
    args, values = operands(rng, cascade.levels[0], tier)
    out = ba.mla_attention(*args, cascade, backend=tier.backend)
    want_o, _ = oracle(*values, flat)
    assert_close(tier.numpy(out), want_o, "attention", "float32", name=f"{tier.name} cascade out")


def test_one_latent_cache_array_is_read_in_place(tier):
    """``ckv`` and ``kpe`` as the two parts of one ``[..., Dc + Dr]`` cache (and ``q_nope``, ``q_pe`` of one query
    array): the kernel reads that array as the key, no copy, and answers bit for bit as with separate copies; parts
    in the other order, or from two arrays, are copied and still right."""
    rng = np.random.default_rng(8)
    layout = _paged(16, [1, 2], [70, 21], rng)
    q_all = tier.array(rng.standard_normal((layout.nnz_qo, H, DC + DR)), "float32")
    cache = tier.array(rng.standard_normal((layout.num_blocks, 16, DC + DR)), "float32")
    parts = q_all[..., :DC], q_all[..., DC:], cache[..., :DC], cache[..., DC:]
    q, k, v = _as_attention(*parts)
    assert q.data_ptr() == q_all.data_ptr() if hasattr(q, "data_ptr") else np.shares_memory(q, q_all)
    assert k.data_ptr() == cache.data_ptr() if hasattr(k, "data_ptr") else np.shares_memory(k, cache)
    copies = [tier.array(tier.numpy(x), "float32") for x in parts]
    want = tier.numpy(ba.mla_attention(*copies, layout, backend=tier.backend))
    assert np.array_equal(tier.numpy(ba.mla_attention(*parts, layout, backend=tier.backend)), want)
    assert_close(want, oracle(*map(tier.numpy, parts), layout)[0], "attention", "float32", name=f"{tier.name} out")

    # The rotary part first in both arrays: the parts are not ``x ⊕ y`` of one row, so they are copied.
    swapped = q_all[..., DR:], q_all[..., :DR], cache[..., DR:], cache[..., :DR]
    out = ba.mla_attention(*swapped, layout, backend=tier.backend)
    assert_close(tier.numpy(out), oracle(*map(tier.numpy, swapped), layout)[0], "attention", "float32",
                 name=f"{tier.name} swapped parts")


def test_deterministic_rows_are_bitwise_the_same_in_any_batch(tier):
    if tier.backend.kernel == "core":
        pytest.skip("the core has no chunk grid")
    rng = np.random.default_rng(3)
    alone = _paged(16, [1], [200], rng)
    batch = ba.layouts.paged([1, 1], [alone.kv_indices, alone.kv_indices[:3]], [200, 40], page_size=16,
                             num_pages=alone.num_blocks)
    args, _ = operands(rng, batch, tier)
    q_nope, q_pe, ckv, kpe = args
    one = ba.mla_attention(q_nope[:1], q_pe[:1], ckv, kpe, alone, backend=tier.backend, deterministic=True,
                           split_size=64)
    both = ba.mla_attention(q_nope, q_pe, ckv, kpe, batch, backend=tier.backend, deterministic=True, split_size=64)
    assert np.array_equal(tier.numpy(one)[0], tier.numpy(both)[0])


def test_float16_matches_the_formula(tier):
    rng = np.random.default_rng(4)
    layout = _paged(16, [1, 3], [60, 33], rng)
    args, values = operands(rng, layout, tier, "float16")
    out = ba.mla_attention(*args, layout, variant=ba.Variant(causal=True), backend=tier.backend)
    assert_close(tier.numpy(out), oracle(*values, layout, causal=True)[0], "attention", "float16",
                 name=f"{tier.name} float16 out")


def test_an_fp8_cache_with_its_scales(tier):
    """fp8 ``ckv`` and ``kpe`` with ``ckv_scale`` and ``kpe_scale`` (unequal: the rotary part's scale goes into
    ``q_pe``), one-shot and planned: MLA's formula over the dequantised cache, ``ckv * ckv_scale`` the value too."""
    rng = np.random.default_rng(9)
    layout = _paged(16, [1, 2], [70, 21], rng)
    pool = (layout.num_blocks, layout.block_size)
    shapes = {"float16": ((layout.nnz_qo, H, DC), (layout.nnz_qo, H, DR)), "float8_e4m3fn": (pool + (DC,),
                                                                                          pool + (DR,))}
    values = [rounded(rng.standard_normal(s), dtype) for dtype, pair in shapes.items() for s in pair]
    args = [tier.array(v, dtype) for v, dtype in zip(values, ["float16"] * 2 + ["float8_e4m3fn"] * 2)]
    scales = dict(ckv_scale=0.5, kpe_scale=3.0)
    want_o, want_lse = oracle(*values[:2], values[2] * 0.5, values[3] * 3.0, layout)
    out, lse = ba.mla_attention(*args, layout, backend=tier.backend, return_lse=True, **scales)
    assert_close(tier.numpy(out), want_o, "attention", "float16", name=f"{tier.name} fp8 out")
    assert_close(tier.numpy(lse), want_lse, "lse", "float16", name=f"{tier.name} fp8 lse")
    attn = ba.BatchMLAAttention(backend=tier.backend)
    attn.plan(layout, num_heads=H, head_dim_ckv=DC, head_dim_kpe=DR, q_dtype="float16", kv_dtype="float8_e4m3fn")
    assert_close(tier.numpy(attn.run(*args, **scales)), want_o, "attention", "float16",
                 name=f"{tier.name} fp8 planned out")


@pytest.mark.parametrize("scales, match", [(dict(ckv_scale=0.0), "ckv_scale must be a positive finite float"),
                                           (dict(kpe_scale=float("inf")), "kpe_scale must be a positive finite"),
                                           (dict(kpe_scale="2"), "kpe_scale")])
def test_bad_scales_are_refused_by_name(scales, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _bad_call(**scales)


def test_the_scale_defaults_to_both_widths_and_follows_the_variant():
    rng = np.random.default_rng(5)
    layout = ba.layouts.ragged([2], [11])
    q_nope, q_pe = rng.standard_normal((2, H, DC)), rng.standard_normal((2, H, DR))
    ckv, kpe = rng.standard_normal((11, DC)), rng.standard_normal((11, DR))
    for sm_scale in (None, 0.3):
        out = ba.mla_attention(q_nope, q_pe, ckv, kpe, layout, variant=ba.Variant(sm_scale=sm_scale))
        assert_close(out, oracle(q_nope, q_pe, ckv, kpe, layout, sm_scale=sm_scale)[0], "attention", "float64")


def test_mla_runs_on_torch_tensors_on_the_reference_tier():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    layout = _paged(4, [1, 1], [9, 6], rng)
    values = [rng.standard_normal(s) for s in ((2, H, DC), (2, H, DR), (layout.num_blocks, 4, DC),
                                               (layout.num_blocks, 4, DR))]
    out = ba.mla_attention(*map(torch.from_numpy, values), layout, backend="reference")
    assert isinstance(out, torch.Tensor) and out.shape == (2, H, DC)
    assert_close(out.numpy(), oracle(*values, layout)[0], "attention", "float64")


def _bad_call(variant=None, **change):
    rng = np.random.default_rng(7)
    layout = ba.layouts.paged([1, 1], [[0], [1]], [3, 4], page_size=4, num_pages=2)
    args = dict(q_nope=rng.standard_normal((2, H, DC)), q_pe=rng.standard_normal((2, H, DR)),
                ckv=rng.standard_normal((2, 4, DC)), kpe=rng.standard_normal((2, 4, DR)))
    args.update(change)
    return ba.mla_attention(**args, layout=layout, variant=variant)


@pytest.mark.parametrize("change, error, match", [
    (dict(q_pe=np.zeros((2, H + 1, DR))), ValueError, r"q_pe has shape \(2, 9, 8\)"),
    (dict(q_nope=np.zeros((3, H, DC)), q_pe=np.zeros((3, H, DR))), ValueError, "q_nope has 3 query rows"),
    (dict(ckv=np.zeros((2, 8, DC))), ValueError, r"ckv has shape \(2, 8, 16\)"),
    (dict(ckv=np.zeros((2, 4, DC + 1))), ValueError, "ckv has head_dim_ckv 17; q_nope has 16"),
    (dict(kpe=np.zeros((2, 4, DR + 2))), ValueError, r"kpe has shape \(2, 4, 10\)"),
    (dict(kpe=np.zeros((2, 4, DR), np.float32)), TypeError, "kpe has dtype float32 but ckv has float64"),
    (dict(ckv=[[0.0]]), TypeError, "ckv must be an array"),
])
def test_operands_that_do_not_fit_are_refused_by_name(change, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**change)


def test_fused_rope_is_refused():
    with pytest.raises(ValueError, match="fused RoPE"):
        _bad_call(variant=ba.Variant(rope_theta=1e4))


def test_a_run_that_does_not_fit_its_plan_is_refused():
    attn = ba.BatchMLAAttention(backend="reference")
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(*[np.zeros((1, 1, 1))] * 4)
    layout = ba.layouts.ragged([1], [5])
    attn.plan(layout, num_heads=H, head_dim_ckv=DC, head_dim_kpe=DR)
    with pytest.raises(ValueError, match="the plan is for num_heads=8, head_dim_ckv=16, head_dim_kpe=8"):
        attn.run(np.zeros((1, H, DC - 1)), np.zeros((1, H, DR)), np.zeros((5, DC - 1)), np.zeros((5, DR)))
    with pytest.raises(ValueError, match="head_dim_kpe must be"):
        attn.plan(layout, num_heads=H, head_dim_ckv=DC, head_dim_kpe=-1)
