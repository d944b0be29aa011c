"""The scheduler (Algorithm 1): coverage, purity, the split options, the seed's makespan table, execution."""

from __future__ import annotations

import heapq
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn import scheduler
from bsrattn.indexing import ceil_div
from bsrattn.reference import attention_rows, execute
from bsrattn.testing import assert_close
from bsrattn.validation import make_spec
from helpers import call_inputs, check_plan_coverage, compiled_or_python, raw_tensors
from strategies import plan_kwargs, problems


@st.composite
def lengths(draw, max_batch=12, max_qo=20, max_kv=300):
    batch = draw(st.integers(1, max_batch))
    qo = draw(st.lists(st.integers(0, max_qo), min_size=batch, max_size=batch))
    kv = draw(st.lists(st.integers(0, max_kv), min_size=batch, max_size=batch))
    return qo, kv


implementation = compiled_or_python(scheduler._core)


def test_plan_covers_every_row_and_kv_slot_exactly_once(implementation):
    @given(lengths(), plan_kwargs())
    def check(lens, kwargs):
        check_plan_coverage(scheduler.plan(*lens, **kwargs), *lens)

    check()


@given(lengths(), st.integers(1, 16), st.integers(1, 8))
def test_round_robin_covers_every_row_and_kv_slot_exactly_once(lens, num_ctas, tile_q):
    work_plan = scheduler.round_robin(*lens, num_ctas=num_ctas, tile_q=tile_q)
    check_plan_coverage(work_plan, *lens)
    assert work_plan.num_merges == 0
    # Tiles have distinct first query rows, so sorting items by it lists the tiles in order: tile i on CTA i % n.
    owner = np.repeat(np.arange(num_ctas), np.diff(work_plan.cta_indptr))
    np.testing.assert_array_equal(owner[np.argsort(work_plan.item_qo_start)], np.arange(work_plan.num_items) % num_ctas)


@given(lengths(), plan_kwargs())
def test_least_loaded_assignment_matches_a_heapq_construction(lens, kwargs):
    """Each CTA runs the items Algorithm 1 gives it, in the order it gives them: items longest first (equal
    costs in (tile, chunk) order), each onto the least-loaded CTA, ties to the lower CTA id."""
    work_plan = scheduler.plan(*lens, **kwargs)
    created = np.lexsort((work_plan.item_kv_start, work_plan.item_qo_start))  # (tile, chunk) order
    longest_first = created[np.argsort(-work_plan.item_cost[created], kind="stable")]
    heap = [(0, c) for c in range(work_plan.num_ctas)]
    runs = [[] for _ in range(work_plan.num_ctas)]
    for w in longest_first:
        load, c = heapq.heappop(heap)
        runs[c].append((int(work_plan.item_qo_start[w]), int(work_plan.item_kv_start[w])))
        heapq.heappush(heap, (load + int(work_plan.item_cost[w]), c))
    for c, want in enumerate(runs):
        items = range(work_plan.cta_indptr[c], work_plan.cta_indptr[c + 1])
        assert [(int(work_plan.item_qo_start[w]), int(work_plan.item_kv_start[w])) for w in items] == want, f"CTA {c}"


@given(lengths(), plan_kwargs())
def test_compiled_core_and_its_python_fallback_plan_the_same(lens, kwargs):
    """Without Numba the scheduler runs the same source as plain Python: the same plan, bit for bit."""
    compiled = scheduler.plan(*lens, **kwargs)
    with scheduler._core.as_python():
        fallback = scheduler.plan(*lens, **kwargs)
    assert compiled.equals(fallback)
    for plan_ in (compiled, fallback):
        assert all(type(getattr(plan_, f)) is int for f in ("num_ctas", "tile_q", "kv_chunk_size", "num_partial_rows"))
        assert all(getattr(plan_, f.name).dtype == np.int32 for f in fields(plan_) if f.type == "np.ndarray")


def test_lengths_must_fit_int32():
    with pytest.raises(ValueError, match="kv_lens must fit in int32"):
        scheduler.plan([1], [2**31], num_ctas=2)


@given(lengths(), plan_kwargs())
def test_identical_lengths_give_an_identical_plan(lens, kwargs):
    qo, kv = lens
    first = scheduler.plan(qo, kv, **kwargs)
    assert first.equals(scheduler.plan(np.array(qo, np.int32), np.array(kv, np.int64), **kwargs))
    assert first.equals(scheduler.plan(list(qo), list(kv), **kwargs))


