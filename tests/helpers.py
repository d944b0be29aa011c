"""What a layout means, recomputed from its constructor's raw inputs, and the checks built on it.

Nothing here reads a ``BSRLayout``'s arrays or calls its methods, or calls a tier: the query views come from
the page tables, token lists, block lists and tree parents in ``case.raw``, and the oracle is a plain float64
loop over (query, head) (:func:`naive_attention`; :func:`naive_state` and :func:`naive_merge` for keys given
with positions and for states). That independence is what makes "the layout equals dense masked attention",
and "a tier equals the oracle", tests rather than restatements; every tier, the reference included, is
compared with it through :func:`check_attention` and :func:`assert_matches_oracle`, the one place that says
what "matches" means (``bsrattn.testing``'s error budget, or its float64 table entry).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import assert_close, assert_within_budget, naive_attention_row

NUMPY_DTYPES = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
}


@dataclass(frozen=True)
class QueryView:
    """What one query row (for one KV head) sees, from the raw inputs.

    ``slots [m]`` index the canonical pool ``[num_slots, Hkv, D]`` (slot ``page * page_size + t``),
    ``k_pos [m]`` are the keys' logical positions, ``q_pos`` the query's, ``allowed [m]`` the data mask
    (block mask, tree mask; all True otherwise).
    """

    slots: np.ndarray
    k_pos: np.ndarray
    q_pos: int
    allowed: np.ndarray


def _view(slots, q_pos, allowed=None, k_pos=None):
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    k_pos = np.arange(slots.size) if k_pos is None else np.asarray(k_pos, dtype=np.int64)
    allowed = np.ones(slots.size, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool)
    return QueryView(slots, k_pos, int(q_pos), allowed)


def _paged_slots(table, kv_len, page_size):
    return [table[t // page_size] * page_size + t % page_size for t in range(kv_len)]


def query_views(case) -> list:
    """``views[n]``: a list of :class:`QueryView`, one for all KV heads or one per KV head (Quest).

    ``n`` runs over the raw query rows (for Quest: the requests, before the per-head views).
    """
    raw = case.raw
    views = []
    if case.kind in ("ragged", "dense"):
        qo_lens = raw["qo_lens"] if case.kind == "ragged" else [raw["qo_len"]]
        kv_lens = raw["kv_lens"] if case.kind == "ragged" else [raw["kv_len"]]
        start = 0
        for qo, kv in zip(qo_lens, kv_lens):
            views += [[_view(range(start, start + kv), kv - qo + i)] for i in range(qo)]
            start += kv
    elif case.kind == "paged":
        for qo, table, kv in zip(raw["qo_lens"], raw["page_tables"], raw["kv_lens"]):
            slots = _paged_slots(table, kv, raw["page_size"])
            views += [[_view(slots, kv - qo + i)] for i in range(qo)]
    elif case.kind == "block_sparse":
        R, C, indptr, indices = raw["R"], raw["C"], raw["indptr"], raw["indices"]
        for row in range(raw["M"] // R):
            blocks = range(indptr[row], indptr[row + 1])
            slots = [indices[b] * C + j for b in blocks for j in range(C)]
            for i in range(R):
                allowed = None if raw["mask"] is None else [raw["mask"][b][i][j] for b in blocks for j in range(C)]
                views.append([_view(slots, len(slots) - R + i, allowed)])
    elif case.kind == "vector_sparse":
        for tokens, qo in zip(raw["token_indices"], raw["qo_lens"]):
            views += [[_view(tokens, len(tokens) - qo + i)] for i in range(qo)]
    elif case.kind == "quest":
        ps = raw["page_size"]
        for table, kv, selected in zip(raw["page_tables"], raw["kv_lens"], raw["selected_pages"]):
            per_head = []
            for pages in selected:
                tokens = [t for p in pages for t in range(p * ps, min((p + 1) * ps, kv))]
                per_head.append(_view([table[t // ps] * ps + t % ps for t in tokens], len(tokens) - 1))
            views.append(per_head)
    elif case.kind == "tree":
        for parents, table, kv in zip(raw["parents"], raw["page_tables"], raw["kv_lens"]):
            n = len(parents)
            committed = kv - n
            slots = _paged_slots(table, kv, raw["page_size"])
            for i in range(n):
                allowed = [t < committed for t in range(kv)]
                node = i
                while node != -1:
                    allowed[committed + node] = True
                    node = parents[node]
                views.append([_view(slots, committed + i, allowed)])
    elif case.kind == "shared_prefix":
        ps, plen = raw["page_size"], raw["prefix_len"]
        prefix = _paged_slots(raw["prefix_pages"], plen, ps)
        for qo, table, slen in zip(raw["qo_lens"], raw["suffix_page_tables"], raw["suffix_lens"]):
            slots = prefix + _paged_slots(table, slen, ps)
            # Absolute positions: the prefix, then the suffix; queries are the suffix's last qo tokens.
            views += [[_view(slots, plen + slen - qo + i)] for i in range(qo)]
    else:
        raise ValueError(f"unknown layout kind {case.kind!r}")
    return views


# ---- tensors ------------------------------------------------------------------------------------------

def pool_geometry(case) -> tuple:
    """``(num_blocks, block_size)`` of the raw KV pool, from the raw inputs."""
    raw = case.raw
    if case.kind in ("ragged", "dense"):
        kv = raw["kv_lens"] if case.kind == "ragged" else [raw["kv_len"]]
        return int(sum(kv)), 1
    if case.kind == "block_sparse":
        return raw["N"] // raw["C"], raw["C"]
    if case.kind == "vector_sparse":
        return raw["num_slots"], 1
    return raw["num_pages"], raw["page_size"]


def num_query_rows(case) -> int:
    raw = case.raw
    if case.kind == "quest":
        return len(raw["kv_lens"])
    if case.kind == "block_sparse":
        return raw["M"]
    if case.kind == "dense":
        return raw["qo_len"]
    if case.kind == "tree":
        return sum(len(p) for p in raw["parents"])
    return int(sum(raw["qo_lens"]))


def raw_tensors(problem, dtype=np.float64, rng=None):
    """Random raw ``q [n, Hq, D]`` and ``k, v`` in the case's storage, rounded through ``dtype``; float64."""
    case = problem.case
    rng = np.random.default_rng(problem.seed) if rng is None else rng
    hq, hkv, d = problem.num_qo_heads, problem.num_kv_heads, problem.head_dim
    nb, bs = pool_geometry(case)
    kv_shape = {"flat": (nb * bs, hkv, d), "NHD": (nb, bs, hkv, d), "HND": (nb, hkv, bs, d),
                "quest": (nb, hkv, bs, d)}[case.kv_pool]
    q = rng.standard_normal((num_query_rows(case), hq, d))
    k, v = rng.standard_normal(kv_shape), rng.standard_normal(kv_shape)
    return tuple(rounded(x, dtype) for x in (q, k, v))


