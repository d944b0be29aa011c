"""The dense microkernel, as NumPy: attention of gathered queries over gathered keys.

For query ``i`` (head ``h``, KV head ``h // G``) and visible keys ``j`` (see :mod:`bsrattn.variant`):

    s_ij = transform(sm_scale * rope(q_i) . rope(k_j))        (rope: the identity unless fused RoPE is on)
    lse_i = log(sum_j exp(s_ij))                       (natural log)
    o_i   = sum_j exp(s_ij - lse_i) v_j

A row with no visible key gets ``o = 0`` and ``lse = -inf``. FlashSigmoid instead returns
``o_i = sum_j sigmoid(s_ij + bias) v_j`` and ``lse = nan`` (undefined).

Numbers that are not numbers (the same on every tier, per query row and head):

- a hidden key (outside the causal mask, the window or the custom mask, past the row's end) contributes
  nothing, whatever its ``k`` and ``v`` hold;
- a visible score (after the soft cap and ALiBi) that is NaN or ``+inf`` makes ``o`` and ``lse`` NaN; a
  visible score of ``-inf`` weighs ``exp(-inf) = 0``;
- a NaN or infinity anywhere in a visible key's ``v`` makes the row's whole ``o`` NaN; ``lse`` depends on the
  scores alone;
- a row whose visible keys all weigh 0 (none visible, or every score ``-inf``) is empty: ``o = 0``,
  ``lse = -inf``, whatever ``v`` holds.

FlashSigmoid follows the same rules (a NaN score makes ``o`` NaN; ``sigmoid(+-inf)`` is 1 or 0).

:func:`attend` is the formula, all of a tile's keys at once with a plain softmax (no online rescaling), the
two products ``q . k`` and ``p . v`` on BLAS (``np.matmul``), a KV head's ``G`` query heads batched as one
matrix (:func:`per_kv_head`), so that each KV head's keys are read once per tile.
:func:`attend_range` is the loop around it: it gathers a (row, KV range)'s keys and values once and feeds
the row's queries through :func:`attend` in tiles of at most ``TILE_SCORES`` scores (``[Hq, rows, m]``), so
memory stays bounded whatever the row's length. A tile reads only the span of keys some of its queries can
see (a causal tile stops at its last query's position): a hidden key contributes nothing, so leaving it out
changes no answer.
"""

from __future__ import annotations

import numpy as np

from bsrattn import indexing
from bsrattn.reference.gather import gather

TILE_SCORES = 1 << 23  # scores per tile: 64 MiB of float64, a 128-query tile of a 2048-key row with 32 heads


