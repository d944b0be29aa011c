"""The numba tier's core (``bsrattn/numba_cuda/core.py``), the paper's kernel at teaching size, against the oracle.

The core is called as the API calls a tier: a spec from ``bsrattn.validation.spec_from_inputs``, then
``core.attention`` (planned with ``core.plan_options``) or ``core.make_runner(spec, plan).run`` with a plan that
splits rows into chunks. A Cascade's levels run one by one (fused RoPE at their ``Cascade.rope_positions``) and
fold with ⊕, as ``bsrattn.api`` folds them. Results are checked with ``helpers.check_attention`` (the float64
oracle rebuilt from the layout's raw inputs, within the dtype's error budget), the rules for NaN and infinities
with ``test_special_values``'s statement of them, and the merge order bit for bit. Sizes are the strategies' tiny
ones: the simulator runs each CUDA thread as a Python thread.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn import scheduler
from bsrattn.validation import spec_from_inputs
from helpers import as_float64, canonical_pool, check_attention, query_views, raw_tensors, rounded
from strategies import EDGE_CASES, LAYOUT_STRATEGIES, Problem, named_case, paged_problem, problems
from test_special_values import KV_LENS, POISONS, check, expected, inputs, paged_layout, paged_views, poisoned, slot

pytest.importorskip("numba.cuda", reason="the numba tier needs numba-cuda")
from numba import cuda  # noqa: E402

from bsrattn.numba_cuda import core  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SPLIT = dict(num_ctas=3, fixed_split_size=5, tile_q=3)  # chunks of 5 keys; 3-row tiles: two sub-tiles at G = 2
TIER = SimpleNamespace(name="numba core")  # what test_special_values.check names in its messages


def state(q, k, v, layout, variant, kv_layout="NHD", plan=None, rope_positions=None, **run_kwargs):
    """``(out, lse or None)`` of the core over a BSRLayout: one-shot, or through ``scheduler.plan(**plan)``."""
    want_lse = not variant.use_sigmoid
    spec = spec_from_inputs(q, k, v, layout, variant, kv_layout, return_lse=want_lse, **run_kwargs)
    spec = replace(spec, rope_positions=rope_positions)
    if plan is None:
        return core.attention(spec, q, k, v, return_lse=want_lse, **run_kwargs)
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, **plan)
    return core.make_runner(spec, work_plan).run(q, k, v, return_lse=want_lse, **run_kwargs)


def core_call(problem, plan=None, **run_kwargs):
    """The core as a run for ``helpers.check_attention``; a Cascade's level states folded in level order."""
    layout, variant = problem.case.layout, problem.variant

    def run(q, k, v, kv_layout):
        if isinstance(layout, ba.BSRLayout):
            return state(q, k, v, layout, variant, kv_layout, plan, **run_kwargs)
        o, s = None, None
        for i, level in enumerate(layout.levels):
            o_i, s_i = state(q, k, v, level, layout.level_variant(i, variant), kv_layout, plan,
                             layout.rope_positions(i) if variant.use_rope else None, **run_kwargs)
            if o is None:
                o, s = o_i, s_i
            elif variant.use_sigmoid:
                o = o + o_i
            else:
                o, s = ba.merge_state(o, s, o_i, s_i, backend="numba")
        return o, s
    return run


# ---- every layout kind, edge cases, variant features ----------------------------------------------------

@pytest.mark.parametrize("kind", sorted(LAYOUT_STRATEGIES))
def test_every_layout_kind(kind):
    @settings(max_examples=3)
    @given(problems([kind]), st.sampled_from(["float32", "float16"]))
    def check_kind(problem, dtype):
        check_attention(core_call(problem), problem, dtype, name=f"core {kind} {dtype}")

    check_kind()


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases(name):
    problem = EDGE_CASES[name]
    check_attention(core_call(problem), problem, "float32", name=f"core {name}")


