"""Determinism: a fixed merge order makes outputs bitwise reproducible; fold order is otherwise not free.

The reference executor runs in float32 here (``execute(..., dtype=np.float32)``), where the last bits of
a fold depend on its order, as on a GPU.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn import scheduler
from bsrattn.reference import attend, execute
from bsrattn.validation import make_spec
from helpers import call_inputs, raw_tensors
from strategies import problems


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
