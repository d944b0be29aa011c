"""Determinism: a fixed merge order makes outputs bitwise reproducible; fold order is otherwise not free.

The reference executor runs in float32 here (``execute(..., dtype=np.float32)``), where the last bits of
a fold depend on its order, as on a GPU. That dependence is what makes "the plan's merge order is the
order" testable bit for bit, on every tier: a split row's output must be the left fold, in the plan's
order, of its chunks' states with the tier's own ⊕, and a fold in any other order (checked: the reversed
one) gives other bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn import scheduler
from bsrattn.reference import attend, execute
from bsrattn.validation import make_spec
from helpers import as_float64, call_inputs, canonical_pool, query_views, raw_tensors
from strategies import paged_problem, problems
from test_tiers import TIERS, load_tier


def _float32_run(work_plan, spec, q, k, v):
    o, lse = execute(work_plan, spec, q, k, v, dtype=np.float32)
    return o.tobytes() + lse.tobytes()


@given(problems(kinds=["ragged", "paged", "tree", "vector_sparse", "block_sparse"], sigmoid=False),
       st.integers(1, 8), st.integers(1, 4))
def test_same_plan_gives_identical_bits(problem, num_ctas, tile_q):
    q, k, v, kv_layout = call_inputs(problem.case, *raw_tensors(problem, np.float32))
    layout = problem.case.layout
    spec = make_spec(layout, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim, problem.variant,
                     kv_view="NHD3" if k.ndim == 3 else kv_layout)
    first = scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=num_ctas, tile_q=tile_q)
    again = scheduler.plan(layout.qo_lens.tolist(), layout.kv_lens.tolist(), num_ctas=num_ctas, tile_q=tile_q)
    assert first.equals(again)
    runs = {_float32_run(first, spec, q, k, v), _float32_run(again, spec, q.copy(), k.copy(), v.copy()),
            _float32_run(first, spec, q, k, v)}
    assert len(runs) == 1


def _seven_float32_partial_states():
    """Partial states of 4096 keys in seven uneven chunks, in float32: ``o [n, 7, H, D]``, ``lse [n, 7, H]``."""
    rng = np.random.default_rng(0)
    chunks = [7, 300, 1024, 1, 2000, 700, 64]
    m = sum(chunks)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((4, 2, 64), (m, 2, 64), (m, 2, 64)))
    bounds = np.concatenate([[0], np.cumsum(chunks)])
    parts = [attend(q, k[a:b], v[a:b], np.full(4, m - 1), np.arange(a, b), ba.Variant(), 1 / 8, dtype=np.float32)
             for a, b in zip(bounds, bounds[1:])]
    return np.stack([p[0] for p in parts], 1), np.stack([p[1] for p in parts], 1)


def test_shuffled_merge_order_changes_float32_bits_fixed_order_does_not():
    """The seed: 200 shuffles of seven partial states give many distinct results; the plan's order gives one."""
    o, lse = _seven_float32_partial_states()
    rng = np.random.default_rng(1)
    shuffled, fixed = set(), set()
    for _ in range(200):
        perm = rng.permutation(7)
        so, sl = ba.merge_states(o[:, perm], lse[:, perm], backend="reference")
        shuffled.add(so.tobytes() + sl.tobytes())
        fo, fl = ba.merge_states(o, lse, backend="reference")
        fixed.add(fo.tobytes() + fl.tobytes())
    assert len(shuffled) > 1, "fold order should change float32 results"
    assert len(fixed) == 1


# ---- the plan's merge order is the order, bit for bit --------------------------------------------------

SPLIT = dict(num_ctas=3, fixed_split_size=5)  # the 29-key request is cut into 6 chunks, the others into 3


def _fold(tier, part_o, part_lse, starts, rows, reverse=False):
    """The partial states at workspace rows ``starts[j] + (0..rows)`` folded left with the tier's ⊕, in the order
    of ``starts`` (or reversed); float32 throughout."""
    order = list(starts)[::-1] if reverse else list(starts)
    o, s = part_o[order[0]:order[0] + rows], part_lse[order[0]:order[0] + rows]
    for p in order[1:]:
        o, s = ba.merge_state(*(tier.array(x, "float32") for x in (o, s, part_o[p:p + rows], part_lse[p:p + rows])),
                              backend=tier.name)
        o, s = tier.numpy(o), tier.numpy(s)
    return np.asarray(o, np.float32), np.asarray(s, np.float32)


