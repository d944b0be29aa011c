"""Every layout is dense attention under its dense mask, checked from the layout's raw inputs.

The expected values never go through ``BSRLayout``: ``helpers.query_views`` reads the page tables, token
lists, block lists and tree parents the constructor was given, and ``helpers.naive_attention`` is a float64
loop over (query, head).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsrattn as ba
from helpers import (check_layout_attention, dense_mask_from_raw, flattened_problem, query_views,
                     reference_impl)
from strategies import EDGE_CASES, LAYOUT_STRATEGIES, Problem, block_sparse_cases, layout_cases, problems, variants

BSR_KINDS = sorted(set(LAYOUT_STRATEGIES) - {"shared_prefix"})


@pytest.mark.parametrize("kind", sorted(LAYOUT_STRATEGIES))
@settings(max_examples=15)
@given(data=st.data())
def test_attention_equals_naive_dense_attention(kind, data):
    check_layout_attention(reference_impl, data.draw(problems([kind])))


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases_equal_naive_dense_attention(name):
    check_layout_attention(reference_impl, EDGE_CASES[name])


@settings(max_examples=15)
@given(problems(["shared_prefix"]), st.data())
def test_flattened_cascade_takes_absolute_positions(problem, data):
    """``Cascade.flatten()`` is one layout with absolute positions, so ALiBi and windows apply to it."""
    variant = data.draw(variants(problem.num_qo_heads))
    check_layout_attention(reference_impl, flattened_problem(Problem(
        problem.case, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim, variant, problem.seed)))


@settings(max_examples=20)
@given(layout_cases(BSR_KINDS), st.data())
def test_to_dense_mask_matches_raw_inputs(case, data):
    variant = data.draw(variants(1, sigmoid=False)) if case.supports_positions else ba.Variant(
        causal=data.draw(st.booleans()))
    np.testing.assert_array_equal(case.layout.to_dense_mask(variant), dense_mask_from_raw(case, variant))


@settings(max_examples=20)
@given(layout_cases(BSR_KINDS))
def test_lengths_match_raw_inputs(case):
    views = query_views(case)
    heads = case.num_kv_heads or 1  # Quest: one layout row per (request, KV head)
    assert case.layout.nnz_qo == len(views) * heads
    row_of_query = np.repeat(np.arange(case.layout.num_rows), case.layout.qo_lens)
    for i, r in enumerate(row_of_query):
        per_head = views[i // heads]
        view = per_head[i % heads] if len(per_head) > 1 else per_head[0]
        assert case.layout.kv_lens[r] == view.slots.size


def test_a_slot_listed_twice_attends_twice_but_has_no_dense_mask():
    layout = ba.layouts.vector_sparse([[3, 1, 3]], [1], num_slots=4)
    with pytest.raises(ValueError, match="row 0 lists a KV slot more than once"):
        layout.to_dense_mask()
    k = np.eye(4)[:, None, :] * 5.0
    v = np.arange(4.0)[:, None, None] * np.ones((4, 1, 4))
    q = np.ones((1, 1, 4))
    out = ba.attention(q, k, v, layout, variant=ba.Variant(sm_scale=1.0))
    w = np.exp([5.0, 5.0, 5.0])  # three keys, each with score 5: slot 3 counts twice
    np.testing.assert_allclose(out[0, 0, 0], (3 * w[0] + 1 * w[1] + 3 * w[2]) / w.sum())


def test_read_amplification_seed_table():
    """The seed's table: a budget of 64 scattered pages of 16 needs 1024 slots; block 128 reads 8192."""
    pages = np.arange(64) * 8  # every page in its own 128-slot block
    layout = ba.layouts.paged([1], [pages], kv_lens=[1024], page_size=16, num_pages=512)
    at_16, at_128 = layout.read_amplification(16), layout.read_amplification(128)
    assert (at_16.needed, at_16.read, at_16.ratio) == (1024, 1024, 1.0)
    assert (at_128.needed, at_128.read, at_128.ratio) == (1024, 8192, 8.0)


@settings(max_examples=20)
@given(LAYOUT_STRATEGIES["paged"], st.integers(1, 64))
def test_read_amplification_of_a_paged_cache(case, kernel_block):
    """Needed: every token of every request; read: every kernel block holding one, counted per request."""
    raw = case.raw
    needed = read = 0
    for table, kv in zip(raw["page_tables"], raw["kv_lens"]):
        slots = [table[t // raw["page_size"]] * raw["page_size"] + t % raw["page_size"] for t in range(kv)]
        needed += kv
        read += len({s // kernel_block for s in slots}) * kernel_block
    amp = case.layout.read_amplification(kernel_block)
    assert (amp.needed, amp.read) == (needed, read)
    assert amp.read >= amp.needed or amp.needed == 0


@settings(max_examples=20)
@given(block_sparse_cases(with_mask=False))
def test_block_occupancy_of_block_sparse_is_its_block_list(case):
    raw = case.raw
    want = np.zeros((raw["M"] // raw["R"], raw["N"] // raw["C"]), dtype=bool)
    for row in range(want.shape[0]):
        want[row, raw["indices"][raw["indptr"][row]:raw["indptr"][row + 1]]] = True
    np.testing.assert_array_equal(case.layout.block_occupancy(raw["R"], raw["C"]), want)


def test_paged_page_table_is_the_indices_array():
    layout = ba.layouts.paged([1, 2, 1], [[0, 3, 5], [1, 2], [4, 6, 7, 1]], kv_lens=[40, 20, 48], page_size=16,
                              num_pages=8)
    assert layout.kv_indices.tolist() == [0, 3, 5, 1, 2, 4, 6, 7]
    assert layout.kv_indptr.tolist() == [0, 3, 5, 8] and layout.kv_last_len.tolist() == [8, 4, 16]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_a_two_dimensional_page_table_gives_the_layout_of_its_rows(dtype):
    """A ``[B, max_pages]`` integer array, as engines keep page tables, is read without a loop over its rows: the
    same layout as its rows given one by one, and the same refusal of a row too short for its length."""
    rng = np.random.default_rng(3)
    kv_lens = np.array([40, 0, 17, 64, 1])
    table = rng.permutation(40)[:20].reshape(5, 4).astype(dtype)
    as_array = ba.layouts.paged([1, 1, 2, 1, 1], table, kv_lens, 16, 40)
    as_rows = ba.layouts.paged([1, 1, 2, 1, 1], [list(row) for row in table], kv_lens, 16, 40)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len"):
        np.testing.assert_array_equal(getattr(as_array, name), getattr(as_rows, name))
    assert as_array.kv_indices.tolist() == [*table[0, :3], *table[2, :2], *table[3, :4], table[4, 0]]
    for tables in (table[:, :3], [list(row) for row in table[:, :3]]):
        with pytest.raises(ValueError, match=r"page_tables\[3\] has 3 pages, kv_lens\[3\]=64 needs 4"):
            ba.layouts.paged([1] * 5, tables, kv_lens, 16, 40)
