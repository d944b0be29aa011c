"""Deterministic mode: a query row's bits do not depend on how the work is cut.

``deterministic=True`` cuts each row's KV on a grid fixed at absolute positions (``split_size``), computes each
chunk's state alone with one tile configuration per tier, and folds the chunks left to right. These
properties check the contract on every tier, bit for bit (``out`` and ``lse``), against the same requests cut
other ways: another batch around them, another ``num_ctas``, paged or ragged storage, a decode step or the same
query as a row of a causal prefill, a Cascade or its flat layout, one call or two KV pieces merged with
:func:`bsrattn.merge_state`, a fresh object or a re-planned one. The reference runs in float64 and the emulated
tiers in float32: a fold in another order, or a chunk cut elsewhere, changes the last bits (``test_merge_order``
shows it), so the comparisons can fail. The GPU tests (``gpu`` marker) check the compiled kernels at real sizes
in bf16 on the H200, CUDA graph replays across re-plans included.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn.validation import DEFAULT_SPLIT_SIZE
from test_tiers import TIERS, load_tier

HQ, HKV, D, PAGE = 4, 2, 16, 16
DTYPE = {"reference": "float64", "numba": "float32", "torch": "float32"}
BATCH_EXAMPLES = {"reference": None, "numba": 3, "torch": 3}
"""Examples of the properties that cut whole batches, per tier (None: the profile's): an example on an emulated
tier is four plans and runs of up to four requests of up to 160 keys, seconds each."""


@pytest.fixture(params=TIERS)
def tier(request):
    return load_tier(request.param)


class World:
    """One KV pool of pages, requests as page tables over it, and each request's queries at all its positions."""

    def __init__(self, rng, lengths, num_pages):
        self.rng = rng
        self.lengths = list(lengths)
        pages = rng.permutation(num_pages)
        self.tables, at = [], 0
        for n in self.lengths:
            need = -(-n // PAGE)
            self.tables.append(pages[at:at + need])
            at += need
        self.k, self.v = (rng.standard_normal((num_pages, PAGE, HKV, D)) for _ in range(2))
        self.q = [rng.standard_normal((n, HQ, D)) for n in self.lengths]

    def keys(self, i, lo, hi):
        """``k``, ``v`` of request ``i``'s positions ``lo:hi``, contiguous ``[hi - lo, Hkv, D]``."""
        slots = (self.tables[i][:, None] * PAGE + np.arange(PAGE)).ravel()[lo:hi]
        return self.k.reshape(-1, HKV, D)[slots], self.v.reshape(-1, HKV, D)[slots]

    def paged(self, requests):
        """``(layout, q)``: ``requests`` (index, queries) as a paged layout, each request's last ``queries``
        positions as its query rows."""
        layout = ba.layouts.paged([c for _, c in requests], [self.tables[i] for i, _ in requests],
                                  [self.lengths[i] for i, _ in requests], PAGE, self.k.shape[0])
        return layout, np.concatenate([self.q[i][self.lengths[i] - c:] for i, c in requests])

    def ragged(self, requests):
        """``(layout, q, k, v)``: the same requests with their keys copied into one ragged pool."""
        layout = ba.layouts.ragged([c for _, c in requests], [self.lengths[i] for i, _ in requests])
        kv = [self.keys(i, 0, self.lengths[i]) for i, _ in requests]
        q = np.concatenate([self.q[i][self.lengths[i] - c:] for i, c in requests])
        return layout, q, np.concatenate([k for k, _ in kv]), np.concatenate([v for _, v in kv])


def _run(tier, layout, q, k, v, variant, split, num_ctas=None, attn=None):
    """Deterministic attention on ``tier`` in its test dtype; ``(out, lse)`` as float64 NumPy (exact)."""
    dtype = DTYPE[tier.name]
    args = [tier.array(x, dtype) for x in (q, k, v)]
    if attn is None:
        attn = ba.BatchAttention(tier.backend)
    attn.plan(layout, HQ, HKV, D, variant=variant, deterministic=True, split_size=split, num_ctas=num_ctas)
    o, s = attn.run(*args, return_lse=True)
    return tier.numpy(o), tier.numpy(s)


def _rows(requests, lengths):
    """``{(request, position): row}`` of a batch's query rows."""
    rows, at = {}, 0
    for i, c in requests:
        for pos in range(lengths[i] - c, lengths[i]):
            rows[i, pos] = at
            at += 1
    return rows


def _assert_same_rows(first, second, rows_a, rows_b):
    common = sorted(set(rows_a) & set(rows_b))
    assert common
    for key in common:
        a, b = rows_a[key], rows_b[key]
        for got, want, name in ((second[0][b], first[0][a], "out"), (second[1][b], first[1][a], "lse")):
            assert np.array_equal(got, want, equal_nan=True), \
                f"request {key[0]}, position {key[1]}: {name} differs (max {np.nanmax(np.abs(got - want))})"


@st.composite
def batches(draw):
    """Requests, two batches of them (each request with its own number of query rows: 1 is a decode step) and
    the grid, the variant and the two calls' ``num_ctas``."""
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 160), min_size=n, max_size=n))
    queries = lambda i: st.integers(1, min(lengths[i], 16))  # noqa: E731
    first = [(i, draw(queries(i))) for i in range(n)]
    subset = draw(st.lists(st.sampled_from(range(n)), min_size=1, max_size=n, unique=True))
    second = [(i, draw(queries(i))) for i in subset]
    window = draw(st.sampled_from([-1, -1, 7, 70]))
    variant = ba.Variant(causal=True, window_left=window, logits_soft_cap=draw(st.sampled_from([0.0, 5.0])))
    ctas = st.one_of(st.none(), st.integers(1, 6))
    return lengths, first, second, draw(st.sampled_from([64, 128])), variant, draw(ctas), draw(ctas), \
        draw(st.integers(0, 2**32 - 1))


