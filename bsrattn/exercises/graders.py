"""The hidden tests: one grader per exercise, each holding the learner's module to the library or a float64 oracle.

A grader runs named cases — a small, readable one first, then the edge cases the statement warns of, then random
inputs from fixed seeds — and stops at the first that fails (:mod:`bsrattn.exercises.checks`). The yardsticks are
the library's own functions wherever it has one (``ba.layouts.*``, ``ba.merge_state``, ``ba.scheduler.plan``,
``ba.Variant.position_mask``, ``BSRLayout.kv_slots``...), so an exercise teaches what bsrattn really computes.
"""

from __future__ import annotations

import math
import os
import warnings
from types import ModuleType

import numpy as np

import bsrattn as ba
from bsrattn import indexing
from bsrattn.exercises.checks import case, close, fmt, paged_layout, parts, random_paged, same, seeded
from bsrattn.reference.microkernel import transform

INF = np.inf


def _lse(s) -> float:
    """The float64 oracle of a row's natural-log LSE."""
    s = np.asarray(s, dtype=np.float64)
    m = s.max(initial=-INF)
    return -INF if m == -INF else float(m + np.log(np.sum(np.exp(s - m))))


def _softmax(s, v):
    """``(o [..., D], lse [...])``, the float64 oracle of attention with scores ``s [..., n]`` over ``v [n, D]``."""
    s = np.asarray(s, dtype=np.float64)
    m = s.max(axis=-1, initial=-INF)
    m_safe = np.where(m == -INF, 0.0, m)
    p = np.exp(s - m_safe[..., None])
    total = p.sum(axis=-1)
    o = np.where((total > 0)[..., None], (p @ v) / np.where(total > 0, total, 1.0)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        return o, m_safe + np.log(total)


def lse(mod: ModuleType) -> None:
    rng = seeded(1)
    rows = [("s = [1.0, 2.0, 3.0]", [1.0, 2.0, 3.0]),
            ("s = [2.5], a single score", [2.5]),
            ("s = [1000.0, 1001.0]: exp(1000.0) overflows float64", [1000.0, 1001.0]),
            ("s = [-1000.0, -1001.0]: exp(-1000.0) underflows to 0", [-1000.0, -1001.0]),
            ("s = [-inf, 0.5, -inf]: two masked keys", [-INF, 0.5, -INF]),
            ("s = [], an empty row", []),
            ("s = [-inf, -inf], every key masked", [-INF, -INF])]
    for n in (7, 64, 300):
        s = rng.normal(0.0, 5.0, n)
        s[rng.random(n) < 0.2] = -INF
        rows.append((f"s = {n} random scores, a fifth masked: {fmt(s)}", s.tolist()))
    for name, s in rows:
        with case(name):
            close(mod.lse(np.array(s, dtype=np.float64)), _lse(s), "lse", rtol=1e-12, atol=1e-12)


def merge(mod: ModuleType) -> None:
    rng = seeded(2)
    d = 4
    pairs = [("lse_a = 0.3, lse_b = -1.2", 0.3, -1.2),
             ("lse_a = lse_b = 2.0", 2.0, 2.0),
             ("lse_a = 800.0, lse_b = 799.5: exp(800.0) overflows without the max shift", 800.0, 799.5),
             ("lse_a = -800.0, lse_b = -801.0: exp(-800.0) underflows without the max shift", -800.0, -801.0)]
    pairs += [(f"random states, lse_a = {a:.3f}, lse_b = {b:.3f}", a, b) for a, b in rng.normal(0.0, 3.0, (4, 2))]
    for name, la, lb in pairs:
        o_a, o_b = rng.standard_normal(d), rng.standard_normal(d)
        want_o, want_s = ba.merge_state(o_a[None, None], np.array([[la]]), o_b[None, None], np.array([[lb]]))
        with case(f"{name}, o_a = {fmt(o_a)}, o_b = {fmt(o_b)}"):
            o, s = parts(mod.merge_state(o_a.copy(), la, o_b.copy(), lb), 2, "(o, lse)")
            close(o, want_o[0, 0], "o", rtol=1e-12, atol=1e-14)
            close(s, want_s[0, 0], "lse", rtol=1e-12, atol=1e-14)
    with case("empty_state(4)"):
        o, s = parts(mod.empty_state(d), 2, "(o, lse)")
        same(o, np.zeros(d), "o")
        same(s, -INF, "lse")
    state, nan = (rng.standard_normal(d), 1.7), np.full(d, np.nan)
    identities = [("s ⊕ empty, the empty state's o all NaN", (*state, nan, -INF), state),
                  ("empty ⊕ s, the empty state's o all NaN", (nan, -INF, *state), state),
                  ("empty ⊕ empty, both o NaN", (nan, -INF, nan, -INF), (np.zeros(d), -INF))]
    for name, args, (want_o, want_s) in identities:
        with case(f"{name}, s = (o {fmt(state[0])}, lse 1.7): the identity, bit for bit"):
            o, s = parts(mod.merge_state(*(a.copy() if isinstance(a, np.ndarray) else a for a in args)), 2, "(o, lse)")
            same(o, want_o, "o")
            same(s, want_s, "lse")
    with case("s ⊕ empty_state(4), s = (o, lse 1.7)"):
        o, s = parts(mod.merge_state(state[0].copy(), state[1], *mod.empty_state(d)), 2, "(o, lse)")
        same(o, state[0], "o")
        same(s, state[1], "lse")


# ---- 3-8: layouts as BSR -----------------------------------------------------------------------------------------

def online_softmax(mod: ModuleType) -> None:
    rng = seeded(10)
    d = 4

    def run(s, v, sizes):
        state = (-INF, 0.0, np.zeros(d))
        cuts = np.cumsum([0, *sizes])
        for a, b in zip(cuts[:-1], cuts[1:]):
            state = mod.softmax_step(state, s[a:b].copy(), v[a:b].copy())
        return parts(mod.finish(state), 2, "(o, lse)")

    ascending = np.sort(rng.normal(0, 2, 12)) + np.repeat([0.0, 3.0, 6.0], 4)
    masked_first = np.concatenate([np.full(4, -INF), rng.normal(0, 1, 6)])
    random = rng.normal(0, 3, 50)
    random[rng.random(50) < 0.2] = -INF
    cases = [("one tile of 6 keys", rng.normal(0, 1, 6), [6]),
             ("three tiles whose maxima grow: the old state must shrink", ascending, [4, 4, 4]),
             ("a first tile of masked keys (-inf): m stays -inf until a key is visible", masked_first, [4, 6]),
             ("an empty tile (no keys) between two others", rng.normal(0, 1, 7), [3, 0, 4]),
             ("scores near 1000: exp overflows without the shift", 1000 + rng.normal(0, 1, 8), [3, 5]),
             ("every key masked: the empty state, o = 0, lse = -inf", np.full(6, -INF), [2, 4]),
             ("no tile at all", np.zeros(0), []),
             ("50 random scores, a fifth masked, in tiles of 7", random, [7] * 7 + [1])]
    for name, s, sizes in cases:
        v = rng.standard_normal((s.size, d))
        with case(f"{name}: s {fmt(s)}, tiles of {sizes}"):
            o, lse_ = run(s, v, sizes)
            want_o, want_lse = _softmax(s, v)
            close(o, want_o, "o", rtol=1e-10, atol=1e-12)
            close(lse_, want_lse, "lse", rtol=1e-10, atol=1e-12)


def block_row(mod: ModuleType) -> None:
    rng = seeded(12)
    heads, d = 2, 8
    cases = [("a decode row: 1 query over 20 keys in pages of 4", paged_layout([[3, 0, 4, 1, 2]], [20], 4, 5), 0,
              False, 8),
             ("a causal append: 3 queries after 9 cached keys", paged_layout([[1, 2, 0]], [12], 4, 3, [3]), 0, True,
              4),
             ("causal, more queries than keys: the first see nothing (o = 0, lse = -inf)",
              paged_layout([[0]], [3], 4, 1, [5]), 0, True, 4),
             ("a row with no keys", paged_layout([[0], []], [4, 0], 4, 1, [1, 2]), 1, False, 4),
             ("tile_kv 1", paged_layout([[1, 0]], [7], 4, 2, [2]), 0, True, 1),
             ("tile_kv longer than the row", paged_layout([[1, 0]], [7], 4, 2, [2]), 0, True, 64)]
    tables, kv_lens = random_paged(rng, 3, 16, 70, 12)
    batch = paged_layout(tables, kv_lens, 16, 12, [int(n) for n in rng.integers(1, 6, 3)])
    cases += [(f"a random batch, row {r}, causal", batch, r, True, 16) for r in range(3)]
    for name, layout, r, causal, tile_kv in cases:
        q = rng.standard_normal((layout.nnz_qo, heads, d))
        k, v = rng.standard_normal((2, layout.num_blocks, layout.block_size, heads, d))
        want_o, want_lse = ba.attention(q, k, v, layout, variant=ba.Variant(causal=causal), backend="reference",
                                        return_lse=True)
        rows = slice(int(layout.qo_indptr[r]), int(layout.qo_indptr[r + 1]))
        with case(f"{name}: row {r}, qo_len {layout.qo_lens[r]}, kv_len {layout.kv_lens[r]}, causal {causal}, "
                  f"tile_kv {tile_kv}, H {heads}, D {d}"):
            o, lse_ = parts(mod.attend_row(q[rows].copy(), k.copy(), v.copy(), layout, r, causal, tile_kv), 2,
                            "(o, lse)")
            close(o, want_o[rows], "o", rtol=1e-9, atol=1e-12)
            close(lse_, want_lse[rows], "lse", rtol=1e-9, atol=1e-12)


def split_merge(mod: ModuleType) -> None:
    rng = seeded(13)
    n, heads, d = 2, 2, 4
    cases = [("kv_len 40, chunk 16: chunks 0:16, 16:32, 32:40", 40, 16),
             ("kv_len 48, chunk 16: no empty last chunk", 48, 16),
             ("a chunk longer than the row", 10, 64), ("chunk 1", 5, 1), ("a row with no keys", 0, 8),
             ("kv_len 333, chunk 37: nine chunks, whose fold order shows in the bits", 333, 37)]
    for name, kv_len, chunk in cases:
        q = rng.standard_normal((n, heads, d))
        k, v = 2 * rng.standard_normal((2, kv_len, heads, d))
        calls = []

        def state(kv_start, kv_end, q=q, k=k, v=v):
            keys = slice(kv_start, kv_end)
            return ba.attention(q, k[keys], v[keys], ba.layouts.dense(n, kv_end - kv_start), backend="reference",
                                return_lse=True)

        def state_of(kv_start, kv_end, state=state, calls=calls):
            calls.append((int(kv_start), int(kv_end)))
            return state(int(kv_start), int(kv_end))

        chunks = [(s, min(s + chunk, kv_len)) for s in range(0, kv_len, chunk)] or [(0, 0)]
        o_w, lse_w = state(*chunks[0])
        for a, b in chunks[1:]:
            o_w, lse_w = ba.merge_state(o_w, lse_w, *state(a, b))
        with case(f"{name} ({n} queries, H {heads}, D {d})"):
            o, lse_ = parts(mod.split_merge(state_of, kv_len, chunk), 2, "(o, lse)")
            if calls != chunks:
                same(np.array(calls).reshape(-1, 2), np.array(chunks), "the (kv_start, kv_end) of the state_of calls")
            same(o, o_w, "o (bit for bit, against the left-to-right fold with ba.merge_state)")
            same(lse_, lse_w, "lse (bit for bit, against the left-to-right fold with ba.merge_state)")


def plan_merges(mod: ModuleType) -> None:
    rng = seeded(14)
    heads, d = 2, 4
    cases = [("four chunks of one decode row, and an unsplit row", [1, 1], [100, 10], dict(num_ctas=4)),
             ("query tiles of 2 rows, split over 6 CTAs", [5, 1, 3], [70, 40, 9], dict(num_ctas=6, tile_q=2)),
             ("fixed_split_size 16", [1, 1, 1], [50, 3, 33], dict(num_ctas=3, fixed_split_size=16)),
             ("a plan that splits nothing", [2, 1], [30, 8], dict(num_ctas=2, disable_split_kv=True))]
    for name, qo_lens, kv_lens, options in cases:
        plan = ba.scheduler.plan(qo_lens, kv_lens, **options)
        part_o = rng.standard_normal((plan.num_partial_rows, heads, d))
        part_lse = rng.normal(0, 3, (plan.num_partial_rows, heads))
        part_lse[rng.random(part_lse.shape) < 0.15] = -INF  # chunks that saw no key: empty states
        out = rng.standard_normal((sum(qo_lens), heads, d))
        lse_ = rng.normal(0, 3, (sum(qo_lens), heads))
        want_o, want_lse = out.copy(), lse_.copy()
        for m in range(plan.num_merges):
            qs, qe = int(plan.merge_qo_start[m]), int(plan.merge_qo_end[m])
            first, *rest = plan.merge_partials[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]
            o, s = part_o[first:first + qe - qs], part_lse[first:first + qe - qs]
            for p in rest:
                o, s = ba.merge_state(o, s, part_o[p:p + qe - qs], part_lse[p:p + qe - qs])
            want_o[qs:qe], want_lse[qs:qe] = o, s
        with case(f"{name}: plan(qo_lens={qo_lens}, kv_lens={kv_lens}, {fmt(options)}): merges {plan.num_merges}, "
                  f"partials {plan.merge_partials.size}"):
            got = parts(mod.merge_plan(plan, part_o.copy(), part_lse.copy(), out.copy(), lse_.copy()), 2,
                        "(out, lse)")
            same(got[0], want_o, "out (bit for bit, against the plan-order fold with ba.merge_state)")
            same(got[1], want_lse, "lse (bit for bit, against the plan-order fold with ba.merge_state)")


# ---- 15-18: the scheduler, its cost, read amplification, the chunk grid ------------------------------------------

def lpt_plan(mod: ModuleType) -> None:
    rng = seeded(15)
    cases = [("the statement's example", [1, 1], [100, 10], 4, 1),
             ("eight equal decode rows on 3 CTAs: ties everywhere", [1] * 8, [64] * 8, 3, 1),
             ("a prefill in tiles of 4 beside two decodes", [10, 1, 1], [30, 200, 7], 5, 4),
             ("a row with no keys, and one with no queries", [2, 0, 1], [0, 50, 20], 3, 1),
             ("one CTA", [1, 3], [20, 9], 1, 2), ("more CTAs than items", [1, 1], [5, 3], 16, 1)]
    kv = np.clip(rng.lognormal(5.0, 1.0, 12), 1, 2000).astype(int)
    cases.append(("a random batch of 12 rows", rng.integers(1, 20, 12).tolist(), kv.tolist(), 10, 4))
    for name, qo_lens, kv_lens, num_ctas, tile_q in cases:
        plan = ba.scheduler.plan(qo_lens, kv_lens, num_ctas=num_ctas, tile_q=tile_q)
        columns = (plan.item_row, plan.item_qo_start, plan.item_qo_end, plan.item_kv_start, plan.item_kv_end)
        owner = np.repeat(np.arange(plan.num_ctas), np.diff(plan.cta_indptr))
        order = np.lexsort((plan.item_kv_start, plan.item_qo_start, plan.item_row))  # (row, tile, chunk) order
        items = np.stack(columns, axis=1)[order].astype(np.int64)
        args = f"qo_lens {qo_lens}, kv_lens {kv_lens}, num_ctas {num_ctas}, tile_q {tile_q}"
        with case(f"{name}: chunk_size for {args}"):
            same(mod.chunk_size(list(qo_lens), list(kv_lens), num_ctas, tile_q), plan.kv_chunk_size, "L_kv")
        with case(f"{name}: work_items for {args}, chunk {plan.kv_chunk_size}"):
            got = [tuple(int(x) for x in item) for item in mod.work_items(list(qo_lens), list(kv_lens), tile_q,
                                                                           plan.kv_chunk_size)]
            same(np.array(got, dtype=np.int64).reshape(-1, 5), items, "items (row, qo_start, qo_end, kv_start, kv_end)")
        costs = (items[:, 2] - items[:, 1] + items[:, 4] - items[:, 3]).tolist()
        with case(f"{name}: assign(costs {fmt(costs)}, num_ctas {num_ctas})"):
            same(np.asarray(list(mod.assign(list(costs), num_ctas))), owner[order], "the CTA of each item")


def makespan(mod: ModuleType) -> None:
    rng = seeded(16)
    kv = np.clip(rng.lognormal(6.0, 0.8, 20), 16, 8000).astype(int).tolist()
    cases = [("the statement's plan", ba.scheduler.plan([1, 1], [100, 10], num_ctas=4)),
             ("its round robin", ba.scheduler.round_robin([1, 1], [100, 10], num_ctas=4)),
             ("20 lognormal decode rows on 8 CTAs, Algorithm 1", ba.scheduler.plan([1] * 20, kv, num_ctas=8)),
             ("the same rows, round robin", ba.scheduler.round_robin([1] * 20, kv, num_ctas=8)),
             ("one CTA", ba.scheduler.plan([3, 1], [40, 9], num_ctas=1, tile_q=2)),
             ("more CTAs than items: idle CTAs", ba.scheduler.plan([1], [5], num_ctas=6))]
    for name, plan in cases:
        costs = plan.item_cost.tolist()
        with case(f"{name}: makespan of a plan with cta_indptr {fmt(plan.cta_indptr)}, item_cost {fmt(costs)}"):
            got = mod.makespan(plan)
            close(got, ba.scheduler.makespan(plan), "makespan", rtol=0.0, atol=0.0)
        with case(f"{name}: lower_bound(costs {fmt(costs)}, num_ctas {plan.num_ctas})"):
            bound = mod.lower_bound(list(costs), plan.num_ctas)
            close(bound, max(sum(costs) / plan.num_ctas, max(costs, default=0)), "lower bound", rtol=1e-12, atol=0.0)
    with case("lower_bound of no items"):
        close(mod.lower_bound([], 4), 0.0, "lower bound")


def read_amplification(mod: ModuleType) -> None:
    rng = seeded(17)
    scattered = (np.arange(64) * 64).tolist()
    cases = [("the paper's: 64 pages of 16 scattered over a 32k context, B 128",
              paged_layout([scattered], [1024], 16, 4096), 128),
             ("the same at B 16", paged_layout([scattered], [1024], 16, 4096), 16),
             ("a partly filled last page, B 8", paged_layout([[5, 2]], [20], 16, 8), 8),
             ("a page two rows need: counted for each", paged_layout([[3], [3, 1]], [16, 20], 16, 4), 32),
             ("a row with no keys", paged_layout([[1], []], [9, 0], 16, 2), 64),
             ("a ragged batch (contiguous), B 64", ba.layouts.ragged([1, 1, 1], [70, 5, 100]), 64),
             ("B 1: read = needed", paged_layout([[2, 0, 1]], [40], 16, 3), 1)]
    tokens = [np.sort(rng.choice(4096, 50, replace=False)).tolist() for _ in range(3)]
    cases.append(("vector-sparse rows of 50 scattered tokens, B 16",
                  ba.layouts.vector_sparse(tokens, [1, 1, 1], num_slots=4096), 16))
    for name, layout, block in cases:
        amp = layout.read_amplification(block)
        with case(f"{name}: kv_lens {fmt(layout.kv_lens)}, kv_indices {fmt(layout.kv_indices)}, "
                  f"block_size {layout.block_size}, kernel_block_size {block}"):
            got = parts(mod.read_amplification(layout, block), 2, "(needed, read)")
            same(got[0], amp.needed, "needed")
            same(got[1], amp.read, "read")


def chunk_grid(mod: ModuleType) -> None:
    def plan_cuts(kv_len, size, others, num_ctas):
        plan = ba.scheduler.plan([1] * (1 + len(others)), [kv_len, *others], num_ctas=num_ctas, fixed_split_size=size)
        mine = plan.item_row == 0
        return sorted(zip(plan.item_kv_start[mine].tolist(), plan.item_kv_end[mine].tolist()))

    rows = [("KV 0:150", 150, 64), ("KV 0:128, the row ends on the grid", 128, 64),
            ("KV 0:30, shorter than one chunk", 30, 64), ("KV 0:0, a row with no keys", 0, 64),
            ("KV 0:1000, split_size 128", 1000, 128)]
    for name, kv_len, size in rows:
        want = plan_cuts(kv_len, size, [999, 7, 300], 9)
        with case(f"{name}, split_size {size}: plan(..., fixed_split_size={size}) cuts it at {want}, whatever "
                  f"the batch"):
            same(np.array(list(mod.grid_chunks(0, kv_len, size))).reshape(-1, 2), np.array(want), "chunks")
    pieces = [("a piece of a row, KV 100:150", 100, 150, 64),
              ("a piece that starts on the grid, KV 128:300", 128, 300, 64),
              ("a piece inside one chunk, KV 70:90", 70, 90, 64), ("an empty piece, KV 70:70", 70, 70, 64),
              ("a piece ending on the grid, KV 10:192", 10, 192, 64)]
    for name, start, end, size in pieces:
        cuts = [start, *range((start // size + 1) * size, end, size), end]
        want = list(zip(cuts[:-1], cuts[1:])) if end > start else [(start, start)]
        with case(f"{name}, split_size {size}"):
            same(np.array(list(mod.grid_chunks(start, end, size))).reshape(-1, 2), np.array(want), "chunks")


# ---- 19-20: one tile of a GPU kernel, in a simulator -------------------------------------------------------------

def numba_tile(mod: ModuleType) -> None:
    from numba import cuda

    rng = seeded(19)
    nq, d, tile = 3, 8, 8
    grow = np.sort(rng.normal(0, 1, (nq, 3 * tile)), axis=1) + np.repeat([0.0, 2.0, 4.0], tile)[None, :]
    first_masked = rng.normal(0, 1, (nq, 2 * tile))
    first_masked[:, :tile] = -INF
    one_row_masked = rng.normal(0, 1, (nq, 2 * tile))
    one_row_masked[1] = -INF
    cases = [("one tile", rng.normal(0, 1, (nq, tile))),
             ("three tiles whose maxima grow: the old state must shrink", grow),
             ("a first tile where every key is masked (-inf)", first_masked),
             ("query row 1 sees no key in any tile: o = 0, lse = -inf", one_row_masked),
             ("scores near 500, four tiles", 500 + rng.normal(0, 1, (nq, 4 * tile)))]
    for name, s in cases:
        v = rng.standard_normal((s.shape[1], d))
        with case(f"{name}: online_softmax_tile[{nq}, {d}](s, v, m, l, acc) over tiles of {tile} keys"):
            state = [cuda.to_device(x) for x in (np.full(nq, -INF), np.zeros(nq), np.zeros((nq, d)))]
            with warnings.catch_warnings():  # a grid of 3 blocks is the point here, not a GPU's occupancy
                warnings.filterwarnings("ignore", message=".*under-utilization")
                for t in range(0, s.shape[1], tile):
                    mod.online_softmax_tile[nq, d](cuda.to_device(np.ascontiguousarray(s[:, t:t + tile])),
                                                   cuda.to_device(np.ascontiguousarray(v[t:t + tile])), *state)
            m, l, acc = (x.copy_to_host() for x in state)
            seen = l > 0
            o = np.where(seen[:, None], acc / np.where(seen, l, 1.0)[:, None], 0.0)
            with np.errstate(divide="ignore"):
                lse_ = m + np.log(l)
            want_o, want_lse = _softmax(s, v)
            close(o, want_o, "o = acc / l", rtol=1e-9, atol=1e-12)
            close(np.where(seen, lse_, -INF), want_lse, "lse = m + log(l)", rtol=1e-9, atol=1e-12)


def triton_tile(mod: ModuleType) -> None:
    import torch
    import triton

    device = "cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda"
    rng = seeded(20)
    d, block, num_slots = 16, 16, 64

    def tensor(x, dtype=torch.float32):
        return torch.tensor(np.ascontiguousarray(x), dtype=dtype, device=device)

    cases = [("5 queries, 37 keys gathered from a pool of 64 slots (the last tile partly filled)", 5,
              rng.choice(num_slots, 37, replace=False)),
             ("20 queries (two programs, the second partly filled), 16 keys", 20,
              rng.choice(num_slots, 16, replace=False)),
             ("keys in a scrambled order, some slots read twice", 7, rng.integers(0, num_slots, 40)),
             ("no keys: o = 0, lse = -inf", 3, np.zeros(0, np.int64))]
    for name, nq, slots in cases:
        q = rng.standard_normal((nq, d))
        k, v = rng.standard_normal((2, num_slots, d))
        scale = 1 / math.sqrt(d)
        want_o, want_lse = _softmax(q @ k[slots].T * scale, v[slots])
        o = torch.full((nq, d), float("nan"), device=device)
        lse_ = torch.full((nq,), float("nan"), device=device)
        with case(f"{name}: attend_tile[({triton.cdiv(nq, block)},)](..., HEAD_DIM={d}, BLOCK_M={block}, "
                  f"BLOCK_N={block})"):
            mod.attend_tile[(triton.cdiv(nq, block),)](tensor(q), tensor(k), tensor(v), tensor(slots, torch.int32),
                                                       o, lse_, nq, len(slots), scale, HEAD_DIM=d, BLOCK_M=block,
                                                       BLOCK_N=block)
            close(o.cpu().numpy(), want_o, "o", rtol=1e-3, atol=1e-4)
            close(lse_.cpu().numpy(), want_lse, "lse", rtol=1e-3, atol=1e-4)


# ---- 21-24: masks as data, score transforms, GQA, the dense picture ----------------------------------------------

def score_transform(mod: ModuleType) -> None:
    rng = seeded(22)
    k_pos = np.arange(9)
    q_pos = np.array([6, 7, 8])
    cases = [("the scale alone", 0.0, None, 1.0), ("a soft cap of 30, on large products", 30.0, None, 20.0),
             ("ALiBi, slope 0.5", 0.0, 0.5, 1.0), ("the soft cap, then ALiBi", 30.0, 0.25, 20.0),
             ("a soft cap of 5 and a steep ALiBi", 5.0, 2.0, 4.0)]
    for name, cap, slope, spread in cases:
        qk = spread * rng.standard_normal((q_pos.size, k_pos.size))
        variant = ba.Variant(logits_soft_cap=cap, alibi_slopes=None if slope is None else (slope,))
        want = transform(qk[None].copy(), q_pos, k_pos, variant, 0.35)[0]
        with case(f"{name}: soft_cap {cap}, alibi_slope {slope}, sm_scale 0.35, q_pos {q_pos.tolist()}, "
                  f"k_pos {k_pos.tolist()}, qk {fmt(qk)}"):
            close(mod.transform(qk.copy(), q_pos.copy(), k_pos.copy(), 0.35, cap, slope), want, "scores", rtol=1e-12,
                  atol=1e-12)


def gqa(mod: ModuleType) -> None:
    rng = seeded(23)
    for num_qo_heads, num_kv_heads in ((8, 2), (4, 4), (6, 1), (32, 8)):
        group = num_qo_heads // num_kv_heads
        with case(f"kv_head for num_qo_heads {num_qo_heads}, num_kv_heads {num_kv_heads}, every query head"):
            same([mod.kv_head(h, num_qo_heads, num_kv_heads) for h in range(num_qo_heads)],
                 np.arange(num_qo_heads) // group, "KV heads")
    for kv_head, group, num_rows in ((1, 4, 6), (0, 1, 3), (2, 2, 8)):
        rows = np.arange(num_rows)
        with case(f"tile_rows(kv_head {kv_head}, group {group}, num_rows {num_rows})"):
            query, head = parts(mod.tile_rows(kv_head, group, num_rows), 2, "(query, head)")
            same(query, indexing.tile_query(rows, group), "query")
            same(head, indexing.tile_head(kv_head, group, rows), "head")
    for n, num_kv_heads, num_qo_heads in ((5, 2, 8), (3, 4, 4), (2, 1, 3)):
        k = rng.standard_normal((n, num_kv_heads, 3))
        with case(f"expand_kv of k [{n}, {num_kv_heads}, 3] to {num_qo_heads} query heads"):
            got = mod.expand_kv(k.copy(), num_qo_heads)
            same(got, k[:, np.arange(num_qo_heads) // (num_qo_heads // num_kv_heads)], "expanded k")


# ---- 25: multi-head latent attention ----------------------------------------------------------------------------

def _mla(q_nope, q_pe, ckv, kpe, layout) -> np.ndarray:
    """``o [nnz_qo, H, Dc]``, the float64 oracle of MLA over ``layout`` (no causal mask): each query's slots scored by
    both dot products, weighting ``ckv`` itself."""
    ckv, kpe = ckv.reshape(-1, ckv.shape[-1]), kpe.reshape(-1, kpe.shape[-1])
    scale = 1 / math.sqrt(ckv.shape[-1] + kpe.shape[-1])
    o = np.zeros(q_nope.shape)
    for r in range(layout.num_rows):
        slots = layout.kv_slots(r)
        for row in range(int(layout.qo_indptr[r]), int(layout.qo_indptr[r + 1])):
            s = scale * (q_nope[row] @ ckv[slots].T + q_pe[row] @ kpe[slots].T)       # [H, kv_len]
            o[row] = _softmax(s, ckv[slots])[0]
    return o


def mla_as_attention(mod: ModuleType) -> None:
    rng = seeded(25)
    cases = [("2 decode requests over pages of 4, H 4, Dc 8, Dr 4",
              ba.layouts.paged([1, 1], [[2, 0], [1]], [7, 3], page_size=4, num_pages=3), 4, 8, 4),
             ("a ragged batch (block size 1: ckv [slots, Dc]), rows of 2 and 3 queries, H 6, Dc 16, Dr 8",
              ba.layouts.ragged([2, 3], [9, 5]), 6, 16, 8),
             ("3 requests over scattered pages of 8, one page shared, H 8, Dc 32, Dr 8",
              ba.layouts.paged([1, 2, 1], [[4, 1], [3], [1, 0, 2]], [13, 6, 20], page_size=8, num_pages=5), 8, 32, 8)]
    for name, layout, num_heads, dc, dr in cases:
        pool = (layout.num_blocks,) if layout.block_size == 1 else (layout.num_blocks, layout.block_size)
        q_nope = rng.standard_normal((layout.nnz_qo, num_heads, dc))
        q_pe = rng.standard_normal((layout.nnz_qo, num_heads, dr))
        ckv, kpe = rng.standard_normal(pool + (dc,)), rng.standard_normal(pool + (dr,))
        args = tuple(x.copy() for x in (q_nope, q_pe, ckv, kpe))
        with case(f"{name}: mla_as_attention(q_nope {q_nope.shape}, q_pe {q_pe.shape}, ckv {ckv.shape}, "
                  f"kpe {kpe.shape})"):
            q, k, v = (np.asarray(x) for x in parts(mod.mla_as_attention(*args), 3, "(q, k, v)"))
            same(q.shape, (layout.nnz_qo, num_heads, dc + dr), "q's shape")
            same(k.shape, pool + (1, dc + dr), "k's shape (one KV head, keys of Dc + Dr)")
            same(v.shape, pool + (1, dc), "v's shape (one KV head, values of Dc: ckv, not ckv ⊕ kpe)")
            close(ba.attention(q, k, v, layout), _mla(q_nope, q_pe, ckv, kpe, layout),
                  "ba.attention(q, k, v, layout) against MLA's formula", rtol=1e-10, atol=1e-12)
            same(v[..., 0, :], ckv, "v (ckv itself)")
            same(k[..., 0, :dc], ckv, "k's first Dc columns (ckv first, then kpe)")
            same(k[..., 0, dc:], kpe, "k's last Dr columns (kpe)")
            same(q, np.concatenate([q_nope, q_pe], axis=-1), "q (q_nope first, then q_pe: in the key's order)")
