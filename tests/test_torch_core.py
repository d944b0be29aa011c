"""The torch tier's core (``bsrattn/torch_cuda/core.py``), the paper's kernel at teaching size, against the oracle.

Every layout kind, every variant feature, split rows merged in plan order, the rules for NaN and infinities and
fp8 KV, compared with the float64 oracle of ``helpers.py`` (the error budget of ``bsrattn.testing``) or, where a
rule is the point, with the reference tier. Specs are built as ``bsrattn.api`` builds them: ``spec_from_inputs``
for a call, then the core's ``attention`` (its own plan) or ``make_runner`` over a ``scheduler.plan``. A Cascade
runs level by level with its RoPE positions and its states fold with the reference ⊕, as ``api`` folds them
above the tier.

Without a GPU the kernels run in the Triton interpreter (the root ``conftest.py``), at tiny sizes, with 16-slot
KV tiles so that short rows span several. ``TestOnGPU`` runs real sizes, bfloat16 and fp8 on the H200::

    python -m pytest tests/test_torch_core.py -m gpu -q -rs
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn.cascade import Cascade
from bsrattn.reference.merge import merge_state
from bsrattn.testing import assert_close, compare, scattered_page_tables
from bsrattn.validation import dtype_name, make_spec, spec_from_inputs
from helpers import as_float64, assert_matches_reference, check_attention
from strategies import EDGE_CASES, LAYOUT_STRATEGIES, named_case, paged_problem, problems
from test_special_values import POISONS, expected, inputs, paged_layout, paged_views, poisoned, slot

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from bsrattn.torch_cuda import core  # after the skips: it imports torch and triton

# The emulated kernels compute with NumPy, which warns at the NaNs and infinities some tests feed them on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = ("float32", "float16") + (("bfloat16",) if GPU else ())  # the interpreter computes bfloat16 wrongly


def on_device(x):
    """NumPy values (float, or ml_dtypes bfloat16 and fp8) as a tensor of their dtype on the device; tensors as they
    are."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(DEVICE, getattr(torch, dtype_name(x)))


def core_states(layout, variant, q, k, v, kv_layout="NHD", plan=None, **scales):
    """``(out, lse or None)`` of the core as float64 NumPy. ``plan``: ``scheduler.plan``'s options (default: the
    core's own, through its one-shot ``attention``). A Cascade's levels run one by one and fold with ⊕ (a sum for
    FlashSigmoid)."""
    q, k, v = (on_device(x) for x in (q, k, v))
    cascade = isinstance(layout, Cascade)
    states = []
    for i, level in enumerate(layout.levels if cascade else (layout,)):
        spec = spec_from_inputs(q, k, v, level, layout.level_variant(i, variant) if cascade else variant, kv_layout,
                                **scales)
        if cascade and variant.use_rope:
            spec = replace(spec, rope_positions=layout.rope_positions(i))
        kwargs = dict(return_lse=not variant.use_sigmoid, **scales)
        if plan is None:
            o, s = core.attention(spec, q, k, v, **kwargs)
        else:
            work_plan = ba.scheduler.plan(level.qo_lens, level.kv_lens, **plan)
            o, s = core.make_runner(spec, work_plan).run(q, k, v, **kwargs)
        states.append((as_float64(o), None if s is None else as_float64(s)))
    o, s = states[0]
    for o_b, s_b in states[1:]:
        o, s = (o + o_b, None) if variant.use_sigmoid else merge_state(o, s, o_b, s_b)
    return o, s


def run_of(problem, plan=None):
    """A run for ``helpers.check_attention``."""
    return lambda q, k, v, kv_layout: core_states(problem.case.layout, problem.variant, q, k, v, kv_layout, plan)


# ---- every layout kind, every variant feature ------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(LAYOUT_STRATEGIES))
def test_every_layout_kind(kind):
    @settings(max_examples=3)
    @given(problems([kind]), st.sampled_from(DTYPES))
    def check(problem, dtype):
        check_attention(run_of(problem), problem, dtype, name=f"core {kind} {dtype}")

    check()


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases(name):
    problem = EDGE_CASES[name]
    check_attention(run_of(problem), problem, "float32", name=f"core {name}")