def rounded(x, dtype) -> np.ndarray:
    """``x`` rounded through ``dtype`` (a name of :data:`NUMPY_DTYPES` or a NumPy dtype), as float64."""
    return np.asarray(x).astype(NUMPY_DTYPES.get(dtype, dtype)).astype(np.float64)


def as_float64(x) -> np.ndarray:
    """Any tier's array (NumPy, torch tensor, Numba device array) as float64 NumPy."""
    if hasattr(x, "detach"):
        return x.detach().double().cpu().numpy()
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    return np.asarray(x).astype(np.float64)


def canonical_pool(case, x) -> np.ndarray:
    """Raw ``k``/``v`` (``x``: the case's storage, see ``LayoutCase.kv_pool``) as ``[num_slots, Hkv, D]``,
    slot ``block * block_size + t``."""
    x = np.asarray(x, dtype=np.float64)
    if case.kv_pool in ("HND", "quest"):
        x = x.transpose(0, 2, 1, 3)
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def call_inputs(case, q, k, v) -> tuple:
    """The arguments ``(q, k, v, kv_layout)`` a caller passes to ``ba.attention`` for raw tensors.

    ``q [n, Hq, D]`` and ``k, v`` in the case's storage, as :func:`raw_tensors` makes them.
    """
    if case.kind == "quest":
        q, k, v = ba.layouts.per_head_views(q, k, v, case.num_kv_heads)
        return q, k, v, "NHD"
    nb, bs = pool_geometry(case)
    if case.block_size != bs:
        # A flattened Cascade addresses the paged pool slot by slot (block_size 1).
        return q, canonical_pool(case, k), canonical_pool(case, v), "NHD"
    if case.kv_pool == "flat" and bs > 1:
        return q, k.reshape(nb, bs, *k.shape[1:]), v.reshape(nb, bs, *v.shape[1:]), "NHD"
    return q, k, v, ("HND" if case.kv_pool == "HND" else "NHD")


