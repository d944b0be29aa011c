"""Numbers that are not numbers, keys a query cannot see, and launches that share buffers: on every tier.

The rules (``bsrattn.reference.microkernel`` and ``bsrattn.reference.merge`` state them) are written here a
second time, as a float64 loop over (query, head) from the layout's raw inputs (:func:`expected`), and every
tier is checked against it, one-shot and through a plan that splits every row into chunks:

- a hidden key (causal, window, custom mask, past the row's end, another request's) changes nothing;
- a NaN or ``+inf`` visible score makes ``out`` and ``lse`` NaN; a ``-inf`` score weighs 0;
- a non-finite value in a visible key's ``v`` makes the whole ``out`` row NaN, ``lse`` unchanged;
- ⊕: an empty state is the identity whatever its ``o``; a NaN or ``+inf`` LSE gives NaN.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import compare
from test_tiers import TIERS, load_tier

# The emulators compute with NumPy, which warns at the NaNs and infinities these tests feed them on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

HQ, HKV, D, PAGE = 4, 2, 16, 4
# Request 0: 3 queries over 10 keys in pages 3, 0, 5; request 1: 1 query over 6 keys in pages 1, 2 (page 2's
# last two slots are past its end); page 4 belongs to no request.
QO_LENS, KV_LENS, TABLES, NUM_PAGES = [3, 1], [10, 6], [[3, 0, 5], [1, 2]], 6


def slot(request, position):
    return TABLES[request][position // PAGE] * PAGE + position % PAGE


def paged_views(variant):
    """``[(request, slots, q_pos)]`` per query row: the pool slots it sees, from the raw inputs."""
    views = []
    for b, (qo, kv) in enumerate(zip(QO_LENS, KV_LENS)):
        for i in range(qo):
            q_pos = kv - qo + i
            keys = [p for p in range(kv) if (not variant.causal or p <= q_pos)
                    and (variant.window_left < 0 or q_pos - p <= variant.window_left)]
            views.append((b, [slot(b, p) for p in keys], q_pos))
    return views


def expected(views, q, k, v, sigmoid_bias=None):
    """The rules, in float64: ``q [n, Hq, D]``, ``k, v [num_slots, Hkv, D]`` -> ``(out, lse)``."""
    group = HQ // HKV
    out, lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for n, (_, slots, _) in enumerate(views):
        for h in range(HQ):
            keys, vals = k[slots, h // group], v[slots, h // group]
            with np.errstate(invalid="ignore", over="ignore"):
                s = keys @ q[n, h] / math.sqrt(D)
            v_bad = bool(slots) and not np.isfinite(vals).all()
            if sigmoid_bias is not None:
                lse[n, h] = np.nan
                out[n, h] = np.nan if v_bad or np.isnan(s).any() else \
                    (1 / (1 + np.exp(-(s + sigmoid_bias)))) @ np.nan_to_num(vals) if slots else 0
                continue
            if np.isnan(s).any() or (s == np.inf).any():
                out[n, h], lse[n, h] = np.nan, np.nan
                continue
            w = np.exp(s - s.max()) if slots and s.max() > -np.inf else np.zeros(len(slots))
            if w.sum() == 0:
                continue  # empty: out 0, lse -inf
            lse[n, h] = s.max() + math.log(w.sum())
            out[n, h] = np.nan if v_bad else w @ vals / w.sum()
    return out, lse


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(QO_LENS), HQ, D))
    k, v = rng.standard_normal((2, NUM_PAGES * PAGE, HKV, D))
    return q, k, v


def paged_layout():
    return ba.layouts.paged(QO_LENS, TABLES, KV_LENS, page_size=PAGE, num_pages=NUM_PAGES)


def run_tier(tier, layout, q, k, v, variant, planned):
    """``(out, lse)`` of the tier on float32 inputs, one-shot or through a plan that splits rows into chunks."""
    pool = (layout.num_blocks, layout.block_size, HKV, D)
    args = [tier.array(x, "float32") for x in (q, k.reshape(pool), v.reshape(pool))]
    want_lse = not variant.use_sigmoid
    if planned:
        attn = ba.BatchAttention(backend=tier.name)
        attn.plan(layout, HQ, HKV, D, variant=variant, num_ctas=3, fixed_split_size=3)
        assert attn.work_plans[0].num_merges > 0, "the plan must split rows, so that chunk states merge"
        got = attn.run(*args, return_lse=want_lse)
    else:
        got = ba.attention(*args, layout, variant=variant, backend=tier.name, return_lse=want_lse)
    o, s = got if want_lse else (got, None)
    return tier.numpy(o), (None if s is None else tier.numpy(s))


def check(tier, got, want, name):
    for label, g, w in zip(("out", "lse"), got, want):
        if g is None:
            continue
        result = compare(g, w, atol=2e-5, rtol=2e-5, name=f"{tier.name} {name} {label}")
        assert result.ok, result.message


@pytest.fixture(scope="module", params=TIERS)
def tier(request):
    return load_tier(request.param)


# (name, variant, which array, request, position, value): one poisoned element per case.
POISONS = {
    "NaN v of a causally hidden key": (ba.Variant(causal=True), "v", 0, 9, np.nan),
    "inf k of a causally hidden key": (ba.Variant(causal=True), "k", 0, 9, np.inf),
    "NaN v outside the window": (ba.Variant(causal=True, window_left=2), "v", 0, 3, np.nan),
    "NaN k and v past the row's end": (ba.Variant(), "kv", 1, 7, np.nan),
    "NaN v of a visible key": (ba.Variant(), "v", 0, 4, np.nan),
    "-inf v of a visible key": (ba.Variant(causal=True), "v", 1, 2, -np.inf),
    "NaN k of a visible key": (ba.Variant(), "k", 1, 0, np.nan),
    "+inf score": (ba.Variant(causal=True), "q+", 0, None, np.inf),
    "-inf score of one key": (ba.Variant(), "k-", 0, 5, -np.inf),
    "NaN k, sigmoid": (ba.Variant(sigmoid_bias=-0.5, causal=True), "k", 0, 8, np.nan),
    "NaN v of a hidden key, sigmoid": (ba.Variant(sigmoid_bias=0.5, causal=True), "v", 0, 9, np.nan),
}


def poisoned(kind, request, position, value, q, k, v):
    q, k, v = q.copy(), k.copy(), v.copy()
    if kind == "q+":  # a positive score times infinity: +inf for every key of the request's first query
        q[0, :, 0] = value
        k[:, :, 0] = np.abs(k[:, :, 0]) + 0.5
        return q, k, v
    at = slot(request, position) if position < KV_LENS[request] else TABLES[request][-1] * PAGE + position % PAGE
    if kind == "k-":  # a score of -inf for one key: positive queries against -inf in one dimension
        q[:, :, 0] = np.abs(q[:, :, 0]) + 0.5
        k[at, :, 0] = value
    if "k" in kind.rstrip("-") or kind == "kv":
        k[at, :, 1] = value
    if "v" in kind:
        v[at, :, 3] = value
    return q, k, v


@pytest.mark.parametrize("planned", [False, True], ids=["one-shot", "split plan"])
@pytest.mark.parametrize("name", list(POISONS))
def test_poisoned_inputs_follow_the_rules(tier, name, planned):
    variant, kind, request, position, value = POISONS[name]
    q, k, v = poisoned(kind, request, position if position is not None else 0, value, *inputs())
    views = paged_views(variant)
    got = run_tier(tier, paged_layout(), q, k, v, variant, planned)
    check(tier, got, expected(views, q, k, v, variant.sigmoid_bias), name)


@pytest.mark.parametrize("name", ["NaN v of a causally hidden key", "inf k of a causally hidden key",
                                  "NaN v outside the window", "NaN k and v past the row's end"])
def test_hidden_keys_leave_the_bits_unchanged(tier, name):
    """A value a query cannot see changes no bit of its answer (the same call on clean inputs)."""
    variant, kind, request, position, value = POISONS[name]
    clean = inputs()
    dirty = poisoned(kind, request, position, value, *clean)
    blind = [slot(request, position) not in slots for _, slots, _ in paged_views(variant)]
    assert any(blind)
    for planned in (False, True):
        a = run_tier(tier, paged_layout(), *clean, variant, planned)
        b = run_tier(tier, paged_layout(), *dirty, variant, planned)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x[blind], y[blind])


def test_tree_mask_hides_a_sibling(tier):
    """Node 1 of the draft tree does not see node 2: a NaN in node 2's v reaches node 2's row only."""
    layout = ba.layouts.tree([[-1, 0, 0]], [[0, 1]], kv_lens=[7], page_size=PAGE, num_pages=2)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, HQ, D))
    k, v = rng.standard_normal((2, 2 * PAGE, HKV, D))
    v[6, :, 2] = np.nan  # node 2 is the last of the 7 keys, slot 6
    committed = list(range(4))
    views = [(0, committed + [4], 4), (0, committed + [4, 5], 5), (0, committed + [4, 6], 6)]
    for planned in (False, True):
        got = run_tier(tier, layout, q, k, v, ba.Variant(), planned)
        check(tier, got, expected(views, q, k, v), f"tree planned={planned}")
        assert np.isnan(got[0][2]).all() and np.isfinite(got[0][:2]).all()


def test_a_row_of_minus_inf_scores_is_empty(tier):
    variant = ba.Variant()
    q, k, v = inputs()
    q[:, :, 0] = np.abs(q[:, :, 0]) + 0.5
    for p in range(KV_LENS[1]):
        k[slot(1, p), :, 0] = -np.inf
    got = run_tier(tier, paged_layout(), q, k, v, variant, planned=True)
    check(tier, got, expected(paged_views(variant), q, k, v), "all -inf")
    assert (got[0][3] == 0).all() and (got[1][3] == -np.inf).all()


# ---- ⊕ ------------------------------------------------------------------------------------------------

def _state(tier, o, lse):
    return tier.array(o, "float32"), tier.array(lse, "float32")


def test_merge_special_states(tier):
    rng = np.random.default_rng(2)
    o_a, o_b = rng.standard_normal((2, 6, 1, 4))
    lse_a, lse_b = rng.standard_normal((2, 6, 1))
    o_a[0], lse_a[0] = np.nan, -np.inf          # an empty state with a NaN o: the identity
    o_a[1], lse_a[1] = 1e30, -np.inf            # an empty state with a huge o: the identity
    lse_a[2] = np.nan                           # NaN lse: NaN
    lse_a[3] = np.inf                           # +inf lse: NaN
    o_a[4, 0, 1] = np.nan                       # NaN in a non-empty state's o: reaches the merged o
    lse_a[5], lse_b[5] = -np.inf, -np.inf       # two empty states: 0 and -inf
    o, s = ba.merge_state(*_state(tier, o_a, lse_a), *_state(tier, o_b, lse_b), backend=tier.name)
    o, s = tier.numpy(o), tier.numpy(s)
    np.testing.assert_array_equal(o[:2], o_b[:2].astype(np.float32))
    np.testing.assert_array_equal(s[:2], lse_b[:2].astype(np.float32))
    assert np.isnan(o[2:4]).all() and np.isnan(s[2:4]).all()
    assert np.isnan(o[4, 0, 1]) and np.isfinite(o[4, 0, [0, 2, 3]]).all() and np.isfinite(s[4]).all()
    assert (o[5] == 0).all() and (s[5] == -np.inf).all()


def test_merge_states_fold_skips_empty_states_and_keeps_nan(tier):
    rng = np.random.default_rng(3)
    o = rng.standard_normal((3, 4, 1, 4))
    lse = rng.standard_normal((3, 4, 1))
    o[0, 1], lse[0, 1] = np.nan, -np.inf        # request 0: an empty state with a NaN o in the middle
    lse[1, 2] = np.nan                          # request 1: one chunk's lse is NaN
    clean_o, clean_lse = np.delete(o[0:1], 1, axis=1), np.delete(lse[0:1], 1, axis=1)
    got_o, got_s = ba.merge_states(*_state(tier, o, lse), backend=tier.name)
    want_o, want_s = ba.merge_states(*_state(tier, clean_o, clean_lse), backend=tier.name)
    np.testing.assert_array_equal(tier.numpy(got_o)[0], tier.numpy(want_o)[0])
    np.testing.assert_array_equal(tier.numpy(got_s)[0], tier.numpy(want_s)[0])
    assert np.isnan(tier.numpy(got_o)[1]).all() and np.isnan(tier.numpy(got_s)[1]).all()
    assert np.isfinite(tier.numpy(got_o)[2]).all()


# ---- launches that share buffers ---------------------------------------------------------------------

def _workspaces(attn):
    """The partial states (and the numba tier's scratch lse) a tier keeps between launches, poisoned by the test."""
    runner = attn._runners[0]
    if hasattr(runner, "buffers"):  # torch
        return [runner.buffers.part_o, runner.buffers.part_lse]
    if hasattr(runner, "_workspace"):  # numba: (part_o, part_lse) pairs, and the scratch lse
        return [x for pair in runner._workspace.values() for x in pair] + list(runner._scratch_lse.values())
    return []


def _left_in_sync(attn) -> int:
    """How many of the torch tier's merge counters and flags are not zero (0 on the other tiers)."""
    buffers = getattr(attn._runners[0], "buffers", None)
    return 0 if buffers is None else int(buffers.sync.count_nonzero())


def _split_causal_plan(tier):
    attn = ba.BatchAttention(backend=tier.name)
    attn.plan(paged_layout(), HQ, HKV, D, variant=ba.Variant(causal=True), num_ctas=3, fixed_split_size=3)
    assert attn.work_plans[0].num_merges > 0
    return attn


def _pool_args(tier, q, k, v):
    pool = (NUM_PAGES, PAGE, HKV, D)
    return [tier.array(x, "float32") for x in (q, k.reshape(pool), v.reshape(pool))]


def test_no_launch_depends_on_what_an_earlier_one_left(tier):
    """NaN in the partial states, and a launch just before whose NaN flagged items and merges for the second pass,
    change nothing; every launch leaves the torch tier's merge counters and flags at zero, as it found them."""
    q, k, v = inputs()
    want = expected(paged_views(ba.Variant(causal=True)), q, k, v)
    attn = _split_causal_plan(tier)
    attn.run(*_pool_args(tier, *poisoned("v", 0, 9, np.nan, q, k, v)))  # a visible NaN: flags, a second pass
    assert _left_in_sync(attn) == 0
    for x in _workspaces(attn):
        if hasattr(x, "fill_"):
            x.fill_(float("nan"))
        else:
            x.copy_to_device(np.full(x.shape, np.nan, dtype=x.dtype))
    o, s = attn.run(*_pool_args(tier, q, k, v), return_lse=True)
    check(tier, (tier.numpy(o), tier.numpy(s)), want, "after NaN")
    assert _left_in_sync(attn) == 0


def test_a_call_stopped_between_its_launches_leaves_nothing_behind(monkeypatch):
    """A torch call whose second launch raises after its first flagged items leaves the flags at zero, and the
    next call is right."""
    from bsrattn.torch_cuda import executor
    from bsrattn.torch_cuda import launch as launches

    tier = load_tier("torch")
    q, k, v = inputs()
    attn = _split_causal_plan(tier)
    flagged = []

    class Stops:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                flagged.append(_left_in_sync(attn))
                raise RuntimeError("stopped before the second launch")
            return launch

    passes = executor.passes
    monkeypatch.setattr(launches, "_COMPILED", {})  # on a GPU too, the call's launches go through Triton
    monkeypatch.setattr(executor, "passes", lambda *a, **kw: [passes(*a, **kw)[0], (Stops(), None, {})])
    with pytest.raises(RuntimeError, match="stopped before"):
        attn.run(*_pool_args(tier, *poisoned("v", 0, 9, np.nan, q, k, v)))
    assert flagged[0] > 0, "the first launch flagged nothing: the test sets up nothing to leave behind"
    assert _left_in_sync(attn) == 0
    monkeypatch.setattr(executor, "passes", passes)
    o, s = attn.run(*_pool_args(tier, q, k, v), return_lse=True)
    check(tier, (tier.numpy(o), tier.numpy(s)), expected(paged_views(ba.Variant(causal=True)), q, k, v), "after")


def _in_threads(worker, count=4):
    """``worker(seed)`` for ``seed < count``, each in its own thread, all at once; an exception in any fails."""
    errors = []

    def guarded(seed):
        try:
            worker(seed)
        except Exception as err:  # noqa: BLE001 - reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(seed,)) for seed in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_threads_sharing_one_batch_attention_each_get_their_answer(tier):
    variant = ba.Variant(causal=True)
    attn = ba.BatchAttention(backend=tier.name)
    attn.plan(paged_layout(), HQ, HKV, D, variant=variant, num_ctas=3, fixed_split_size=3)
    pool = (NUM_PAGES, PAGE, HKV, D)
    results = {}

    def worker(seed):
        q, k, v = inputs(seed)
        args = [tier.array(x, "float32") for x in (q, k.reshape(pool), v.reshape(pool))]
        results[seed] = [tier.numpy(x) for x in attn.run(*args, return_lse=True)]

    _in_threads(worker)
    for seed, got in results.items():
        check(tier, got, expected(paged_views(variant), *inputs(seed)), f"thread {seed}")


def test_threads_making_one_shot_calls_at_once_each_get_their_answer(tier):
    """One-shot calls reuse idle buffers of earlier ones (the torch tier): two calls at once must never share
    them, whatever their plans. Each thread has its own lengths, so a shared plan would be a wrong answer."""
    variant = ba.Variant(causal=True)
    results = {}

    def layout_of(seed):
        return ba.layouts.ragged([2 + seed, 5], [4 + 3 * seed, 9])

    def worker(seed):
        lay = layout_of(seed)
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((n, h, D)).astype(np.float32)
                   for n, h in ((lay.nnz_qo, HQ), (lay.num_blocks, HKV), (lay.num_blocks, HKV)))
        for _ in range(3):
            got = ba.attention(*(tier.array(x, "float32") for x in (q, k, v)), lay, variant=variant,
                               backend=tier.name, return_lse=True)
            results.setdefault(seed, []).append(([tier.numpy(x) for x in got], (q, k, v)))

    _in_threads(worker)
    for seed, runs in results.items():
        for got, (q, k, v) in runs:
            want = ba.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), layout_of(seed),
                                variant=variant, backend="reference", return_lse=True)
            check(tier, got, want, f"thread {seed}")


