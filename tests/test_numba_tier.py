"""The numba tier against the float64 oracle, under the CUDA simulator at tiny sizes (on a GPU: for real).

What the cross-tier tests (``test_tiers.py``) do not single out: each layout kind by name, each ``Variant``
field, GQA ratios and storage orders, every dtype including the bit-decoded bf16 and fp8, both load paths
(sparse and affine) giving the same bits, plans with forced splits and query sub-tiles, the merge kernels,
array kinds and ``out=`` buffers, and the errors the tier raises itself. Sizes are tens of keys and
head_dim 8: the simulator runs every CUDA thread as a Python thread. Attention is checked with
``helpers.check_attention`` (the oracle rebuilt from the layout's raw inputs, within the dtype's error budget),
merges against ``helpers.naive_merge``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import bsrattn as ba
from bsrattn import scheduler
from bsrattn.items import ITEM, item_table
from bsrattn.testing import assert_close
from helpers import NUMPY_DTYPES as NP
from helpers import check_attention, naive_merge, raw_tensors, rounded
from strategies import PAGED, Problem, named_case, paged_problem

pytest.importorskip("numba.cuda", reason="the numba tier needs numba-cuda")
import numba
from numba import cuda

from bsrattn.numba_cuda import config, formats, gather, launch, make_runner, plan_options
from bsrattn.validation import make_spec

D = 8
PLAIN, CAUSAL = ba.Variant(), ba.Variant(causal=True)


def _host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def _attention(problem, **kwargs):
    """``ba.attention`` on the numba tier, as a run for ``helpers.check_attention``; ``out`` keeps ``q``'s dtype."""
    want_lse = not problem.variant.use_sigmoid

    def run(q, k, v, kv_layout):
        got = ba.attention(q, k, v, problem.case.layout, variant=problem.variant, kv_layout=kv_layout,
                           backend="numba", return_lse=want_lse, **kwargs)
        got_o, got_lse = got if want_lse else (got, None)
        assert _host(got_o).dtype == q.dtype
        return _host(got_o), (None if got_lse is None else _host(got_lse))
    return run


def _check(problem, dtype="float32", **kwargs):
    """``ba.attention`` on the numba tier against the oracle; returns ``(out, lse)`` as float64."""
    return check_attention(_attention(problem), problem, dtype, name=f"numba {problem.case.kind}", **kwargs)


def _tensors(rng, n_q, hq, kv_shape, dtype="float32"):
    q = rng.standard_normal((n_q, hq, D)).astype(NP[dtype])
    k, v = (rng.standard_normal(kv_shape).astype(NP[dtype]) for _ in range(2))
    return q, k, v


def _paged(rng, hq=4, hkv=2, dtype="float32"):
    layout = ba.layouts.paged(**PAGED)
    return (layout, *_tensors(rng, layout.nnz_qo, hq, (8, 8, hkv, D), dtype))


# ---- every layout kind ----------------------------------------------------------------------------------