SLOPES = [0.5, 0.25, 0.125, 0.0625]
FEATURES = {
    "sm_scale": ba.Variant(sm_scale=0.9),
    "causal": ba.Variant(causal=True),
    "window_left": ba.Variant(window_left=6),
    "causal window_left 0": ba.Variant(causal=True, window_left=0),
    "logits_soft_cap": ba.Variant(logits_soft_cap=1.5, sm_scale=1.0),
    "alibi_slopes": ba.Variant(alibi_slopes=SLOPES),
    "sigmoid_bias": ba.Variant(sigmoid_bias=-0.7),
    "sigmoid_bias causal": ba.Variant(sigmoid_bias=0.4, causal=True),
    "rope_theta": ba.Variant(rope_theta=100.0, rope_scale=2.5),
    "rope_theta causal": ba.Variant(rope_theta=1e4, causal=True),
    "all but sigmoid": ba.Variant(sm_scale=0.5, causal=True, window_left=9, logits_soft_cap=3.0, alibi_slopes=SLOPES,
                                  rope_theta=100.0),
}
"""Each feature on three requests over shuffled pages of 8 (29, 12, 11 keys: two KV tiles in the interpreter)."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FEATURES))
def test_variant_features(name, dtype):
    problem = paged_problem(FEATURES[name])
    check_attention(run_of(problem), problem, dtype, name=f"core {name} {dtype}")


TREE = dict(parents=[[-1, 0, 0, 1, 3, 1]], page_tables=[[3, 0, 2, 1]], kv_lens=[27], page_size=8, num_pages=4)


@pytest.mark.parametrize("variant", [ba.Variant(), ba.Variant(causal=True, rope_theta=100.0, alibi_slopes=SLOPES[:2]),
                                     ba.Variant(sigmoid_bias=0.2)], ids=["plain", "causal rope alibi", "sigmoid"])
def test_custom_mask_with_variants(variant):
    """A tree's custom mask (27 keys, 6 draft nodes) beside the position masks and score transforms."""
    problem = replace(paged_problem(variant, hq=2, hkv=1), case=named_case("tree", TREE))
    check_attention(run_of(problem), problem, "float32", name=f"core tree {variant}")


def test_cascade_levels_turn_at_their_positions():
    """A shared prefix's levels with fused RoPE: each level's queries and keys turn at their positions in the whole
    sequence (``spec.rope_frame()`` from ``Cascade.rope_positions``), not at the level's own."""
    raw = dict(qo_lens=[2, 3], prefix_pages=[4, 0], prefix_len=13, suffix_page_tables=[[1, 3], [2]],
               suffix_lens=[11, 5], page_size=8, num_pages=5)
    problem = replace(paged_problem(ba.Variant(causal=True, rope_theta=100.0)), case=named_case("shared_prefix", raw))
    check_attention(run_of(problem), problem, "float32", name="core cascade rope")


# ---- split rows, merged in plan order --------------------------------------------------------------------

SPLITS = {
    "balanced, unaligned chunks": dict(num_ctas=10, tile_q=2),
    "fixed_split_size 5": dict(num_ctas=3, tile_q=4, fixed_split_size=5),
    "fixed_split_size 16, whole tiles": dict(num_ctas=3, tile_q=4, fixed_split_size=16),
}


@pytest.mark.parametrize("variant", [ba.Variant(causal=True), ba.Variant(logits_soft_cap=5.0),
                                     ba.Variant(sigmoid_bias=0.1)], ids=["causal", "soft cap", "sigmoid"])
@pytest.mark.parametrize("options", list(SPLITS))
def test_planned_run_with_split_rows(options, variant):
    """Split items write partial states, merged in each merge list's order; the same plan twice, the same bits."""
    problem = paged_problem(variant)
    layout = problem.case.layout
    work_plan = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, **SPLITS[options])
    assert work_plan.num_merges > 0 and np.diff(work_plan.merge_indptr).min() >= 2, "the plan must split rows"
    runs = []

    def run(q, k, v, kv_layout):
        runs.append(core_states(layout, variant, q, k, v, kv_layout, SPLITS[options]))
        runs.append(core_states(layout, variant, q, k, v, kv_layout, SPLITS[options]))
        return runs[0]

    check_attention(run, problem, "float32", name=f"core {options}")
    for a, b in zip(*runs):
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg="one plan, two runs, different bits")