# ---- the compiled kernels at real sizes (H200) ---------------------------------------------------------

GPU_HQ, GPU_HKV, GPU_D = 32, 8, 128


def _gpu_run(layout, q, k, v, variant, **plan_kwargs):
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, GPU_HQ, GPU_HKV, GPU_D, variant=variant, **plan_kwargs)
    return [x.float().cpu().numpy() for x in attn.run(q, k, v, return_lse=True)]


def _heads_of(kv_head):
    group = GPU_HQ // GPU_HKV
    return slice(kv_head * group, (kv_head + 1) * group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_causal_prefill_rows_that_see_a_nan(dtype):
    """1 x 1024 causal prefill: the unmasked interior tiles and the masked diagonal ones, compiled."""
    torch = pytest.importorskip("torch")
    n = 1024
    layout = ba.layouts.ragged([n], [n])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, GPU_D, device="cuda", generator=gen).to(getattr(torch, dtype))
               for h in (GPU_HQ, GPU_HKV, GPU_HKV))
    variant = ba.Variant(causal=True)
    clean_o, clean_s = _gpu_run(layout, q, k, v, variant)
    assert np.isfinite(clean_o).all() and np.isfinite(clean_s).all()
    k[700, 1, 9], v[100, 3, 5] = float("nan"), float("inf")
    o, s = _gpu_run(layout, q, k, v, variant)
    rows_v, rows_k = slice(100, n), slice(700, n)
    assert np.isnan(o[rows_v, _heads_of(3)]).all() and np.isnan(o[rows_k, _heads_of(1)]).all()
    assert np.isnan(s[rows_k, _heads_of(1)]).all()
    np.testing.assert_array_equal(s[rows_v, _heads_of(3)], clean_s[rows_v, _heads_of(3)])
    touched = np.zeros(o.shape[:2], dtype=bool)
    touched[rows_v, _heads_of(3)] = touched[rows_k, _heads_of(1)] = True
    np.testing.assert_array_equal(o[~touched], clean_o[~touched])
    np.testing.assert_array_equal(s[~touched], clean_s[~touched])