@given(lengths(), st.integers(1, 16), st.integers(1, 16), st.integers(1, 32), st.sampled_from([1, 4, 16]))
def test_chunk_size_is_algorithm_1s_l_kv(lens, num_ctas, tile_q, min_split, align):
    """``L_kv = ceil(sum_r ceil(l_qo/T_q) * l_kv / num_ctas)``, at least ``min_split_size``, rounded up to
    ``kv_align``."""
    qo, kv = lens
    total = sum(ceil_div(q, tile_q) * k for q, k in zip(qo, kv))
    want = max(ceil_div(total, num_ctas), min_split, 1)
    want = ceil_div(want, align) * align
    work_plan = scheduler.plan(qo, kv, num_ctas=num_ctas, tile_q=tile_q, min_split_size=min_split, kv_align=align)
    assert work_plan.kv_chunk_size == want


@given(lengths(), plan_kwargs())
def test_greedy_makespan_bound_and_longest_first_order(lens, kwargs):
    """Least-loaded assignment: makespan <= total / num_ctas + the largest item; each CTA runs longest first."""
    work_plan = scheduler.plan(*lens, **kwargs)
    cost = work_plan.item_cost.astype(np.int64)
    if cost.size:
        assert scheduler.makespan(work_plan) <= cost.sum() / work_plan.num_ctas + cost.max()
    assert scheduler.makespan(work_plan) == (work_plan.cta_loads().max() if cost.size else 0.0)
    for c in range(work_plan.num_ctas):
        mine = cost[work_plan.cta_indptr[c]:work_plan.cta_indptr[c + 1]]
        assert (np.diff(mine) <= 0).all(), f"CTA {c} runs costs {mine.tolist()}, not longest first"


@given(lengths(), st.integers(1, 16), st.integers(1, 8), st.integers(1, 40))
def test_fixed_split_size_chunks_depend_on_the_row_alone(lens, num_ctas, tile_q, size):
    qo, kv = lens
    work_plan = scheduler.plan(qo, kv, num_ctas=num_ctas, tile_q=tile_q, fixed_split_size=size)
    assert work_plan.kv_chunk_size == size
    starts, ends = work_plan.item_kv_start, work_plan.item_kv_end
    assert (starts % size == 0).all() and (ends - starts <= size).all()
    for r, k in enumerate(kv):
        mine = work_plan.item_row == r
        if qo[r]:
            want = max(1, ceil_div(k, size)) * ceil_div(qo[r], tile_q)
            assert mine.sum() == want, f"row {r}: {mine.sum()} items, want {want}"


@given(lengths(), st.integers(1, 16), st.integers(1, 8))
def test_disable_split_kv_gives_one_item_per_tile(lens, num_ctas, tile_q):
    qo, kv = lens
    work_plan = scheduler.plan(qo, kv, num_ctas=num_ctas, tile_q=tile_q, disable_split_kv=True)
    assert work_plan.kv_chunk_size == 0 and work_plan.num_merges == 0 and work_plan.num_partial_rows == 0
    assert work_plan.num_items == sum(ceil_div(q, tile_q) for q in qo)
    assert (work_plan.item_partial == -1).all()
    np.testing.assert_array_equal(work_plan.item_kv_start, 0)
    np.testing.assert_array_equal(work_plan.item_kv_end, np.asarray(kv)[work_plan.item_row])


def test_busy_ctas_balances_over_the_first_ctas_and_leaves_the_rest_empty(implementation):
    """``busy_ctas`` plans exactly as ``num_ctas=busy_ctas`` would, in a grid of ``num_ctas`` whose last CTAs
    get no item."""
    @given(lengths(), plan_kwargs(), st.integers(1, 8))
    def check(lens, kwargs, extra):
        busy = kwargs["num_ctas"]
        work_plan = scheduler.plan(*lens, **dict(kwargs, num_ctas=busy + extra), busy_ctas=busy)
        want = scheduler.plan(*lens, **kwargs)
        assert work_plan.num_ctas == busy + extra
        np.testing.assert_array_equal(work_plan.cta_indptr, np.r_[want.cta_indptr, [want.cta_indptr[-1]] * extra])
        for f in fields(scheduler.WorkPlan):
            if f.name not in ("num_ctas", "cta_indptr"):
                np.testing.assert_array_equal(getattr(work_plan, f.name), getattr(want, f.name), err_msg=f.name)
        check_plan_coverage(work_plan, *lens)
        with pytest.raises(ValueError, match=f"busy_ctas must be <= {busy + extra}"):
            scheduler.plan(*lens, **dict(kwargs, num_ctas=busy + extra), busy_ctas=busy + extra + 1)

    check()


# ---- the seed's makespan table (ratio of round-robin's makespan to the plan's, 132 CTAs) ------------------

