"""The torch tier against the float64 oracle, on CPU tensors under the Triton interpreter (CI) or on CUDA.

``test_tiers.py`` runs the shared cross-tier properties; this file covers what is the torch tier's own:
both load paths (gathered and affine) on every storage view, every variant through split plans (so the
merge folded into the persistent kernel runs for each), fp8 KV with scales, buffers refilled in place (the
CPU analogue of replaying a CUDA graph), the merge kernels, array kinds, custom ops under
``torch.compile``, and the checks that run before any launch. Sizes are small: the interpreter executes
every program in Python. Attention is checked with ``helpers.check_attention`` (the oracle rebuilt from the
layout's raw inputs, within the dtype's error budget), merges against ``helpers.naive_merge``.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import bsrattn as ba
from bsrattn.testing import assert_close, scattered_page_tables
from bsrattn.torch_cuda import config as tcfg
from bsrattn.torch_cuda.arrays import check_device, to_numpy
from helpers import call_inputs, check_attention, naive_merge, raw_tensors, rounded
from strategies import Problem, named_case, paged_problem

DEVICE = "cpu" if tcfg.interpreting() else "cuda"


def tensor(x, dtype=torch.float32):
    return torch.as_tensor(np.asarray(x, dtype=np.float32)).to(device=DEVICE, dtype=dtype)


def inputs(problem, dtype=torch.float32):
    """``problem``'s ``q, k, v`` (``helpers.raw_tensors``, as a caller passes them) as tensors on ``DEVICE``."""
    return tuple(tensor(x, dtype) for x in call_inputs(problem.case, *raw_tensors(problem, "float32"))[:3])


def _attention(problem, dtype=torch.float32, kv_dtype=None, **kwargs):
    """``ba.attention`` on the torch tier (tensors on ``DEVICE``), as a run for ``helpers.check_attention``."""
    sigmoid = problem.variant.use_sigmoid

    def run(q, k, v, kv_layout):
        got = ba.attention(tensor(q, dtype), tensor(k, kv_dtype or dtype), tensor(v, kv_dtype or dtype),
                           problem.case.layout, variant=problem.variant, kv_layout=kv_layout, backend="torch",
                           return_lse=not sigmoid, **kwargs)
        return (got, None) if sigmoid else got
    return run


def _batch(problem, dtype=torch.float32, **plan_kwargs):
    """``BatchAttention`` planned for ``problem`` and run once, as a run for ``helpers.check_attention``; returns
    ``(run, attn)``."""
    attn = ba.BatchAttention(backend="torch")
    sigmoid = problem.variant.use_sigmoid

    def run(q, k, v, kv_layout):
        attn.plan(problem.case.layout, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                  variant=problem.variant, kv_layout=kv_layout, **plan_kwargs)
        got = attn.run(tensor(q, dtype), tensor(k, dtype), tensor(v, dtype), return_lse=not sigmoid)
        return (got, None) if sigmoid else got
    return run, attn


def scattered(rng, qo_lens=(3, 1, 2), kv_lens=(45, 12, 70), page=8, spare=3) -> dict:
    """The fields of ``strategies.PAGED`` for these lengths (``paged_problem``'s overrides): shuffled page tables
    over one pool with ``spare`` unused pages. The default rows are long enough for several KV tiles, whole, so
    that the online softmax rescales its state."""
    tables, num_pages = scattered_page_tables(rng, kv_lens, page, spare_pages=spare)
    return dict(qo_lens=list(qo_lens), page_tables=[t.tolist() for t in tables], kv_lens=list(kv_lens),
                page_size=page, num_pages=num_pages)


# ---- layouts and storage views ------------------------------------------------------------------------

def _layout_problem(kind, rng, hq, hkv):
    """A problem in each storage view the tier reads by strides (``"flat"``: the 3-D ``[N, Hkv, D]`` pool)."""
    if kind == "dense":
        case = named_case("dense", dict(qo_len=20, kv_len=33))
    elif kind == "ragged (affine path)":
        case = named_case("ragged", dict(qo_lens=[2, 1, 3], kv_lens=[30, 65, 9]), "flat")
    elif kind == "paged NHD":
        case = named_case("paged", scattered(rng))
    elif kind == "paged HND":
        case = named_case("paged", scattered(rng, page=5), "HND")
    elif kind == "vector_sparse 3-D":
        tokens = [rng.choice(90, size=n, replace=False).tolist() for n in (40, 7)]
        case = named_case("vector_sparse", dict(token_indices=tokens, qo_lens=[2, 1], num_slots=90), "flat")
    elif kind == "block_sparse with mask":
        mask = rng.random((4, 2, 4)) < 0.7
        case = named_case("block_sparse", dict(indptr=[0, 3, 4], indices=[5, 0, 2, 3], M=4, N=24, R=2, C=4, mask=mask))
    elif kind == "tree":
        case = named_case("tree", dict(parents=[[-1, 0, 0, 1, 3], [-1]], page_tables=[[4, 1, 6], [0, 2]],
                                       kv_lens=[21, 9], page_size=8, num_pages=7))
    else:
        raise AssertionError(kind)
    return Problem(case, hq, hkv, 16, ba.Variant(causal=kind != "block_sparse with mask"), seed=1)