def _layout_problem(kind, seed=1):
    """One named tiny problem of each constructor."""
    causal = ba.Variant(causal=True)
    mask = np.random.default_rng(seed).random((5, 2, 4)) < 0.7
    cases = {
        "dense": (named_case("dense", dict(qo_len=4, kv_len=21), "flat"), 2, 1, causal),
        "ragged": (named_case("ragged", dict(qo_lens=[2, 0, 3], kv_lens=[20, 5, 3]), "flat"), 4, 2, causal),
        "paged": (named_case("paged", PAGED), 4, 2, causal),
        "block_sparse": (named_case("block_sparse", dict(indptr=[0, 3, 3, 5], indices=[0, 2, 5, 1, 4], M=6, N=24,
                                                         R=2, C=4, mask=mask)), 2, 1, ba.Variant()),
        "vector_sparse": (named_case("vector_sparse", dict(token_indices=[[9, 2, 30, 5, 17, 11, 0, 3, 25], [4, 4, 8]],
                                                           qo_lens=[2, 1], num_slots=32), "flat"), 2, 2, causal),
        "quest": (named_case("quest", dict(page_tables=[[2, 0, 1, 3], [4, 5]], kv_lens=[30, 12],
                                           selected_pages=[[[0, 3], [1, 2, 3]], [[1], [0, 1]]], page_size=8,
                                           num_pages=6, num_kv_heads=2), "quest", 2), 4, 2, ba.Variant()),
        "tree": (named_case("tree", dict(parents=[[-1, 0, 0, 1], [-1, -1]], page_tables=[[1, 0, 3], [2]],
                                         kv_lens=[19, 3], page_size=8, num_pages=4)), 2, 1, causal),
        "shared_prefix": (named_case("shared_prefix", dict(qo_lens=[1, 2], prefix_pages=[0, 1], prefix_len=13,
                                                           suffix_page_tables=[[2], [3]], suffix_lens=[5, 8],
                                                           page_size=8, num_pages=4)), 2, 1, causal),
    }
    case, hq, hkv, variant = cases[kind]
    return Problem(case, hq, hkv, D, variant, seed)


KINDS = ("dense", "ragged", "paged", "block_sparse", "vector_sparse", "quest", "tree", "shared_prefix")


def test_kinds_are_every_constructor():
    assert set(KINDS) == set(ba.layouts.__all__) - {"per_head_views"}


@pytest.mark.parametrize("kind", KINDS)
def test_every_layout_kind(kind):
    _check(_layout_problem(kind))


# ---- every Variant field, GQA, storage orders -------------------------------------------------------------