def _reference_split_run(problem, q, k, v):
    """The reference executor in float32 on a split plan, and each chunk's state computed on its own by the
    microkernel (``attend``) from the raw page tables, at its plan-assigned workspace rows."""
    layout, variant = problem.case.layout, problem.variant
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, tile_q=1, **SPLIT)
    spec = make_spec(layout, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim, variant)
    out, lse = execute(work_plan, spec, q, k, v, dtype=np.float32)
    views = query_views(problem.case)
    pool_k, pool_v = (canonical_pool(problem.case, x).astype(np.float32) for x in (k, v))
    part_o = np.zeros((work_plan.num_partial_rows, *q.shape[1:]), np.float32)
    part_lse = np.zeros(part_o.shape[:2], np.float32)
    for w in np.flatnonzero(work_plan.item_partial >= 0):
        (view,) = views[work_plan.item_qo_start[w]]  # tile_q = 1: one query row per item
        ks, ke, p, qs = (int(a[w]) for a in (work_plan.item_kv_start, work_plan.item_kv_end, work_plan.item_partial,
                                              work_plan.item_qo_start))
        part_o[p:p + 1], part_lse[p:p + 1] = attend(q[qs:qs + 1], pool_k[view.slots[ks:ke]], pool_v[view.slots[ks:ke]],
                                                    np.array([view.q_pos]), view.k_pos[ks:ke], variant,
                                                    spec.sm_scale, dtype=np.float32)
    return work_plan, out, lse, part_o, part_lse


def _tier_split_run(tier, problem, q, k, v):
    """``BatchAttention`` on a split plan in float32, and the partial states its kernel left in the workspace."""
    attn = ba.BatchAttention(backend=tier.name)
    attn.plan(problem.case.layout, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
              variant=problem.variant, **SPLIT)
    out, lse = attn.run(*(tier.array(x, "float32") for x in (q, k, v)), return_lse=True)
    (runner,) = attn._runners
    work_plan = runner.work_plan
    held = runner.workspace("float32") if tier.name == "numba" else (runner.buffers.part_o, runner.buffers.part_lse)
    part_o, part_lse = (as_float64(x)[:work_plan.num_partial_rows].astype(np.float32) for x in held)
    return work_plan, tier.numpy(out).astype(np.float32), tier.numpy(lse).astype(np.float32), part_o, part_lse


@pytest.mark.parametrize("name", TIERS)
def test_split_rows_fold_their_chunks_in_the_plan_order(name):
    """Every merged row, bit for bit: the plan's order, and not the reversed one."""
    tier = load_tier(name)
    problem = paged_problem()
    q, k, v = (x.astype(np.float32) for x in raw_tensors(problem, "float32"))
    run = _reference_split_run if name == "reference" else lambda *args: _tier_split_run(tier, *args)
    work_plan, out, lse, part_o, part_lse = run(problem, q, k, v)
    lists = np.diff(work_plan.merge_indptr)
    assert lists.max() >= 4, f"the plan should cut a row into >= 4 chunks, got merge lists of {lists.tolist()}"
    order_matters = False
    for m in range(work_plan.num_merges):
        qs, qe = int(work_plan.merge_qo_start[m]), int(work_plan.merge_qo_end[m])
        starts = work_plan.merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]
        want_o, want_lse = _fold(tier, part_o, part_lse, starts, qe - qs)
        np.testing.assert_array_equal(out[qs:qe], want_o, err_msg=f"{name}: merge {m} out, plan order")
        np.testing.assert_array_equal(lse[qs:qe], want_lse, err_msg=f"{name}: merge {m} lse, plan order")
        other_o, other_lse = _fold(tier, part_o, part_lse, starts, qe - qs, reverse=True)
        order_matters |= not (np.array_equal(other_o, want_o) and np.array_equal(other_lse, want_lse))
    assert order_matters, "the reversed fold gave the same bits: this case cannot tell fold orders apart"


