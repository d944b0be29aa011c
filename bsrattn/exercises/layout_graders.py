"""The hidden tests of the layout exercises: page tables, ragged batches, slots, masks, cascades, Quest, gathers.

As :mod:`bsrattn.exercises.graders` does for the state and the kernel: named cases, a small readable one first,
held to the library's own layouts (``ba.layouts.*``, ``BSRLayout.kv_slots``, ``Variant.position_mask``).
"""

from __future__ import annotations

import types
from types import ModuleType

import numpy as np

import bsrattn as ba
from bsrattn.exercises.checks import case, close, fmt, paged_layout, parts, random_paged, same, seeded

INF = np.inf


def _layout_arrays(layout):
    return layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_last_len


def _check_arrays(got, want, names):
    for value, expected, name in zip(parts(got, len(names), f"({', '.join(names)})"), want, names):
        same(value, expected, name)


# ---- 1-2: the attention state ------------------------------------------------------------------------------------

def page_table(mod: ModuleType) -> None:
    rng = seeded(3)
    cases = [("the statement's three requests", [[0, 3, 5], [1, 2], [4, 6, 7]], [40, 20, 48], 16),
             ("kv_len a multiple of page_size: the last page is full", [[2, 5]], [32], 16),
             ("a request with no tokens between two others", [[3], [], [1, 4]], [5, 0, 17], 16),
             ("page tables longer than the tokens need (pages reserved for tokens to come)",
              [[4, 1, 7, 0], [2, 3]], [17, 3], 16),
             ("page_size 1", [[5, 1, 2], [0]], [3, 1], 1)]
    for i, page_size in enumerate((4, 16, 16)):
        tables, kv_lens = random_paged(rng, 6, page_size, 70, 30, spare=2)
        cases.append((f"random batch {i}: kv_lens {kv_lens}, page_size {page_size}", tables, kv_lens, page_size))
    for name, tables, kv_lens, page_size in cases:
        layout = paged_layout(tables, kv_lens, page_size, 1 + max((p for t in tables for p in t), default=0))
        with case(f"{name}: page_tables {fmt(tables)}, kv_lens {kv_lens}, page_size {page_size}"):
            got = mod.page_table_to_bsr([list(t) for t in tables], list(kv_lens), page_size)
            _check_arrays(got, _layout_arrays(layout)[1:], ("kv_indptr", "kv_indices", "kv_last_len"))


