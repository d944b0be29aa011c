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

:func:`attend` is the formula as written: every key at once, a plain softmax, the rules for values that are
not numbers as one step (:func:`poisoned_sum`). :func:`attend_tiles` is its fast path, the one the tier runs:
the same arguments and states, the queries in tiles of bounded size, each reading only the keys it can see,
the softmax in place. :func:`attend_range` gathers a (row, KV range)'s keys and values once and runs its
queries through :func:`attend_tiles`; it is the body that the row-by-row attention (:mod:`.rows`) and the
plan executor (:mod:`.executor`) share. Both paths compute ``q . k`` and ``p . v`` on BLAS (``np.matmul``), a
KV head's ``G`` query heads batched as one matrix (:func:`per_kv_head`).
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


def poisoned_sum(w, v, visible, live=True):
    """``o [n, Hq, D] = sum_j w_ij v_j`` under the rules for values that are not numbers, in one step.

    ``w [Hq, n, m]`` are the weights, ``v [m, Hkv, D]`` the values, ``visible [n, m]`` which keys each query
    sees, ``live [n, Hq]`` the rows that are not empty. A hidden key's ``v`` never reaches ``o``, not even as
    ``0 * NaN``: the sum is over the finite values, and then a NaN or infinity anywhere in a visible key's ``v``
    makes the whole ``o`` of a live row NaN. An empty row's ``o`` stays 0 whatever ``v`` holds.
    """
    finite = np.isfinite(v)
    bad = np.repeat(~finite.all(axis=2), w.shape[0] // v.shape[1], axis=1)   # [m, Hq]
    worth_a_look = np.flatnonzero(bad.any(axis=1))                           # the few keys that are not numbers
    poisoned = (visible[:, worth_a_look, None] & bad[None, worth_a_look, :]).any(axis=1)   # [n, Hq]
    o = weighted_sum(w, np.where(finite, v, 0))
    return np.where((poisoned & live)[:, :, None], np.nan, o)


def attend(q, k, v, q_pos, k_pos, variant, sm_scale, mask=None, dtype=np.float64, k_rope_offset=0, q_rope_pos=None):
    """Attention state of queries ``q [n, Hq, D]`` over keys ``k, v [m, Hkv, D]``: the formula, every key at once.

    ``q_pos [n]`` and ``k_pos [m]`` are logical positions; ``mask [n, m]`` is the custom mask or None. Fused RoPE
    turns the queries at ``q_rope_pos [n]`` (default ``q_pos``) and the keys at ``k_pos + k_rope_offset``. With
    ``s`` the scores of :func:`scores` and ``visible`` the causal, window and custom masks::

        m_i   = max_{j visible} s_ij                 (0 for a row that sees no key)
        p_ij  = exp(s_ij - m_i)  if visible else 0
        o_i   = sum_j p_ij v_j / sum_j p_ij,   lse_i = m_i + log(sum_j p_ij)
        FlashSigmoid: p_ij = sigmoid(s_ij + bias) if visible else 0,  o_i = sum_j p_ij v_j,  lse_i = NaN

    An empty row (``sum_j p_ij = 0``) gets ``o = 0``, ``lse = -inf``; values that are not numbers follow
    :func:`poisoned_sum`. Returns ``o [n, Hq, D]`` and ``lse [n, Hq]`` in ``dtype``.
    """
    visible = indexing.key_visible(q_pos[:, None], k_pos[None, :], variant.causal, variant.window_left)   # [n, m]
    if mask is not None:
        visible = visible & mask
    rope_pos = (q_pos if q_rope_pos is None else q_rope_pos, k_pos + k_rope_offset)
    v = v.astype(dtype)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):   # non-finite inputs: see the rules above
        s = scores(q, k, q_pos, k_pos, variant, sm_scale, dtype, rope_pos=rope_pos)                 # [Hq, n, m]
        if variant.use_sigmoid:
            p = np.where(visible, 1.0 / (1.0 + np.exp(-(s + dtype(variant.sigmoid_bias)))), 0).astype(dtype)
            return poisoned_sum(p, v, visible), np.full(q.shape[:2], np.nan, dtype)
        s = np.where(visible, s, -np.inf)
        m = s.max(axis=2, initial=-np.inf)                       # NaN if a visible score is NaN
        m = np.where(m == -np.inf, 0, m)                         # a row that sees no key shifts by 0, not by -inf
        p = np.exp(s - m[:, :, None])                            # a +inf score gives exp(inf - inf) = NaN
        total = p.sum(axis=2)                                    # [Hq, n]
        o = poisoned_sum(p, v, visible, total.T != 0) / np.where(total == 0, 1, total).T[:, :, None]
        lse = m + np.log(total)                                  # an empty row: log(0) = -inf
    return o.astype(dtype), lse.T.astype(dtype)


