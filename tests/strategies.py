"""Hypothesis strategies: random layouts of every constructor, with the raw inputs they were built from.

Every layout strategy draws a :class:`LayoutCase`: the constructor's raw arguments (page tables, token
lists, tree parents…), the layout built from them, and how the KV pool is stored. Tests recompute what the
layout means from ``case.raw`` alone (see ``helpers.py``), never through ``BSRLayout`` methods.

Sizes stay small (tens of keys, head_dim 4-16, at most 4 query heads) so the numba CUDA simulator, which
runs each CUDA thread as a Python thread, and the Triton interpreter can run the same draws.

``EDGE_CASES`` names the corners a random draw might miss (STYLE.md item 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import bsrattn as ba

MAX_KEYS = 40


@dataclass(frozen=True)
class LayoutCase:
    """A layout and the raw inputs its constructor was called with.

    ``kv_pool`` says how the raw ``k``/``v`` pool is stored: ``"flat"`` ``[num_slots, Hkv, D]``,
    ``"NHD"`` ``[num_blocks, block_size, Hkv, D]``, ``"HND"`` ``[num_blocks, Hkv, block_size, D]``, or
    ``"quest"`` (HND ``[num_pages, Hkv, page_size, D]``, called through ``per_head_views``).
    ``num_kv_heads`` is fixed by the layout for Quest (its rows are per KV head), else None.
    """

    kind: str
    raw: dict
    layout: object
    kv_pool: str = "NHD"
    num_kv_heads: int | None = None

    @property
    def block_size(self) -> int:
        levels = getattr(self.layout, "levels", (self.layout,))
        return levels[0].block_size

    @property
    def supports_positions(self) -> bool:
        """Whether ALiBi and sliding windows apply: a Cascade and Quest's per-head views reject or hide them."""
        return self.kind not in ("shared_prefix", "quest")

    @property
    def supports_rope(self) -> bool:
        """Whether fused RoPE applies: a Cascade turns at positions in the whole sequence; Quest's per-head views
        hide the positions."""
        return self.kind != "quest"


@dataclass(frozen=True)
class Problem:
    """One attention problem: a layout case, head counts, head_dim and a variant."""

    case: LayoutCase
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    variant: ba.Variant
    seed: int = 0


# ---- building blocks ----------------------------------------------------------------------------------

def _pages_needed(kv_len, page_size):
    return -(-kv_len // page_size)


@st.composite
def _page_table(draw, n_pages, num_pages, extra=True):
    """``n_pages`` distinct pool pages in random order, sometimes with unused trailing entries."""
    table = draw(st.permutations(range(num_pages)))[:n_pages]
    if extra and draw(st.booleans()):
        table = table + draw(st.lists(st.integers(0, num_pages - 1), max_size=2))
    return list(table)


# ---- one strategy per constructor ---------------------------------------------------------------------

@st.composite
def ragged_cases(draw):
    batch = draw(st.integers(1, 4))
    kv_lens = draw(st.lists(st.integers(0, 16), min_size=batch, max_size=batch))
    qo_lens = draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    raw = dict(qo_lens=qo_lens, kv_lens=kv_lens)
    return LayoutCase("ragged", raw, ba.layouts.ragged(**raw), "flat")


@st.composite
def dense_cases(draw):
    raw = dict(qo_len=draw(st.integers(0, 6)), kv_len=draw(st.integers(0, 24)))
    return LayoutCase("dense", raw, ba.layouts.dense(**raw), "flat")


@st.composite
def paged_cases(draw):
    """Pages in any order, shared between requests at times (drawn from a small pool), Bc=1 included."""
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    batch = draw(st.integers(1, 4))
    max_len = min(MAX_KEYS, 8 * page_size)
    kv_lens = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    qo_lens = draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
    n_pages = [_pages_needed(n, page_size) for n in kv_lens]
    num_pages = max(n_pages + [1]) + draw(st.integers(0, 3))
    tables = [draw(_page_table(n, num_pages)) for n in n_pages]
    raw = dict(qo_lens=qo_lens, page_tables=tables, kv_lens=kv_lens, page_size=page_size, num_pages=num_pages)
    return LayoutCase("paged", raw, ba.layouts.paged(**raw), draw(st.sampled_from(["NHD", "HND"])))


@st.composite
def block_sparse_cases(draw, with_mask=None):
    R, C = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, max(1, MAX_KEYS // (2 * C))))
    per_row = [draw(st.permutations(range(cols)))[:draw(st.integers(0, cols))] for _ in range(rows)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in per_row])]).tolist()
    indices = [c for r in per_row for c in r]
    if with_mask is None:
        with_mask = draw(st.booleans())
    mask = None
    if with_mask:
        bits = draw(st.lists(st.booleans(), min_size=len(indices) * R * C, max_size=len(indices) * R * C))
        mask = np.array(bits, dtype=bool).reshape(len(indices), R, C)
    raw = dict(indptr=indptr, indices=indices, M=rows * R, N=cols * C, R=R, C=C, mask=mask)
    return LayoutCase("block_sparse", raw, ba.layouts.block_sparse(**raw), "flat")