@pytest.mark.parametrize("variant", [
    ba.Variant(sm_scale=0.9),
    ba.Variant(causal=True),
    ba.Variant(causal=True, window_left=3),
    ba.Variant(window_left=0),
    ba.Variant(logits_soft_cap=2.0, sm_scale=1.5),
    ba.Variant(causal=True, alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    ba.Variant(sigmoid_bias=-0.5),
    ba.Variant(causal=True, window_left=5, logits_soft_cap=3.0, alibi_slopes=[0.3, 0.2, 0.1, 0.05]),
    ba.Variant(causal=True, rope_theta=100.0, rope_scale=1.5),
], ids=["sm_scale", "causal", "window", "window0", "soft_cap", "alibi", "sigmoid", "combined", "rope"])
def test_every_variant_field(variant):
    _check(paged_problem(variant, seed=2))


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("storage", ["NHD", "HND"])
def test_gqa_ratios_and_storage(hq, hkv, storage):
    _check(paged_problem(hq=hq, hkv=hkv, kv_pool=storage))


def test_a_group_too_large_for_one_block_is_shared_among_blocks_of_its_kv_head():
    """48 query heads of 256 per KV head overflow one block's shared memory: each KV head's heads are split
    between blocks reading its tiles (ALiBi's per-head slopes check that each block writes its own heads)."""
    hq, hkv, head_dim = 96, 2, 256
    slopes = [2.0 ** -(1 + h % 8) for h in range(hq)]
    variant = ba.Variant(causal=True, alibi_slopes=slopes)
    assert config.choose_tiles(head_dim, hq // hkv, 4, 8, 4, item_rows=1)[2] > 1, "the group must be split"
    _check(Problem(named_case("paged", PAGED, "NHD"), hq, hkv, head_dim, variant, seed=6))


def test_three_d_kv_for_block_size_one():
    raw = dict(token_indices=[[3, 1, 4, 15, 9, 2, 6], [5, 3]], qo_lens=[2, 1], num_slots=16)
    flat = Problem(named_case("vector_sparse", raw, "flat"), 4, 2, D, ba.Variant(), seed=4)
    _check(flat)
    _check(Problem(named_case("vector_sparse", raw, "NHD"), 4, 2, D, ba.Variant(), seed=4))  # [N, 1, Hkv, D]


# ---- dtypes -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_dtypes(dtype):
    _check(paged_problem(seed=5), dtype)


@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_with_scales(q_dtype, kv_dtype):
    """fp8 KV stored as ``2k`` and ``4v`` with scales 1/2 and 1/4; the oracle sees the dequantised values."""
    problem = paged_problem(seed=6)
    q, k, v = raw_tensors(problem)
    tensors = rounded(q, q_dtype), rounded(k * 2, kv_dtype), rounded(v * 4, kv_dtype)
    check_attention(_attention(problem, k_scale=0.5, v_scale=0.25), problem, q_dtype, tensors, kv_dtype=kv_dtype,
                    k_scale=0.5, v_scale=0.25, name=f"numba fp8 {kv_dtype}")


def test_float64_is_computed_in_float64():
    problem = paged_problem(ba.Variant(), seed=7)

    def run(q, k, v, kv_layout):
        out, lse = _attention(problem)(q, k, v, kv_layout)
        assert lse.dtype == np.float64
        return out, lse

    check_attention(run, problem, "float64", name="numba float64")


# ---- the two load paths -------------------------------------------------------------------------------------

def test_dense_and_sparse_paths_give_the_same_bits():
    """The same keys in the same order: contiguous (a ragged layout, the affine path) or scattered through the
    pool (a vector-sparse layout, the sparse path). Only addressing differs, so the bits must not."""
    rng = np.random.default_rng(8)
    dense = ba.layouts.ragged([3, 2], [21, 9])
    where = rng.permutation(30)  # key s of the contiguous pool lives at slot where[s] of the scattered one
    sparse = ba.layouts.vector_sparse([where[:21], where[21:]], [3, 2], num_slots=30)
    first_slot = [item_table(scheduler.plan(x.qo_lens, x.kv_lens, num_ctas=1), x)[:, ITEM["first_slot"]]
                  for x in (dense, sparse)]
    assert (first_slot[0] >= 0).all() and (first_slot[1] < 0).all()
    q, k, v = _tensors(rng, 5, 2, (30, 1, D))
    k_scattered, v_scattered = np.empty_like(k), np.empty_like(v)
    k_scattered[where], v_scattered[where] = k, v
    variant = ba.Variant(causal=True)
    a = ba.attention(q, k, v, dense, backend="numba", variant=variant, return_lse=True)
    b = ba.attention(q, k_scattered, v_scattered, sparse, backend="numba", variant=variant, return_lse=True)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_copy_word_respects_row_size_and_alignment():
    assert gather.copy_word(256, 0, 4096).itemsize == 8
    assert gather.copy_word(12, 0).itemsize == 4
    assert gather.copy_word(256, 2).itemsize == 2
    assert gather.copy_word(3, 0).itemsize == 1


# ---- plans: splits, sub-tiles, determinism ---------------------------------------------------------------

def _plan_run(layout, q, k, v, work_plan, variant=CAUSAL, hq=4, hkv=2):
    spec = make_spec(layout, hq, hkv, D, variant)
    return make_runner(spec, work_plan).run(q, k, v, return_lse=not variant.use_sigmoid)


@pytest.mark.parametrize("plan_kwargs", [
    dict(num_ctas=4, tile_q=1, fixed_split_size=3),
    dict(num_ctas=3, tile_q=2, fixed_split_size=7),
    dict(num_ctas=2, tile_q=8),                      # query rows beyond the kernel's sub-tile: it loops
    dict(num_ctas=5, tile_q=3, disable_split_kv=True),
], ids=["splits-of-3", "splits-of-7", "tall-tiles", "no-split"])
def test_plans_agree_with_the_oracle(plan_kwargs):
    problem = paged_problem(seed=9)
    layout = problem.case.layout
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, **plan_kwargs)
    check_attention(lambda q, k, v, _: _plan_run(layout, q, k, v, work_plan), problem, "float32",
                    name=f"numba plan {plan_kwargs}")
    if not plan_kwargs.get("disable_split_kv"):
        assert work_plan.num_merges > 0


def test_split_sigmoid_adds_partials():
    variant = ba.Variant(sigmoid_bias=0.3)
    problem = paged_problem(variant, seed=10)
    layout = problem.case.layout
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=4, fixed_split_size=5)

    def run(q, k, v, kv_layout):
        out, lse = _plan_run(layout, q, k, v, work_plan, variant=variant)
        assert lse is None
        return out, None

    check_attention(run, problem, "float32", name="numba split sigmoid")