def test_merges_fold_in_plan_order():
    """Three chunks of one row whose values are +1e8, -1e8 and 1 (equal weights): folded in the plan's order, the
    first two cancel exactly and the small chunk survives, 1/3; in another order float32 rounds it away."""
    n, d = 8, 16
    layout = ba.layouts.ragged([1], [3 * n])
    q = np.zeros((1, 1, d), np.float32)  # every score 0: every key weighs the same
    k = np.zeros((3 * n, 1, d), np.float32)
    v = np.repeat(np.array([1e8, -1e8, 1.0], np.float32), n)[:, None, None] * np.ones((1, 1, d), np.float32)
    plan = dict(num_ctas=3, fixed_split_size=n)
    assert ba.scheduler.plan(layout.qo_lens, layout.kv_lens, **plan).merge_partials.tolist() == [0, 1, 2]
    o, s = core_states(layout, ba.Variant(), q, k, v, plan=plan)
    assert_close(o, np.full((1, 1, d), 1 / 3), "attention", "float32", name="plan-order fold")
    assert_close(s, np.full((1, 1), np.log(3 * n)), "lse", "float32")


def test_merge_stage_on_special_states():
    """The merge kernel alone, on partial states written by hand (reference ``merge_state``'s rules): an empty state
    is the identity whatever its ``o`` holds, empty states merge to 0 and -inf, a NaN or ``+inf`` LSE gives NaN."""
    layout = ba.layouts.ragged([1] * 5, [24] * 5)
    work_plan = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=5, fixed_split_size=8)
    spec = make_spec(layout, 1, 1, 16, ba.Variant(), "float32", "float32")
    q, k = torch.zeros((5, 1, 16), device=DEVICE), torch.zeros((120, 1, 16), device=DEVICE)
    out, lse = torch.zeros_like(q), torch.zeros((5, 1), device=DEVICE)
    _, (merge, grid, args, kwargs) = core.make_runner(spec, work_plan).launches(q, k, k, out, lse)
    rng = np.random.default_rng(7)
    o, s = rng.standard_normal((5, 3, 1, 16)), rng.standard_normal((5, 3, 1))
    o[0, 0], s[0, 0] = np.nan, -np.inf  # empty states holding NaN and infinity, first and later in the fold
    o[1, 1], s[1, 1] = np.inf, -np.inf
    o[2], s[2] = 1e30, -np.inf  # every state empty
    s[3, 2], s[4, 0] = np.nan, np.inf
    part_o, part_lse = args[:2]
    for m in range(5):
        for j, p in enumerate(work_plan.merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]):
            part_o[p], part_lse[p] = torch.from_numpy(o[m, j]), torch.from_numpy(s[m, j])
    merge[grid](*args, **kwargs)
    want_o, want_s = o[:, 0], s[:, 0]
    for j in (1, 2):
        want_o, want_s = merge_state(want_o, want_s, o[:, j], s[:, j])
    rows = work_plan.merge_qo_start
    for label, got, want in (("o", out, want_o), ("lse", lse, want_s)):
        result = compare(as_float64(got)[rows], want, atol=1e-5, rtol=1e-5, name=f"merge {label}")
        assert result.ok, result.message
    assert (as_float64(out)[rows[2]] == 0).all() and (as_float64(lse)[rows[2]] == -np.inf).all()


# ---- numbers that are not numbers ------------------------------------------------------------------------

SPLIT_EVERY_ROW = dict(num_ctas=3, tile_q=4, fixed_split_size=4)


def _poisoned_run(name, planned, clean=False):
    variant, kind, request, position, value = POISONS[name]
    q, k, v = inputs()
    if not clean:
        q, k, v = poisoned(kind, request, position if position is not None else 0, value, q, k, v)
    pool = (-1, 4, 2, 16)  # test_special_values' pages of 4 slots, 2 KV heads, head_dim 16
    got = core_states(paged_layout(), variant, *(x.astype(np.float32) for x in (q, k.reshape(pool), v.reshape(pool))),
                      plan=SPLIT_EVERY_ROW if planned else None)
    return got, (q, k, v), variant


@pytest.mark.parametrize("planned", [False, True], ids=["one-shot", "split plan"])
@pytest.mark.parametrize("name", list(POISONS))
def test_poisoned_inputs_follow_the_rules(name, planned):
    """The rules of ``reference/microkernel.py``, stated a second time in ``test_special_values.expected``."""
    got, (q, k, v), variant = _poisoned_run(name, planned)
    want = expected(paged_views(variant), q, k, v, variant.sigmoid_bias)
    for label, g, w in zip(("out", "lse"), got, want):
        if g is not None:
            result = compare(g, w, atol=2e-5, rtol=2e-5, name=f"core {name} {label}")
            assert result.ok, result.message