def test_makespan_table_shape():
    """Seed medians: uniform 1.00x, U(512, 2048) 1.48x and U(4096, 16384) 1.52x at batch 256, lognormal
    3.31x, U(4096, 16384) at batch 32 5.43x. A few trials suffice for the shape."""
    table = {(dist, batch): scheduler.simulate(dist, batch, num_ctas=132, trials=5, seed=0)
             for dist, batch in [("uniform kv=2048", 256), ("U(512, 2048)", 256), ("U(4096, 16384)", 256),
                                 ("lognormal", 256), ("U(4096, 16384)", 32)]}
    uniform = table["uniform kv=2048", 256]
    assert (uniform.ratios == 1.0).all(), "nothing to balance: exactly 1.00x"
    assert 1.3 <= table["U(512, 2048)", 256].median <= 1.7
    assert 1.3 <= table["U(4096, 16384)", 256].median <= 1.7
    assert 2.5 <= table["lognormal", 256].median <= 5.0
    assert 4.3 <= table["U(4096, 16384)", 32].median <= 6.5
    assert table["U(512, 2048)", 256].median < table["lognormal", 256].median < table["U(4096, 16384)", 32].median


def test_simulate_rejects_an_unknown_distribution():
    with pytest.raises(ValueError, match="unknown distribution 'zipf'"):
        scheduler.simulate("zipf", 8)


# ---- a plan executed CTA by CTA equals attention --------------------------------------------------------

@given(problems(kinds=["ragged", "paged", "block_sparse", "vector_sparse", "tree", "quest"]), plan_kwargs())
def test_executed_plan_equals_reference_attention(problem, kwargs):
    q, k, v, kv_layout = call_inputs(problem.case, *raw_tensors(problem))
    hq, hkv = (q.shape[1], 1) if problem.case.kind == "quest" else (problem.num_qo_heads, problem.num_kv_heads)
    layout = problem.case.layout
    spec = make_spec(layout, hq, hkv, problem.head_dim, problem.variant, kv_view="NHD3" if k.ndim == 3 else kv_layout)
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, **kwargs)
    got_o, got_lse = execute(work_plan, spec, q, k, v)
    want_o, want_lse = attention_rows(spec, q, k, v)
    assert_close(got_o, want_o, "attention", "float64", name="executed plan out")
    if not problem.variant.use_sigmoid:
        assert_close(got_lse, want_lse, "lse", "float64", name="executed plan lse")


@given(problems(kinds=["shared_prefix"]), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 6)))
def test_batch_attention_cascade_equals_one_shot_attention(problem, num_ctas, fixed_split_size):
    q, k, v, kv_layout = call_inputs(problem.case, *raw_tensors(problem))
    attn = ba.BatchAttention(backend="reference")
    attn.plan(problem.case.layout, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
              variant=problem.variant, num_ctas=num_ctas, fixed_split_size=fixed_split_size)
    want = ba.attention(q, k, v, problem.case.layout, variant=problem.variant, backend="reference")
    assert_close(attn.run(q, k, v), want, "attention", "float64", name="cascade plan/run out")


def test_the_makespan_study_is_reexported_by_the_scheduler():
    from bsrattn import makespan

    for name in ("makespan", "SimulationResult", "DISTRIBUTIONS"):
        assert getattr(scheduler, name) is getattr(makespan, name)


def test_lead_items_gives_a_row_one_first_item_of_l_kv_on_the_grid_then_single_chunks(implementation):
    """With ``lead_items``, a row's first item covers Algorithm 1's ``L_kv`` rounded up to a multiple of
    ``fixed_split_size``; the rest of a longer row is cut at every grid point."""
    p = scheduler.plan([1, 1], [5000, 300], num_ctas=4, fixed_split_size=1024, lead_items=True)
    assert p.kv_chunk_size == 1024  # L_kv = ceil(5300 / 4) = 1325: a first item of 2048
    items = sorted(zip(p.item_row.tolist(), p.item_kv_start.tolist(), p.item_kv_end.tolist()))
    assert items == [(0, 0, 2048), (0, 2048, 3072), (0, 3072, 4096), (0, 4096, 5000), (1, 0, 300)]
    assert scheduler.plan([1, 1], [5000, 300], num_ctas=4, fixed_split_size=1024).equals(
        scheduler.plan([1, 1], [5000, 300], num_ctas=4, fixed_split_size=1024, lead_items=False))
    plain = scheduler.plan([1, 1], [5000, 300], num_ctas=1, fixed_split_size=1024, lead_items=True)
    assert plain.num_items == 2 and plain.num_merges == 0
    with pytest.raises(ValueError, match="lead_items=True needs fixed_split_size"):
        scheduler.plan([1, 1], [5000, 300], num_ctas=4, lead_items=True)
