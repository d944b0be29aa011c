"""The torch tier against the float64 reference, on CPU tensors under the Triton interpreter (CI) or on CUDA.

``test_tiers.py`` runs the shared cross-tier properties; this file covers what is the torch tier's own:
both load paths (gathered and affine) on every storage view, every variant through split plans (so the
merge folded into the persistent kernel runs for each), fp8 KV with scales, buffers refilled in place (the
CPU analogue of replaying a CUDA graph), the merge kernels, array kinds, custom ops under
``torch.compile``, and the checks that run before any launch. Sizes are small: the interpreter executes
every program in Python.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import bsrattn as ba
from bsrattn import reference
from bsrattn.testing import assert_close
from bsrattn.torch_cuda import config as tcfg
from bsrattn.torch_cuda.tensors import check_device, to_numpy

DEVICE = "cpu" if tcfg.interpreting() else "cuda"
INTERPRETER_BF16 = "the Triton interpreter mishandles bf16 arithmetic; bf16 runs in tests/test_torch_gpu.py on the GPU"


def tensor(x, dtype=torch.float32):
    return torch.as_tensor(np.asarray(x, dtype=np.float32)).to(device=DEVICE, dtype=dtype)


def pool(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def reference_of(q, k, v, layout, variant, kv_layout="NHD", k_scale=None, v_scale=None):
    """The float64 reference on the same (rounded) values the tier saw."""
    as64 = [to_numpy(x).astype(np.float64) if isinstance(x, torch.Tensor) and not str(x.dtype).startswith(
        "torch.float8") else x for x in (q, k, v)]
    return ba.attention(*as64, layout, variant=variant, kv_layout=kv_layout, backend="reference",
                        return_lse=not variant.use_sigmoid, k_scale=k_scale, v_scale=v_scale)


def check(got, want, dtype="float32", sigmoid=False, name="torch"):
    if sigmoid:
        assert_close(got, want, "attention", dtype, name=f"{name} out")
        return
    assert_close(got[0], want[0], "attention", dtype, name=f"{name} out")
    assert_close(got[1], want[1], "lse", dtype, name=f"{name} lse")


def paged_case(rng, qo_lens=(3, 1, 2), kv_lens=(45, 12, 70), page=8, extra=3):
    need = [-(-n // page) for n in kv_lens]
    perm = rng.permutation(sum(need) + extra)
    tables = np.split(perm[:sum(need)], np.cumsum(need)[:-1])
    return ba.layouts.paged(list(qo_lens), tables, list(kv_lens), page_size=page, num_pages=int(perm.size))


# ---- layouts and storage views ------------------------------------------------------------------------

def _layout_case(kind, rng):
    """``(layout, storage view)`` for each storage view the tier reads by strides."""
    if kind == "dense":
        return ba.layouts.dense(20, 33), "NHD"
    if kind == "ragged (affine path)":
        return ba.layouts.ragged([2, 1, 3], [30, 65, 9]), "NHD3"
    if kind == "paged NHD":
        return paged_case(rng), "NHD"
    if kind == "paged HND":
        return paged_case(rng, page=5), "HND"
    if kind == "vector_sparse 3-D":
        tokens = [rng.choice(90, size=n, replace=False) for n in (40, 7)]
        return ba.layouts.vector_sparse(tokens, [2, 1], num_slots=90), "NHD3"
    if kind == "block_sparse with mask":
        mask = rng.random((4, 2, 4)) < 0.7
        return ba.layouts.block_sparse([0, 3, 4], [5, 0, 2, 3], M=4, N=24, R=2, C=4, mask=mask), "NHD"
    if kind == "tree":
        return ba.layouts.tree([[-1, 0, 0, 1, 3], [-1]], [[4, 1, 6], [0, 2]], kv_lens=[21, 9], page_size=8,
                               num_pages=7), "NHD"
    raise AssertionError(kind)


def _kv_for(layout, view, hkv, d, rng):
    shape = {"NHD": (layout.num_blocks, layout.block_size, hkv, d), "HND": (layout.num_blocks, hkv, layout.block_size, d),
             "NHD3": (layout.num_blocks, hkv, d)}[view]
    return pool(rng, *shape), pool(rng, *shape), "HND" if view == "HND" else "NHD"


@pytest.mark.parametrize("kind", ["dense", "ragged (affine path)", "paged NHD", "paged HND", "vector_sparse 3-D",
                                  "block_sparse with mask", "tree"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["mha", "gqa4"])
def test_layouts_and_views(kind, heads):
    rng = np.random.default_rng(1)
    layout, view = _layout_case(kind, rng)
    hq, hkv = heads
    k, v, kv_layout = _kv_for(layout, view, hkv, 16, rng)
    q = pool(rng, layout.nnz_qo, hq, 16)
    variant = ba.Variant(causal=kind != "block_sparse with mask")
    got = ba.attention(tensor(q), tensor(k), tensor(v), layout, variant=variant, kv_layout=kv_layout,
                       backend="torch", return_lse=True)
    check(got, reference_of(q, k, v, layout, variant, kv_layout), name=kind)


def test_quest_per_head_views():
    rng = np.random.default_rng(2)
    hq, hkv, d, page = 4, 2, 16, 4
    tables, kv_lens = [rng.permutation(12)[:9], rng.permutation(12)[:5]], [35, 18]
    selected = [[[0, 3, 8], [2, 5]], [[1, 4], [0, 2, 3, 4]]]
    layout = ba.layouts.quest(tables, kv_lens, selected, page_size=page, num_pages=12, num_kv_heads=hkv)
    q, k, v = pool(rng, 2, hq, d), pool(rng, 12, hkv, page, d), pool(rng, 12, hkv, page, d)
    views = ba.layouts.per_head_views(tensor(q), tensor(k), tensor(v), hkv)
    got = ba.attention(*views, layout, backend="torch", return_lse=True)
    check(got, ba.attention(*ba.layouts.per_head_views(q, k, v, hkv), layout, return_lse=True))


# ---- variants, through split plans --------------------------------------------------------------------

VARIANTS = {
    "plain": ba.Variant(),
    "causal": ba.Variant(causal=True),
    "sliding window": ba.Variant(causal=True, window_left=9),
    "soft cap": ba.Variant(logits_soft_cap=2.0, sm_scale=0.9),
    "alibi": ba.Variant(causal=True, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    "sigmoid": ba.Variant(sigmoid_bias=-0.5, causal=True),
    "all at once": ba.Variant(causal=True, window_left=20, logits_soft_cap=3.0, alibi_slopes=(0.3, 0.2, 0.1, 0.05)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_with_split_plans(name):
    variant = VARIANTS[name]
    rng = np.random.default_rng(3)
    layout = paged_case(rng)
    q, k, v = pool(rng, layout.nnz_qo, 4, 16), pool(rng, layout.num_blocks, 8, 2, 16), pool(rng, layout.num_blocks, 8, 2, 16)
    want = reference_of(q, k, v, layout, variant)
    for options in (dict(num_ctas=2, fixed_split_size=13), dict(num_ctas=3, disable_split_kv=True)):
        attn = ba.BatchAttention(backend="torch")
        attn.plan(layout, 4, 2, 16, variant=variant, **options)
        assert (attn.work_plans[0].num_merges > 0) == ("fixed_split_size" in options)
        got = attn.run(tensor(q), tensor(k), tensor(v), return_lse=not variant.use_sigmoid)
        check(got, want, sigmoid=variant.use_sigmoid, name=f"{name} {options}")


def test_masked_rows_give_zero_and_minus_inf():
    # Row 0: 3 queries over 1 key, causal: queries 0 and 1 sit at positions -2 and -1 and see nothing.
    layout = ba.layouts.ragged([3, 2], [1, 6])
    rng = np.random.default_rng(4)
    q, k, v = pool(rng, 5, 2, 16), pool(rng, 7, 1, 16), pool(rng, 7, 1, 16)
    variant = ba.Variant(causal=True, window_left=0)
    out, lse = ba.attention(tensor(q), tensor(k), tensor(v), layout, variant=variant, backend="torch", return_lse=True)
    check((out, lse), reference_of(q, k, v, layout, variant))
    assert (to_numpy(out)[:2] == 0).all() and (to_numpy(lse)[:2] == -np.inf).all()
    assert np.isfinite(to_numpy(lse)[2:]).all()


# ---- dtypes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype):
    if dtype == "bfloat16" and tcfg.interpreting():
        pytest.skip(INTERPRETER_BF16)
    rng = np.random.default_rng(5)
    layout = paged_case(rng)
    tdt = getattr(torch, dtype)
    q, k, v = (tensor(pool(rng, *s), tdt) for s in ((layout.nnz_qo, 4, 16), (layout.num_blocks, 8, 2, 16),
                                                     (layout.num_blocks, 8, 2, 16)))
    variant = ba.Variant(causal=True)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, 4, 2, 16, variant=variant, num_ctas=2, fixed_split_size=16)
    out, lse = attn.run(q, k, v, return_lse=True)
    assert out.dtype == tdt and lse.dtype == torch.float32
    check((out, lse), reference_of(q, k, v, layout, variant), dtype)


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_with_scales(fp8):
    rng = np.random.default_rng(6)
    layout = paged_case(rng)
    k8 = torch.as_tensor(pool(rng, layout.num_blocks, 8, 2, 16)).to(getattr(torch, fp8)).to(DEVICE)
    v8 = torch.as_tensor(pool(rng, layout.num_blocks, 8, 2, 16)).to(getattr(torch, fp8)).to(DEVICE)
    q = tensor(pool(rng, layout.nnz_qo, 4, 16), torch.float16)
    variant = ba.Variant(causal=True, logits_soft_cap=4.0)
    got = ba.attention(q, k8, v8, layout, variant=variant, backend="torch", return_lse=True, k_scale=0.7,
                       v_scale=1.3)
    k64, v64 = (to_numpy(x).astype(np.float64) for x in (k8, v8))
    want = ba.attention(to_numpy(q).astype(np.float64), k64 * 0.7, v64 * 1.3, layout, variant=variant,
                        return_lse=True)
    check(got, want, fp8)


def test_numpy_inputs_come_back_as_numpy():
    rng = np.random.default_rng(7)
    layout = paged_case(rng)
    q = pool(rng, layout.nnz_qo, 4, 16).astype(np.float16)
    k, v = (pool(rng, layout.num_blocks, 8, 2, 16).astype(ml_dtypes.float8_e4m3fn) for _ in range(2))
    out, lse = ba.attention(q, k, v, layout, backend="torch", return_lse=True, k_scale=0.5)
    assert isinstance(out, np.ndarray) and out.dtype == np.float16 and lse.dtype == np.float32
    want = ba.attention(q.astype(np.float64), k.astype(np.float64) * 0.5, v.astype(np.float64), layout, return_lse=True)
    check((out, lse), want, "float8_e4m3fn")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_numpy_dtypes_cross_bit_for_bit(dtype):
    from bsrattn.torch_cuda.tensors import to_torch

    x = np.random.default_rng(15).standard_normal((3, 5)).astype(getattr(ml_dtypes, dtype))
    t = to_torch("x", x, torch.device(DEVICE))
    assert t.dtype == getattr(torch, dtype)
    back = to_numpy(t)
    assert back.dtype == x.dtype and np.array_equal(back.view(np.uint8), x.view(np.uint8))


# ---- configuration ------------------------------------------------------------------------------------

def test_plan_options_pick_decode_and_prefill_tiles():
    from bsrattn.validation import make_spec

    decode = make_spec(ba.layouts.ragged([1, 1, 1], [900, 40, 7]), 32, 8, 128, q_dtype="float16")
    prefill = make_spec(ba.layouts.ragged([512, 64], [512, 64]), 32, 8, 128, q_dtype="bfloat16")
    for spec, rows in ((decode, 16), (prefill, 128)):
        opts = tcfg.plan_options(spec)
        assert tcfg.block_m(opts["tile_q"], spec.group_size) == rows == opts["tile_q"] * spec.group_size
        assert opts["num_ctas"] * spec.num_kv_heads <= tcfg.num_sms() * max(tcfg.CTAS_PER_SM.values())
    config = tcfg.LaunchConfig(4, 8, 4, 128, 16, 16, 64, 128, 4, 3, "HND", True, 7, False, True, False, True, True,
                               False)
    assert tcfg.LaunchConfig.from_list(config.to_list()) == config


# ---- out= / lse= buffers ------------------------------------------------------------------------------

def test_out_and_lse_buffers_are_written_and_returned():
    rng = np.random.default_rng(8)
    layout = paged_case(rng)
    q, k, v = pool(rng, layout.nnz_qo, 4, 16), pool(rng, layout.num_blocks, 8, 2, 16), pool(rng, layout.num_blocks, 8, 2, 16)
    want = reference_of(q, k, v, layout, ba.Variant())
    out, lse = torch.full(q.shape, float("nan"), device=DEVICE), torch.full(q.shape[:2], float("nan"), device=DEVICE)
    got_o, got_lse = ba.attention(tensor(q), tensor(k), tensor(v), layout, backend="torch", out=out, lse=lse,
                                  return_lse=True)
    assert got_o is out and got_lse is lse
    check((out, lse), want)
    out_np, lse_np = np.full(q.shape, np.nan, np.float32), np.full(q.shape[:2], np.nan, np.float32)
    got_o = ba.attention(q, k, v, layout, backend="torch", out=out_np, lse=lse_np)
    assert got_o is out_np
    check((out_np, lse_np), want)


# ---- plan / run: buffers refilled in place ------------------------------------------------------------

def test_replan_refills_buffers_in_place_and_replays():
    """The CPU analogue of a CUDA-graph replay: the op's arguments from the first run, after a re-plan."""
    rng = np.random.default_rng(9)
    lay_a = paged_case(rng, qo_lens=(1, 1, 1), kv_lens=(45, 12, 70))
    lay_b = ba.layouts.paged([1, 1, 1], [[0, 1, 2], [7, 6, 5, 4, 3], [9]], kv_lens=[17, 33, 2], page_size=8,
                             num_pages=lay_a.num_blocks)
    q, k, v = pool(rng, 3, 4, 16), pool(rng, lay_a.num_blocks, 8, 2, 16), pool(rng, lay_a.num_blocks, 8, 2, 16)
    qt, kt, vt = tensor(q), tensor(k), tensor(v)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(lay_a, 4, 2, 16, num_ctas=3)
    runner_a = attn._runners[0]
    out, lse = torch.empty_like(qt), torch.empty(3, 4, device=DEVICE)
    check(runner_a.run(qt, kt, vt, out=out, lse=lse), reference_of(q, k, v, lay_a, ba.Variant()), name="plan A")
    buffers, pointer = runner_a.buffers, runner_a.buffers.raw.data_ptr()

    attn.plan(lay_b, 4, 2, 16, num_ctas=3)
    assert attn._runners[0].buffers is buffers and buffers.raw.data_ptr() == pointer
    assert attn.work_plans[0].num_merges > 0
    out.fill_(float("nan"))
    # runner_a launches exactly what it launched before (plan A's config, the same buffers): a replay.
    runner_a.run(qt, kt, vt, out=out, lse=lse)
    check((out, lse), reference_of(q, k, v, lay_b, ba.Variant()), name="replayed launch, plan B")

    big = paged_case(rng, qo_lens=(1,) * 20, kv_lens=(40,) * 20, extra=0)
    with pytest.warns(RuntimeWarning, match="recapture any CUDA graph"):
        attn.plan(big, 4, 2, 16, num_ctas=3)
    assert attn._runners[0].buffers is not buffers, "a plan over capacity gets new buffers"