def attend_tiles(q, k, v, q_pos, k_pos, variant, sm_scale, mask=None, dtype=np.float64, k_rope_offset=0,
                 q_rope_pos=None):
    """:func:`attend`, fast: the same arguments, and states that must match attend's to rounding. What differs:

    - the queries go through in tiles of at most ``TILE_SCORES`` scores (``[Hq, rows, m]``), so memory stays
      bounded whatever the row's length;
    - a tile reads only the span of keys some of its queries can see (a causal tile stops at its last query's
      position): a hidden key adds nothing, so leaving it out changes only the order of the sums' terms;
    - the softmax runs in place on the tile's scores, its one large array.
    """
    q_rot = q_pos if q_rope_pos is None else q_rope_pos
    o = np.zeros(q.shape[:2] + (v.shape[2],), dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype)
    rows = max(1, TILE_SCORES // max(1, q.shape[1] * len(k_pos)))
    for t in range(0, len(q), rows):
        tile = slice(t, t + rows)
        o[tile], lse[tile] = tile_state(q[tile], k, v, q_pos[tile], k_pos, variant, sm_scale,
                                        None if mask is None else mask[tile], dtype, k_rope_offset, q_rot[tile])
    return o, lse


def tile_state(q, k, v, q_pos, k_pos, variant, sm_scale, mask, dtype, k_rope_offset, q_rope_pos):
    """One tile of :func:`attend_tiles` (:func:`attend`'s arguments): over the span of keys its queries see, the
    softmax in place."""
    visible = indexing.key_visible(q_pos[:, None], k_pos[None, :], variant.causal, variant.window_left)
    if mask is not None:
        visible = visible & mask
    seen = np.flatnonzero(visible.any(axis=0))
    span = slice(seen[0], seen[-1] + 1) if seen.size else slice(0, 0)
    k, v, k_pos, visible = k[span], v[span].astype(dtype), k_pos[span], visible[:, span]
    with np.errstate(invalid="ignore", over="ignore"):   # non-finite inputs: see the rules above
        s = scores(q, k, q_pos, k_pos, variant, sm_scale, dtype, rope_pos=(q_rope_pos, k_pos + k_rope_offset))
        if variant.use_sigmoid:
            w = np.where(visible, 1.0 / (1.0 + np.exp(-(s + dtype(variant.sigmoid_bias)))), 0).astype(dtype)
            return poisoned_sum(w, v, visible), np.full(q.shape[:2], np.nan, dtype)
        np.copyto(s, -np.inf, where=~visible)
        m = s.max(axis=2, initial=-np.inf)
        m_safe = np.where(m == -np.inf, 0, m)
        s -= m_safe[:, :, None]                             # in place: s is the tile's one large array
        p = np.exp(s, out=s)
        denom = p.sum(axis=2).T                             # [n, Hq]
        o = poisoned_sum(p, v, visible, denom != 0) / np.where(denom == 0, 1, denom)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m_safe.T + np.log(denom)
    return o.astype(dtype), lse.astype(dtype)


def attend_range(spec, q, k_slots, v_slots, r, qo_start, qo_end, kv_start, kv_end, dtype=np.float64):
    """State of query rows ``qo_start:qo_end`` of block row ``r`` over its logical KV ``kv_start:kv_end``.

    The shared body of the reference attention (whole rows) and of the plan executor (work items): the KV
    range gathered once, the queries through :func:`attend_tiles`.
    """
    layout = spec.layout
    qo_len, kv_len = int(layout.qo_lens[r]), int(layout.kv_lens[r])
    local = np.arange(qo_start, qo_end) - int(layout.qo_indptr[r])
    q_pos = indexing.query_position(qo_len, kv_len, local)
    q_rot, k_offset = q_pos, 0
    if spec.variant.use_rope and spec.rope_positions is not None:  # not the layout's own (AttentionSpec.rope_frame)
        q_rot, k_offset = spec.rope_positions[0][qo_start:qo_end], int(spec.rope_positions[1][r])
    mask = layout.row_mask(r)
    if mask is not None:
        mask = mask[local][:, kv_start:kv_end]
    k = gather(k_slots, layout, r, kv_start, kv_end)
    v = gather(v_slots, layout, r, kv_start, kv_end)
    return attend_tiles(np.asarray(q)[qo_start:qo_end], k, v, q_pos, np.arange(kv_start, kv_end), spec.variant,
                        spec.sm_scale, mask, dtype, k_offset, q_rot)
