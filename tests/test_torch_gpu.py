"""The torch tier on a GPU at real sizes (marked ``gpu``; skipped, with the reason, where there is none).

32 query heads over 8 KV heads, head_dim 128, page 16, thousands of keys, in every dtype (float32,
float16, bfloat16, fp8 KV with float16/bfloat16 queries and scales), against the float64 reference. Then
what only a GPU can show: a CUDA graph captured once and replayed across re-plans with other lengths
(compared with eager runs and the reference), ``torch.compile(fullgraph=True)`` with Inductor, bitwise
determinism over 100 runs of a split plan, and batch invariance under ``fixed_split_size``. Run on the
H200 with::

    python -m pytest tests/test_torch_gpu.py -m gpu -q -rs
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import scattered_page_tables
from helpers import assert_matches_reference

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPES = ("float32", "float16", "bfloat16")
FP8 = [(q, kv) for q in ("float16", "bfloat16") for kv in ("float8_e4m3fn", "float8_e5m2")]


def _paged(rng, qo_lens, kv_lens, extra=16):
    tables, num_pages = scattered_page_tables(rng, kv_lens, PAGE, spare_pages=extra)
    return ba.layouts.paged(list(qo_lens), tables, list(kv_lens), PAGE, num_pages)


def _inputs(rng, layout, q_dtype, kv_dtype, hq=HQ, hkv=HKV, d=D, kv_shape=None):
    kv_shape = kv_shape or (layout.num_blocks, layout.block_size, hkv, d)
    q = torch.randn(layout.nnz_qo, hq, d, device="cuda").to(getattr(torch, q_dtype))
    k, v = (torch.randn(kv_shape, device="cuda").to(getattr(torch, kv_dtype)) for _ in range(2))
    return q, k, v


# ---- every dtype at real sizes ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode(dtype):
    rng = np.random.default_rng(0)
    layout = _paged(rng, [1] * 8, rng.integers(500, 3000, size=8))
    q, k, v = _inputs(rng, layout, dtype, dtype)
    variant = ba.Variant(logits_soft_cap=30.0)
    got = ba.attention(q, k, v, layout, variant=variant, backend="torch", return_lse=True)
    assert_matches_reference(got, q, k, v, layout, dtype, variant=variant)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_causal_prefill(dtype):
    rng = np.random.default_rng(1)
    qo = [300, 517, 64]
    layout = ba.layouts.ragged(qo, [n + 100 for n in qo])
    q, k, v = _inputs(rng, layout, dtype, dtype, kv_shape=(layout.num_blocks, HKV, D))
    variant = ba.Variant(causal=True)
    got = ba.attention(q, k, v, layout, variant=variant, backend="torch", return_lse=True)
    assert_matches_reference(got, q, k, v, layout, dtype, variant=variant)


@pytest.mark.parametrize("q_dtype,kv_dtype", FP8)
def test_fp8_kv(q_dtype, kv_dtype):
    rng = np.random.default_rng(2)
    layout = _paged(rng, [1, 1, 4, 1], [2000, 64, 900, 1500])
    q, k, v = _inputs(rng, layout, q_dtype, kv_dtype)
    variant = ba.Variant(causal=True)
    got = ba.attention(q, k, v, layout, variant=variant, backend="torch", return_lse=True, k_scale=0.8,
                       v_scale=1.7)
    assert_matches_reference(got, q, k, v, layout, kv_dtype, variant=variant, k_scale=0.8, v_scale=1.7)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_prefill_variants_and_tree(dtype):
    rng = np.random.default_rng(3)
    layout = _paged(rng, [200, 130], [700, 300])
    q, k, v = _inputs(rng, layout, dtype, dtype)
    slopes = tuple(2.0 ** (-8 * (i + 1) / HQ) for i in range(HQ))
    for variant in (ba.Variant(causal=True, window_left=128, alibi_slopes=slopes),
                    ba.Variant(causal=True, logits_soft_cap=20.0), ba.Variant(sigmoid_bias=-3.0, causal=True)):
        got = ba.attention(q, k, v, layout, variant=variant, backend="torch", return_lse=not variant.use_sigmoid)
        assert_matches_reference(got, q, k, v, layout, dtype, variant=variant, name=str(variant))
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, 24)], [-1, 0, 0, 1, 1, 2]]
    kv_lens = [1000, 400]
    need = [-(-n // PAGE) for n in kv_lens]
    tables = np.split(rng.permutation(sum(need)), np.cumsum(need)[:-1])
    tree = ba.layouts.tree(parents, tables, kv_lens, PAGE, sum(need))
    q, k, v = _inputs(rng, tree, dtype, dtype)
    got = ba.attention(q, k, v, tree, backend="torch", return_lse=True)
    assert_matches_reference(got, q, k, v, tree, dtype, name="tree")


def test_quest_and_cascade():
    rng = np.random.default_rng(4)
    n_pages, budget, heads = 512, 64, 32
    selected = [np.sort(rng.choice(n_pages, budget, replace=False)) for _ in range(heads)]
    layout = ba.layouts.quest([rng.permutation(n_pages)], [n_pages * PAGE], [selected], PAGE, n_pages, heads)
    q = torch.randn(1, heads, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(n_pages, heads, PAGE, D, device="cuda", dtype=torch.float16) for _ in range(2))
    views = ba.layouts.per_head_views(q, k, v, heads)
    got = ba.attention(*views, layout, backend="torch", return_lse=True)
    assert_matches_reference(got, *views, layout, "float16", name="quest")

    casc = ba.layouts.shared_prefix([1] * 16, rng.permutation(256)[:200], 3200, [[256 + i] for i in range(16)],
                                    [int(n) for n in rng.integers(1, PAGE + 1, size=16)], PAGE, 272)
    q = torch.randn(16, HQ, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(272, PAGE, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
    attn = ba.BatchAttention(backend="torch")
    attn.plan(casc, HQ, HKV, D, q_dtype="float16", kv_dtype="float16")
    assert_matches_reference(attn.run(q, k, v, return_lse=True), q, k, v, casc, "float16", name="cascade")


# ---- CUDA graphs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [ba.Variant(), ba.Variant(rope_theta=5e5)], ids=["plain", "fused RoPE"])
def test_cuda_graph_replays_across_replans(variant):
    rng = np.random.default_rng(5)
    batch, max_len = 16, 4096
    num_pages = batch * max_len // PAGE
    tables = rng.permutation(num_pages).reshape(batch, -1)

    def layout(lens):
        return ba.layouts.paged([1] * batch, tables, lens, PAGE, num_pages)

    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(num_pages, PAGE, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.empty_like(q)
    lse = torch.empty(batch, HQ, device="cuda")
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout([max_len] * batch), HQ, HKV, D, variant=variant, q_dtype="float16", kv_dtype="float16")
    buffers = attn._runners[0].buffers
    attn.run(q, k, v, out=out, lse=lse)  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out, lse=lse)
    assert buffers.captured, "a launch inside the capture flags its buffers, for the re-plan's check"
    for step in range(4):
        lens = rng.integers(1, max_len + 1, size=batch)
        attn.plan(layout(lens), HQ, HKV, D, variant=variant, q_dtype="float16", kv_dtype="float16")
        assert attn._runners[0].buffers is buffers, "the re-plan must refill the captured buffers in place"
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_o, eager_lse = attn.run(q, k, v, return_lse=True)
        assert torch.equal(out, eager_o) and torch.equal(lse, eager_lse), f"step {step}: replay != eager"
        assert_matches_reference((out, lse), q, k, v, layout(lens), "float16", variant=variant,
                                 name=f"replay step {step}")


def test_a_cuda_graph_object_replays_a_plan_that_splits_after_a_capture_on_one_that_does_not():
    """``BatchAttention(cuda_graph=True)``: captured on a decode plan that splits no row (the kernel a plan
    without merges would otherwise get), replayed after re-plans that split, with no warning; the default object
    warns on the same re-plan, as its captured kernel has no merges."""
    rng = np.random.default_rng(8)
    batch, max_len = 48, 4096
    num_pages = batch * max_len // PAGE
    tables = rng.permutation(num_pages).reshape(batch, -1)

    def layout(lens):
        return ba.layouts.paged([1] * batch, tables, lens, PAGE, num_pages)

    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(num_pages, PAGE, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
    short = [64] * batch
    for cuda_graph in (True, False):
        out, lse = torch.empty_like(q), torch.empty(batch, HQ, device="cuda")
        attn = ba.BatchAttention(backend="torch", cuda_graph=cuda_graph)
        attn.plan(layout([max_len] * batch), HQ, HKV, D, q_dtype="float16", kv_dtype="float16")
        attn.plan(layout(short), HQ, HKV, D, q_dtype="float16", kv_dtype="float16")
        assert attn.work_plans[0].num_merges == 0
        attn.run(q, k, v, out=out, lse=lse)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn.run(q, k, v, out=out, lse=lse)
        key = attn.graph_key
        lens = [max_len] + [1] * (batch - 1)  # one long row: split over the CTAs
        if not cuda_graph:
            with pytest.warns(RuntimeWarning, match="without merges"):
                attn.plan(layout(lens), HQ, HKV, D, q_dtype="float16", kv_dtype="float16")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            attn.plan(layout(lens), HQ, HKV, D, q_dtype="float16", kv_dtype="float16")
        assert attn.work_plans[0].num_merges > 0 and attn.graph_key == key
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference((out, lse), q, k, v, layout(lens), "float16", name="replay of a split plan")


# ---- prefill plans that split no row: the item kernel (item_kernel.py) -------------------------------------

def _consecutive_pages(lens):
    """Page tables of consecutive pages, one request after another: every row dense."""
    need = [-(-int(n) // PAGE) for n in lens]
    return np.split(np.arange(sum(need)), np.cumsum(need)[:-1]), sum(need)


ITEM_KERNEL_CASES = {  # name: (q dtype, KV dtype, pages, variant, whether the call reads dense rows through tensor
    # descriptors)
    "bf16, consecutive pages, causal": ("bfloat16", "bfloat16", "consecutive", ba.Variant(causal=True), True),
    "fp16, consecutive pages, soft cap": ("float16", "float16", "consecutive", ba.Variant(logits_soft_cap=20.0),
                                          True),
    "bf16, scattered pages, causal": ("bfloat16", "bfloat16", "scattered", ba.Variant(causal=True), False),
    "fp16 + fp8-e4m3 KV, consecutive pages, causal": ("float16", "float8_e4m3fn", "consecutive",
                                                      ba.Variant(causal=True), False),
}


@pytest.mark.parametrize("min_kv", [0, None], ids=["descriptors for any row", "as shipped"])
@pytest.mark.parametrize("name", sorted(ITEM_KERNEL_CASES))
def test_prefill_item_kernel(name, min_kv, monkeypatch):
    """A prefill of ~100 query tiles a KV head (more than its 66 CTAs) splits no row and runs the item kernel:
    dense rows of 16-bit KV through tensor descriptors where the plan asks (here: any row, and the short rows of
    the shipped threshold, which read none), every other row gathered."""
    from bsrattn.torch_cuda import config as cfg, item_kernel

    if min_kv is not None:
        monkeypatch.setattr(cfg, "ITEM_TMA_MIN_KV", min_kv)

    q_dtype, kv_dtype, pages, variant, descriptors = ITEM_KERNEL_CASES[name]
    rng = np.random.default_rng(12)
    lens = rng.integers(200, 600, size=8)
    if pages == "consecutive":
        tables, num_pages = _consecutive_pages(lens)
        layout = ba.layouts.paged(lens, tables, lens, PAGE, num_pages)
    else:
        layout = _paged(rng, lens, lens)
    q, k, v = _inputs(rng, layout, q_dtype, kv_dtype)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, HQ, HKV, D, variant=variant, q_dtype=q_dtype, kv_dtype=kv_dtype)
    config = attn._runners[0].launch_config(q_dtype, "NHD", True)
    assert attn.work_plans[0].num_merges == 0 and config.item_kernel in (cfg.ITEM_KERNEL, cfg.ITEM_KERNEL_TMA), config
    assert item_kernel.tma_ready(config, q, k, v) == (descriptors and min_kv == 0)
    scales = dict(k_scale=0.8, v_scale=1.3) if kv_dtype.startswith("float8") else {}
    got = attn.run(q, k, v, return_lse=True, **scales)
    assert_matches_reference(got, q, k, v, layout, kv_dtype if scales else q_dtype, variant=variant, name=name,
                             **scales)
    again = attn.run(q, k, v, return_lse=True, **scales)  # through the kept kernels
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])


def test_a_graph_captured_on_the_item_kernel_replays_re_plans(monkeypatch):
    """Captured on a plan of consecutive pages (tensor descriptors, asked for at any length), replayed after
    re-plans of other lengths, some over scattered pages of the same pool (gathered loads, chosen per row): every
    replay gives the reference's answer, and the eager call's bits where that call runs the same kernel."""
    from bsrattn.torch_cuda import config as cfg

    monkeypatch.setattr(cfg, "ITEM_TMA_MIN_KV", 0)
    rng = np.random.default_rng(13)
    batch, num_pages = 8, 300
    causal = ba.Variant(causal=True)
    q = torch.randn(num_pages * PAGE, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(num_pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device="cuda")

    def layout(pages):
        """``batch`` requests filling the pool, a random number of whole pages each."""
        cuts = np.sort(rng.choice(np.arange(1, num_pages), batch - 1, replace=False))
        per = np.diff([0, *cuts, num_pages])
        order = np.arange(num_pages) if pages == "consecutive" else rng.permutation(num_pages)
        return ba.layouts.paged(per * PAGE, np.split(order, cuts), per * PAGE, PAGE, num_pages)

    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout("consecutive"), HQ, HKV, D, variant=causal, q_dtype="bfloat16", kv_dtype="bfloat16")
    assert attn._runners[0].launch_config("bfloat16", "NHD", True).item_kernel
    attn.run(q, k, v, out=out, lse=lse)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out, lse=lse)
    for step, pages in enumerate(("consecutive", "scattered", "scattered", "consecutive")):
        lay = layout(pages)
        attn.plan(lay, HQ, HKV, D, variant=causal, q_dtype="bfloat16", kv_dtype="bfloat16")
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_o, eager_lse = attn.run(q, k, v, return_lse=True)
        if pages == "consecutive":  # a scattered plan's eager call runs the gathered kernel
            assert torch.equal(out, eager_o) and torch.equal(lse, eager_lse), f"step {step}: replay != eager"
        assert_matches_reference((out, lse), q, k, v, lay, "bfloat16", variant=causal,
                                 name=f"replay step {step} ({pages})")
        assert_matches_reference((eager_o, eager_lse), q, k, v, lay, "bfloat16", variant=causal,
                                 name=f"eager step {step} ({pages})")


# ---- torch.compile ------------------------------------------------------------------------------------

def test_torch_compile_fullgraph_inductor():
    rng = np.random.default_rng(6)
    layout = _paged(rng, [1] * 4, [3000, 200, 1500, 900])
    q, k, v = _inputs(rng, layout, "bfloat16", "bfloat16")
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, HQ, HKV, D, q_dtype="bfloat16", kv_dtype="bfloat16")

    def step(q, k, v):
        out, lse = attn.run(q * 1.0, k, v, return_lse=True)
        merged, _ = torch.ops.bsrattn.merge_state(out, lse, out, lse)
        return merged, lse

    eager = step(q, k, v)
    compiled = torch.compile(step, fullgraph=True)(q, k, v)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- determinism --------------------------------------------------------------------------------------

def test_bitwise_determinism_over_100_runs():
    rng = np.random.default_rng(7)
    layout = _paged(rng, [1, 1, 2], [16000, 9000, 12000])
    q, k, v = _inputs(rng, layout, "float16", "float16")
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, HQ, HKV, D, q_dtype="float16", kv_dtype="float16")
    assert attn.work_plans[0].num_merges > 0, "the plan must split, so that merges race to finish"
    first_o, first_lse = attn.run(q, k, v, return_lse=True)
    for run in range(100):
        o, lse = attn.run(q, k, v, return_lse=True)
        assert torch.equal(o, first_o) and torch.equal(lse, first_lse), f"run {run} differs"


def test_batch_invariance_with_fixed_split_size():
    rng = np.random.default_rng(8)
    alone = _paged(rng, [1], [7000])
    q, k, v = _inputs(rng, alone, "bfloat16", "bfloat16")
    crowd_layout = ba.layouts.paged([1, 1, 1], [rng.permutation(alone.num_blocks)[:300], alone.kv_indices,
                                                rng.permutation(alone.num_blocks)[:100]], [4800, 7000, 1600], PAGE,
                                    alone.num_blocks)
    crowd_q = torch.cat([torch.randn_like(q), q, torch.randn_like(q)])
    outs = []
    for lay, qq, ctas in ((alone, q, 3), (crowd_layout, crowd_q, 40)):
        attn = ba.BatchAttention(backend="torch")
        attn.plan(lay, HQ, HKV, D, fixed_split_size=1024, num_ctas=ctas)
        outs.append(attn.run(qq, k, v))
    assert torch.equal(outs[0][0], outs[1][1]), "a request's output must not depend on its batch"


# ---- eager launches -------------------------------------------------------------------------------------

GROWING_PLANS = {  # a small plan's (qo_lens, kv_lens), those of a plan of more items than its capacity, the variant
    "causal prefill": (([1100, 1100], [1100, 1100]), ([2000] * 8, [2000] * 8), ba.Variant(causal=True)),
    "chains of short decode items": (([1] * 80, [200] * 80), ([1] * 600, [200] * 600), ba.Variant()),
}


@pytest.mark.parametrize("case", sorted(GROWING_PLANS))
def test_a_plan_of_more_items_than_a_kept_kernels_grid_runs_every_item(case, monkeypatch):
    """The item kernel's launch grid is its buffers' item capacity. A later plan of the same kind whose buffers
    hold more items must not reuse a kept kernel launched over the first buffers' grid: every row is written."""
    from bsrattn.torch_cuda import launch

    monkeypatch.setattr(launch, "_COMPILED", {})  # the small plan's kernels are the first of their kind
    rng = np.random.default_rng(13)
    small, large, variant = GROWING_PLANS[case]
    capacities = []
    for qo_lens, kv_lens in (small, large):
        layout = _paged(rng, qo_lens, kv_lens)
        q, k, v = _inputs(rng, layout, "float16", "float16")
        attn = ba.BatchAttention(backend="torch")
        attn.plan(layout, HQ, HKV, D, variant=variant, q_dtype="float16", kv_dtype="float16")
        runner = attn._runners[0]
        assert runner.launch_config("float16", "NHD", True).item_kernel, "the case must run the item kernel"
        capacities.append(runner.buffers.item_capacity)
        out = torch.full_like(q, float("nan"))
        got = attn.run(q, k, v, out=out, return_lse=True)
        assert_matches_reference(got, q, k, v, layout, "float16", variant=variant)
    assert int(attn.work_plans[0].cta_indptr[-1]) > capacities[0], capacities