def test_same_plan_same_bits_and_plans_agree():
    rng = np.random.default_rng(11)
    layout, q, k, v = _paged(rng)
    plans = [scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=n, fixed_split_size=s)
             for n, s in ((4, 3), (2, 16))]
    runs = [_plan_run(layout, q, k, v, p) for p in (plans[0], plans[0], plans[1])]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert_close(runs[2][0], runs[0][0], "attention", "float32")


def _batch_run(attn, problem, **plan_kwargs):
    """``BatchAttention`` planned for ``problem`` and run once, as a run for ``helpers.check_attention``."""
    def run(q, k, v, kv_layout):
        attn.plan(problem.case.layout, problem.num_qo_heads, problem.num_kv_heads, D, variant=problem.variant,
                  kv_layout=kv_layout, **plan_kwargs)
        return attn.run(q, k, v), None
    return run


def test_batch_attention_replans_in_place():
    attn = ba.BatchAttention(backend="numba")
    for seed, kv_lens in enumerate(([29, 12, 11], [3, 16, 9])):
        problem = paged_problem(kv_lens=kv_lens, seed=seed)
        check_attention(_batch_run(attn, problem, num_ctas=3, fixed_split_size=4), problem, "float32",
                        name=f"numba replanned for {kv_lens}")


def test_plan_options():
    spec = make_spec(ba.layouts.paged(**PAGED), 8, 2, D)
    options = plan_options(spec)
    assert options["tile_q"] == config.query_tile_rows(4)
    assert options["kv_align"] == config.KV_ALIGN and options["num_ctas"] >= 1


# ---- cascade and masked rows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [ba.Variant(causal=True), ba.Variant(sigmoid_bias=-1.0)],
                         ids=["softmax", "sigmoid"])
def test_cascade_through_attention_and_batch_attention(variant):
    problem = _layout_problem("shared_prefix", seed=13)
    problem = Problem(problem.case, problem.num_qo_heads, problem.num_kv_heads, D, variant, problem.seed)
    _check(problem)
    check_attention(_batch_run(ba.BatchAttention(backend="numba"), problem, num_ctas=2, fixed_split_size=4),
                    problem, "float32", name="numba cascade plan")


def test_rows_that_see_no_key():
    """Causal with qo_len > kv_len, an empty row and a query-less row: out = 0, lse = -inf where nothing is seen."""
    case = named_case("ragged", dict(qo_lens=[4, 2, 0, 1], kv_lens=[2, 0, 3, 5]), "flat")
    out, lse = _check(Problem(case, 2, 1, D, ba.Variant(causal=True), seed=14))
    unseen = [0, 1, 4, 5]  # positions -2, -1 of row 0; the empty row 1
    assert (out[unseen] == 0).all() and (lse[unseen] == -np.inf).all()
    assert np.isfinite(lse[[2, 3, 6]]).all()


# ---- array kinds and buffers ----------------------------------------------------------------------------------

def test_device_arrays_in_device_arrays_out():
    rng = np.random.default_rng(15)
    layout, q, k, v = _paged(rng)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    out, lse = ba.attention(dq, dk, dv, layout, backend="numba", return_lse=True)
    assert type(out) is type(dq) and type(lse) is type(dq)
    host_o, host_lse = ba.attention(q, k, v, layout, backend="numba", return_lse=True)
    np.testing.assert_array_equal(out.copy_to_host(), host_o)
    np.testing.assert_array_equal(lse.copy_to_host(), host_lse)