def test_same_plan_same_bits():
    rng = np.random.default_rng(10)
    layout = paged_case(rng)
    q, k, v = (tensor(pool(rng, *s)) for s in ((layout.nnz_qo, 4, 16), (layout.num_blocks, 8, 2, 16),
                                                (layout.num_blocks, 8, 2, 16)))
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, 4, 2, 16, num_ctas=2, fixed_split_size=7)
    first = attn.run(q, k, v, return_lse=True)
    for _ in range(2):
        again = attn.run(q, k, v, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_cascade_through_attention_and_batch_attention():
    rng = np.random.default_rng(11)
    casc = ba.layouts.shared_prefix([2, 1, 1], [0, 3, 5], 21, [[1], [2, 4], []], [5, 11, 0], page_size=8,
                                    num_pages=6)
    q, k, v = pool(rng, 4, 4, 16), pool(rng, 6, 8, 2, 16), pool(rng, 6, 8, 2, 16)
    for variant in (ba.Variant(causal=True), ba.Variant(sigmoid_bias=0.3)):
        want = reference_of(q, k, v, casc, variant)
        sig = variant.use_sigmoid
        check(ba.attention(tensor(q), tensor(k), tensor(v), casc, variant=variant, backend="torch", return_lse=not sig),
              want, sigmoid=sig)
        attn = ba.BatchAttention(backend="torch")
        attn.plan(casc, 4, 2, 16, variant=variant, num_ctas=2)
        check(attn.run(tensor(q), tensor(k), tensor(v), return_lse=not sig), want, sigmoid=sig)


# ---- merge kernels ------------------------------------------------------------------------------------

def test_merge_kernels():
    rng = np.random.default_rng(12)
    o = rng.standard_normal((3, 5, 2, 16))
    lse = rng.standard_normal((3, 5, 2)) * 3
    lse[0, 1:, 0] = -np.inf  # a row with one live state
    lse[1, :, 1] = -np.inf  # a row with none
    be = ba.get_backend("torch")
    for dtype in (torch.float32, torch.float16):
        o_t, lse_t = tensor(o, dtype), tensor(lse)
        o_r = to_numpy(o_t).astype(np.float64)
        lse_r = to_numpy(lse_t).astype(np.float64)
        name = str(dtype).removeprefix("torch.")
        got_o, got_lse = be.merge_states(o_t, lse_t)
        want_o, want_lse = reference.merge_states(o_r, lse_r)
        assert got_o.dtype == dtype
        assert_close(got_o, want_o, "merge", name)
        assert_close(got_lse, want_lse, "merge", "float32")
        got_o, got_lse = be.merge_state(o_t[:, 0], lse_t[:, 0], o_t[:, 3], lse_t[:, 3])
        want_o, want_lse = reference.merge_state(o_r[:, 0], lse_r[:, 0], o_r[:, 3], lse_r[:, 3])
        assert_close(got_o, want_o, "merge", name)
        assert_close(got_lse, want_lse, "merge", "float32")
        assert_close(be.add_states(o_t[:, 0], o_t[:, 1]), o_r[:, 0] + o_r[:, 1], "merge", name)


# ---- torch.compile ------------------------------------------------------------------------------------

def test_custom_ops_trace_without_graph_breaks():
    rng = np.random.default_rng(13)
    layout = paged_case(rng, qo_lens=(1, 1, 1))
    q, k, v = (tensor(pool(rng, *s)) for s in ((3, 4, 16), (layout.num_blocks, 8, 2, 16), (layout.num_blocks, 8, 2, 16)))
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, 4, 2, 16, num_ctas=2, fixed_split_size=16)

    def step(q, k, v):
        out, lse = attn.run(q, k, v, return_lse=True)
        o2, s2 = torch.ops.bsrattn.merge_state(out, lse, out, lse)
        return o2 * 2, s2

    eager = step(q, k, v)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if tcfg.interpreting() else "inductor")(q, k, v)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- checks before any launch -------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    """Make any kernel launch fail the test: the checks under test must raise first."""
    from bsrattn.torch_cuda import executor

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the inputs were checked")

    monkeypatch.setattr(executor, "launch", launched)


def test_bad_inputs_raise_before_launch(no_launch):
    rng = np.random.default_rng(14)
    layout = paged_case(rng)
    q, k, v = (tensor(pool(rng, *s)) for s in ((layout.nnz_qo, 4, 16), (layout.num_blocks, 8, 2, 16),
                                                (layout.num_blocks, 8, 2, 16)))
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, 4, 2, 16)
    with pytest.raises(TypeError, match="float64"):
        attn.run(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="lse has dtype"):
        attn.run(q, k, v, lse=torch.empty(q.shape[:2], dtype=torch.float16, device=DEVICE))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        attn.run(q, k, v, out=np.zeros(q.shape, np.float32))
    with pytest.raises(TypeError, match="out must be a NumPy array"):
        attn.run(to_numpy(q), to_numpy(k), to_numpy(v), out=torch.empty_like(q))
    with pytest.raises(ValueError, match="is on meta"):
        attn.run(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="q has shape"):
        attn.run(q[:1], k, v)


def test_device_must_suit_the_kernels():
    other = "cuda" if tcfg.interpreting() else "cpu"
    with pytest.raises(ValueError, match="cannot run on"):
        check_device(torch.device(other))
    check_device(torch.device(DEVICE))
