"""What deterministic mode adds to the plan executor: the canonical chunk grid, so a row's state is partition invariant.

KV is cut at absolute positions, multiples of ``spec.split_size`` (:func:`grid_state`), and each chunk's state
is computed query by query over sums of a length the grid fixes (:func:`attend_chunk`): a query row's ``out``
and ``lse`` are then the same bits whatever the rest of the batch, the plan's cuts, ``num_ctas``, a Cascade
holding part of the KV, or a prefill chunked into several calls (``docs/concepts/determinism.md``). The
plan executor (:mod:`.executor`) runs an item through :func:`grid_state` instead of
:func:`~bsrattn.reference.microkernel.attend_range` when the spec has a grid.
"""

from __future__ import annotations

import numpy as np

from bsrattn import indexing
from bsrattn.reference.gather import gather
from bsrattn.reference.merge import merge_state
from bsrattn.reference.microkernel import rope, transform


def grid_state(spec, q, k_slots, v_slots, r, qo_start, qo_end, kv_start, kv_end, dtype=np.float64):
    """Deterministic mode's state of an item: its KV in chunks of the grid (``spec.split_size``), each chunk's
    state by :func:`attend_chunk`, folded left to right with ⊕ (added, for FlashSigmoid) — the states and the
    order of a plan that cuts the row at every grid point. (The torch tier's plans hold several chunks per item,
    ``scheduler.plan``'s ``lead_items``; the others one.)"""
    size = spec.split_size
    (o, s), *rest = (attend_chunk(spec, q, k_slots, v_slots, r, qo_start, qo_end, start, min(start + size, kv_end),
                                  dtype) for start in range(kv_start, max(kv_end, kv_start + 1), size))
    for o_c, s_c in rest:
        o, s = (o + o_c, s) if spec.variant.use_sigmoid else merge_state(o, s, o_c, s_c)
    return o, s


def attend_chunk(spec, q, k_slots, v_slots, r, qo_start, qo_end, kv_start, kv_end, dtype=np.float64):
    """Deterministic mode's state of query rows ``qo_start:qo_end`` of block row ``r`` over one chunk of its
    grid, logical KV ``kv_start:kv_end`` (``kv_start`` a multiple of ``spec.split_size``).

    Each query row is computed on its own, over the chunk's ``split_size`` slots: those past ``kv_end``, and
    the keys a mask hides, are hidden (score ``-inf``, value 0). Every sum is a NumPy reduction over a length
    the grid fixes (the head dimension for ``q . k``, ``split_size`` for ``sum p`` and ``p . v``), so the state is a
    function of the query, the chunk's keys and positions and what the query sees of them, and of nothing else:
    not the item's other queries, nor where the row ends past the chunk, nor the batch. (The plain path,
    :func:`~bsrattn.reference.microkernel.attend_tiles`, batches queries on BLAS, whose order of summation follows
    the matrices' shapes.) The rules for NaN and infinities are
    :func:`~bsrattn.reference.microkernel.attend`'s. Returns ``(o [n, Hq, D], lse [n, Hq])`` in ``dtype``.
    """
    layout, variant, size = spec.layout, spec.variant, spec.split_size
    group_size = spec.group_size
    qo_len, kv_len = int(layout.qo_lens[r]), int(layout.kv_lens[r])
    local = np.arange(qo_start, qo_end) - int(layout.qo_indptr[r])
    q_pos = indexing.query_position(qo_len, kv_len, local)
    k_pos = np.arange(kv_start, kv_start + size)
    count = kv_end - kv_start
    k = np.zeros((size, spec.num_kv_heads, spec.head_dim), dtype)
    v = np.zeros((size, spec.num_kv_heads, spec.dim_vo), dtype)
    k[:count] = gather(k_slots, layout, r, kv_start, kv_end)
    v[:count] = gather(v_slots, layout, r, kv_start, kv_end)
    q = np.asarray(q)[qo_start:qo_end].astype(dtype)
    if variant.use_rope:
        q_rot, k_offset = spec.rope_frame()
        freqs = variant.rope_frequencies(spec.head_dim)
        q = rope(q, q_rot[qo_start:qo_end], freqs)
        k = rope(k, k_pos + int(k_offset[r]), freqs)
    k_heads = np.repeat(k, group_size, axis=1).transpose(1, 0, 2)               # [Hq, S, D]
    finite = np.isfinite(v)
    v_bad = np.repeat(~finite.all(axis=2), group_size, axis=1)                 # [S, Hq]
    mask = layout.row_mask(r)
    o = np.zeros(q.shape[:2] + (spec.dim_vo,), dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype)
    for i in range(q.shape[0]):
        visible = (k_pos < kv_end) & indexing.key_visible(q_pos[i], k_pos, variant.causal, variant.window_left)
        if mask is not None:
            visible[:count] &= mask[local[i], kv_start:kv_end]
        poisoned = (visible[:, None] & v_bad).any(axis=0)                      # [Hq]
        v_heads = np.repeat(np.where(visible[:, None, None] & finite, v, 0), group_size, axis=1).transpose(1, 2, 0)
        with np.errstate(invalid="ignore", over="ignore"):
            s = transform(np.sum(q[i][:, None, :] * k_heads, axis=-1)[:, None, :], q_pos[i:i + 1], k_pos, variant,
                          spec.sm_scale, dtype)[:, 0]                           # [Hq, S]
            if variant.use_sigmoid:
                w = np.where(visible, 1.0 / (1.0 + np.exp(-(s + dtype(variant.sigmoid_bias)))), 0)
                o[i] = np.where(poisoned[:, None], np.nan, np.sum(w[:, None, :] * v_heads, axis=-1))
                lse[i] = np.nan
                continue
            s = np.where(visible, s, -np.inf)
            m = s.max(axis=1, initial=-np.inf)
            m_safe = np.where(m == -np.inf, 0, m)
            p = np.exp(s - m_safe[:, None])
            denom = p.sum(axis=1)
            o[i] = np.sum(p[:, None, :] * v_heads, axis=-1) / np.where(denom == 0, 1, denom)[:, None]
        o[i] = np.where((poisoned & (denom != 0))[:, None], np.nan, o[i])
        with np.errstate(divide="ignore", invalid="ignore"):
            lse[i] = m_safe + np.log(denom)
    return o, lse