def output_to_raw(case, out, lse=None, num_qo_heads=None):
    """Undo Quest's per-head view: ``out [B*Hkv, G, D] -> [B, Hq, D]``, ``lse [B*Hkv, G] -> [B, Hq]``;
    identity otherwise."""
    if case.kind != "quest":
        return out, lse
    batch = len(case.raw["kv_lens"])
    out = out.reshape(batch, num_qo_heads, out.shape[-1])
    return out, (None if lse is None else lse.reshape(batch, num_qo_heads))


# ---- the independent reference ------------------------------------------------------------------------

def visible(view, variant) -> np.ndarray:
    """``[m]`` bool: the data mask and the variant's position masks, from positions alone."""
    keep = view.allowed.copy()
    if variant.causal:
        keep &= view.k_pos <= view.q_pos
    if variant.window_left >= 0:
        keep &= view.q_pos - view.k_pos <= variant.window_left
    return keep


def rotate(x, pos, variant, dtype):
    """Fused RoPE from its definition (``bsrattn.variant``, step 0): ``x [..., D]`` at positions ``pos [...]``, as a
    framework rotates before attention: in float32 unless ``dtype`` is float64, the result rounded to ``dtype``."""
    work = np.float64 if dtype == "float64" else np.float32
    d = x.shape[-1]
    half = d // 2
    inv_freq = (1.0 / variant.rope_theta ** (np.arange(0, d, 2) / d) / variant.rope_scale).astype(work)
    angle = np.asarray(pos, dtype=work)[..., None] * inv_freq
    cos, sin = np.cos(angle), np.sin(angle)
    x = np.asarray(x, dtype=work)
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1).astype(NUMPY_DTYPES[dtype])


def _naive_query(q, K, V, view, variant, scale, slope, dtype):
    """One query head ``q [D]`` over the keys of ``view`` in the KV head's pool ``K, V [num_slots, D]``."""
    keep = visible(view, variant)
    bias = None if slope is None else slope * (view.k_pos - view.q_pos)[keep]
    keys = K[view.slots[keep]]
    if variant.use_rope:
        q, keys = rotate(q, view.q_pos, variant, dtype), rotate(keys, view.k_pos[keep], variant, dtype)
    return naive_attention_row(q, keys, V[view.slots[keep]], scale, dtype,
                               soft_cap=variant.logits_soft_cap, bias=bias, sigmoid_bias=variant.sigmoid_bias)


def naive_attention(problem, q, k, v, variant=None, dtype="float64"):
    """Attention of every raw query row and head, by a loop, from the raw inputs alone: the float64 oracle, or
    with ``dtype`` the same attention done naively in that precision (``bsrattn.testing.naive_attention_row``).

    Returns ``out [n, Hq, D]`` and ``lse [n, Hq]`` (natural log; ``-inf`` and ``out = 0`` for a query that
    sees nothing; ``lse = nan`` for FlashSigmoid). Attention sinks join each head's softmax denominator by their
    definition, ``lse' = log(exp(lse) + exp(sink))`` and ``out' = out exp(lse) / exp(lse')``, not through ⊕.
    """
    case = problem.case
    variant = problem.variant if variant is None else variant
    K, V = canonical_pool(case, k), canonical_pool(case, v)
    q = np.asarray(q, dtype=np.float64)
    n, hq, d = q.shape
    group = hq // K.shape[1]
    scale = variant.sm_scale if variant.sm_scale is not None else 1.0 / math.sqrt(d)
    out, lse = np.zeros((n, hq, d)), np.zeros((n, hq))
    for i, per_head in enumerate(query_views(case)):
        for h in range(hq):
            g = h // group
            view = per_head[g] if len(per_head) > 1 else per_head[0]
            slope = None if variant.alibi_slopes is None else variant.alibi_slopes[h]
            out[i, h], lse[i, h] = _naive_query(q[i, h], K[:, g], V[:, g], view, variant, scale, slope, dtype)
    if variant.sinks is not None:
        total = np.logaddexp(lse, np.asarray(variant.sinks)[None, :])
        out, lse = out * np.exp(lse - total)[..., None], total
    return out, lse