@pytest.mark.parametrize("name", TIERS)
def test_merge_states_folds_in_index_order(name):
    """``merge_states`` over seven float32 states is the left fold of ``merge_state`` in index order, bit for bit."""
    tier = load_tier(name)
    rng = np.random.default_rng(2)
    o = rng.standard_normal((3, 7, 2, 8)).astype(np.float32)
    lse = rng.uniform(-4, 4, (3, 7, 2)).astype(np.float32)
    got_o, got_lse = (tier.numpy(x).astype(np.float32)
                      for x in ba.merge_states(tier.array(o, "float32"), tier.array(lse, "float32"), backend=name))
    stacked_o, stacked_lse = o.transpose(1, 0, 2, 3).reshape(-1, 2, 8), lse.transpose(1, 0, 2).reshape(-1, 2)
    starts = np.arange(7) * 3  # state s of all three rows sits at rows 3s..3s+2 of the stacked states
    want_o, want_lse = _fold(tier, stacked_o, stacked_lse, starts, 3)
    np.testing.assert_array_equal(got_o, want_o)
    np.testing.assert_array_equal(got_lse, want_lse)
    other_o, _ = _fold(tier, stacked_o, stacked_lse, starts, 3, reverse=True)
    assert not np.array_equal(other_o, want_o), "the reversed fold gave the same bits"


@st.composite
def batches_around(draw):
    """Other requests' ``(qo_len, kv_len)`` and where the request under test sits among them."""
    others = draw(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 120)), max_size=5))
    return others, draw(st.integers(0, len(others)))


REQUEST = (3, 57)  # (qo_len, kv_len) of the request whose output must not depend on its batch


def _request_output(others, position, fixed_split_size, num_ctas, tile_q):
    """The request's float32 output rows when batched with ``others`` (its q and KV are always the same)."""
    rng = np.random.default_rng(5)
    d, heads = 8, 2
    mine = [rng.standard_normal((n, heads, d)).astype(np.float32) for n in (REQUEST[0], REQUEST[1], REQUEST[1])]
    lens = others[:position] + [REQUEST] + others[position:]
    qs, ks, vs = [], [], []
    for i, (qo, kv) in enumerate(lens):
        if i == position:
            q, k, v = mine
        else:
            q, k, v = (rng.standard_normal((n, heads, d)).astype(np.float32) for n in (qo, kv, kv))
        qs.append(q)
        ks.append(k)
        vs.append(v)
    layout = ba.layouts.ragged([qo for qo, _ in lens], [kv for _, kv in lens])
    spec = make_spec(layout, heads, heads, d, ba.Variant(causal=True), kv_view="NHD3")
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=num_ctas, tile_q=tile_q,
                               fixed_split_size=fixed_split_size)
    o, lse = execute(work_plan, spec, np.concatenate(qs), np.concatenate(ks), np.concatenate(vs), dtype=np.float32)
    start = sum(qo for qo, _ in lens[:position])
    return o[start:start + REQUEST[0]], lse[start:start + REQUEST[0]]


@given(batches_around(), st.integers(1, 6), st.integers(1, 3))
def test_batch_invariance_with_fixed_split_size(batch, num_ctas, tile_q):
    alone_o, alone_lse = _request_output([], 0, 8, 1, tile_q)
    got_o, got_lse = _request_output(*batch, 8, num_ctas, tile_q)
    np.testing.assert_array_equal(got_o, alone_o)
    np.testing.assert_array_equal(got_lse, alone_lse)


def test_without_fixed_split_size_chunks_depend_on_the_batch():
    """Why batch invariance needs ``fixed_split_size``: L_kv is computed from the whole batch."""
    alone = scheduler.plan([REQUEST[0]], [REQUEST[1]], num_ctas=4)
    batched = scheduler.plan([REQUEST[0], 1, 1], [REQUEST[1], 400, 300], num_ctas=4)
    assert alone.kv_chunk_size != batched.kv_chunk_size
    fixed = [scheduler.plan(qo, kv, num_ctas=4, fixed_split_size=8)
             for qo, kv in (([REQUEST[0]], [REQUEST[1]]), ([REQUEST[0], 1, 1], [REQUEST[1], 400, 300]))]
    mine = [sorted(zip(p.item_kv_start[p.item_row == 0].tolist(), p.item_kv_end[p.item_row == 0].tolist()))
            for p in fixed]
    assert mine[0] == mine[1]