@pytest.mark.parametrize("name", ["NaN v of a causally hidden key", "inf k of a causally hidden key",
                                  "NaN v outside the window", "NaN k and v past the row's end",
                                  "NaN v of a hidden key, sigmoid"])
def test_hidden_keys_leave_the_bits_unchanged(name):
    variant, _, request, position, _ = POISONS[name]
    blind = [slot(request, position) not in slots for _, slots, _ in paged_views(variant)]
    assert any(blind)
    for planned in (False, True):
        dirty, _, _ = _poisoned_run(name, planned)
        clean, _, _ = _poisoned_run(name, planned, clean=True)
        for a, b in zip(dirty, clean):
            if a is not None:
                np.testing.assert_array_equal(a[blind], b[blind])


# ---- dtypes, array kinds, refusals -----------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_with_scales(kv_dtype):
    """fp8 KV under a float16 ``q``, scaled by ``k_scale``/``v_scale``, against the reference on the same values."""
    problem = paged_problem(ba.Variant(causal=True))
    rng = np.random.default_rng(5)
    layout = problem.case.layout
    q = on_device(rng.standard_normal((layout.nnz_qo, 4, 8)).astype(np.float16))
    k, v = (on_device(rng.standard_normal((layout.num_blocks, 8, 2, 8))).to(getattr(torch, kv_dtype))
            for _ in range(2))
    scales = dict(k_scale=0.6, v_scale=1.7)
    got = core_states(layout, problem.variant, q, k, v, plan=SPLIT_EVERY_ROW, **scales)
    assert_matches_reference(got, q, k, v, layout, kv_dtype, variant=problem.variant, **scales)