@pytest.mark.parametrize("kernel", ["shipped", "core"])
def test_values_narrower_than_keys_in_place_and_beyond_mla(kernel):
    """``head_dim_vo`` where MLA (``test_mla.py``, NumPy, one KV head, NHD) does not go: two KV heads in HND storage
    on a plan that splits rows; and ``v`` a device view of the keys' first columns, read where it lies, bit for bit
    what the same values copied give. A device ``v`` whose rows are not evenly spaced is refused by name."""
    rng = np.random.default_rng(31)
    layout = ba.layouts.paged([1, 2], [[3, 0, 1], [2]], [20, 6], page_size=8, num_pages=4)
    q = rng.standard_normal((3, 4, 12)).astype(np.float32)
    k, v = (rng.standard_normal((4, 2, 8, d)).astype(np.float32) for d in (12, 8))
    attn = ba.BatchAttention("numba", kernel)
    attn.plan(layout, 4, 2, 12, kv_layout="HND", num_ctas=4, fixed_split_size=8, head_dim_vo=8)
    assert attn.work_plans[0].num_merges > 0, "the plan splits rows"
    out, lse = attn.run(q, k, v, return_lse=True)
    want_o, want_lse = ba.attention(q, k, v, layout, kv_layout="HND", backend="reference", return_lse=True)
    assert_close(out, want_o, "attention", "float32", name=f"numba {kernel} HND out")
    assert_close(lse, want_lse, "lse", "float32", name=f"numba {kernel} HND lse")

    wide = rng.standard_normal((4, 8, 1, 12)).astype(np.float32)
    q1, key = np.ascontiguousarray(q[:, :1]), cuda.to_device(wide)
    got = ba.attention(cuda.to_device(q1), key, key[..., :8], layout, backend="numba", kernel=kernel)
    np.testing.assert_array_equal(got.copy_to_host(), ba.attention(q1, wide, wide[..., :8].copy(), layout,
                                                                   backend="numba", kernel=kernel))
    with pytest.raises(ValueError, match=r"v must have its rows \(the last axis\) contiguous and evenly spaced"):
        ba.attention(cuda.to_device(q1), key, key[..., ::2][..., :6], layout, backend="numba", kernel=kernel)


@pytest.mark.parametrize("kind", ["numpy", "device"])
def test_out_and_lse_buffers(kind):
    problem = paged_problem(ba.Variant(), seed=16)
    place = (lambda x: x) if kind == "numpy" else cuda.to_device

    def run(q, k, v, kv_layout):
        out, lse = place(np.full(q.shape, np.nan, np.float32)), place(np.full(q.shape[:2], np.nan, np.float32))
        got_o, got_lse = ba.attention(place(q), place(k), place(v), problem.case.layout, backend="numba", out=out,
                                      lse=lse, return_lse=True)
        assert got_o is out and got_lse is lse
        return _host(out), _host(lse)

    check_attention(run, problem, "float32", name=f"numba {kind} buffers")


# ---- merge kernels -------------------------------------------------------------------------------------------

def _states(rng, shape, dtype):
    o = rng.standard_normal(shape).astype(NP[dtype])
    lse = rng.uniform(-5, 5, shape[:-1]).astype(np.float32)
    lse[rng.random(lse.shape) < 0.25] = -np.inf
    return o, lse


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_merge_state(dtype):
    rng = np.random.default_rng(17)
    (o_a, s_a), (o_b, s_b) = _states(rng, (5, 3, D), dtype), _states(rng, (5, 3, D), dtype)
    s_a[0, 0] = s_b[0, 0] = -np.inf  # both empty: o = 0, lse = -inf
    got_o, got_lse = ba.merge_state(o_a, s_a, o_b, s_b, backend="numba")
    want_o, want_lse = naive_merge(np.stack([o_a, o_b], 1), np.stack([s_a, s_b], 1))
    assert got_o.dtype == o_a.dtype and got_lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert_close(got_o.astype(np.float64), want_o, "merge", dtype)
    assert_close(got_lse, want_lse, "merge", "float32")
    assert (got_o[0, 0] == 0).all() and got_lse[0, 0] == -np.inf