SLOPES = [0.5, 0.25, 0.125, 0.0625]
FEATURES = {
    "sm_scale": ba.Variant(sm_scale=0.9),
    "causal": ba.Variant(causal=True),
    "window_left": ba.Variant(causal=True, window_left=3),
    "logits_soft_cap": ba.Variant(logits_soft_cap=2.0, sm_scale=1.5),
    "alibi": ba.Variant(alibi_slopes=SLOPES),
    "sigmoid": ba.Variant(sigmoid_bias=-0.5, causal=True),
    "rope": ba.Variant(causal=True, rope_theta=100.0, rope_scale=1.5),
    "all softmax features": ba.Variant(causal=True, window_left=5, logits_soft_cap=3.0, alibi_slopes=SLOPES,
                                       rope_theta=1e4, sm_scale=0.7),
}
TREE = named_case("tree", dict(parents=[[-1, 0, 0, 1], [-1, -1]], page_tables=[[1, 0, 3], [2]], kv_lens=[19, 3],
                               page_size=8, num_pages=4))
PREFIX = named_case("shared_prefix", dict(qo_lens=[1, 3], prefix_pages=[0, 1], prefix_len=13,
                                          suffix_page_tables=[[2], [3]], suffix_lens=[5, 8], page_size=8, num_pages=4))


@pytest.mark.parametrize("plan", [None, SPLIT], ids=["one-shot", "split plan"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_each_variant_feature(name, plan):
    problem = paged_problem(FEATURES[name], seed=2)
    check_attention(core_call(problem, plan), problem, "float32", name=f"core {name}")


@pytest.mark.parametrize("plan", [None, SPLIT], ids=["one-shot", "split plan"])
@pytest.mark.parametrize("variant", [ba.Variant(), ba.Variant(causal=True, logits_soft_cap=3.0, rope_theta=10.0),
                                     ba.Variant(sigmoid_bias=0.5)], ids=["plain", "features", "sigmoid"])
def test_custom_mask(variant, plan):
    problem = Problem(TREE, 4, 2, 8, variant, seed=3)
    check_attention(core_call(problem, plan), problem, "float32", name="core tree")


@pytest.mark.parametrize("variant", [ba.Variant(causal=True, rope_theta=100.0), ba.Variant(sigmoid_bias=-1.0)],
                         ids=["rope at rope_positions", "sigmoid"])
def test_cascade_levels(variant):
    """A Cascade's suffix level turns its keys past the prefix (``spec.rope_positions``); FlashSigmoid adds."""
    problem = Problem(PREFIX, 4, 2, 8, variant, seed=4)
    check_attention(core_call(problem, SPLIT), problem, "float32", name="core cascade")


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("storage", ["NHD", "HND"])
def test_gqa_ratios_and_storage(hq, hkv, storage):
    """Groups of 3 and 8 (more query heads than ``QUERIES``: one row per sub-tile) over both storage orders."""
    problem = paged_problem(hq=hq, hkv=hkv, kv_pool=storage)
    check_attention(core_call(problem, SPLIT), problem, "float32", name=f"core G={hq // hkv} {storage}")


# ---- split plans: merged to the oracle, in the plan's order ----------------------------------------------

@st.composite
def plans(draw):
    kwargs = dict(num_ctas=draw(st.integers(1, 4)), tile_q=draw(st.integers(1, 4)))
    if draw(st.booleans()):
        kwargs["fixed_split_size"] = draw(st.integers(1, 8))
    return kwargs


@settings(max_examples=10)
@given(problems(), st.sampled_from(["float32", "float16"]), plans())
def test_any_layout_any_plan(problem, dtype, plan):
    check_attention(core_call(problem, plan), problem, dtype, name=f"core {problem.case.kind} {plan}")


def test_split_rows_fold_their_chunks_in_the_plan_order():
    """Every merged row, bit for bit, is its chunks' states folded left to right with ⊕ in the plan's order (and
    the reversed fold differs). A chunk's state is the core's own unsplit answer over that chunk's keys alone:
    without positions in the variant, a chunk sees what it sees inside its row."""
    problem = paged_problem(ba.Variant())
    q, k, v = (x.astype(np.float32) for x in raw_tensors(problem, "float32"))
    layout = problem.case.layout
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=3, fixed_split_size=5, tile_q=1)
    out, lse = core.make_runner(spec_from_inputs(q, k, v, layout), work_plan).run(q, k, v, return_lse=True)
    pool_k, pool_v = (canonical_pool(problem.case, x).astype(np.float32) for x in (k, v))
    views = query_views(problem.case)
    assert np.diff(work_plan.merge_indptr).max() >= 4, "the plan should cut a row into >= 4 chunks"
    order_matters = False
    for m in range(work_plan.num_merges):
        row = int(work_plan.merge_qo_start[m])
        chunks = []
        for p in work_plan.merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]:
            (w,) = np.flatnonzero(work_plan.item_partial == p)
            (view,) = views[row]
            slots = view.slots[work_plan.item_kv_start[w]:work_plan.item_kv_end[w]]
            alone = ba.layouts.ragged([1], [slots.size])
            chunks.append(state(q[row:row + 1], pool_k[slots], pool_v[slots], alone, ba.Variant()))
        for order, want in ((chunks, True), (chunks[::-1], False)):
            o, s = order[0]
            for o_c, s_c in order[1:]:
                o, s = ba.merge_state(o, s, o_c, s_c, backend="numba")
            same = np.array_equal(o, out[row:row + 1]) and np.array_equal(s, lse[row:row + 1])
            if want:
                assert same, f"merge {m}: row {row} is not its chunks folded in the plan's order"
            order_matters |= not same
    assert order_matters, "the reversed fold gave the same bits: this case cannot tell fold orders apart"