def test_rows_agree_however_the_batch_is_cut(tier):
    @tier.examples(budgets=BATCH_EXAMPLES)
    @given(batches())
    def check(case):
        lengths, first, second, split, variant, ctas_a, ctas_b, seed = case
        world = World(np.random.default_rng(seed), lengths, sum(-(-n // PAGE) for n in lengths) + 3)
        layout, q = world.paged(first)
        attn = ba.BatchAttention(tier.backend)
        a = _run(tier, layout, q, world.k, world.v, variant, split, ctas_a, attn)
        rows_a = _rows(first, lengths)
        # The second batch, ragged: other neighbours, another num_ctas, other query counts for the same requests.
        layout_b, q_b, k_b, v_b = world.ragged(second)
        _assert_same_rows(a, _run(tier, layout_b, q_b, k_b, v_b, variant, split, ctas_b), rows_a,
                          _rows(second, lengths))
        # The first batch again, on the object re-planned for the second in between.
        _run(tier, layout_b, q_b, k_b, v_b, variant, split, ctas_b, attn)
        _assert_same_rows(a, _run(tier, layout, q, world.k, world.v, variant, split, ctas_a, attn), rows_a, rows_a)

    check()


def test_a_window_cuts_its_keys_into_the_same_tiles_in_a_decode_step_and_a_prefill(tier):
    """A sliding window starts inside a KV tile; a query tile's first query and a decode step's query start their
    windows at other keys, and both must still see the window's keys in the grid's tiles."""
    rng = np.random.default_rng(3)
    world = World(rng, [200], 16)
    variant = ba.Variant(causal=True, window_left=70)
    layout, q = world.paged([(0, 40)])
    prefill = _run(tier, layout, q, world.k, world.v, variant, 64)
    for pos in (163, 190, 199):
        step = ba.layouts.paged([1], world.tables, [pos + 1], PAGE, world.k.shape[0])
        _assert_same_rows(prefill, _run(tier, step, world.q[0][pos:pos + 1], world.k, world.v, variant, 64),
                          _rows([(0, 40)], [200]), _rows([(0, 1)], [pos + 1]))


@st.composite
def shared_prefixes(draw):
    prefix_pages = draw(st.integers(1, 9))
    suffixes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    queries = [draw(st.integers(1, min(n, 16))) for n in suffixes]
    return prefix_pages * PAGE, suffixes, queries, draw(st.sampled_from([64, 128])), draw(st.integers(0, 2**32 - 1))


def test_a_cascade_agrees_with_the_same_keys_in_one_paged_layout(tier):
    @tier.examples(budgets=BATCH_EXAMPLES)
    @given(shared_prefixes())
    def check(case):
        prefix, suffixes, queries, split, seed = case
        rng = np.random.default_rng(seed)
        n_prefix = prefix // PAGE
        suffix_pages = [-(-n // PAGE) for n in suffixes]
        num_pages = n_prefix + sum(suffix_pages) + 2
        pages = rng.permutation(num_pages)
        prefix_table, at, tables = pages[:n_prefix], n_prefix, []
        for n in suffix_pages:
            tables.append(pages[at:at + n])
            at += n
        k, v = (rng.standard_normal((num_pages, PAGE, HKV, D)) for _ in range(2))
        q = rng.standard_normal((sum(queries), HQ, D))
        variant = ba.Variant(causal=True)
        cascade = ba.layouts.shared_prefix(queries, prefix_table, prefix, tables, suffixes, PAGE, num_pages)
        flat = ba.layouts.paged(queries, [np.concatenate([prefix_table, t]) for t in tables],
                                [prefix + n for n in suffixes], PAGE, num_pages)
        got = _run(tier, cascade, q, k, v, variant, split)
        want = _run(tier, flat, q, k, v, variant, split)
        for x, y, name in zip(got, want, ("out", "lse")):
            assert np.array_equal(x, y), f"{name}: the cascade differs from the flat layout by {np.abs(x - y).max()}"

    check()


def test_a_cascade_over_an_hnd_pool_is_its_nhd_pool_viewed_per_slot():
    rng = np.random.default_rng(2)
    cascade = ba.layouts.shared_prefix([1, 2], [3, 0], 2 * PAGE, [[1], [2, 4]], [9, 20], PAGE, 5)
    q = rng.standard_normal((3, HQ, D))
    k, v = (rng.standard_normal((5, PAGE, HKV, D)) for _ in range(2))
    nhd = ba.attention(q, k, v, cascade, return_lse=True, deterministic=True, split_size=64)
    hnd = ba.attention(q, k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy(), cascade, kv_layout="HND",
                       return_lse=True, deterministic=True, split_size=64)
    assert all(np.array_equal(a, b) for a, b in zip(nhd, hnd))
    want = ba.attention(q, k, v, cascade, return_lse=True)
    assert np.allclose(nhd[0], want[0]) and np.allclose(nhd[1], want[1])


@st.composite
def kv_pieces(draw):
    split = draw(st.sampled_from([64, 128]))
    length = draw(st.integers(1, 3 * split))
    cut = (length - 1) // split * split  # the last grid point before the end: the second piece is one chunk
    queries = draw(st.integers(1, min(16, length - cut)))  # a prefill's last rows: a few query tiles
    return length, cut, queries, split, draw(st.integers(0, 2**32 - 1))


def test_kv_pieces_merged_in_order_equal_one_call(tier):
    """The query rows at a prefill's end over all their keys, or over the keys before the grid point ``cut``
    (every key visible) and the keys after it (causal), the two states merged with ⊕: the same bits."""
    @tier.examples()
    @given(kv_pieces())
    def check(case):
        length, cut, queries, split, seed = case
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((queries, HQ, D))
        k, v = (rng.standard_normal((length, HKV, D)) for _ in range(2))
        causal = ba.Variant(causal=True)
        whole = _run(tier, ba.layouts.ragged([queries], [length]), q, k, v, causal, split)
        before = _run(tier, ba.layouts.ragged([queries], [cut]), q, k[:cut], v[:cut], ba.Variant(), split)
        after = _run(tier, ba.layouts.ragged([queries], [length - cut]), q, k[cut:], v[cut:], causal, split)
        dtype = DTYPE[tier.name]
        o, s = ba.merge_state(*(tier.array(x, dtype) for x in (*before, *after)), backend=tier.backend)
        for x, y, name in ((tier.numpy(o), whole[0], "out"), (tier.numpy(s), whole[1], "lse")):
            assert np.array_equal(x, y), f"{name}: merged pieces differ from one call by {np.abs(x - y).max()}"

    check()


def test_float32_pieces_on_the_reference_tier_match_one_call_to_rounding():
    """The reference folds its chunk states in float64 and rounds once: float32 pieces, each rounded before the
    merge, land within float32 rounding of the one call (the condition its docs state), not bitwise."""
    rng = np.random.default_rng(3)
    length, cut, queries, split = 200, 128, 8, 64
    q = rng.standard_normal((queries, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((length, HKV, D)).astype(np.float32) for _ in range(2))
    causal = ba.Variant(causal=True)

    def run(layout, q, k, v, variant):
        return ba.attention(q, k, v, layout, variant=variant, return_lse=True, deterministic=True, split_size=split)

    whole = run(ba.layouts.ragged([queries], [length]), q, k, v, causal)
    before = run(ba.layouts.ragged([queries], [cut]), q, k[:cut], v[:cut], ba.Variant())
    after = run(ba.layouts.ragged([queries], [length - cut]), q, k[cut:], v[cut:], causal)
    merged = ba.merge_state(*before, *after)
    eps = np.finfo(np.float32).eps
    for x, y, name in zip(merged, whole, ("out", "lse")):
        assert x.dtype == y.dtype == np.float32
        error = np.abs(x - y).max() / max(1.0, np.abs(y).max())
        assert error <= 2 * eps, f"{name}: merged float32 pieces are {error / eps:.1f} eps from the one call"


def test_one_shot_attention_is_the_planned_call():
    rng = np.random.default_rng(0)
    layout = ba.layouts.ragged([3, 1], [200, 90])
    q, k, v = rng.standard_normal((4, HQ, D)), rng.standard_normal((290, HKV, D)), rng.standard_normal((290, HKV, D))
    variant = ba.Variant(causal=True)
    o, s = ba.attention(q, k, v, layout, variant=variant, return_lse=True, deterministic=True, split_size=64)
    attn = ba.BatchAttention("reference")
    attn.plan(layout, HQ, HKV, D, variant=variant, deterministic=True, split_size=64, num_ctas=5)
    o2, s2 = attn.run(q, k, v, return_lse=True)
    assert np.array_equal(o, o2) and np.array_equal(s, s2)
    assert attn.work_plans[0].kv_chunk_size == 64
    default = ba.BatchAttention("reference")
    default.plan(layout, HQ, HKV, D, deterministic=True)
    assert default.work_plans[0].kv_chunk_size == DEFAULT_SPLIT_SIZE


@pytest.mark.parametrize("name", ["reference", "torch"])
@pytest.mark.parametrize("variant", [ba.Variant(causal=True), ba.Variant(causal=True, window_left=150)],
                         ids=["causal", "window"])
def test_items_of_several_chunks_fold_as_a_plan_cut_at_every_grid_point(name, variant):
    """The torch tier's deterministic plans (``lead_items``) give a row a first item of several chunks of the
    grid, whose executor folds them itself, and cut the rest at every grid point: rows whole (one CTA) or
    split, the same bits as the plan cut at every grid point."""
    from bsrattn.validation import make_spec

    tier = load_tier(name)
    rng = np.random.default_rng(5)
    layout = ba.layouts.ragged([1, 3, 1], [700, 300, 90])
    q, k, v = (tier.array(rng.standard_normal(shape), DTYPE[name])
               for shape in ((5, HQ, D), (1090, HKV, D), (1090, HKV, D)))
    spec = replace(make_spec(layout, HQ, HKV, D, variant, q_dtype=DTYPE[name]), split_size=128)
    cut = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=40, fixed_split_size=128)
    whole, split = (ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=n, tile_q=16, fixed_split_size=128,
                                      lead_items=True) for n in (1, 4))
    assert whole.num_merges == 0 < cut.num_merges and (whole.item_kv_end - whole.item_kv_start).max() == 700
    starts = sorted(split.item_kv_start[split.item_row == 0].tolist())
    assert starts == [0, 384, 512, 640]  # L_kv = ceil(1090 / 4) = 273: a first item of 384 slots
    want = tier.backend.make_runner(spec, cut).run(q, k, v, return_lse=True)
    for plan in (whole, split):
        for got, expected in zip(tier.backend.make_runner(spec, plan).run(q, k, v, return_lse=True), want):
            assert np.array_equal(tier.numpy(got), tier.numpy(expected))


def test_a_deterministic_kernel_keeps_its_merges_for_a_plan_that_splits_nothing():
    """A CUDA graph captured on a deterministic plan replays the later plans of its buffers, and which rows a
    plan cuts changes with the batch: the kernel keeps its partial-state stores and merges even when this plan
    needs none."""
    from bsrattn.validation import make_spec

    tier = load_tier("torch")
    layout = ba.layouts.ragged([1, 1], [300, 90])
    spec = replace(make_spec(layout, HQ, HKV, D, q_dtype="float32"), split_size=128)
    whole = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=1, fixed_split_size=128, lead_items=True)
    assert whole.num_merges == 0
    runner = tier.backend.make_runner(spec, whole)
    assert runner.launch_config("float32", "NHD3", True).merges


def test_the_numba_tier_refuses_a_deterministic_plan_of_items_longer_than_a_chunk():
    from bsrattn.validation import make_spec

    numba_tier = load_tier("numba")
    layout = ba.layouts.ragged([1], [300])
    spec = replace(make_spec(layout, HQ, HKV, D), split_size=128)
    whole = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=1, fixed_split_size=128, lead_items=True)
    with pytest.raises(ValueError, match="runs items of one chunk of the grid"):
        numba_tier.backend.make_runner(spec, whole)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(deterministic=True, split_size=100), ValueError, "split_size=100 must be a multiple of 64"),
    (dict(deterministic=True, split_size=0), ValueError, "split_size"),
    (dict(deterministic=True, split_size=64.0), TypeError, "split_size"),
    (dict(split_size=128), ValueError, "split_size=128 is deterministic mode's chunk grid"),
    (dict(deterministic=True, fixed_split_size=64), ValueError, "fixed_split_size=64 with deterministic=True"),
    (dict(deterministic=True, disable_split_kv=True), ValueError, "disable_split_kv=True with deterministic"),
    (dict(deterministic="yes"), TypeError, "deterministic must be a bool"),
])
def test_bad_deterministic_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ba.BatchAttention("reference").plan(ba.layouts.ragged([1], [10]), HQ, HKV, D, **kwargs)