@st.composite
def vector_sparse_cases(draw):
    num_slots = draw(st.integers(1, MAX_KEYS))
    batch = draw(st.integers(1, 3))
    tokens = [draw(st.permutations(range(num_slots)))[:draw(st.integers(0, min(num_slots, 16)))]
              for _ in range(batch)]
    qo_lens = draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
    raw = dict(token_indices=tokens, qo_lens=qo_lens, num_slots=num_slots)
    return LayoutCase("vector_sparse", raw, ba.layouts.vector_sparse(**raw), "flat")


@st.composite
def quest_cases(draw):
    """Decode with per-KV-head page selection; the partial last page is sometimes selected."""
    page_size = draw(st.sampled_from([2, 4, 8]))
    num_kv_heads = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    kv_lens = draw(st.lists(st.integers(0, 5 * page_size), min_size=batch, max_size=batch))
    n_pages = [_pages_needed(n, page_size) for n in kv_lens]
    num_pages = max(n_pages + [1]) + draw(st.integers(0, 2))
    tables = [draw(_page_table(n, num_pages)) for n in n_pages]
    selected = [[sorted(draw(st.permutations(range(n)))[:draw(st.integers(0, n))]) for _ in range(num_kv_heads)]
                for n in n_pages]
    raw = dict(page_tables=tables, kv_lens=kv_lens, selected_pages=selected, page_size=page_size,
               num_pages=num_pages, num_kv_heads=num_kv_heads)
    return LayoutCase("quest", raw, ba.layouts.quest(**raw), "quest", num_kv_heads)


@st.composite
def tree_cases(draw):
    page_size = draw(st.sampled_from([1, 4, 8]))
    batch = draw(st.integers(1, 3))
    parents, kv_lens = [], []
    for _ in range(batch):
        n = draw(st.integers(0, 6))
        parents.append([draw(st.integers(-1, i - 1)) for i in range(n)])
        kv_lens.append(draw(st.integers(0, 16)) + n)
    n_pages = [_pages_needed(n, page_size) for n in kv_lens]
    num_pages = max(n_pages + [1]) + draw(st.integers(0, 2))
    tables = [draw(_page_table(n, num_pages)) for n in n_pages]
    raw = dict(parents=parents, page_tables=tables, kv_lens=kv_lens, page_size=page_size, num_pages=num_pages)
    return LayoutCase("tree", raw, ba.layouts.tree(**raw), "NHD")


@st.composite
def shared_prefix_cases(draw):
    """A shared prefix then per-request suffixes; queries are the suffixes' last tokens (qo_len <= suffix_len)."""
    page_size = draw(st.sampled_from([1, 4, 8]))
    prefix_len = draw(st.integers(0, 24))
    batch = draw(st.integers(1, 3))
    suffix_lens = draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch))
    qo_lens = [draw(st.integers(0, min(n, 4))) for n in suffix_lens]
    n_prefix = _pages_needed(prefix_len, page_size)
    n_suffix = [_pages_needed(n, page_size) for n in suffix_lens]
    num_pages = n_prefix + sum(n_suffix) + draw(st.integers(0, 2))
    pool = draw(st.permutations(range(num_pages)))
    prefix_pages, rest = pool[:n_prefix], pool[n_prefix:]
    tables = []
    for n in n_suffix:
        tables.append(rest[:n])
        rest = rest[n:]
    raw = dict(qo_lens=qo_lens, prefix_pages=prefix_pages, prefix_len=prefix_len, suffix_page_tables=tables,
               suffix_lens=suffix_lens, page_size=page_size, num_pages=num_pages)
    return LayoutCase("shared_prefix", raw, ba.layouts.shared_prefix(**raw), "NHD")


LAYOUT_STRATEGIES = {
    "dense": dense_cases(),
    "ragged": ragged_cases(),
    "paged": paged_cases(),
    "block_sparse": block_sparse_cases(),
    "vector_sparse": vector_sparse_cases(),
    "quest": quest_cases(),
    "tree": tree_cases(),
    "shared_prefix": shared_prefix_cases(),
}


def layout_cases(kinds=None):
    """Any layout case, or one of ``kinds``."""
    kinds = sorted(LAYOUT_STRATEGIES) if kinds is None else kinds
    return st.one_of([LAYOUT_STRATEGIES[k] for k in kinds])


# ---- heads and variants -------------------------------------------------------------------------------