def ragged(mod: ModuleType) -> None:
    rng = seeded(4)
    cases = [("the statement's batch: a prefill, a decode, an append", [3, 1, 2], [3, 4, 2]),
             ("a single query over a single key", [1], [1]),
             ("a request with no keys", [2, 1], [0, 5]),
             ("a request with no queries", [0, 2], [3, 3])]
    for i in range(2):
        kv = rng.integers(0, 40, 5)
        qo = np.minimum(rng.integers(0, 12, 5), kv)
        cases.append((f"random batch {i}", qo.tolist(), kv.tolist()))
    for name, qo_lens, kv_lens in cases:
        with case(f"{name}: qo_lens {qo_lens}, kv_lens {kv_lens}"):
            got = mod.ragged_layout(list(qo_lens), list(kv_lens))
            _check_arrays(got, _layout_arrays(ba.layouts.ragged(qo_lens, kv_lens)),
                          ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len"))


def pool_slot(mod: ModuleType) -> None:
    rng = seeded(5)
    layouts = [("the statement's row: Bc 4, blocks [7, 2], kv_len 7", paged_layout([[7, 2]], [7], 4, 8)),
               ("a quest layout: one row per KV head, block = page * Hkv + head",
                ba.layouts.quest([[4, 1, 3, 0]], [60], [[[0, 3], [1, 3]]], page_size=16, num_pages=5, num_kv_heads=2)),
               ("a vector-sparse row, Bc 1", ba.layouts.vector_sparse([[9, 2, 5, 11]], [1], num_slots=16))]
    for i in range(2):
        tables, kv_lens = random_paged(rng, 4, 8, 50, 20)
        layouts.append((f"random paged batch {i}, Bc 8, kv_lens {kv_lens}", paged_layout(tables, kv_lens, 8, 20)))
    for name, layout in layouts:
        indptr, indices, bc = layout.kv_indptr.copy(), layout.kv_indices.copy(), layout.block_size
        for r in range(layout.num_rows):
            want = layout.kv_slots(r)
            if not want.size:
                continue
            with case(f"{name}: row {r}, i = arange({want.size}), kv_indptr {fmt(indptr)}, "
                      f"kv_indices {fmt(indices)}"):
                same(mod.pool_slot(indptr, indices, bc, r, np.arange(want.size)), want, "pool slot")
            i = int(rng.integers(0, want.size))
            with case(f"{name}: row {r}, i = {i} (an int)"):
                same(mod.pool_slot(indptr, indices, bc, r, i), want[i], "pool slot")


def causal_mask(mod: ModuleType) -> None:
    cases = [("the statement's append", 3, 7), ("a decode: one query", 1, 5), ("a prefill", 4, 4),
             ("more queries than keys: the first see nothing", 5, 2), ("no queries", 0, 3), ("no keys", 2, 0),
             ("one query, one key", 1, 1), ("a longer append", 6, 13)]
    for name, qo_len, kv_len in cases:
        with case(f"{name}: qo_len {qo_len}, kv_len {kv_len}"):
            same(mod.causal_mask(qo_len, kv_len), ba.Variant(causal=True).position_mask(qo_len, kv_len), "mask")


def sliding_window(mod: ModuleType) -> None:
    cases = [("the statement's window", 2, 6, 2, True), ("window_left 0: the query's own key", 3, 8, 0, True),
             ("window_left -1: no window, causal only", 4, 9, -1, True),
             ("a window without causality: later keys stay visible", 3, 7, 2, False),
             ("a window longer than the row", 2, 5, 10, True), ("more queries than keys", 5, 3, 1, True),
             ("neither window nor causality", 2, 4, -1, False), ("a decode", 1, 12, 4, True)]
    for name, qo_len, kv_len, window_left, causal in cases:
        with case(f"{name}: qo_len {qo_len}, kv_len {kv_len}, window_left {window_left}, causal {causal}"):
            want = ba.Variant(causal=causal, window_left=window_left).position_mask(qo_len, kv_len)
            same(mod.window_mask(qo_len, kv_len, window_left, causal), want, "mask")


def cascade(mod: ModuleType) -> None:
    rng = seeded(8)
    cases = [("the statement's cascade", [1, 2], [0, 1], 20, [[2], [3]], [5, 9], 16),
             ("a prefix of whole pages, three decodes", [1, 1, 1], [4, 0], 32, [[1], [2, 5], [3]], [7, 20, 1], 16),
             ("a request whose suffix is empty", [2, 1], [0], 10, [[], [1]], [0, 6], 16),
             ("no prefix at all", [1, 1], [], 0, [[0], [1]], [3, 4], 8)]
    pool = rng.permutation(40).tolist()
    cases.append(("a random cascade", [3, 1, 2, 1], pool[:5], 37, [pool[5 + 3 * b:8 + 3 * b] for b in range(4)],
                  [9, 17, 0, 24], 8))
    names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len")
    for name, qo_lens, prefix_pages, prefix_len, suffix_tables, suffix_lens, page_size in cases:
        levels = ba.layouts.shared_prefix(qo_lens, prefix_pages, prefix_len, suffix_tables, suffix_lens, page_size,
                                          num_pages=40).levels
        with case(f"{name}: qo_lens {qo_lens}, prefix_pages {prefix_pages}, prefix_len {prefix_len}, "
                  f"suffix_page_tables {suffix_tables}, suffix_lens {suffix_lens}, page_size {page_size}"):
            got = parts(mod.cascade_levels(list(qo_lens), list(prefix_pages), prefix_len,
                                           [list(t) for t in suffix_tables], list(suffix_lens), page_size),
                        2, "(prefix_level, suffix_level)")
            for level, (got_level, want_level) in enumerate(zip(got, levels)):
                _check_arrays(got_level, _layout_arrays(want_level), tuple(f"level {level} {n}" for n in names))


# ---- 9: Quest ----------------------------------------------------------------------------------------------------

def _page_bounds(q, pages, kv_len):
    n_pages, page_size, _ = pages.shape
    bounds = np.empty(n_pages)
    for p in range(n_pages):
        keys = pages[p, :max(0, min(page_size, kv_len - p * page_size))]
        bounds[p] = np.sum(np.maximum(q * keys.min(axis=0), q * keys.max(axis=0)))
    return bounds


def _select_pages(bounds, budget):
    n = len(bounds)
    if n <= budget:
        return list(range(n))
    ranked = sorted(range(n - 1), key=lambda p: -bounds[p])  # stable: ties to the lower page
    return sorted(ranked[:budget - 1]) + [n - 1]


def quest(mod: ModuleType) -> None:
    rng = seeded(9)
    d = 8
    cases = [("3 full pages of 4 slots, kv_len 12", 3, 4, 12), ("a partly filled last page, kv_len 10", 3, 4, 10),
             ("one page", 1, 16, 5), ("13 pages of 16, kv_len 200", 13, 16, 200)]
    for name, n_pages, page_size, kv_len in cases:
        q = rng.standard_normal(d)
        pages = rng.standard_normal((n_pages, page_size, d))
        stale = np.arange(n_pages * page_size).reshape(n_pages, page_size) >= kv_len
        pages[stale] = 1e6 * rng.choice([-1.0, 1.0], size=(int(stale.sum()), d))
        note = ", the slots past kv_len hold stale values of 1e6" if stale.any() else ""
        with case(f"page_bounds: {name}{note}, q {fmt(q)} (of mixed signs)"):
            close(mod.page_bounds(q.copy(), pages.copy(), kv_len), _page_bounds(q, pages, kv_len), "bounds",
                  rtol=1e-12, atol=1e-12)
    selections = [("the statement's bounds", [2.1, 7.9, 0.3, 5.5, 1.0], 3),
                  ("the last page has the lowest bound: kept all the same", [5.0, 4.0, 3.0, 2.0, -9.0], 2),
                  ("budget 1: the last page alone", [3.0, 8.0, 1.0, 0.5], 1),
                  ("a budget of all the pages", [1.0, 3.0, 2.0], 3), ("a budget beyond the pages", [1.0, 3.0], 5),
                  ("ties: equal bounds go to the lower page", [1.0, 2.0, 2.0, 2.0, 0.0, 1.0], 3)]
    selections.append(("20 random bounds, budget 6", np.round(rng.normal(0, 4, 20), 3).tolist(), 6))
    for name, bounds, budget in selections:
        with case(f"select_pages: {name}: bounds {fmt(bounds)}, budget {budget}"):
            same(np.asarray(list(mod.select_pages(np.array(bounds), budget))), _select_pages(bounds, budget),
                 "kept pages")


# ---- 10-14: the online softmax, gather, one block row, splits and merges -----------------------------------------

def gather(mod: ModuleType) -> None:
    rng = seeded(11)
    layouts = [("the statement's row: Bc 4, blocks [2, 0], kv_last_len 3", paged_layout([[2, 0]], [7], 4, 3)),
               ("a partly filled last page, and a page two rows share",
                paged_layout([[1, 3], [3, 0, 2]], [6, 11], 4, 4)),
               ("a row with no blocks", paged_layout([[1], [], [0]], [3, 0, 4], 4, 2)),
               ("a vector-sparse row, Bc 1", ba.layouts.vector_sparse([[9, 2, 5, 11]], [1], num_slots=16))]
    tables, kv_lens = random_paged(rng, 3, 16, 60, 6)
    layouts.append((f"a random paged batch, Bc 16, kv_lens {kv_lens}", paged_layout(tables, kv_lens, 16, 6)))
    for name, layout in layouts:
        x = rng.standard_normal((layout.num_blocks, layout.block_size, 2, 3))
        fields = types.SimpleNamespace(kv_indptr=layout.kv_indptr.copy(), kv_indices=layout.kv_indices.copy(),
                                       kv_last_len=layout.kv_last_len.copy(), block_size=layout.block_size)
        for r in range(layout.num_rows):
            with case(f"{name}: row {r} of kv_indptr {fmt(fields.kv_indptr)}, kv_indices {fmt(fields.kv_indices)}, "
                      f"kv_last_len {fmt(fields.kv_last_len)}; x [{', '.join(map(str, x.shape))}]"):
                same(mod.gather_rows(x.copy(), fields, r), x.reshape(-1, 2, 3)[layout.kv_slots(r)], "gathered rows")


def tree_mask(mod: ModuleType) -> None:
    rng = seeded(21)
    parents = rng.integers(-1, np.arange(10)).tolist()  # node i's parent in -1..i-1
    cases = [("the statement's tree", [-1, 0, 0, 1], 6), ("three nodes behind two committed tokens", [-1, 0, 0], 5),
             ("a chain and nothing committed", [-1, 0, 1, 2], 4), ("a forest of two roots", [-1, -1, 1, 0], 7),
             ("a single node", [-1], 1), ("a random tree of 10 nodes behind 15 tokens", parents, 25)]
    for name, tree, kv_len in cases:
        pages = -(-kv_len // 8)
        want = ba.layouts.tree([tree], [list(range(pages))], [kv_len], page_size=8, num_pages=pages).row_mask(0)
        with case(f"{name}: parents {tree}, kv_len {kv_len}"):
            same(mod.tree_mask(list(tree), kv_len), want, "mask")


def dense_mask(mod: ModuleType) -> None:
    rng = seeded(24)
    tables, kv_lens = random_paged(rng, 3, 4, 14, 12)
    distinct = [rng.permutation(12)[:len(t)].tolist() for t in tables]  # a row that lists a slot twice has no picture
    cases = [("the statement's row", paged_layout([[1]], [3], 4, 2, [2]), True),
             ("a paged batch, not causal", paged_layout(distinct, kv_lens, 4, 12, [2, 1, 3]), False),
             ("the same batch, causal", paged_layout(distinct, kv_lens, 4, 12, [2, 1, 3]), True),
             ("a draft tree: its custom mask", ba.layouts.tree([[-1, 0, 0, 1]], [[2, 0]], [6], 4, 3), False),
             ("a draft tree, causal as well", ba.layouts.tree([[-1, 0, 0, 1]], [[2, 0]], [6], 4, 3), True),
             ("a ragged causal batch with a row of no keys", ba.layouts.ragged([2, 1, 3], [4, 0, 3]), True),
             ("a quest layout", ba.layouts.quest([[4, 1, 3, 0]], [60], [[[0, 3], [1, 3]]], 16, 5, 2), False)]
    for name, layout, causal in cases:
        with case(f"{name}: {layout!r}, qo_lens {layout.qo_lens.tolist()}, kv_lens {layout.kv_lens.tolist()}, "
                  f"kv_indices {fmt(layout.kv_indices)}, causal {causal}"):
            same(mod.dense_mask(layout, causal), layout.to_dense_mask(ba.Variant(causal=causal)), "mask")