@pytest.mark.parametrize("kind", ["dense", "ragged (affine path)", "paged NHD", "paged HND", "vector_sparse 3-D",
                                  "block_sparse with mask", "tree"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["mha", "gqa4"])
def test_layouts_and_views(kind, heads):
    problem = _layout_problem(kind, np.random.default_rng(1), *heads)
    check_attention(_attention(problem), problem, "float32", name=kind)


def test_quest_per_head_views():
    rng = np.random.default_rng(2)
    raw = dict(page_tables=[rng.permutation(12)[:9].tolist(), rng.permutation(12)[:5].tolist()], kv_lens=[35, 18],
               selected_pages=[[[0, 3, 8], [2, 5]], [[1, 4], [0, 2, 3, 4]]], page_size=4, num_pages=12,
               num_kv_heads=2)
    problem = Problem(named_case("quest", raw, "quest", 2), 4, 2, 16, ba.Variant(), seed=2)
    check_attention(_attention(problem), problem, "float32", name="quest")


# ---- variants, through split plans --------------------------------------------------------------------

VARIANTS = {
    "plain": ba.Variant(),
    "causal": ba.Variant(causal=True),
    "sliding window": ba.Variant(causal=True, window_left=9),
    "soft cap": ba.Variant(logits_soft_cap=2.0, sm_scale=0.9),
    "alibi": ba.Variant(causal=True, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    "sigmoid": ba.Variant(sigmoid_bias=-0.5, causal=True),
    "fused RoPE, window": ba.Variant(causal=True, window_left=9, rope_theta=100.0, rope_scale=1.5),
    "all at once": ba.Variant(causal=True, window_left=20, logits_soft_cap=3.0, alibi_slopes=(0.3, 0.2, 0.1, 0.05)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_with_split_plans(name):
    problem = paged_problem(VARIANTS[name], seed=3, **scattered(np.random.default_rng(3)))
    for options in (dict(num_ctas=2, fixed_split_size=13), dict(num_ctas=3, disable_split_kv=True)):
        run, attn = _batch(problem, **options)
        check_attention(run, problem, "float32", name=f"{name} {options}")
        assert (attn.work_plans[0].num_merges > 0) == ("fixed_split_size" in options)


def test_masked_rows_give_zero_and_minus_inf():
    # Row 0: 3 queries over 1 key, causal: queries 0 and 1 sit at positions -2 and -1 and see nothing.
    case = named_case("ragged", dict(qo_lens=[3, 2], kv_lens=[1, 6]), "flat")
    problem = Problem(case, 2, 1, 16, ba.Variant(causal=True, window_left=0), seed=4)
    out, lse = check_attention(_attention(problem), problem, "float32", name="masked rows")
    assert (out[:2] == 0).all() and (lse[:2] == -np.inf).all()
    assert np.isfinite(lse[2:]).all()


# ---- dtypes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype):
    """bf16 runs on the GPU only (tests/test_torch_gpu.py): the interpreter computes it wrongly and is refused."""
    problem = paged_problem(ba.Variant(causal=True), seed=5, **scattered(np.random.default_rng(5)))
    tdt = getattr(torch, dtype)
    run, attn = _batch(problem, tdt, num_ctas=2, fixed_split_size=16)
    if dtype == "bfloat16" and tcfg.interpreting():
        with pytest.raises(TypeError, match="q has dtype bfloat16: the Triton interpreter computes bfloat16 "
                                            "arithmetic wrongly"):
            check_attention(run, problem, dtype)
        return

    def typed(q, k, v, kv_layout):
        out, lse = run(q, k, v, kv_layout)
        assert out.dtype == tdt and lse.dtype == torch.float32
        return out, lse

    check_attention(typed, problem, dtype, name=f"torch {dtype}")


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_with_scales(fp8):
    problem = paged_problem(ba.Variant(causal=True, logits_soft_cap=4.0), seed=6, **scattered(np.random.default_rng(6)))
    q, k, v = raw_tensors(problem, "float16")
    tensors = q, rounded(k, fp8), rounded(v, fp8)
    check_attention(_attention(problem, torch.float16, getattr(torch, fp8), k_scale=0.7, v_scale=1.3), problem,
                    "float16", tensors, kv_dtype=fp8, k_scale=0.7, v_scale=1.3, name=f"torch {fp8}")


def test_numpy_inputs_come_back_as_numpy():
    problem = paged_problem(ba.Variant(), seed=7, **scattered(np.random.default_rng(7)))
    q, k, v = raw_tensors(problem, "float16")

    def run(q, k, v, kv_layout):
        out, lse = ba.attention(q, k, v, problem.case.layout, backend="torch", return_lse=True, k_scale=0.5)
        assert isinstance(out, np.ndarray) and out.dtype == np.float16 and lse.dtype == np.float32
        return out, lse

    check_attention(run, problem, "float16", (q, rounded(k, "float8_e4m3fn"), rounded(v, "float8_e4m3fn")),
                    kv_dtype="float8_e4m3fn", k_scale=0.5, name="torch NumPy fp8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_numpy_dtypes_cross_bit_for_bit(dtype):
    from bsrattn.torch_cuda.arrays import to_torch

    x = np.random.default_rng(15).standard_normal((3, 5)).astype(getattr(ml_dtypes, dtype))
    t = to_torch("x", x, torch.device(DEVICE))
    assert t.dtype == getattr(torch, dtype)
    back = to_numpy(t)
    assert back.dtype == x.dtype and np.array_equal(back.view(np.uint8), x.view(np.uint8))


# ---- configuration ------------------------------------------------------------------------------------

def _pretend_sms(monkeypatch, sms: int):
    """Plan as for a GPU of ``sms`` SMs: the interpreter's count, and the current device's where one runs."""
    monkeypatch.setattr(tcfg, "INTERPRETER_SMS", sms)
    if not tcfg.interpreting():
        monkeypatch.setitem(tcfg._SMS, torch.cuda.current_device(), sms)


def test_plan_options_pick_decode_and_prefill_tiles():
    from bsrattn.validation import make_spec

    decode = make_spec(ba.layouts.ragged([1, 1, 1], [900, 40, 7]), 32, 8, 128, q_dtype="float16")
    prefill = make_spec(ba.layouts.ragged([512, 64], [512, 64]), 32, 8, 128, q_dtype="bfloat16")
    for spec, rows in ((decode, 16), (prefill, 128)):
        opts = tcfg.plan_options(spec)
        assert tcfg.block_m(opts["tile_q"], spec.group_size) == rows == opts["tile_q"] * spec.group_size
        assert opts["num_ctas"] * spec.num_kv_heads <= tcfg.num_sms() * max(tcfg.CTAS_PER_SM.values())
    config = tcfg.LaunchConfig(4, 8, 4, 128, 16, 16, 64, 128, 4, 3, "HND", True, 7, False, True, False, True, True,
                               True, False)
    assert tcfg.LaunchConfig.from_list(config.to_list()) == config


@pytest.mark.parametrize("heads, dims, qo_len, kv_len", [
    ((128, 1), (576, 512), 80, 4096),  # MLA prefill at DeepSeek-V3's widths: a tile of one query's 128 heads
    ((32, 8), (128, 128), 32, 4096),  # a chunk of prefill over a long cache
])
def test_a_split_prefill_tile_reads_more_kv_than_its_partial_states(heads, dims, qo_len, kv_len, monkeypatch):
    """Where a prefill-shaped tile's row is split over a GPU's CTAs, each item reads at least as many K and V bytes
    as the float32 partial state it writes, which the one program that folds the row reads back: a finer cut
    makes that fold the call's critical path (W11's MLA decode at batch 1, when it planned as a prefill: 512 states
    of 256 KiB)."""
    from bsrattn.validation import make_spec

    _pretend_sms(monkeypatch, 132)
    (num_qo_heads, num_kv_heads), (head_dim, dim_vo) = heads, dims
    spec = make_spec(ba.layouts.ragged([qo_len], [kv_len]), num_qo_heads, num_kv_heads, head_dim,
                     q_dtype="float16", kv_dtype="float16", head_dim_vo=dim_vo)
    opts = tcfg.plan_options(spec)
    plan = ba.scheduler.plan(spec.layout.qo_lens, spec.layout.kv_lens, num_ctas=opts["num_ctas"],
                             tile_q=opts["tile_q"], min_split_size=opts["min_split_size"], kv_align=opts["kv_align"])
    keys = plan.item_kv_end - plan.item_kv_start
    rows = opts["tile_q"] * spec.group_size
    assert plan.num_merges and keys.size > 1, "the case must split its row"
    inner = keys[plan.item_kv_end < kv_len]  # a tile's last chunk takes the rest
    assert inner.min() * (head_dim + dim_vo) * 2 >= rows * dim_vo * 4


@pytest.mark.parametrize("batch", [1, 32])
def test_an_mla_decode_plan_cuts_its_rows_into_whole_tiles_of_its_launch(batch, monkeypatch):
    """Multi-head latent attention's decode (128 heads over one latent head, its value read from the key) splits
    rows at multiples of the tile its launch runs. Aligned to a narrower tile's 16 keys, batch 32 x 4096 cut each
    row into four 1008-key chunks and a 64-key rest: 32 more items, 8 of them on one CTA, each paying an MLA item's
    start and its 128 KiB partial state (W11: 696 us, against 353 with whole tiles)."""
    from bsrattn.validation import make_spec

    _pretend_sms(monkeypatch, 132)
    lens = np.full(batch, 4096)
    layout = ba.layouts.paged(np.ones(batch, dtype=np.int64), np.arange(batch * 64).reshape(batch, 64), lens, 64,
                              batch * 64)
    spec = make_spec(layout, 128, 1, 576, q_dtype="bfloat16", kv_dtype="bfloat16", head_dim_vo=512)
    opts = tcfg.plan_options(spec)
    plan = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=opts["num_ctas"], tile_q=opts["tile_q"],
                             min_split_size=opts["min_split_size"], kv_align=opts["kv_align"])
    group = spec.group_size // tcfg.head_groups(spec)
    tile = tcfg.tiles(tcfg.block_m(opts["tile_q"], group), 576, "bfloat16", head_dim_vo=512, value_in_key=True)
    assert plan.num_merges, "the case must split its rows"
    assert np.all(plan.item_kv_start % tile.block_n == 0), (opts["kv_align"], tile)


@pytest.mark.parametrize("variant", [ba.Variant(causal=True, alibi_slopes=[0.5 ** (i / 20) for i in range(1, 161)]),
                                     ba.Variant(logits_soft_cap=2.0)], ids=["causal, ALiBi", "soft cap"])
@pytest.mark.parametrize("split", [dict(num_ctas=2, fixed_split_size=24), dict(deterministic=True, split_size=64)],
                         ids=["split rows", "deterministic"])
def test_a_gqa_group_too_tall_for_a_decode_tile_runs_in_head_groups(variant, split):
    """A decode step whose KV heads each hold more query heads than one decode tile has rows (here 80 a KV head,
    over 2 speculative rows: 160 rows, against 64) runs them in head groups (``config.head_groups``: 4 groups of 20
    heads, 40 rows), each group's programs reading the KV head's tiles on their own, splitting and merging rows,
    and redoing masked rows, apart. Every head answers as the reference does, by the head its ALiBi slope marks;
    the counters and flags are back at zero after each call."""
    rng = np.random.default_rng(33)
    problem = paged_problem(variant, hq=160, hkv=2, **scattered(rng, (2, 1, 1), (150, 12, 70)))
    run, attn = _batch(problem, torch.float16, **split)
    for _ in range(2):
        check_attention(run, problem, "float16", name=f"head groups, {split}")
        runner = attn._runners[0]
        config = runner.launch_config("float16", "NHD", True)
        assert (runner.head_groups, config.head_programs, config.tile_group) == (4, 8, 20), config
        assert runner.work_plan.num_merges > 0 or split.get("deterministic"), "the case must split rows"
        assert not runner.buffers.sync.any(), "a merge counter or flag left behind"


def test_a_decode_batch_of_few_pairs_runs_on_one_8_warp_cta_per_sm(monkeypatch):
    """A decode batch of few (row, KV head) pairs is balanced over one CTA per SM (``busy_ctas``) inside the
    usual grid of two per SM, the rest left empty, and runs 8 warps; a larger batch uses every CTA, and so does
    a row whose tile is taller than ``DECODE_FEW_ROWS`` (a cascade's prefix level). All answer as the reference
    does. (16 pretend SMs: the interpreter's 4 leave no batch few enough.)"""
    _pretend_sms(monkeypatch, 16)
    rng = np.random.default_rng(16)
    for qo_lens, kv_lens, few in (((1,), (300,), True), ((1, 1, 1), (300, 12, 70), False), ((12,), (300,), False)):
        problem = paged_problem(ba.Variant(), **scattered(rng, qo_lens, kv_lens))
        run, attn = _batch(problem, torch.float16)
        check_attention(run, problem, "float16", name=f"decode rows {qo_lens}")
        plan, config = attn.work_plans[0], attn._runners[0].launch_config("float16", "NHD", True)
        assert plan.num_ctas == 16 * tcfg.CTAS_PER_SM["decode"] // 2, "the grid stays at two CTAs per SM"
        busy = tcfg.plan_options(attn._specs[0])["busy_ctas"]
        assert busy == (16 // 2 if few else plan.num_ctas), busy
        assert np.ptp(plan.cta_indptr[busy:]) == 0, "the CTAs past the busy ones get no item"
        if few:
            assert config.num_warps == 8, config


# ---- the kernels' runtime arguments, declared once (kernel_args.py) ----------------------------------------

def test_both_kernels_take_the_declared_runtime_arguments_then_their_constexprs():
    """Each attention kernel's signature is :data:`kernel_args.RUNTIME_ARGS`, in order, then the compile-time
    constants its ``constexprs`` gives, by name: a kernel, a declaration or a constexpr table that drifts fails."""
    from bsrattn.torch_cuda import executor, item_kernel, kernel_args

    config = tcfg.LaunchConfig(4, 2, 4, 64, 16, 16, 64, 64, 4, 3, "NHD", True, -1, False, False, False, False, False,
                               True, True)
    for kernel, constexprs in ((executor.persistent_attention, executor.constexprs(config, torch.float16)),
                               (item_kernel.item_attention, item_kernel.constexprs(config, torch.float16, False))):
        runtime = kernel_args.runtime_names(kernel)
        assert runtime == kernel_args.RUNTIME_ARGS, (kernel.__name__, runtime)
        assert tuple(kernel.arg_names) == runtime + kernel_args.constexpr_names(kernel), kernel.__name__
        assert set(constexprs) == set(kernel_args.constexpr_names(kernel)), kernel.__name__
    assert len(set(kernel_args.RUNTIME_ARGS)) == len(kernel_args.RUNTIME_ARGS)


def _launch_fixture():
    """Buffers, a configuration and a call's arguments, each tensor of its own shape, for the packers' checks."""
    from bsrattn.torch_cuda.plan_buffers import Capacity, PlanBuffers

    buffers = PlanBuffers(Capacity(4, 16, 16, 16, 16, 0, 16), 8, 2, 16, torch.device(DEVICE))
    config = tcfg.LaunchConfig(4, 2, 4, 16, 8, 16, 64, 16, 4, 3, "HND", False, 5, False, False, False, False, False,
                               True, True)
    q, out, prior_o = (torch.zeros((3, 8, 16), device=DEVICE) for _ in range(3))
    k, v = (torch.zeros((6, 2, 8, 16), device=DEVICE) for _ in range(2))
    lse, prior_lse = (torch.zeros((3, 8), device=DEVICE) for _ in range(2))
    scalars = tcfg.Scalars(0.25, 1.5, 2.0, -0.5)
    return buffers, config, (q, k, v, out, lse, prior_o, prior_lse), scalars


def test_the_packers_give_the_declared_arguments_in_order():
    """``call_args`` and ``plan_args`` give one value per declared name, each the one its name says."""
    from bsrattn.torch_cuda import kernel_args
    from bsrattn.torch_cuda.gather import kv_strides

    buffers, config, (q, k, v, out, lse, prior_o, prior_lse), scalars = _launch_fixture()
    call = kernel_args.call_args(q, k, v, out, lse, prior_o, prior_lse, config, scalars)
    assert len(call) == len(kernel_args.CALL_ARGS)
    named = dict(zip(kernel_args.CALL_ARGS, call))
    for name, x in dict(q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, lse_ptr=lse, prior_o=prior_o,
                        prior_lse=prior_lse).items():
        assert named[name] is x, name
    assert (named["q_strides"], named["out_strides"], named["lse_strides"]) == (q.stride(), out.stride(), lse.stride())
    assert named["k_strides"] == kv_strides(k, "HND") and named["v_strides"] == kv_strides(v, "HND")
    assert named["block_size"] == config.block_size and named["scalars"] == scalars
    plan = kernel_args.plan_args(buffers, config)
    assert len(plan) == len(kernel_args.PLAN_ARGS)
    named = dict(zip(kernel_args.PLAN_ARGS, plan))
    for name in ("cta_indptr", "items", "merge_partials", "kv_indices", "rope_q"):
        assert named[name].data_ptr() == buffers.section(name).data_ptr(), name
    for name, x in dict(part_o=buffers.part_o, part_lse=buffers.part_lse, sync=buffers.sync, mask_ptr=buffers.mask,
                        alibi_ptr=buffers.alibi, rope_ptr=buffers.rope).items():
        assert named[name].data_ptr() == x.data_ptr() and named[name].dtype == x.dtype, name
    assert named["part_o_strides"] == buffers.part_o.stride()[:2]
    assert named["part_lse_strides"] == buffers.part_lse.stride()
    assert (named["window_left"], named["head_programs"], named["merge_rows"]) == (5, 2, buffers.merge_rows)


def test_a_launch_of_a_kept_kernel_hands_it_the_declared_arguments(monkeypatch):
    """A :class:`~bsrattn.torch_cuda.launch.Launch` of a kind seen before hands a kept kernel's runner
    ``RUNTIME_ARGS`` in order, tensors as their addresses, then the constexpr values: what the first launch,
    through Triton, was given by name. (The interpreter keeps no kernels: here each kept one records its call.)"""
    from bsrattn.torch_cuda import kernel_args, launch

    calls = []

    def recording(compiled, launch_grid, tail, descriptors):
        return launch.KeptKernel(lambda *args, **kwargs: calls.append(args), lambda *args: None, launch_grid, None,
                                 None, tail, descriptors)

    monkeypatch.setattr(launch, "_KEEPS_KERNELS", True)
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch.KeptKernel, "of", staticmethod(recording))
    buffers, config, tensors, scalars = _launch_fixture()
    buffers.section("cta_indptr").zero_()  # no items: the first launch, through Triton, runs no program's work
    kept = launch.Launch(buffers, config)
    kept(*tensors, scalars)
    kept(*tensors, scalars)
    (kernels,) = launch._COMPILED.values()
    assert len(calls) == len(kernels) == 2, "the first pass and REDO (the window hides keys), each once"
    declared = kernel_args.call_args(*tensors, config, scalars) + kernel_args.plan_args(buffers, config)
    addresses = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in declared)
    for args, kernel in zip(calls, kernels):
        for name, got, want in zip(kernel_args.RUNTIME_ARGS, args, addresses):
            assert got == want, name
        assert args == addresses + kernel.tail


def test_block_sizes_that_are_not_powers_of_two_share_one_kernel():
    """transformers' cache is one block of ``S`` slots per request, ``S`` growing every step: the kernel reads such
    a block size at run time, so the steps share one compiled kernel instead of compiling one each; a page size
    that is a power of two stays a compile-time constant."""
    from dataclasses import replace

    from bsrattn.torch_cuda import executor, launch
    from bsrattn.torch_cuda.plan_buffers import Capacity, PlanBuffers

    buffers = PlanBuffers(Capacity(4, 16, 16, 16, 16, 0, 16), 8, 2, 64, torch.device(DEVICE))
    base = tcfg.LaunchConfig(4, 2, 4, 64, 16, 16, 64, 64, 4, 3, "HND", False, -1, False, False, False, False, False,
                             True, True)
    kinds = {bs: launch.Launch(buffers, replace(base, block_size=bs))._plan_kind for bs in (16, 512, 1000, 1001)}
    assert kinds[1000] == kinds[1001] != kinds[16] != kinds[512]
    block_sizes = {bs: executor.constexprs(replace(base, block_size=bs), torch.float16)["BLOCK_SIZE"]
                   for bs in kinds}
    assert block_sizes == {16: 16, 512: 512, 1000: 0, 1001: 0}


# ---- out= / lse= buffers ------------------------------------------------------------------------------

def test_out_and_lse_buffers_are_written_and_returned():
    problem = paged_problem(ba.Variant(), seed=8, **scattered(np.random.default_rng(8)))
    layout = problem.case.layout

    def into_tensors(q, k, v, kv_layout):
        out = torch.full(q.shape, float("nan"), device=DEVICE)
        lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
        got_o, got_lse = ba.attention(tensor(q), tensor(k), tensor(v), layout, backend="torch", out=out, lse=lse,
                                      return_lse=True)
        assert got_o is out and got_lse is lse
        return out, lse

    def into_arrays(q, k, v, kv_layout):
        out, lse = np.full(q.shape, np.nan, np.float32), np.full(q.shape[:2], np.nan, np.float32)
        assert ba.attention(q, k, v, layout, backend="torch", out=out, lse=lse) is out
        return out, lse

    for run in (into_tensors, into_arrays):
        check_attention(run, problem, "float32", name=run.__name__)


# ---- plan / run: buffers refilled in place ------------------------------------------------------------

def test_replan_refills_buffers_in_place_and_replays():
    """The CPU analogue of a CUDA-graph replay: the op's arguments from the first run, after a re-plan."""
    rng = np.random.default_rng(9)
    plan_a = paged_problem(ba.Variant(), seed=9, **scattered(rng, (1, 1, 1), (45, 12, 70)))
    lay_a, head_dim = plan_a.case.layout, plan_a.head_dim
    plan_b = paged_problem(ba.Variant(), qo_lens=[1, 1, 1], page_tables=[[0, 1, 2], [7, 6, 5, 4, 3], [9]],
                           kv_lens=[17, 33, 2], num_pages=lay_a.num_blocks)
    tensors = raw_tensors(plan_a, "float32")
    qt, kt, vt = (tensor(x) for x in tensors)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(lay_a, 4, 2, head_dim, num_ctas=3)
    runner_a = attn._runners[0]
    out, lse = torch.empty_like(qt), torch.empty(3, 4, device=DEVICE)

    def launch(*_):
        # runner_a launches exactly what it launched the first time (plan A's config, the same buffers).
        out.fill_(float("nan"))
        runner_a.run(qt, kt, vt, out=out, lse=lse)
        return out, lse

    check_attention(launch, plan_a, "float32", tensors, name="plan A")
    buffers, pointer = runner_a.buffers, runner_a.buffers.raw.data_ptr()

    attn.plan(plan_b.case.layout, 4, 2, head_dim, num_ctas=3)
    assert attn._runners[0].buffers is buffers and buffers.raw.data_ptr() == pointer
    assert attn.work_plans[0].num_merges > 0
    check_attention(launch, plan_b, "float32", tensors, name="replayed launch, plan B")

    big = named_case("paged", scattered(rng, (1,) * 20, (40,) * 20, spare=0)).layout
    buffers.captured = True  # as a CUDA graph capture's launch marks them: the graph holds their addresses
    with pytest.warns(RuntimeWarning, match="recapture any CUDA graph"):
        attn.plan(big, 4, 2, head_dim, num_ctas=3)
    assert attn._runners[0].buffers is not buffers, "a plan over capacity gets new buffers"


@pytest.mark.parametrize("change", [dict(variant=ba.Variant(causal=True)), dict(variant=ba.Variant(sm_scale=0.5)),
                                    dict(variant=ba.Variant(sinks=[1.0] * 4))], ids=["causal", "scale", "sinks"])
def test_a_replan_that_changes_what_a_captured_graph_recorded_warns(change):
    """A CUDA graph captured on a runner's buffers records the launch's grid, compile-time switches and scalars;
    a re-plan refills the buffers in place, so one that changes any of those would make the graph's replays
    run the old launch over the new plan: it is warned, and a re-plan that keeps them is not. (Another grid
    never fits the buffers: that re-plan gets new ones, and its own warning, above.)"""
    layout = named_case("paged", scattered(np.random.default_rng(12))).layout
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, 4, 2, 8, num_ctas=3)
    buffers = attn._runners[0].buffers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn.plan(layout, 4, 2, 8, num_ctas=3, **change)  # nothing captured: any re-plan is fine
        buffers.captured = True  # what a launch inside torch.cuda.graph() sets (tests/test_torch_gpu.py)
        other_pages = named_case("paged", scattered(np.random.default_rng(13))).layout
        attn.plan(other_pages, 4, 2, 8, num_ctas=3, **change)  # new page tables only
    with pytest.warns(RuntimeWarning, match=r"a CUDA graph was captured on these buffers.*recapture it"):
        attn.plan(layout, 4, 2, 8, num_ctas=3)
    assert attn._runners[0].buffers is buffers


def test_a_causal_mask_that_hides_no_key_is_left_out_of_the_launch():
    """A decode step's query sits at its row's last position: causal hides none of its keys, so the launch runs
    without the mask and without the second pass that only hidden keys need; the answer is the causal one.
    A row of two queries keeps both, and a graph captured on the decode plan is warned about at that re-plan."""
    rng = np.random.default_rng(14)
    causal = ba.Variant(causal=True)
    problem = paged_problem(causal, **scattered(rng, (1, 1, 1), (45, 12, 70)))
    run, attn = _batch(problem, num_ctas=2, fixed_split_size=16)
    check_attention(run, problem, "float32", name="causal decode")
    config = attn._runners[0].launch_config("float32", "NHD", True)
    assert not config.causal and not config.hidden_keys
    attn._runners[0].buffers.captured = True  # as a launch inside torch.cuda.graph() sets it
    with pytest.warns(RuntimeWarning, match="the causal mask"):
        attn.plan(named_case("paged", scattered(rng, (1, 2, 1), (45, 12, 70), spare=0)).layout, 4, 2,
                  problem.head_dim, variant=causal, num_ctas=2, fixed_split_size=16)
    assert attn._runners[0].launch_config("float32", "NHD", True).hidden_keys


def test_a_prefill_plan_that_splits_no_row_runs_the_kernel_without_merges(monkeypatch):
    """A prefill with at least as many query tiles as CTAs splits no row, and its launch leaves the merges out of
    the kernel (fewer live values: no spills on sm_90, test_torch_compile.py); the answer is the same as a split
    plan's through the full kernel. A graph captured on the merge-free kernel is warned about when a re-plan
    splits rows, and only then."""
    _pretend_sms(monkeypatch, 1)  # 2 CTAs a KV head
    rng = np.random.default_rng(15)
    causal = ba.Variant(causal=True)
    problem = paged_problem(causal, **scattered(rng, (70, 45, 50), (80, 45, 70)))
    run, attn = _batch(problem)
    check_attention(run, problem, "float32", name="prefill, no merges")
    assert attn.work_plans[0].num_merges == 0
    assert not attn._runners[0].launch_config("float32", "NHD", True).merges
    run, split = _batch(problem, num_ctas=3, fixed_split_size=16)
    check_attention(run, problem, "float32", name="prefill, split")
    assert split.work_plans[0].num_merges > 0 and split._runners[0].launch_config("float32", "NHD", True).merges
    buffers = attn._runners[0].buffers
    buffers.captured, buffers.captured_without_merges = True, True  # as a capture of the merge-free launch sets
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn.plan(problem.case.layout, 4, 2, problem.head_dim, variant=causal)  # splits nothing: the graph still fits
    with pytest.warns(RuntimeWarning, match="a kernel without merges, and the new plan splits rows"):
        attn.plan(problem.case.layout, 4, 2, problem.head_dim, variant=causal, num_ctas=attn.work_plans[0].num_ctas,
                  fixed_split_size=32)
    assert attn._runners[0].buffers is buffers


# ---- prefill plans that split no row: the item kernel (item_kernel.py) ---------------------------------------

def _item_kernel_problem(kind, variant, rng):
    """A prefill of 5 query tiles (64 rows of 2 heads each), enough that 2 CTAs a KV head split no row."""
    qo, kv = (70, 65, 30), (90, 65, 30)
    if kind == "ragged":
        case = named_case("ragged", dict(qo_lens=list(qo), kv_lens=list(kv)), "flat")
    else:
        need = [-(-n // 8) for n in kv]
        tables = np.split(np.arange(sum(need)), np.cumsum(need)[:-1])
        if kind == "paged, the last rows on scattered pages":
            tables[1:] = np.split(rng.permutation(np.arange(need[0], sum(need))), [need[1]])
        raw = dict(qo_lens=list(qo), page_tables=[t.tolist() for t in tables], kv_lens=list(kv), page_size=8,
                   num_pages=sum(need))
        # HND: every row's pages consecutive, but a dense row's slots are not one stride apart
        case = named_case("paged", raw, "HND" if kind.startswith("paged HND") else "NHD")
    return Problem(case, 4, 2, 16, variant, seed=4)


ITEM_KERNEL_CASES = {  # kind: whether the call reads its dense rows through tensor descriptors
    "ragged": True,
    "paged, the last rows on scattered pages": True,  # those rows gathered
    "paged HND, consecutive pages": False,
}


@pytest.mark.parametrize("variant", [ba.Variant(causal=True), ba.Variant(logits_soft_cap=2.0, sm_scale=0.9)],
                         ids=["causal", "soft cap"])
@pytest.mark.parametrize("kind", sorted(ITEM_KERNEL_CASES))
def test_prefill_plans_that_split_no_row_run_the_item_kernel(kind, variant, monkeypatch):
    """One program per item, reading dense rows through tensor descriptors where the plan asks (here for short
    rows too) and the call allows (``tma_ready``), gathered loads elsewhere; a window, deterministic mode, or a
    plan that splits rows under a causal mask that hides keys keep the persistent kernel (a split plan without
    hidden keys runs the item kernel with its merges)."""
    from bsrattn.torch_cuda import executor, item_kernel, launch

    _pretend_sms(monkeypatch, 1)  # 2 CTAs a KV head
    problem = _item_kernel_problem(kind, variant, np.random.default_rng(16))
    q, k, v, view = call_inputs(problem.case, *raw_tensors(problem, "float16"))
    shipped = ba.BatchAttention(backend="torch")
    shipped.plan(problem.case.layout, 4, 2, 16, variant=variant, kv_layout=view)
    kv_view = shipped._runners[0].spec.kv_view_of(tensor(k))
    assert shipped._runners[0].launch_config("float16", kv_view, True).item_kernel == tcfg.ITEM_KERNEL  # short rows
    monkeypatch.setattr(tcfg, "ITEM_TMA_MIN_KV", 0)
    # The item kernel alone, without the persistent kernel's REDO launch (which would compute a flagged item
    # again, and clear its flag): on finite inputs it writes every row itself and flags no item.
    passes = executor.passes
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(executor, "passes", lambda *a, **kw: passes(*a, **kw)[:1])
    run, attn = _batch(problem, torch.float16)
    check_attention(run, problem, "float16", name=kind)
    buffers = attn._runners[0].buffers
    assert not buffers.sync[3 * buffers.merge_rows:].any(), "items flagged for computing again"
    monkeypatch.setattr(executor, "passes", passes)
    config = attn._runners[0].launch_config("float16", kv_view, True)
    assert attn.work_plans[0].num_merges == 0 and config.item_kernel == tcfg.ITEM_KERNEL_TMA, config
    assert item_kernel.tma_ready(config, *(tensor(x, torch.float16) for x in (q, k, v))) == ITEM_KERNEL_CASES[kind]
    windowed = ba.Variant(causal=True, window_left=40)
    for changed, kwargs in ((variant, dict(num_ctas=3, fixed_split_size=16)), (variant, dict(deterministic=True)),
                            (windowed, {})):
        other = ba.BatchAttention(backend="torch")
        other.plan(problem.case.layout, 4, 2, 16, variant=changed, kv_layout=view, **kwargs)
        on_items = bool(other._runners[0].launch_config("float16", config.kv_view, True).item_kernel)
        assert on_items == (changed is variant and "fixed_split_size" in kwargs and not variant.causal), \
            (changed, kwargs)


@pytest.mark.parametrize("descriptors", [False, True], ids=["gathered", "tensor descriptors"])
def test_a_hidden_keys_nan_does_not_reach_the_item_kernels_rows(descriptors, monkeypatch):
    """Causal prefill through the item kernel with a NaN in the value of a key that the first queries of its row
    cannot see: those rows answer as without it (the item is flagged and computed again, dropping hidden values),
    the rows that see it are NaN."""
    problem = _item_kernel_problem("ragged", ba.Variant(causal=True), np.random.default_rng(18))
    q, k, v = raw_tensors(problem, "float16")
    v = v.copy()
    v[40] = np.nan  # row 0's key 40: hidden from its first 20 queries (positions 20..89 see keys up to their own)
    _pretend_sms(monkeypatch, 1)
    monkeypatch.setattr(tcfg, "ITEM_TMA_MIN_KV", 0 if descriptors else tcfg.ITEM_TMA_MIN_KV)
    run, attn = _batch(problem, torch.float16)
    out, _ = check_attention(run, problem, "float16", tensors=(q, k, v), name="NaN of a hidden key")
    want = tcfg.ITEM_KERNEL_TMA if descriptors else tcfg.ITEM_KERNEL
    assert attn._runners[0].launch_config("float16", "NHD3", True).item_kernel == want
    assert np.isfinite(out[:20]).all() and np.isnan(out[20:70]).all()


def test_same_plan_same_bits():
    problem = paged_problem(ba.Variant(), seed=10, **scattered(np.random.default_rng(10)))
    q, k, v = inputs(problem)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(problem.case.layout, 4, 2, problem.head_dim, num_ctas=2, fixed_split_size=7)
    first = attn.run(q, k, v, return_lse=True)
    for _ in range(2):
        again = attn.run(q, k, v, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_cascade_through_attention_and_batch_attention():
    case = named_case("shared_prefix", dict(qo_lens=[2, 1, 1], prefix_pages=[0, 3, 5], prefix_len=21,
                                            suffix_page_tables=[[1], [2, 4], []], suffix_lens=[5, 11, 0],
                                            page_size=8, num_pages=6))
    for variant in (ba.Variant(causal=True), ba.Variant(sigmoid_bias=0.3)):
        problem = Problem(case, 4, 2, 16, variant, seed=11)
        check_attention(_attention(problem), problem, "float32", name=f"cascade {variant}")
        check_attention(_batch(problem, num_ctas=2)[0], problem, "float32", name=f"cascade plan {variant}")


@pytest.mark.parametrize("kernel", ["persistent", "items"])
@pytest.mark.parametrize("split", [False, True], ids=["whole rows", "split rows"])
def test_a_cascades_last_level_folds_the_levels_before_it(kernel, split, monkeypatch):
    """The torch tier merges a Cascade's levels in its last level's kernel: that level runs with the fold of the
    levels before it as its prior state and writes the output itself, with no merge launch, whether it stores a
    whole row (an item's store) or a split one (the merge's), on either kernel. Its rows, a request with no suffix
    among them, answer as the reference does, planned and one-shot."""
    monkeypatch.setattr(tcfg, "decode_on_items", lambda work_plan, rows: kernel == "items")
    merged = []
    merge_state = ba.backends.Backend.merge_state
    monkeypatch.setattr(ba.backends.Backend, "merge_state",
                        lambda self, *states: merged.append(self.name) or merge_state(self, *states))
    case = named_case("shared_prefix", dict(qo_lens=[1, 1, 1], prefix_pages=[0, 3, 5], prefix_len=21,
                                            suffix_page_tables=[[1], [2, 4], []], suffix_lens=[5, 11, 0],
                                            page_size=8, num_pages=6))
    problem = Problem(case, 4, 2, 16, ba.Variant(logits_soft_cap=3.0), seed=12)
    plan = dict(num_ctas=2, fixed_split_size=3) if split else dict(disable_split_kv=True)
    run, attn = _batch(problem, torch.float16, **plan)
    check_attention(run, problem, "float16", name=f"cascade, {kernel}, split {split}")
    last = attn._runners[-1]
    assert (last.work_plan.num_merges > 0) == split
    (key, config), = last._configs.items()
    assert key[3] and config.prior and bool(config.item_kernel) == (kernel == "items"), config
    assert not any(key[3] for key in attn._runners[0]._configs), "the first level folds no prior"
    check_attention(_attention(problem, torch.float16), problem, "float16", name=f"one-shot cascade, {kernel}")
    assert merged == [], "a merge launched beside the levels"


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
        want_o, want_lse = naive_merge(o_r, lse_r)
        assert got_o.dtype == dtype
        assert_close(got_o, want_o, "merge", name)
        assert_close(got_lse, want_lse, "merge", "float32")
        got_o, got_lse = be.merge_state(o_t[:, 0], lse_t[:, 0], o_t[:, 3], lse_t[:, 3])
        want_o, want_lse = naive_merge(o_r[:, [0, 3]], lse_r[:, [0, 3]])
        assert_close(got_o, want_o, "merge", name)
        assert_close(got_lse, want_lse, "merge", "float32")
        assert_close(be.add_states(o_t[:, 0], o_t[:, 1]), o_r[:, 0] + o_r[:, 1], "merge", name)


def test_one_shot_calls_of_one_spec_plan_once(monkeypatch):
    """A model's layers call ``attention`` with one layout in a step: the torch tier keeps the last one-shot call's
    runner and runs its plan again for a call of the same spec (the same layout object, heads, variant, dtypes and
    view), planning again whenever any of them changes; every call answers as the reference does."""
    from bsrattn import scheduler
    from bsrattn.torch_cuda import one_shot

    plans = []
    real = scheduler._plan_valid
    monkeypatch.setattr(scheduler, "_plan_valid", lambda *args, **kwargs: plans.append(1) or real(*args, **kwargs))
    monkeypatch.setattr(one_shot, "_kept", {})
    rng = np.random.default_rng(8)
    plain = paged_problem(ba.Variant(), **scattered(rng, (1, 1, 1), (40, 70, 20)))
    capped = Problem(plain.case, 4, 2, plain.head_dim, ba.Variant(logits_soft_cap=2.0), seed=0)
    other = paged_problem(ba.Variant(), **scattered(rng, (1, 1), (90, 30)))
    calls = [(plain, torch.float32, 1), (plain, torch.float32, 1), (capped, torch.float32, 2),
             (plain, torch.float32, 3), (plain, torch.float16, 4), (plain, torch.float16, 4), (other, torch.float16, 5),
             (other, torch.float16, 5)]
    for i, (problem, dtype, planned) in enumerate(calls):
        name = "float16" if dtype == torch.float16 else "float32"
        check_attention(_attention(problem, dtype), problem, name, name=f"call {i}")
        assert len(plans) == planned, (i, len(plans))


# ---- torch.compile ------------------------------------------------------------------------------------

def test_custom_ops_trace_without_graph_breaks():
    problem = paged_problem(ba.Variant(), seed=13, **scattered(np.random.default_rng(13), qo_lens=(1, 1, 1)))
    q, k, v = inputs(problem)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(problem.case.layout, 4, 2, problem.head_dim, num_ctas=2, fixed_split_size=16)

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
    from bsrattn.torch_cuda import launch

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the inputs were checked")

    monkeypatch.setattr(launch, "launch", launched)
    monkeypatch.setattr(launch.Launch, "__call__", launched)


def test_bad_inputs_raise_before_launch(no_launch):
    problem = paged_problem(ba.Variant(), seed=14, **scattered(np.random.default_rng(14)))
    q, k, v = inputs(problem)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(problem.case.layout, 4, 2, problem.head_dim)
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


def test_kept_kernels_go_through_triton_while_a_launch_hook_is_set(monkeypatch):
    """A kept kernel's launcher is called directly only while no launch hook would be called: not while a profiler
    has set one, as a function or in Triton's chain of hooks (an empty chain calls nothing). The hooks are read
    where the installed Triton keeps them."""
    import triton

    from bsrattn.torch_cuda import launch

    chain_type = getattr(getattr(triton, "knobs", None), "HookChain", None)  # Triton 3.5 on
    for name in ("launch_enter_hook", "launch_exit_hook"):
        with monkeypatch.context() as m:
            m.setattr(launch._HOOKS, name, None)
            assert launch._no_launch_hooks()
            m.setattr(launch._HOOKS, name, print)
            assert not launch._no_launch_hooks(), name
            if chain_type is not None:
                chain = chain_type()
                m.setattr(launch._HOOKS, name, chain)
                assert launch._no_launch_hooks()
                chain.add(print)
                assert not launch._no_launch_hooks(), name
    from triton.compiler.compiler import CompiledKernel

    monkeypatch.delattr(triton, "knobs", raising=False)  # before Triton 3.4: CompiledKernel's class attributes
    assert launch._hook_holder() is CompiledKernel


def test_a_launch_over_buffers_of_another_item_capacity_keeps_its_own_kernels(monkeypatch):
    """The item kernel's launch grid is its buffers' item capacity, and a kept kernel carries the launch grid it was
    launched over: a later plan whose buffers hold more items must not launch the first plan's kept kernels, or the
    items past the first capacity never run. Here kept kernels do nothing, so a launch that reused them would leave the
    second plan's rows unwritten (the interpreter compiles nothing to keep: this stands in for the GPU)."""
    from bsrattn.torch_cuda import launch

    def do_nothing(compiled, launch_grid, tail, descriptors):
        return launch.KeptKernel(lambda *args, **kwargs: None, lambda *args: None, launch_grid, None, None, tail,
                                 descriptors)

    monkeypatch.setattr(launch, "_KEEPS_KERNELS", True)
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch.KeptKernel, "of", staticmethod(do_nothing))
    _pretend_sms(monkeypatch, tcfg.INTERPRETER_SMS)  # the chains of short items are the plan of a few CTAs
    rng = np.random.default_rng(5)
    capacities = []
    for batch in (8, 20):  # chains of short decode items (config.decode_on_items): 8 and then 20 items
        problem = paged_problem(ba.Variant(), **scattered(rng, (1,) * batch, tuple(rng.integers(20, 60, size=batch))))
        run, attn = _batch(problem, torch.float16)
        check_attention(run, problem, "float16", name=f"decode of {batch} rows")
        runner = attn._runners[0]
        assert runner.launch_config("float16", "NHD", True).item_kernel, "the case must run the item kernel"
        capacities.append(runner.buffers.item_capacity)
    assert capacities[0] < 20, capacities


SPLIT_DECODES = {  # (qo_lens, kv_lens): the item kernel's two kinds of decode plan (config.decode_on_items)
    "chains of short items": ((1,) * 8, (300, 12, 170, 40, 90, 200, 33, 100)),
    "tiles of 32 rows": ((16,), (300,)),
}


@pytest.mark.parametrize("storage", ["paged", "ragged, tensor descriptors"])
@pytest.mark.parametrize("variant", [ba.Variant(), ba.Variant(logits_soft_cap=2.0)], ids=["plain", "soft cap"])
@pytest.mark.parametrize("shape", sorted(SPLIT_DECODES))
def test_a_split_decode_runs_the_item_kernel_with_its_merges(shape, variant, storage, monkeypatch):
    """A decode plan that splits rows into chains of short items, or whose tiles are taller than
    ``DECODE_FEW_ROWS``, runs the item kernel, one program per item: a split item writes its partial state and the
    last of a merge's items to land folds them in the plan's order, as the persistent kernel's do; dense rows
    through tensor descriptors where the plan asks (here for short rows too). The rows answer as the reference
    does, and the merge counters are back at zero after every call. A decode of a few items keeps the persistent
    kernel."""
    _pretend_sms(monkeypatch, tcfg.INTERPRETER_SMS)  # the chains of short items are the plan of a few CTAs
    rng = np.random.default_rng(21)
    qo_lens, kv_lens = SPLIT_DECODES[shape]
    if storage == "paged":
        problem, kernel = paged_problem(variant, **scattered(rng, qo_lens, kv_lens)), tcfg.ITEM_KERNEL
    else:
        monkeypatch.setattr(tcfg, "ITEM_TMA_MIN_KV", 0)
        case = named_case("ragged", dict(qo_lens=list(qo_lens), kv_lens=list(kv_lens)), "flat")
        problem, kernel = Problem(case, 4, 2, 16, variant, seed=21), tcfg.ITEM_KERNEL_TMA
    from bsrattn.torch_cuda import item_kernel

    q, k, v = (tensor(x, torch.float16) for x in call_inputs(problem.case, *raw_tensors(problem, "float16"))[:3])
    run, attn = _batch(problem, torch.float16)
    for _ in range(2):
        check_attention(run, problem, "float16", name=f"split decode, {shape}, {storage}")
        runner = attn._runners[0]
        plan, config = runner.work_plan, runner.launch_config("float16", runner.spec.kv_view_of(k), True)
        assert plan.num_merges > 0 and config.merges and config.item_kernel == kernel, config
        assert not runner.buffers.sync.any(), "a merge counter left behind"
        assert item_kernel.tma_ready(config, q, k, v) == (kernel == tcfg.ITEM_KERNEL_TMA)
    few = ba.BatchAttention(backend="torch")
    few.plan(named_case("paged", scattered(rng, (1, 1, 1), (300, 12, 170))).layout, 4, 2, 8, variant=variant)
    assert not few._runners[0].launch_config("float16", "NHD", True).item_kernel