def naive_state(q, k, v, q_pos, k_pos, variant, sm_scale):
    """The float64 oracle's state of ``q [n, Hq, D]`` over keys ``k, v [m, Hkv, D]`` at positions ``q_pos [n]``,
    ``k_pos [m]``: ``(o [n, Hq, D], lse [n, Hq])``."""
    q = np.asarray(q, dtype=np.float64)
    n, hq, d = q.shape
    group = hq // k.shape[1]
    out, lse = np.zeros((n, hq, d)), np.zeros((n, hq))
    for i in range(n):
        view = _view(np.arange(k.shape[0]), q_pos[i], k_pos=k_pos)
        for h in range(hq):
            slope = None if variant.alibi_slopes is None else variant.alibi_slopes[h]
            out[i, h], lse[i, h] = _naive_query(q[i, h], k[:, h // group], v[:, h // group], view, variant,
                                                sm_scale, slope, "float64")
    return out, lse


def naive_merge(o, lse):
    """``o [n, S, H, D]``, ``lse [n, S, H]`` merged in one step, in float64, from the definition: the weights
    ``exp(lse_s - max)`` of the non-empty states normalised, ``lse = max + log(sum of the weights)``. One
    state is its own merge, an empty one's ``o`` included: there is nothing to fold."""
    o, lse = np.asarray(o, dtype=np.float64), np.asarray(lse, dtype=np.float64)
    if o.shape[1] == 1:
        return o[:, 0], lse[:, 0]
    top = lse.max(axis=1, keepdims=True)
    shift = np.where(np.isfinite(top), top, 0.0)
    w = np.exp(lse - shift)
    total = w.sum(axis=1)
    weighted = np.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(axis=1)
    merged = weighted / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        return merged, np.where(total > 0, shift[:, 0] + np.log(total), -np.inf)


def dense_mask_from_raw(case, variant=None) -> np.ndarray:
    """``[nnz_qo, num_slots]`` bool in the layout's own row and slot numbering, from the raw inputs.

    For Quest the rows are ``(request, KV head)`` and the slots index the HND pool ``[P, Hkv, page]``.
    """
    variant = ba.Variant() if variant is None else variant
    views = query_views(case)
    nb, bs = pool_geometry(case)
    if case.kind == "quest":
        hkv = case.num_kv_heads
        mask = np.zeros((len(views) * hkv, nb * hkv * bs), dtype=bool)
        for b, per_head in enumerate(views):
            for g, view in enumerate(per_head):
                hnd_slots = (view.slots // bs) * hkv * bs + g * bs + view.slots % bs
                mask[b * hkv + g, hnd_slots[visible(view, variant)]] = True
        return mask
    mask = np.zeros((len(views), nb * bs), dtype=bool)
    for i, (view,) in enumerate(views):
        mask[i, view.slots[visible(view, variant)]] = True
    return mask


# ---- checks shared by the property tests and the wrong-implementation tests --------------------------

def assert_matches_reference(got, q, k, v, layout, dtype, *, variant=None, kv_layout="NHD", name="output",
                             **scales):
    """Raise unless ``got`` (``out``, or ``(out, lse)``) of a call on ``q, k, v`` over ``layout`` matches the
    reference tier's answer on the same stored values in float64, within the tolerance table's ``dtype`` entry.

    ``q, k, v`` are what the call was given (any tier's arrays, fp8 too: the reference reads their values);
    ``scales`` are the call's ``k_scale``/``v_scale``.
    """
    variant = variant or ba.Variant()
    with_lse = not variant.use_sigmoid
    want = ba.attention(*(as_float64(x) for x in (q, k, v)), layout, variant=variant, kv_layout=kv_layout,
                        backend="reference", return_lse=with_lse, **scales)
    got_o, got_lse = got if with_lse else (got, None)
    want_o, want_lse = want if with_lse else (want, None)
    assert_close(as_float64(got_o), want_o, "attention", dtype, name=f"{name} out")
    if with_lse:
        assert_close(as_float64(got_lse), want_lse, "lse", dtype, name=f"{name} lse")


def assert_matches_oracle(got_o, got_lse, want, naive=None, dtype="float64", name="output"):
    """Raise unless ``got_o`` (and ``got_lse``, unless None) match the float64 oracle's ``want = (o, lse)``.

    In float64 (``naive`` None) the table's float64 entries apply; in a lower ``dtype``, the error budget of
    ``bsrattn.testing`` against ``naive = (o, lse)``, the same attention computed naively in ``dtype``.
    """
    if naive is None:
        assert_close(got_o, want[0], "attention", dtype, name=f"{name} out")
        if got_lse is not None:
            assert_close(got_lse, want[1], "lse", dtype, name=f"{name} lse")
        return
    assert_within_budget(got_o, want[0], naive[0], "attention", dtype, name=f"{name} out")
    if got_lse is not None:
        assert_within_budget(got_lse, want[1], naive[1], "lse", dtype, name=f"{name} lse")


def check_attention(run, problem, dtype="float64", tensors=None, *, kv_dtype=None, k_scale=None, v_scale=None,
                    name=None):
    """Run ``run(q, k, v, kv_layout) -> (out, lse or None)`` on ``problem`` and raise unless it matches the
    oracle (:func:`assert_matches_oracle`); return its ``(out, lse)`` as float64 in the raw query order.

    ``run`` gets NumPy arrays as a caller passes them (:func:`call_inputs`): ``q`` in ``dtype``, ``k`` and ``v``
    in ``kv_dtype`` (default ``dtype``). ``tensors`` are raw ``(q, k, v)`` (default :func:`raw_tensors` in
    ``dtype``); for fp8 KV the oracle sees ``k * k_scale`` and ``v * v_scale``, which ``run`` must pass on.
    """
    case = problem.case
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    q, k, v = raw_tensors(problem, dtype) if tensors is None else tensors
    q_c, k_c, v_c, kv_layout = call_inputs(case, q, k, v)
    out, lse = run(q_c.astype(NUMPY_DTYPES[dtype]), k_c.astype(NUMPY_DTYPES[kv_dtype]),
                   v_c.astype(NUMPY_DTYPES[kv_dtype]), kv_layout)
    out, lse = output_to_raw(case, as_float64(out), None if lse is None else as_float64(lse), problem.num_qo_heads)
    k, v = k * (1.0 if k_scale is None else k_scale), v * (1.0 if v_scale is None else v_scale)
    naive = None if dtype == "float64" else naive_attention(problem, q, k, v, dtype=dtype)
    assert_matches_oracle(out, lse, naive_attention(problem, q, k, v), naive, dtype,
                          name or f"{case.kind} {dtype}")
    return out, lse


def reference_impl(q, k, v, layout, variant, kv_layout):
    """``ba.attention`` on the reference tier, returning ``(out, lse)`` (lse None for FlashSigmoid)."""
    if variant.sigmoid_bias is not None:
        return ba.attention(q, k, v, layout, variant=variant, kv_layout=kv_layout, backend="reference"), None
    return ba.attention(q, k, v, layout, variant=variant, kv_layout=kv_layout, backend="reference", return_lse=True)


def check_layout_attention(impl, problem, dtype="float64"):
    """Raise AssertionError unless ``impl(q, k, v, layout, variant, kv_layout) -> (out, lse)`` equals
    the naive attention computed from the raw inputs (:func:`check_attention`)."""
    check_attention(lambda q, k, v, kv_layout: impl(q, k, v, problem.case.layout, problem.variant, kv_layout),
                    problem, dtype)


def check_split_merge(merge_states_fn, q, k, v, q_pos, k_pos, variant, sm_scale, cuts, order):
    """Raise unless the keys split at ``cuts``, attended chunk by chunk and merged with ``merge_states_fn``
    in ``order``, equal the oracle's attention over all keys (float64).

    ``q [n, Hq, D]``, ``k, v [m, Hkv, D]``, ``q_pos [n]``, ``k_pos [m]``; ``cuts`` sorted split points.
    """
    bounds = [0, *cuts, k.shape[0]]
    parts = [naive_state(q, k[a:b], v[a:b], q_pos, k_pos[a:b], variant, sm_scale) for a, b in zip(bounds, bounds[1:])]
    parts = [parts[i] for i in order]
    o, lse = merge_states_fn(np.stack([p[0] for p in parts], axis=1), np.stack([p[1] for p in parts], axis=1))
    assert_matches_oracle(o, lse, naive_state(q, k, v, q_pos, k_pos, variant, sm_scale), name="merged")


def check_plan_coverage(work_plan, qo_lens, kv_lens):
    """Raise unless the plan covers every (query row, KV slot) exactly once, every query row at least once,
    and its partial slots and merge lists are consistent. Counts are recomputed from the lengths."""
    qo_lens, kv_lens = np.asarray(qo_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    nnz = int(qo_indptr[-1])
    row_of = np.repeat(np.arange(qo_lens.size), qo_lens)
    counts = [np.zeros(int(kv_lens[r]), dtype=np.int64) for r in row_of]
    items_per_query = np.zeros(nnz, dtype=np.int64)
    wp = work_plan
    assert wp.cta_indptr.shape == (wp.num_ctas + 1,) and wp.cta_indptr[0] == 0, "cta_indptr must be [num_ctas+1] from 0"
    assert (np.diff(wp.cta_indptr) >= 0).all() and wp.cta_indptr[-1] == wp.num_items, "cta_indptr not monotone/complete"
    for w in range(wp.num_items):
        r, qs, qe = int(wp.item_row[w]), int(wp.item_qo_start[w]), int(wp.item_qo_end[w])
        ks, ke = int(wp.item_kv_start[w]), int(wp.item_kv_end[w])
        assert qo_indptr[r] <= qs < qe <= qo_indptr[r + 1], f"item {w} rows {qs}:{qe} outside row {r}"
        assert 0 <= ks <= ke <= kv_lens[r], f"item {w} KV {ks}:{ke} outside row {r}'s {kv_lens[r]} slots"
        for i in range(qs, qe):
            counts[i][ks:ke] += 1
            items_per_query[i] += 1
    for i, c in enumerate(counts):
        assert (c == 1).all(), f"query row {i}: KV slots covered {c.tolist()} times, want exactly once each"
    assert (items_per_query >= 1).all(), f"query rows {np.flatnonzero(items_per_query == 0).tolist()} have no item"
    # Partial slots: split tiles write disjoint workspace rows; each split tile has one merge list, in KV order.
    split = wp.item_partial >= 0
    used = np.zeros(wp.num_partial_rows, dtype=np.int64)
    for w in np.flatnonzero(split):
        p = int(wp.item_partial[w])
        used[p:p + int(wp.item_qo_end[w] - wp.item_qo_start[w])] += 1
    assert (used == 1).all(), "partial workspace rows must be written exactly once"
    merged = set()
    for m in range(wp.num_merges):
        qs, qe = int(wp.merge_qo_start[m]), int(wp.merge_qo_end[m])
        members = [int(np.flatnonzero(wp.item_partial == p)[0])
                   for p in wp.merge_partials[wp.merge_indptr[m]:wp.merge_indptr[m + 1]]]
        assert len(members) >= 2, f"merge {m} folds {len(members)} partial(s)"
        assert all((wp.item_qo_start[w], wp.item_qo_end[w]) == (qs, qe) for w in members), f"merge {m} mixes tiles"
        starts = [int(wp.item_kv_start[w]) for w in members]
        assert starts == sorted(starts), f"merge {m} folds chunks out of KV order: {starts}"
        merged.update(members)
    assert merged == set(np.flatnonzero(split).tolist()), "every partial state must be merged exactly once"


def flattened_problem(problem):
    """A shared-prefix problem as its flattened single layout (absolute positions; accepts ALiBi/windows)."""
    case = replace(problem.case, layout=problem.case.layout.flatten(), kind="shared_prefix")
    return replace(problem, case=case)


def generate_each(model, prompts, counts, system=None) -> list:
    """``model.generate``'s greedy new tokens for each prompt alone (behind ``system``, a token tensor, when
    given): what a serving loop's batched, paged decoding must reproduce request by request."""
    import torch

    out = []
    for prompt, n in zip(prompts, counts):
        full = prompt if system is None else torch.cat([system, prompt])
        with torch.no_grad():
            out.append(model.generate(full[None], max_new_tokens=n, do_sample=False)[0, full.numel():].tolist())
    return out


def compiled_or_python(*host_loops):
    """A fixture running its tests twice: with ``host_loops`` (``bsrattn.compiled.Compiled``) compiled by Numba,
    then as their plain-Python source, as when Numba is not installed (the same source: a fault in it fails
    both, and the second costs no compilation)."""
    @pytest.fixture(params=["compiled", "python"])
    def implementation(request):
        with contextlib.ExitStack() as stack:
            if request.param == "python":
                for loop in host_loops:
                    stack.enter_context(loop.as_python())
            yield request.param
    return implementation