# ---- NaN and infinities ----------------------------------------------------------------------------------

def poisoned_run(layout, q, k, v, variant, plan):
    pool = (layout.num_blocks, layout.block_size) + k.shape[1:]
    args = [x.astype(np.float32) for x in (q, k.reshape(pool), v.reshape(pool))]
    o, s = state(*args, layout, variant, plan=plan)
    return as_float64(o), None if s is None else as_float64(s)


@pytest.mark.parametrize("plan", [None, dict(num_ctas=3, fixed_split_size=3)], ids=["one-shot", "split plan"])
@pytest.mark.parametrize("name", list(POISONS))
def test_poisoned_inputs_follow_the_rules(name, plan):
    variant, kind, request, position, value = POISONS[name]
    q, k, v = poisoned(kind, request, position if position is not None else 0, value, *inputs())
    got = poisoned_run(paged_layout(), q, k, v, variant, plan)
    check(TIER, got, expected(paged_views(variant), q, k, v, variant.sigmoid_bias), name)


def test_hidden_keys_leave_the_bits_unchanged():
    variant, kind, request, position, value = POISONS["NaN v of a causally hidden key"]
    clean = inputs()
    dirty = poisoned("kv", request, position, value, *clean)
    for plan in (None, SPLIT):
        a, b = (poisoned_run(paged_layout(), *x, variant, plan) for x in (clean, dirty))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x[:2], y[:2])  # queries 0 and 1 of request 0 cannot see key 9


@pytest.mark.parametrize("plan", [None, SPLIT], ids=["one-shot", "split plan"])
def test_a_row_of_minus_inf_scores_is_empty_whatever_v_holds(plan):
    """Request 1 sees its keys at score ``-inf`` and one of them holds NaN in ``v``: weight 0 each, so the row is
    empty (``out = 0``, ``lse = -inf``), not NaN."""
    variant, (q, k, v) = ba.Variant(), inputs()
    q[:, :, 0] = np.abs(q[:, :, 0]) + 0.5
    for position in range(KV_LENS[1]):
        k[slot(1, position), :, 0] = -np.inf
    v[slot(1, 2), :, 1] = np.nan
    got = poisoned_run(paged_layout(), q, k, v, variant, plan)
    check(TIER, got, expected(paged_views(variant), q, k, v), "all -inf, a NaN v")
    assert (got[0][3] == 0).all() and (got[1][3] == -np.inf).all()