@pytest.mark.gpu
def test_gpu_paged_decode_nan_stays_in_its_request():
    """16 x 4096 paged decode through the default (split) plan: a NaN in one request's page, and in a free one."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    batch, kv_len, pages = 16, 4096, 16 * 256 + 8
    perm = rng.permutation(pages)
    tables = perm[:batch * 256].reshape(batch, 256)
    layout = ba.layouts.paged([1] * batch, tables, [kv_len] * batch, page_size=16, num_pages=pages)
    q = torch.randn(batch, GPU_HQ, GPU_D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(pages, 16, GPU_HKV, GPU_D, device="cuda", dtype=torch.float16) for _ in range(2))
    clean = _gpu_run(layout, q, k, v, ba.Variant())
    assert np.isfinite(clean[0]).all() and np.isfinite(clean[1]).all()
    v[int(tables[3, 100]), 7, 2, 0] = float("nan")
    k[int(perm[-1]), 0, :, :] = float("nan")  # a page no request lists
    o, s = _gpu_run(layout, q, k, v, ba.Variant())
    assert np.isnan(o[3, _heads_of(2)]).all()
    np.testing.assert_array_equal(s, clean[1])
    o[3, _heads_of(2)] = clean[0][3, _heads_of(2)]
    np.testing.assert_array_equal(o, clean[0])


@pytest.mark.gpu
def test_gpu_two_streams_sharing_one_batch_attention_take_turns():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    batch, kv_len = 8, 2048
    tables = rng.permutation(batch * 128).reshape(batch, 128)
    layout = ba.layouts.paged([1] * batch, tables, [kv_len] * batch, page_size=16, num_pages=batch * 128)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, GPU_HQ, GPU_HKV, GPU_D)
    assert attn.work_plans[0].num_merges > 0
    shapes = ((batch, GPU_HQ, GPU_D), (batch * 128, 16, GPU_HKV, GPU_D), (batch * 128, 16, GPU_HKV, GPU_D))
    inputs_ = [[torch.randn(*shape, device="cuda", dtype=torch.float16) for shape in shapes] for _ in range(2)]
    want = [attn.run(*x).clone() for x in inputs_]
    assert all(bool(torch.isfinite(w).all()) for w in want)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    got = []
    torch.cuda.synchronize()
    for _ in range(20):
        for stream, x in zip(streams, inputs_):
            with torch.cuda.stream(stream):
                got.append(attn.run(*x))
    torch.cuda.synchronize()
    for i, out in enumerate(got):
        torch.testing.assert_close(out, want[i % 2], rtol=0, atol=0)
