"""Bad input: each item of DESIGN.md's "Validation and errors" raises ValueError/TypeError naming the problem.

Calls go to a probe backend whose every function fails the test if reached, so each case also shows that
validation happens before a tier is handed anything.
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

import bsrattn as ba
from bsrattn import reference, scheduler

f32, f16 = np.float32, np.float16


def _reached(*args, **kwargs):
    raise AssertionError("the backend was called with input that should have been rejected")


class _ProbeRunner:
    def __init__(self, spec, work_plan, previous=None):
        self.work_plan = work_plan

    run = _reached


PROBE = ba.Backend("probe", types.SimpleNamespace(
    attention=_reached, merge_state=_reached, merge_states=_reached, add_states=_reached,
    plan_options=reference.plan_options, make_runner=_ProbeRunner))

LAYOUT = ba.layouts.paged([2, 1], [[2, 0], [1]], kv_lens=[7, 3], page_size=4, num_pages=3)  # nnz_qo 3, 3 pages


def arrays(q_dtype=f32, kv_dtype=None, hq=4, hkv=2, d=8, nnz=3, pages=3, page=4):
    kv_dtype = q_dtype if kv_dtype is None else kv_dtype
    rng = np.random.default_rng(0)
    q = rng.standard_normal((nnz, hq, d)).astype(q_dtype)
    k, v = rng.standard_normal((2, pages, page, hkv, d)).astype(kv_dtype)
    return q, k, v


def attention(q, k, v, layout=LAYOUT, **kwargs):
    return ba.attention(q, k, v, layout, backend=kwargs.pop("backend", PROBE), **kwargs)


def planned(**plan_kwargs):
    attn = ba.BatchAttention(backend=PROBE)
    attn.plan(LAYOUT, 4, 2, 8, **plan_kwargs)
    return attn


def _with(arrays_tuple, index, value):
    out = list(arrays_tuple)
    out[index] = value
    return tuple(out)


def _sigmoid():
    return ba.Variant(sigmoid_bias=0.5)


CASES = {
    # ---- index arrays of a layout --------------------------------------------------------------------
    "kv_indices out of range": (
        lambda: ba.BSRLayout([0, 1], [0, 2], [0, 5], [4], 4, 3), ValueError,
        r"kv_indices\[1\]=5 is outside \[0, num_blocks=3\)"),
    "negative kv_indices": (
        lambda: ba.BSRLayout([0, 1], [0, 1], [-1], [4], 4, 3), ValueError, r"kv_indices\[0\]=-1 is outside"),
    "qo_indptr not monotone": (
        lambda: ba.BSRLayout([0, 2, 1], [0, 1, 2], [0, 1], [4, 4], 4, 3), ValueError,
        r"qo_indptr must be non-decreasing; qo_indptr\[1\]=2 > qo_indptr\[2\]=1"),
    "kv_indptr not monotone": (
        lambda: ba.BSRLayout([0, 1, 2], [0, 2, 1], [0], [4, 4], 4, 3), ValueError,
        r"kv_indptr must be non-decreasing"),
    "indptr not starting at 0": (
        lambda: ba.BSRLayout([1, 2], [0, 1], [0], [4], 4, 3), ValueError, r"qo_indptr must start at 0"),
    "kv_indptr end is not nnz": (
        lambda: ba.BSRLayout([0, 1], [0, 1], [0, 1], [4], 4, 3), ValueError, r"kv_indptr\[-1\]=1 must equal 2"),
    "qo_indptr and kv_indptr lengths differ": (
        lambda: ba.BSRLayout([0, 1, 2], [0, 1], [0], [4], 4, 3), ValueError, r"kv_indptr has shape \(2,\), qo_indptr"),
    "kv_last_len 0 on a row with blocks": (
        lambda: ba.BSRLayout([0, 1], [0, 1], [0], [0], 4, 3), ValueError, r"kv_last_len\[0\]=0 must be in 1\.\.4"),
    "kv_last_len above block_size": (
        lambda: ba.BSRLayout([0, 1], [0, 1], [0], [5], 4, 3), ValueError, r"kv_last_len\[0\]=5 must be in 1\.\.4"),
    "kv_last_len on a row without blocks": (
        lambda: ba.BSRLayout([0, 1], [0, 0], [], [1], 4, 3), ValueError, r"kv_last_len\[0\]=1 must be in 0\.\.0"),
    "float indices": (
        lambda: ba.BSRLayout([0, 1], [0, 1], [0.0], [4], 4, 3), TypeError, r"kv_indices must hold integers"),
    "block_size 0": (lambda: ba.BSRLayout([0, 1], [0, 0], [], [0], 0, 3), ValueError, r"block_size must be >= 1"),
    "custom_mask of the wrong size": (
        lambda: ba.BSRLayout([0, 1], [0, 1], [0], [2], 4, 3, np.ones(3, bool)), ValueError,
        r"custom_mask has 3 elements, expected sum\(qo_len\*kv_len\)=2"),
    "custom_mask not bool": (
        lambda: ba.BSRLayout([0, 1], [0, 1], [0], [2], 4, 3, np.ones(2)), TypeError, r"custom_mask must be bool"),
    # ---- constructors -----------------------------------------------------------------------------------
    "page table too short": (
        lambda: ba.layouts.paged([1], [[0]], kv_lens=[20], page_size=16, num_pages=2), ValueError,
        r"page_tables\[0\] has 1 pages, kv_lens\[0\]=20 needs 2"),
    "negative kv_lens": (lambda: ba.layouts.ragged([1], [-3]), ValueError, r"kv_lens must be >= 0"),
    "block_sparse M not a multiple of R": (
        lambda: ba.layouts.block_sparse([0, 0], [], M=3, N=4, R=2, C=2), ValueError, r"M % R == 0"),
    "tree parent not before its child": (
        lambda: ba.layouts.tree([[-1, 1]], [[0]], kv_lens=[2], page_size=4, num_pages=1), ValueError,
        r"parents\[0\] must satisfy -1 <= parents\[i\] < i"),
    "quest selection not increasing": (
        lambda: ba.layouts.quest([[0, 1]], [8], [[[1, 0]]], page_size=4, num_pages=2, num_kv_heads=1), ValueError,
        r"selected_pages\[0\]\[0\] must be strictly increasing"),
    "quest selection out of range": (
        lambda: ba.layouts.quest([[0, 1]], [8], [[[2]]], page_size=4, num_pages=2, num_kv_heads=1), ValueError,
        r"selected_pages\[0\]\[0\] has pages outside \[0, 2\)"),
    # ---- variants ---------------------------------------------------------------------------------------
    "window_left below -1": (lambda: ba.Variant(window_left=-2), ValueError, r"window_left must be -1"),
    "sm_scale not positive": (lambda: ba.Variant(sm_scale=0.0), ValueError, r"sm_scale must be a positive"),
    "negative soft cap": (lambda: ba.Variant(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap must be >= 0"),
    "causal not a bool": (lambda: ba.Variant(causal=1), TypeError, r"causal must be a bool"),
    "sinks for the wrong head count": (
        lambda: attention(*arrays(), variant=ba.Variant(sinks=[0.5, 1.0])), ValueError,
        r"sinks has 2 entries, num_qo_heads is 4"),
    "a NaN sink": (lambda: ba.Variant(sinks=[0.0, float("nan")]), ValueError,
                   r"sinks must be a 1-D finite \[num_qo_heads\] sequence, got sinks\[1\]=nan"),
    "sinks with FlashSigmoid": (lambda: ba.Variant(sinks=[0.0], sigmoid_bias=0.0), ValueError,
                                r"sinks join a softmax's denominator; FlashSigmoid \(sigmoid_bias\) has none"),
    "alibi_slopes for the wrong head count": (
        lambda: attention(*arrays(), variant=ba.Variant(alibi_slopes=[0.5, 0.25, 0.125])), ValueError,
        r"alibi_slopes has 3 entries, num_qo_heads is 4"),
    "rope_theta not positive": (lambda: ba.Variant(rope_theta=0.0), ValueError,
                                r"rope_theta must be a positive finite float, got 0\.0"),
    "rope_theta infinite": (lambda: ba.Variant(rope_theta=float("inf")), ValueError,
                            r"rope_theta must be a positive finite float, got inf"),
    "rope_scale not positive": (lambda: ba.Variant(rope_theta=1e4, rope_scale=-2.0), ValueError,
                                r"rope_scale must be a positive finite float, got -2\.0"),
    "rope_scale without rope_theta": (lambda: ba.Variant(rope_scale=2.0), ValueError,
                                      r"rope_scale=2\.0 without rope_theta"),
    "RoPE on an odd head_dim": (
        lambda: ba.BatchAttention(backend="reference").plan(ba.layouts.ragged([1], [4]), 2, 1, 7,
                                                            variant=ba.Variant(rope_theta=1e4)), ValueError,
        r"head_dim must be even, got 7"),
    "RoPE on a Cascade row whose queries have different prefixes": (
        lambda: attention(*arrays(nnz=2), layout=ba.Cascade((
            ba.layouts.paged([1, 1], [[0], [1]], kv_lens=[2, 3], page_size=4, num_pages=3),
            ba.layouts.paged([2], [[2]], kv_lens=[2], page_size=4, num_pages=3))),
            variant=ba.Variant(rope_theta=1e4)), ValueError,
        r"levels\[1\] row 0 holds queries with 2 and 3 keys in the levels before it"),
    "rope_positions of the wrong length": (
        lambda: attention(*arrays(), variant=ba.Variant(rope_theta=1e4), rope_positions=([0, 1], [0, 0])),
        ValueError, r"rope_positions\[0\] \(q_positions\) has shape \(2,\), the layout needs \(3,\)"),
    "rope_positions of floats": (
        lambda: attention(*arrays(), variant=ba.Variant(rope_theta=1e4), rope_positions=([0, 1, 2], [0.0, 4.0])),
        TypeError, r"rope_positions\[1\] \(kv_offsets\) must hold integers, got 0\.0"),
    "rope_positions negative": (
        lambda: attention(*arrays(), variant=ba.Variant(rope_theta=1e4), rope_positions=([0, -3, 2], [0, 4])),
        ValueError, r"rope_positions\[0\] \(q_positions\) must be non-negative, got .*\[1\]=-3"),
    "rope_positions not a pair": (
        lambda: attention(*arrays(), variant=ba.Variant(rope_theta=1e4), rope_positions=[0, 1, 2]),
        TypeError, r"rope_positions must be a pair \(q_positions \[nnz_qo\], kv_offsets \[R\]\), got list"),
    "rope_positions without RoPE": (
        lambda: attention(*arrays(), rope_positions=([0, 1, 2], [0, 4])), ValueError,
        r"rope_positions is given but fused RoPE is off"),
    "rope_positions on a Cascade": (
        lambda: attention(*arrays(), layout=ba.layouts.shared_prefix([2, 1], [0], 4, [[1], [2]], [2, 1], 4, 3),
                          variant=ba.Variant(rope_theta=1e4), rope_positions=([0, 1, 2], [0])), ValueError,
        r"rope_positions is for a BSRLayout: a Cascade's levels turn at their positions"),
    "Cascade with ALiBi": (
        lambda: attention(*arrays(), layout=ba.layouts.shared_prefix([2, 1], [0], 4, [[1], [2]], [2, 1], 4, 3),
                          variant=ba.Variant(alibi_slopes=[1.0] * 4)), ValueError,
        r"Cascade does not support alibi_slopes or window_left"),
    # ---- shapes -----------------------------------------------------------------------------------------
    "q not 3-D": (lambda: attention(arrays()[0][0], *arrays()[1:]), ValueError,
                  r"q must be \[nnz_qo, num_qo_heads, head_dim\], got shape \(4, 8\)"),
    "q rows do not match the layout": (
        lambda: attention(*arrays(nnz=5)), ValueError, r"q has shape \(5, 4, 8\), the plan expects .*=\(3, 4, 8\)"),
    "k of the wrong shape": (
        lambda: attention(*arrays(pages=2)), ValueError,
        r"k has shape \(2, 4, 2, 8\), the plan expects \(3, 4, 2, 8\)"),
    "v differs from k": (
        lambda: attention(*_with(arrays(), 2, arrays()[2][:, :3])), ValueError, r"v has shape \(3, 3, 2, 8\)"),
    "head_dim of k differs from q": (
        lambda: attention(*_with(arrays(), 1, arrays(d=4)[1])), ValueError, r"k has shape \(3, 4, 2, 4\)"),
    "3-D k with block_size > 1": (
        lambda: attention(arrays()[0], *(x.reshape(12, 2, 8) for x in arrays()[1:])), ValueError,
        r"3-D k/v .* need kv_layout='NHD' and block_size 1"),
    "unknown kv_layout": (lambda: attention(*arrays(), kv_layout="NDH"), ValueError, r"kv_layout must be one of"),
    "layout not a BSRLayout": (
        lambda: attention(*arrays(), layout="paged"), TypeError, r"layout must be a BSRLayout or a Cascade, got str"),
    "head ratio": (lambda: attention(*arrays(hq=3)), ValueError,
                   r"num_qo_heads=3 must be a multiple of num_kv_heads=2"),
    # ---- dtypes -----------------------------------------------------------------------------------------
    "integer q": (lambda: attention(*_with(arrays(), 0, arrays()[0].astype(np.int64))), TypeError,
                  r"q has dtype int64; supported"),
    "q and k/v dtypes differ": (lambda: attention(*arrays(f32, f16)), TypeError,
                                r"q has dtype float32 but k/v have float16"),
    "k and v dtypes differ": (lambda: attention(*_with(arrays(), 2, arrays()[2].astype(f16))), TypeError,
                              r"k has dtype float32 but v has float16"),
    "fp8 KV with a float32 q": (
        lambda: attention(*arrays(f32, ml_dtypes.float8_e4m3fn)), TypeError,
        r"fp8 KV \(float8_e4m3fn\) needs a float16 or bfloat16 q, got float32"),
    "non-positive fp8 scale": (lambda: attention(*arrays(f16, ml_dtypes.float8_e5m2), v_scale=-1.0), ValueError,
                               r"v_scale must be a positive finite float, got -1.0"),
    # ---- outputs and lse --------------------------------------------------------------------------------
    "out of the wrong shape": (lambda: attention(*arrays(), out=np.zeros((3, 4, 4), f32)), ValueError,
                               r"out has shape \(3, 4, 4\), expected \[nnz_qo, num_qo_heads, head_dim_vo\]=\(3, 4, 8\)"),
    "out of the wrong dtype": (lambda: attention(*arrays(), out=np.zeros((3, 4, 8))), TypeError,
                               r"out has dtype float64, expected q's dtype float32"),
    "lse of the wrong shape": (lambda: attention(*arrays(), lse=np.zeros((3, 2), f32), return_lse=True), ValueError,
                               r"lse has shape \(3, 2\), expected \[nnz_qo, num_qo_heads\]=\(3, 4\)"),
    "sigmoid with return_lse": (lambda: attention(*arrays(), variant=_sigmoid(), return_lse=True), ValueError,
                                r"lse is undefined for sigmoid attention"),
    "sigmoid with an lse buffer": (lambda: attention(*arrays(), variant=_sigmoid(), lse=np.zeros((3, 4), f32)),
                                   ValueError, r"lse is undefined for sigmoid attention"),
    # ---- backends ---------------------------------------------------------------------------------------
    "unknown backend name": (lambda: attention(*arrays(), backend="cuda"), ValueError,
                             r"unknown backend 'cuda'; choose from \['numba', 'reference', 'torch', 'auto'\]"),
    "backend of the wrong type": (lambda: attention(*arrays(), backend=3), TypeError,
                                  r"backend must be a name or a Backend, got int"),
    # ---- plan / run -------------------------------------------------------------------------------------
    "plan with a bad head ratio": (lambda: ba.BatchAttention(backend=PROBE).plan(LAYOUT, 6, 4, 8), ValueError,
                                   r"num_qo_heads=6 must be a multiple of num_kv_heads=4"),
    "plan with head_dim 0": (lambda: ba.BatchAttention(backend=PROBE).plan(LAYOUT, 4, 2, 0), ValueError,
                             r"head_dim must be >= 1, got 0"),
    "plan with an unsupported q_dtype": (lambda: planned(q_dtype="int8"), TypeError,
                                         r"q_dtype 'int8' is not supported"),
    "plan with num_ctas 0": (lambda: planned(num_ctas=0), ValueError, r"num_ctas must be >= 1, got 0"),
    "run q not matching plan": (lambda: planned().run(*arrays(nnz=4)), ValueError,
                                r"q has shape \(4, 4, 8\), the plan expects"),
    "run k not matching plan": (lambda: planned().run(*arrays(hkv=1, hq=4)), ValueError,
                                r"k has shape \(3, 4, 1, 8\), the plan expects \(3, 4, 2, 8\)"),
    "run dtype not matching plan": (lambda: planned(q_dtype="float16", kv_dtype="float16").run(*arrays()), TypeError,
                                    r"q has dtype float32, the plan expects float16"),
    "run kv dtype not matching plan": (
        lambda: planned(q_dtype="float16", kv_dtype="float8_e4m3fn").run(*arrays(f16)), TypeError,
        r"k has dtype float16, the plan expects float8_e4m3fn"),
    "run sigmoid plan with return_lse": (lambda: planned(variant=_sigmoid()).run(*arrays(), return_lse=True),
                                         ValueError, r"lse is undefined for sigmoid attention"),
    # ---- merge ------------------------------------------------------------------------------------------
    "merge_state outputs of different shapes": (
        lambda: ba.merge_state(np.zeros((2, 3, 4)), np.zeros((2, 3)), np.zeros((1, 3, 4)), np.zeros((1, 3)),
                               backend=PROBE), ValueError, r"o_a \(2, 3, 4\) and o_b \(1, 3, 4\) must have the same"),
    "merge_state lse not matching o": (
        lambda: ba.merge_state(np.zeros((2, 3, 4)), np.zeros((2, 4)), np.zeros((2, 3, 4)), np.zeros((2, 3)),
                               backend=PROBE), ValueError, r"o_a has shape \(2, 3, 4\) and lse_a \(2, 4\)"),
    "merge_states not 4-D": (lambda: ba.merge_states(np.zeros((2, 3, 4)), np.zeros((2, 3)), backend=PROBE),
                             ValueError, r"merge_states needs o \[n, S, H, D\] and lse \[n, S, H\]"),
    "merge_states with no state": (lambda: ba.merge_states(np.zeros((2, 0, 3, 4)), np.zeros((2, 0, 3)), backend=PROBE),
                                   ValueError, r"at least one state"),
    # ---- scheduler --------------------------------------------------------------------------------------
    "scheduler lengths of different shapes": (lambda: scheduler.plan([1, 1], [4], num_ctas=2), ValueError,
                                              r"qo_lens has 2 entries and kv_lens has 1"),
    "scheduler negative lengths": (lambda: scheduler.plan([1], [-4], num_ctas=2), ValueError, r"kv_lens must be >= 0"),
    "scheduler fixed_split_size 0": (lambda: scheduler.plan([1], [4], num_ctas=2, fixed_split_size=0), ValueError,
                                     r"fixed_split_size must be >= 1, got 0"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_rejected_with_a_message_naming_it(name):
    make_call, error, match = CASES[name]
    with pytest.raises(error, match=match):
        make_call()


def test_run_before_plan():
    with pytest.raises(RuntimeError, match=r"run called before plan\(\)"):
        ba.BatchAttention(backend=PROBE).run(*arrays())


def test_valid_input_reaches_the_backend():
    """The probe does fail when reached: the cases above are rejected by validation, not by the probe."""
    with pytest.raises(AssertionError, match="the backend was called"):
        attention(*arrays())
    with pytest.raises(AssertionError, match="the backend was called"):
        planned().run(*arrays())