def test_sigmoid_of_a_very_negative_score_is_zero():
    layout = ba.layouts.ragged([1], [3])
    q, k, v = np.full((1, 1, 4), 100.0, np.float32), np.full((3, 1, 4), -100.0, np.float32), np.ones((3, 1, 4))
    out, _ = state(q, k, v.astype(np.float32), layout, ba.Variant(sigmoid_bias=-3.0))
    assert (out == 0).all()


# ---- dtypes, array kinds, what the core refuses ----------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_other_dtypes(dtype):
    problem = paged_problem(ba.Variant(causal=True, alibi_slopes=SLOPES), seed=5)
    check_attention(core_call(problem, SPLIT), problem, dtype, name=f"core {dtype}")


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_with_scales(kv_dtype):
    """fp8 KV stored as ``2k`` and ``4v`` with scales 1/2 and 1/4; the oracle sees the dequantised values."""
    problem = paged_problem(ba.Variant(causal=True), seed=6)
    q, k, v = raw_tensors(problem)
    tensors = rounded(q, "float16"), rounded(k * 2, kv_dtype), rounded(v * 4, kv_dtype)
    check_attention(core_call(problem, SPLIT, k_scale=0.5, v_scale=0.25), problem, "float16", tensors,
                    kv_dtype=kv_dtype, k_scale=0.5, v_scale=0.25, name=f"core fp8 {kv_dtype}")


def test_float64_lse_and_q_dtype_out():
    problem = paged_problem(seed=7)
    q, k, v = raw_tensors(problem)
    out, lse = state(q, k, v, problem.case.layout, problem.variant)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    out, lse = state(*(x.astype(np.float16) for x in (q, k, v)), problem.case.layout, problem.variant)
    assert out.dtype == np.float16 and lse.dtype == np.float32


@pytest.mark.parametrize("kind", ["numpy", "device"])
def test_out_and_lse_buffers_and_array_kinds(kind):
    problem = paged_problem(seed=8)
    place = (lambda x: x) if kind == "numpy" else cuda.to_device

    def run(q, k, v, kv_layout):
        out, lse = place(np.full(q.shape, np.nan, np.float32)), place(np.full(q.shape[:2], np.nan, np.float32))
        args = [place(x) for x in (q, k, v)]
        spec = spec_from_inputs(*args, problem.case.layout, problem.variant, kv_layout, out=out, lse=lse)
        got_o, got_lse = core.make_runner(spec, scheduler.plan(spec.layout.qo_lens, spec.layout.kv_lens, **SPLIT)) \
            .run(*args, out=out, lse=lse)
        assert got_o is out and got_lse is lse
        fresh_o, fresh_lse = core.attention(spec, *args, return_lse=True)
        assert type(fresh_o) is type(args[0]) and type(fresh_lse) is type(args[0])
        return (as_float64(out), as_float64(lse)) if kind == "numpy" else (out.copy_to_host(), lse.copy_to_host())

    check_attention(run, problem, "float32", name=f"core {kind} buffers")


def test_plan_options_fit_the_scheduler():
    problem = paged_problem()
    spec = spec_from_inputs(*(x.astype(np.float32) for x in raw_tensors(problem)), problem.case.layout)
    options = core.plan_options(spec)
    assert sorted(options) == ["kv_align", "min_split_size", "num_ctas", "tile_q"]
    assert options["tile_q"] * spec.group_size <= max(core.QUERIES, spec.group_size)


def test_deterministic_mode_is_refused():
    problem = paged_problem()
    q, k, v = (x.astype(np.float32) for x in raw_tensors(problem))
    spec = replace(spec_from_inputs(q, k, v, problem.case.layout), split_size=64)
    with pytest.raises(ValueError, match="deterministic.*chunk grid"):
        core.attention(spec, q, k, v)
    with pytest.raises(ValueError, match="deterministic.*chunk grid"):
        core.make_runner(spec, scheduler.plan(spec.layout.qo_lens, spec.layout.kv_lens, num_ctas=2))