def per_kv_head(x, num_kv_heads):
    """``x [Hq, n, X]`` as ``[Hkv, G*n, X]``: query head ``h`` reads KV head ``h // G`` (GQA), so a KV head's
    ``G`` query heads are one matrix against its keys and values."""
    return x.reshape(num_kv_heads, x.shape[0] // num_kv_heads * x.shape[1], x.shape[2])


def rope(x, pos, freqs):
    """``x [n, H, D]`` rotated at positions ``pos [n]`` (fused RoPE, :mod:`bsrattn.variant` step 0), in ``x``'s
    dtype: dimensions ``i`` and ``i + D/2`` turn by ``pos * freqs[i]``."""
    angle = pos.astype(x.dtype)[:, None] * freqs.astype(x.dtype)[None, :]          # [n, D/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    lo, hi = x[..., :freqs.size], x[..., freqs.size:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def scores(q, k, q_pos, k_pos, variant, sm_scale, dtype=np.float64, rope_pos=None):
    """``[Hq, n, m]`` transformed scores (fused RoPE, soft cap, ALiBi) before masking, of ``q [n, Hq, D]`` and
    ``k [m, Hkv, D]``; fused RoPE turns them at ``rope_pos = (q [n], k [m])``, by default ``q_pos`` and ``k_pos``."""
    (n, num_qo_heads, head_dim), (m, num_kv_heads, _) = q.shape, k.shape
    q, k = q.astype(dtype), k.astype(dtype)
    if variant.use_rope:
        freqs = variant.rope_frequencies(head_dim)
        q_rot, k_rot = (q_pos, k_pos) if rope_pos is None else rope_pos
        q, k = rope(q, q_rot, freqs), rope(k, k_rot, freqs)
    q = per_kv_head(q.transpose(1, 0, 2), num_kv_heads)                             # [Hkv, G*n, D]
    return transform(np.matmul(q, k.transpose(1, 2, 0)).reshape(num_qo_heads, n, m), q_pos, k_pos, variant,
                     sm_scale, dtype)


def transform(s, q_pos, k_pos, variant, sm_scale, dtype=np.float64):
    """Scores ``[Hq, n, m]`` from the products ``q . k`` (``s``, scaled in place): the scale, the soft cap,
    ALiBi's ``slope * (k_pos - q_pos)``, as :func:`scores` applies them."""
    s *= dtype(sm_scale)
    if variant.logits_soft_cap > 0:
        cap = dtype(variant.logits_soft_cap)
        s = cap * np.tanh(s / cap)
    if variant.alibi_slopes is not None:
        slopes = np.asarray(variant.alibi_slopes, dtype=dtype)
        s = s + slopes[:, None, None] * (k_pos[None, None, :] - q_pos[None, :, None]).astype(dtype)
    return s


def weighted_sum(w, v):
    """``sum_j w_ij v_j`` of weights ``w [Hq, n, m]`` and values ``v [m, Hkv, D]``: ``[n, Hq, D]``."""
    o = np.matmul(per_kv_head(w, v.shape[1]), v.transpose(1, 0, 2))               # [Hkv, G*n, D]
    return o.reshape(w.shape[0], w.shape[1], v.shape[2]).transpose(1, 0, 2)


def attend(q, k, v, q_pos, k_pos, variant, sm_scale, mask=None, dtype=np.float64, k_rope_offset=0, q_rope_pos=None):
    """Attention state of queries ``q [n, Hq, D]`` over keys ``k, v [m, Hkv, D]``.

    ``q_pos [n]`` and ``k_pos [m]`` are logical positions; ``mask [n, m]`` is the custom mask or None. Fused RoPE
    turns the queries at ``q_rope_pos [n]`` (default ``q_pos``) and the keys at ``k_pos + k_rope_offset``.
    Returns ``o [n, Hq, D]`` and ``lse [n, Hq]`` in ``dtype``.
    """
    n, num_qo_heads, _ = q.shape
    group = num_qo_heads // k.shape[1]
    visible = indexing.key_visible(q_pos[:, None], k_pos[None, :], variant.causal, variant.window_left)
    if mask is not None:
        visible = visible & mask
    # Only the span of keys some query sees is read (a causal tile stops at its last query): a hidden key adds
    # nothing, so the answer is the same, and a tile of a long row costs its visible part.
    seen = np.flatnonzero(visible.any(axis=0))
    span = slice(seen[0], seen[-1] + 1) if seen.size else slice(0, 0)
    k, v, k_pos, visible = k[span], v[span], k_pos[span], visible[:, span]
    with np.errstate(invalid="ignore", over="ignore"):   # non-finite inputs: see the rules above
        s = scores(q, k, q_pos, k_pos, variant, sm_scale, dtype,
                   rope_pos=(q_pos if q_rope_pos is None else q_rope_pos, k_pos + k_rope_offset))
    # Hidden keys must not reach P @ V even as 0 * NaN: their values are replaced by 0, and a non-finite value
    # of a visible key is recorded instead, per (query, head).
    v = v.astype(dtype)
    finite = np.isfinite(v)
    v_bad = np.repeat(~finite.all(axis=2), group, axis=1)                  # [m, Hq]
    bad = np.flatnonzero(v_bad.any(axis=1))                                # the few keys worth a look
    poisoned = (visible[:, bad, None] & v_bad[None, bad, :]).any(axis=1)   # [n, Hq]
    v = np.where(finite, v, 0)
    with np.errstate(invalid="ignore", over="ignore"):
        if variant.use_sigmoid:
            w = np.where(visible, 1.0 / (1.0 + np.exp(-(s + dtype(variant.sigmoid_bias)))), 0).astype(dtype)
            o = weighted_sum(w, v)
            return np.where(poisoned[:, :, None], np.nan, o), np.full((n, num_qo_heads), np.nan, dtype)
        np.copyto(s, -np.inf, where=~visible)
        m = s.max(axis=2, initial=-np.inf)                  # NaN if a visible score is NaN
        m_safe = np.where(m == -np.inf, 0, m)               # an empty row shifts by 0, not by -inf
        s -= m_safe[:, :, None]                             # in place: s is the tile's one large array
        p = np.exp(s, out=s)                                # a +inf score gives exp(inf - inf) = NaN
        denom = p.sum(axis=2).T                             # [n, Hq]
        o = weighted_sum(p, v) / np.where(denom == 0, 1, denom)[:, :, None]
    o = np.where((poisoned & (denom != 0))[:, :, None], np.nan, o)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m_safe.T + np.log(denom)
    return o.astype(dtype), lse.astype(dtype)


def attend_range(spec, q, k_slots, v_slots, r, qo_start, qo_end, kv_start, kv_end, dtype=np.float64):
    """State of query rows ``qo_start:qo_end`` of block row ``r`` over its logical KV ``kv_start:kv_end``.

    The shared body of the reference attention (whole rows) and of the plan executor (work items): the KV
    range gathered once, the queries through :func:`attend` a tile of rows at a time.
    """
    layout = spec.layout
    qo_len, kv_len = int(layout.qo_lens[r]), int(layout.kv_lens[r])
    local = np.arange(qo_start, qo_end) - int(layout.qo_indptr[r])
    q_pos = indexing.query_position(qo_len, kv_len, local)
    k_pos = np.arange(kv_start, kv_end)
    q_rot, k_offset = q_pos, 0
    if spec.variant.use_rope and spec.rope_positions is not None:  # not the layout's own (AttentionSpec.rope_frame)
        q_rot, k_offset = spec.rope_positions[0][qo_start:qo_end], int(spec.rope_positions[1][r])
    mask = layout.row_mask(r)
    if mask is not None:
        mask = mask[local][:, kv_start:kv_end]
    k = gather(k_slots, layout, r, kv_start, kv_end)
    v = gather(v_slots, layout, r, kv_start, kv_end)
    q = np.asarray(q)[qo_start:qo_end]
    o = np.zeros(q.shape[:2] + (spec.head_dim,), dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype)
    rows = max(1, TILE_SCORES // max(1, spec.num_qo_heads * (kv_end - kv_start)))
    for t in range(0, len(q), rows):
        tile = slice(t, t + rows)
        o[tile], lse[tile] = attend(q[tile], k, v, q_pos[tile], k_pos, spec.variant, spec.sm_scale,
                                    None if mask is None else mask[tile], dtype, k_offset, q_rot[tile])
    return o, lse


def attend_chunk(spec, q, k_slots, v_slots, r, qo_start, qo_end, kv_start, kv_end, dtype=np.float64):
    """Deterministic mode's state of query rows ``qo_start:qo_end`` of block row ``r`` over one chunk of its
    grid, logical KV ``kv_start:kv_end`` (``kv_start`` a multiple of ``spec.split_size``).

    Each query row is computed on its own, over the chunk's ``split_size`` slots: those past ``kv_end``, and
    the keys a mask hides, are hidden (score ``-inf``, value 0). Every sum is a NumPy reduction over a length
    the grid fixes (``head_dim`` for ``q . k``, ``split_size`` for ``sum p`` and ``p . v``), so the state is a
    function of the query, the chunk's keys and positions and what the query sees of them, and of nothing else:
    not the item's other queries, nor where the row ends past the chunk, nor the batch. (:func:`attend` batches
    queries on BLAS, whose order of summation follows the matrices' shapes.) The rules for NaN and infinities
    are :func:`attend`'s. Returns ``(o [n, Hq, D], lse [n, Hq])`` in ``dtype``.
    """
    layout, variant, size = spec.layout, spec.variant, spec.split_size
    group = spec.group_size
    qo_len, kv_len = int(layout.qo_lens[r]), int(layout.kv_lens[r])
    local = np.arange(qo_start, qo_end) - int(layout.qo_indptr[r])
    q_pos = indexing.query_position(qo_len, kv_len, local)
    k_pos = np.arange(kv_start, kv_start + size)
    count = kv_end - kv_start
    k = np.zeros((size, spec.num_kv_heads, spec.head_dim), dtype)
    v = np.zeros_like(k)
    k[:count] = gather(k_slots, layout, r, kv_start, kv_end)
    v[:count] = gather(v_slots, layout, r, kv_start, kv_end)
    q = np.asarray(q)[qo_start:qo_end].astype(dtype)
    if variant.use_rope:
        q_rot, k_offset = spec.rope_frame()
        freqs = variant.rope_frequencies(spec.head_dim)
        q = rope(q, q_rot[qo_start:qo_end], freqs)
        k = rope(k, k_pos + int(k_offset[r]), freqs)
    k_heads = np.repeat(k, group, axis=1).transpose(1, 0, 2)                    # [Hq, S, D]
    finite = np.isfinite(v)
    v_bad = np.repeat(~finite.all(axis=2), group, axis=1)                      # [S, Hq]
    mask = layout.row_mask(r)
    o = np.zeros(q.shape, dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype)
    for i in range(q.shape[0]):
        visible = (k_pos < kv_end) & indexing.key_visible(q_pos[i], k_pos, variant.causal, variant.window_left)
        if mask is not None:
            visible[:count] &= mask[local[i], kv_start:kv_end]
        poisoned = (visible[:, None] & v_bad).any(axis=0)                      # [Hq]
        v_heads = np.repeat(np.where(visible[:, None, None] & finite, v, 0), group, axis=1).transpose(1, 2, 0)
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