@pytest.mark.parametrize("num_states", [1, 2, 5])
def test_merge_states_folds_in_order(num_states):
    rng = np.random.default_rng(18)
    o, lse = _states(rng, (3, num_states, 2, D), "float32")
    got_o, got_lse = ba.merge_states(o, lse, backend="numba")
    want_o, want_lse = naive_merge(o, lse)
    assert_close(got_o, want_o, "merge", "float32")
    assert_close(got_lse, want_lse, "merge", "float32")


def test_add_states():
    from bsrattn.numba_cuda import add_states

    rng = np.random.default_rng(19)
    a, b = (rng.standard_normal((4, 2, D)).astype(np.float16) for _ in range(2))
    np.testing.assert_array_equal(add_states(a, b), a + b)


# ---- formats: bf16 and fp8 bits ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_decoders_match_ml_dtypes_on_every_bit_pattern(fmt):
    decode = formats.decoder(fmt, np.float32)
    if launch.SIMULATOR is False:
        pytest.skip("device functions are callable from Python only under the simulator")
    bits = np.arange(2 ** (8 * np.dtype(formats.BITS[fmt]).itemsize), dtype=np.int64).astype(formats.BITS[fmt])
    got = np.array([decode(b) for b in bits], dtype=np.float32)
    np.testing.assert_array_equal(got, bits.view(NP[fmt]).astype(np.float32))


def test_bf16_encoder_rounds_to_nearest_even():
    if not launch.SIMULATOR:
        pytest.skip("device functions are callable from Python only under the simulator")
    encode = formats.encoder("bfloat16")
    rng = np.random.default_rng(20)
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-40, 39, 500),
                        [np.inf, -np.inf, np.nan, 3.4e38, 1e-45, 0.0, -0.0]]).astype(np.float32)
    ties = ((np.arange(64, dtype=np.uint32) << 15) | np.uint32(0x3F800000)).view(np.float32)
    x = np.concatenate([x, ties])
    got = np.array([encode(v) for v in x], dtype=np.uint16)
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).view(np.uint16))


# ---- errors the tier raises itself ---------------------------------------------------------------------------------

@pytest.mark.skipif(not numba.config.ENABLE_CUDASIM,
                    reason="only the CUDA simulator can hold a bf16 device array: on a GPU numba cannot make one")
def test_bf16_device_arrays_are_refused():
    from bsrattn.numba_cuda import arrays

    with pytest.raises(TypeError, match="does not support bfloat16 device arrays"):
        arrays.device_array(cuda.to_device(np.zeros(4, ml_dtypes.bfloat16)), "q")


def test_unsupported_inputs_raise_clear_errors():
    from bsrattn.numba_cuda import arrays

    with pytest.raises(TypeError, match="does not support dtype int32"):
        formats.format_of(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        # a strided slice (on a GPU, numba's .T copies into a new contiguous array)
        arrays.device_array(cuda.to_device(np.zeros((4, 8), np.float32))[:, ::2], "k")
    with pytest.raises(ValueError, match="head_dim=65536"):
        config.choose_tiles(1 << 16, 1, 4, 8, 4, 1)
    # The tier's own checks, called directly: ba.merge_states refuses these states before any tier.
    numba_tier = ba.get_backend("numba")
    with pytest.raises(TypeError, match="does not support dtype int16"):
        numba_tier.merge_states(np.zeros((1, 2, 1, D), np.int16), np.zeros((1, 2, 1), np.float32))
    with pytest.raises(TypeError, match="cannot write merged states of dtype float8_e4m3fn"):
        numba_tier.merge_states(np.zeros((1, 2, 1, D), ml_dtypes.float8_e4m3fn), np.zeros((1, 2, 1), np.float32))