def test_a_row_that_rope_positions_start_off_the_grid_is_refused():
    layout = ba.layouts.ragged([1, 1], [10, 20])
    rope = ba.Variant(rope_theta=1e4)
    attn = ba.BatchAttention("reference")
    attn.plan(layout, HQ, HKV, D, variant=rope, deterministic=True, split_size=64,
              rope_positions=([73, 147], [64, 128]))
    with pytest.raises(ValueError, match=r"row 1 starts at KV position 100, not on the deterministic chunk grid "
                                         r"\(every 64 slots: 64 or 128\)"):
        attn.plan(layout, HQ, HKV, D, variant=rope, deterministic=True, split_size=64,
                  rope_positions=([73, 119], [64, 100]))


# ---- the compiled kernels at real sizes -------------------------------------------------------------------

GPU_HEADS = (32, 8, 128)


def _gpu_world(torch, lengths, dtype):
    """bf16 pages of 16 slots for requests of ``lengths`` and each request's queries at every position."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = GPU_HEADS
    pages = [-(-n // 16) for n in lengths]
    num_pages = sum(pages)
    perm = torch.randperm(num_pages, generator=gen, device="cuda").cpu().numpy()
    tables = np.split(perm, np.cumsum(pages)[:-1])
    k, v = (torch.randn((num_pages, 16, hkv, d), generator=gen, device="cuda").to(dtype) for _ in range(2))
    q = [torch.randn((n, hq, d), generator=gen, device="cuda").to(dtype) for n in lengths]
    return tables, k, v, q


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "numba"])
def test_gpu_rows_agree_across_batches_decode_prefill_and_graph_replays(name):
    """Requests of up to 9000 keys: their decode rows batched with 1, 31 or 255 others, over other numbers of
    CTAs, and the same queries as the last rows of their causal prefills: one set of bits (torch: also through a
    CUDA graph captured on the first plan and replayed after re-plans to the others)."""
    torch = pytest.importorskip("torch")
    dtype = torch.bfloat16 if name == "torch" else torch.float16
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 9000, size=256).tolist()
    lengths[:3] = [1, 1024, 8999]
    tables, k, v, q_all = _gpu_world(torch, lengths, dtype)
    hq, hkv, d = GPU_HEADS
    variant = ba.Variant(causal=True)
    watched = [0, 1, 2]

    def decode(batch, num_ctas=None, attn=None):
        layout = ba.layouts.paged([1] * len(batch), [tables[i] for i in batch], [lengths[i] for i in batch], 16,
                                  k.shape[0])
        q = torch.stack([q_all[i][-1] for i in batch])
        attn = ba.BatchAttention(name) if attn is None else attn
        attn.plan(layout, hq, hkv, d, variant=variant, deterministic=True, num_ctas=num_ctas)
        return attn, q

    def host(x):
        return torch.as_tensor(x, device="cuda").float().cpu()

    def rows(o, s, batch):
        o, s = host(o), host(s)
        return {i: (o[batch.index(i)], s[batch.index(i)]) for i in watched}

    results = []
    for size, ctas in ((3, None), (32, 7), (256, None)):
        batch = watched + list(range(3, size))
        attn, q = decode(batch, ctas)
        results.append(rows(*attn.run(q, k, v, return_lse=True), batch))
    for i in watched:  # the same query as the last row of a causal prefill of the whole request (its last 8)
        layout = ba.layouts.paged([8 if lengths[i] >= 8 else lengths[i]], [tables[i]], [lengths[i]], 16, k.shape[0])
        q = q_all[i][-layout.qo_lens[0]:]
        o, s = ba.attention(q, k, v, layout, variant=variant, backend=name, return_lse=True, deterministic=True)
        results.append({i: (host(o)[-1], host(s)[-1])})
    if name == "torch":  # a graph captured at batch 256, replayed after re-plans to batches 3 and 32
        batch = watched + list(range(3, 256))
        attn, q = decode(batch)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
        q_in = q.clone()
        attn.run(q_in, k, v, out=out, lse=lse)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn.run(q_in, k, v, out=out, lse=lse)
        for size in (3, 32):
            small = watched + list(range(3, size))
            _, q_small = decode(small, attn=attn)
            q_in.zero_()
            q_in[:len(small)] = q_small
            graph.replay()
            results.append(rows(out[:len(small)], lse[:len(small)], small))
    for n, got in enumerate(results[1:], 1):
        for i, (o, s) in got.items():
            want_o, want_s = results[0][i]
            assert torch.equal(o, want_o), (name, n, i, (o - want_o).abs().max())
            assert torch.equal(s, want_s), (name, n, i)