@st.composite
def head_configs(draw, num_kv_heads=None, max_qo_heads=4):
    """``(num_qo_heads, num_kv_heads)`` with ``num_qo_heads % num_kv_heads == 0`` (GQA ratio 1, 2, 3 or 4)."""
    hkv = draw(st.integers(1, max_qo_heads)) if num_kv_heads is None else num_kv_heads
    group = draw(st.integers(1, max(1, max_qo_heads // hkv)))
    return hkv * group, hkv


@st.composite
def variants(draw, num_qo_heads, positions=True, sigmoid=True, rope=None):
    """A Variant; ``positions=False`` leaves out ALiBi and the sliding window (Cascade, Quest), ``rope=False``
    fused RoPE (default: as ``positions``)."""
    kwargs = dict(causal=draw(st.booleans()))
    if draw(st.booleans()):
        kwargs["sm_scale"] = draw(st.floats(0.05, 1.0))
    if draw(st.booleans()):
        kwargs["logits_soft_cap"] = draw(st.floats(1.0, 50.0))
    if positions and draw(st.booleans()):
        kwargs["window_left"] = draw(st.integers(0, 12))
    if positions and draw(st.booleans()):
        kwargs["alibi_slopes"] = [2.0 ** -draw(st.integers(0, 6)) for _ in range(num_qo_heads)]
    if (positions if rope is None else rope) and draw(st.integers(0, 3)) == 0:
        kwargs["rope_theta"] = draw(st.sampled_from([10.0, 1e4]))
        kwargs["rope_scale"] = draw(st.sampled_from([1.0, 2.5]))
    if sigmoid and draw(st.integers(0, 4)) == 0:
        kwargs["sigmoid_bias"] = draw(st.floats(-3.0, 3.0))
    return ba.Variant(**kwargs)


@st.composite
def problems(draw, kinds=None, sigmoid=True, head_dims=(4, 8, 16)):
    """A full attention problem over a random layout."""
    case = draw(layout_cases(kinds))
    hq, hkv = draw(head_configs(case.num_kv_heads))
    # Quest's per-head views give the call G query heads and one KV head.
    call_heads = hq // hkv if case.kind == "quest" else hq
    variant = draw(variants(call_heads, positions=case.supports_positions, sigmoid=sigmoid,
                            rope=case.supports_rope))
    return Problem(case, hq, hkv, draw(st.sampled_from(head_dims)), variant, draw(st.integers(0, 2**31 - 1)))


@st.composite
def partial_states(draw, min_states=1, max_states=6, heads=2, head_dim=4, lse_range=30.0, empty=True):
    """``(o [n, S, H, D], lse [n, S, H])`` float64 attention states; some are empty (lse = -inf, o = 0)."""
    n, s = draw(st.integers(1, 3)), draw(st.integers(min_states, max_states))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    o = rng.standard_normal((n, s, heads, head_dim))
    lse = rng.uniform(-lse_range, lse_range, (n, s, heads))
    if empty:
        dead = rng.random((n, s, heads)) < 0.2
        lse[dead] = -np.inf
        o[dead] = 0.0
    return o, lse


@st.composite
def split_problems(draw, q_scale=1.0):
    """Queries over ``m`` keys with positions, a variant, sorted cut points and a merge order: the arguments
    of ``helpers.check_split_merge``. ``q_scale`` multiplies the queries (1000 puts scores in the thousands)."""
    n, m = draw(st.integers(1, 4)), draw(st.integers(1, 48))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    q, k, v = rng.standard_normal((n, hq, 8)), rng.standard_normal((m, hkv, 8)), rng.standard_normal((m, hkv, 8))
    cuts = sorted(draw(st.lists(st.integers(0, m), max_size=6)))
    order = draw(st.permutations(range(len(cuts) + 1)))
    variant = draw(variants(hq, sigmoid=False))
    return q * q_scale, k, v, np.arange(m - n, m), np.arange(m), variant, variant.scale(8), cuts, order


SPLIT_PROBLEMS = st.one_of(split_problems(), split_problems(q_scale=1000.0))


# ---- named cases -----------------------------------------------------------------------------------------

def named_case(kind, raw, kv_pool="NHD", num_kv_heads=None) -> LayoutCase:
    """The :class:`LayoutCase` of ``ba.layouts.<kind>(**raw)``, for cases written out by hand."""
    return LayoutCase(kind, raw, getattr(ba.layouts, kind)(**raw), kv_pool, num_kv_heads)


def _edge(kind, layout_fn, kv_pool, raw, hq=2, hkv=1, head_dim=8, variant=ba.Variant(), num_kv_heads=None):
    case = LayoutCase(kind, raw, layout_fn(**raw), kv_pool, num_kv_heads)
    return Problem(case, hq, hkv, head_dim, variant, seed=7)


PAGED = dict(qo_lens=[3, 1, 2], page_tables=[[5, 1, 7, 2], [0, 3], [6, 4]], kv_lens=[29, 12, 11], page_size=8,
             num_pages=8)


def paged_problem(variant=ba.Variant(causal=True), hq=4, hkv=2, kv_pool="NHD", seed=3, **raw) -> Problem:
    """Three requests over shuffled pages of 8 (full, partial and shared-nothing pages), head_dim 8; ``raw``
    overrides :data:`PAGED`'s fields."""
    return Problem(named_case("paged", {**PAGED, **raw}, kv_pool), hq, hkv, 8, variant, seed)


EDGE_CASES = {
    "empty row": _edge("ragged", ba.layouts.ragged, "flat", dict(qo_lens=[2, 3, 1], kv_lens=[5, 0, 4])),
    "qo_len 0": _edge("ragged", ba.layouts.ragged, "flat", dict(qo_lens=[0, 2], kv_lens=[6, 3])),
    "single slot": _edge("dense", ba.layouts.dense, "flat", dict(qo_len=1, kv_len=1)),
    "Bc=1 paged": _edge("paged", ba.layouts.paged, "NHD",
                        dict(qo_lens=[1, 2], page_tables=[[4, 0, 2], [1, 3]], kv_lens=[3, 2], page_size=1,
                             num_pages=5)),
    "every key masked (causal, qo_len > kv_len)": _edge(
        "ragged", ba.layouts.ragged, "flat", dict(qo_lens=[4], kv_lens=[2]), variant=ba.Variant(causal=True)),
    "every key masked (block mask)": _edge(
        "block_sparse", ba.layouts.block_sparse, "flat",
        dict(indptr=[0, 1, 2], indices=[1, 0], M=4, N=4, R=2, C=2,
             mask=np.array([[[1, 0], [0, 1]], [[0, 0], [0, 0]]], dtype=bool))),
    "GQA ratio 4, HND pool": _edge("paged", ba.layouts.paged, "HND",
                                   dict(qo_lens=[2, 1], page_tables=[[1, 0], [2]], kv_lens=[7, 3], page_size=4,
                                        num_pages=3),
                                   hq=8, hkv=2, variant=ba.Variant(causal=True, logits_soft_cap=5.0)),
    "page shared by two requests, ALiBi": _edge(
        "paged", ba.layouts.paged, "NHD",
        dict(qo_lens=[1, 3], page_tables=[[2, 0], [2, 1]], kv_lens=[6, 8], page_size=4, num_pages=3),
        hq=4, hkv=2, variant=ba.Variant(causal=True, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
    "window 0 (each query sees itself)": _edge(
        "ragged", ba.layouts.ragged, "flat", dict(qo_lens=[3], kv_lens=[5]), variant=ba.Variant(window_left=0)),
    "tree chain and siblings": _edge("tree", ba.layouts.tree, "NHD",
                                     dict(parents=[[-1, 0, 0, 1], [-1, -1]], page_tables=[[1, 0], [2]],
                                          kv_lens=[7, 3], page_size=4, num_pages=3)),
    "quest partial last page": _edge(
        "quest", ba.layouts.quest, "quest",
        dict(page_tables=[[2, 0, 1]], kv_lens=[10], selected_pages=[[[0, 2], [1]]], page_size=4, num_pages=3,
             num_kv_heads=2), hq=4, hkv=2, num_kv_heads=2),
    "shared prefix, empty suffix": _edge(
        "shared_prefix", ba.layouts.shared_prefix, "NHD",
        dict(qo_lens=[0, 2], prefix_pages=[0, 1], prefix_len=6, suffix_page_tables=[[], [2]], suffix_lens=[0, 3],
             page_size=4, num_pages=3), variant=ba.Variant(causal=True)),
}


@st.composite
def plan_kwargs(draw, max_ctas=16, max_tile_q=16, max_split=64):
    """Keyword arguments of :func:`bsrattn.scheduler.plan`: balanced (with a chunk floor and alignment), a fixed
    split size, or no split."""
    kwargs = dict(num_ctas=draw(st.integers(1, max_ctas)), tile_q=draw(st.integers(1, max_tile_q)))
    mode = draw(st.sampled_from(["balanced", "fixed", "disabled"]))
    if mode == "fixed":
        kwargs["fixed_split_size"] = draw(st.integers(1, max_split))
    elif mode == "disabled":
        kwargs["disable_split_kv"] = True
    else:
        kwargs["min_split_size"] = draw(st.integers(1, max(1, max_split // 2)))
        kwargs["kv_align"] = draw(st.sampled_from([1, 4, 16]))
    return kwargs