@pytest.mark.parametrize("case", ("split decode", "causal prefill"))
def test_eager_launches_of_kept_kernels_match_the_first(case, monkeypatch):
    """The first eager launch of a kind goes through Triton, which compiles; the torch tier keeps the compiled
    kernels and sends later launches of that kind to them directly. Those must give the first call's bits, and
    inputs of a new kind (a q view that is not 16-byte aligned, a KV pool whose strides 16 does not divide)
    must go through Triton once, as their own kind, never through a kernel specialised for another. One-shot calls, which
    reuse idle buffers, find the kept kernels too."""
    from bsrattn.torch_cuda import launch

    through_triton = []
    real = launch.Launch._through_triton
    monkeypatch.setattr(launch.Launch, "_through_triton",
                        lambda self, *args: through_triton.append(1) or real(self, *args))
    rng = np.random.default_rng(11)
    if case == "split decode":
        layout, variant = _paged(rng, [1, 1, 1], [9000, 300, 5000]), ba.Variant()
        q, k, v = _inputs(rng, layout, "float16", "float16")
    else:
        layout, variant = ba.layouts.ragged([200, 333], [200, 333]), ba.Variant(causal=True)
        q, k, v = _inputs(rng, layout, "float16", "float16", kv_shape=(533, HKV, D))
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, HQ, HKV, D, variant=variant, q_dtype="float16", kv_dtype="float16")
    first = attn.run(q, k, v, return_lse=True)
    assert_matches_reference(first, q, k, v, layout, "float16", variant=variant)

    def same_bits_without_triton(*inputs, triton_calls=0):
        before = len(through_triton)
        for _ in range(3):
            got = attn.run(*inputs, return_lse=True)
            assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
        assert len(through_triton) - before == triton_calls

    same_bits_without_triton(q, k, v)
    # Kept kernels are launched directly, bypassing Triton's runner, only while no launch hook is set; a
    # profiler's hook must see every launch, so with one set they go through the runner, which calls it.
    assert launch._no_launch_hooks()
    passes = len(next(iter(attn._runners[0]._launches.values()))._last[1])  # the kept kernels of the call
    seen = []
    with monkeypatch.context() as hooked:
        hooked.setattr(launch._HOOKS, "launch_enter_hook", lambda metadata: seen.append(metadata))
        same_bits_without_triton(q, k, v)
    assert len(seen) == 3 * passes
    # q one element past an aligned address: a kind of its own, through Triton once.
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    shifted.copy_(q)
    same_bits_without_triton(shifted, k, v, triton_calls=1)
    # The same keys in a pool twice as wide (every other head slot): other strides, but Triton specialises on
    # strides only as far as 16 divides them, so the kept kernel serves them.
    wide_k, wide_v = (torch.zeros(x.shape[:-2] + (2 * HKV, D), dtype=x.dtype, device="cuda")[..., ::2, :]
                      for x in (k, v))
    wide_k.copy_(k)
    wide_v.copy_(v)
    same_bits_without_triton(q, wide_k, wide_v)
    # Rows padded by 8 elements: strides 16 does not divide, a kind of its own.
    padded_k, padded_v = (torch.zeros(x.shape[:-1] + (D + 8,), dtype=x.dtype, device="cuda")[..., :D]
                          for x in (k, v))
    padded_k.copy_(k)
    padded_v.copy_(v)
    same_bits_without_triton(q, padded_k, padded_v, triton_calls=1)
    for _ in range(3):
        again = ba.attention(q, k, v, layout, variant=variant, backend="torch", return_lse=True)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    before = len(through_triton)
    ba.attention(q, k, v, layout, variant=variant, backend="torch", return_lse=True)
    assert len(through_triton) == before, "a one-shot call of a kind seen before must find the kept kernels"
    if case == "causal prefill":  # the second pass, through a kept kernel: a hidden key's NaN changes nothing
        v[332] = float("nan")  # the second request's key 132: hidden from the first's rows, and from its rows < 132
        got = attn.run(q, k, v, return_lse=True)
        assert torch.equal(got[0][:200], first[0][:200]) and torch.equal(got[0][200:332], first[0][200:332])
        assert torch.isnan(got[0][332:]).all()