def test_numpy_in_numpy_out_and_given_buffers():
    problem = paged_problem(ba.Variant(causal=True))
    layout = problem.case.layout
    rng = np.random.default_rng(6)
    q = rng.standard_normal((layout.nnz_qo, 4, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, layout.num_blocks, 8, 2, 8)).astype(np.float32)
    spec = spec_from_inputs(q, k, v, layout, problem.variant)
    o, s = core.attention(spec, q, k, v)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32 and s is None
    out, lse = np.empty_like(q), np.empty(q.shape[:2], np.float32)
    got = core.attention(spec, q, k, v, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    assert_matches_reference((out, lse), q, k, v, layout, "float32", variant=problem.variant)
    out_t, lse_t = torch.empty(q.shape, device=DEVICE), torch.empty(q.shape[:2], device=DEVICE)
    got = core.attention(spec, *(on_device(x) for x in (q, k, v)), out=out_t, lse=lse_t)
    assert got[0] is out_t and got[1] is lse_t
    np.testing.assert_array_equal(out_t.cpu().numpy(), out)


def test_refusals_name_the_cause():
    problem = paged_problem()
    layout = problem.case.layout
    spec = make_spec(layout, 4, 2, 8, problem.variant, "float32", "float32")
    with pytest.raises(ValueError, match="deterministic"):
        core.plan_options(replace(spec, split_size=1024))
    q, k, v = np.zeros((layout.nnz_qo, 4, 8)), *np.zeros((2, layout.num_blocks, 8, 2, 8))
    with pytest.raises(TypeError, match="float64"):
        core.attention(spec_from_inputs(q, k, v, layout), q, k, v)
    if not GPU:
        q, k, v = (torch.zeros(x.shape, dtype=torch.bfloat16) for x in (q, k, v))
        with pytest.raises(TypeError, match="bfloat16"):
            core.attention(spec_from_inputs(q, k, v, layout), q, k, v)


# ---- real sizes, on a GPU --------------------------------------------------------------------------------

HQ, HKV, D, PAGE = 32, 8, 128, 16


def _paged(rng, qo_lens, kv_lens):
    tables, num_pages = scattered_page_tables(rng, kv_lens, PAGE, spare_pages=16)
    return ba.layouts.paged(list(qo_lens), tables, list(kv_lens), PAGE, num_pages)


def _tensors(layout, q_dtype, kv_dtype, kv_shape=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_shape = kv_shape or (layout.num_blocks, layout.block_size, HKV, D)
    q = torch.randn((layout.nnz_qo, HQ, D), device="cuda", generator=gen).to(getattr(torch, q_dtype))
    k, v = (torch.randn(kv_shape, device="cuda", generator=gen).to(getattr(torch, kv_dtype)) for _ in range(2))
    return q, k, v


@pytest.mark.gpu
class TestOnGPU:
    """32 query heads over 8 KV heads, head_dim 128, pages of 16, thousands of keys, against the reference."""

    def _check(self, layout, variant, q, k, v, dtype, kv_layout="NHD", plan=None, **scales):
        got = core_states(layout, variant, q, k, v, kv_layout, plan, **scales)
        assert_matches_reference(got if not variant.use_sigmoid else got[0], q, k, v, layout, dtype, variant=variant,
                                 kv_layout=kv_layout, **scales)

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    def test_paged_decode_split_over_the_sms(self, dtype):
        rng = np.random.default_rng(0)
        layout = _paged(rng, [1] * 8, rng.integers(500, 4000, size=8))
        spec = make_spec(layout, HQ, HKV, D)
        assert ba.scheduler.plan(layout.qo_lens, layout.kv_lens, **core.plan_options(spec)).num_merges > 0
        self._check(layout, ba.Variant(logits_soft_cap=30.0), *_tensors(layout, dtype, dtype), dtype)

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_ragged_causal_prefill(self, dtype):
        qo = [300, 517, 64]
        layout = ba.layouts.ragged(qo, [n + 100 for n in qo])
        tensors = _tensors(layout, dtype, dtype, kv_shape=(layout.num_blocks, HKV, D), seed=1)
        self._check(layout, ba.Variant(causal=True), *tensors, dtype)

    @pytest.mark.parametrize("q_dtype,kv_dtype", [(q, kv) for q in ("float16", "bfloat16")
                                                  for kv in ("float8_e4m3fn", "float8_e5m2")])
    def test_fp8_kv(self, q_dtype, kv_dtype):
        rng = np.random.default_rng(2)
        layout = _paged(rng, [1, 1, 4, 1], [2000, 64, 900, 1500])
        self._check(layout, ba.Variant(causal=True), *_tensors(layout, q_dtype, kv_dtype, seed=2), kv_dtype,
                    k_scale=0.8, v_scale=1.7)

    @pytest.mark.parametrize("variant", [
        ba.Variant(causal=True, window_left=255, alibi_slopes=[2.0 ** -(h % 8 + 1) for h in range(HQ)]),
        ba.Variant(causal=True, rope_theta=1e4), ba.Variant(sigmoid_bias=-3.0, causal=True),
        ba.Variant(logits_soft_cap=30.0, sm_scale=0.1)], ids=["window alibi", "rope", "sigmoid", "soft cap"])
    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_prefill_variants(self, variant, dtype):
        rng = np.random.default_rng(3)
        layout = _paged(rng, [200, 130], [700, 300])
        self._check(layout, variant, *_tensors(layout, dtype, dtype, seed=3), dtype)

    def test_tree_mask_hnd(self):
        parents = [[-1] + [i // 2 for i in range(63)], [-1, 0, 1, 1, 2]]
        kv = [1000 + len(parents[0]), 300 + len(parents[1])]
        tables, num_pages = scattered_page_tables(np.random.default_rng(4), kv, PAGE, spare_pages=4)
        layout = ba.layouts.tree(parents, tables, kv, page_size=PAGE, num_pages=num_pages)
        q, k, v = _tensors(layout, "float16", "float16", kv_shape=(layout.num_blocks, HKV, PAGE, D), seed=4)
        self._check(layout, ba.Variant(), q, k, v, "float16", kv_layout="HND")

    def test_split_plan_is_bitwise_repeatable(self):
        rng = np.random.default_rng(5)
        layout = _paged(rng, [1, 3, 1], [6000, 2500, 300])
        q, k, v = _tensors(layout, "bfloat16", "bfloat16", seed=5)
        plan = dict(num_ctas=40, tile_q=2)
        assert ba.scheduler.plan(layout.qo_lens, layout.kv_lens, **plan).num_merges >= 3
        first = core_states(layout, ba.Variant(causal=True), q, k, v, plan=plan)
        for _ in range(5):
            again = core_states(layout, ba.Variant(causal=True), q, k, v, plan=plan)
            for a, b in zip(first, again):
                np.testing.assert_array_equal(a, b)
        self._check(layout, ba.Variant(causal=True), q, k, v, "bfloat16", plan=plan)
