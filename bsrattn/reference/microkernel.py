"""The dense microkernel, as NumPy: attention of gathered queries over gathered keys.

For query ``i`` (head ``h``, KV head ``h // G``) and visible keys ``j`` (see :mod:`bsrattn.variant`):

    s_ij = transform(sm_scale * q_i . k_j)
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
"""

from __future__ import annotations

import numpy as np

from bsrattn import indexing


def scores(q, k, q_pos, k_pos, variant, sm_scale, dtype=np.float64):
    """``[Hq, n, m]`` transformed scores (soft cap, ALiBi) before masking."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(dtype), group, axis=1)
    s = np.einsum("nhd,mhd->hnm", q.astype(dtype), k) * dtype(sm_scale)
    if variant.logits_soft_cap > 0:
        cap = dtype(variant.logits_soft_cap)
        s = cap * np.tanh(s / cap)
    if variant.alibi_slopes is not None:
        slopes = np.asarray(variant.alibi_slopes, dtype=dtype)
        s = s + slopes[:, None, None] * (k_pos[None, None, :] - q_pos[None, :, None]).astype(dtype)
    return s


def attend(q, k, v, q_pos, k_pos, variant, sm_scale, mask=None, dtype=np.float64):
    """Attention state of queries ``q [n, Hq, D]`` over keys ``k, v [m, Hkv, D]``.

    ``q_pos [n]`` and ``k_pos [m]`` are logical positions; ``mask [n, m]`` is the custom mask or None.
    Returns ``o [n, Hq, D]`` and ``lse [n, Hq]`` in ``dtype``.
    """
    n, num_qo_heads, _ = q.shape
    group = num_qo_heads // k.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):   # non-finite inputs: see the rules above
        s = scores(q, k, q_pos, k_pos, variant, sm_scale, dtype)
    visible = indexing.key_visible(q_pos[:, None], k_pos[None, :], variant.causal, variant.window_left)
    if mask is not None:
        visible = visible & mask
    v = np.repeat(v.astype(dtype), group, axis=1)
    # Hidden keys must not reach P @ V even as 0 * NaN: their values are replaced by 0, and a non-finite value
    # of a visible key is recorded instead, per (query, head).
    finite = np.isfinite(v)
    v_bad = ~finite.all(axis=2)                                           # [m, Hq]
    poisoned = (visible[None, :, :] & v_bad.T[:, None, :]).any(axis=2).T  # [n, Hq]
    v = np.where(finite, v, 0)
    with np.errstate(invalid="ignore", over="ignore"):
        if variant.use_sigmoid:
            w = np.where(visible, 1.0 / (1.0 + np.exp(-(s + dtype(variant.sigmoid_bias)))), 0).astype(dtype)
            o = np.einsum("hnm,mhd->nhd", w, v)
            return np.where(poisoned[:, :, None], np.nan, o), np.full((n, num_qo_heads), np.nan, dtype)
        s = np.where(visible, s, -np.inf)
        m = s.max(axis=2, initial=-np.inf)                  # NaN if a visible score is NaN
        m_safe = np.where(m == -np.inf, 0, m)               # an empty row shifts by 0, not by -inf
        p = np.exp(s - m_safe[:, :, None])                  # a +inf score gives exp(inf - inf) = NaN
        denom = p.sum(axis=2).T                             # [n, Hq]
        o = np.einsum("hnm,mhd->nhd", p, v) / np.where(denom == 0, 1, denom)[:, :, None]
    o = np.where((poisoned & (denom != 0))[:, :, None], np.nan, o)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m_safe.T + np.log(denom)
    return o.astype(dtype), lse.astype(dtype)


def attend_range(spec, q, k_slots, v_slots, r, qo_start, qo_end, kv_start, kv_end, dtype=np.float64):
    """State of query rows ``qo_start:qo_end`` of block row ``r`` over its logical KV ``kv_start:kv_end``.

    The shared body of the reference attention (whole rows) and of the plan executor (work items).
    """
    from bsrattn.reference.gather import gather

    layout = spec.layout
    qo_len, kv_len = int(layout.qo_lens[r]), int(layout.kv_lens[r])
    local = np.arange(qo_start, qo_end) - int(layout.qo_indptr[r])
    q_pos = indexing.query_position(qo_len, kv_len, local)
    k_pos = np.arange(kv_start, kv_end)
    mask = layout.row_mask(r)
    if mask is not None:
        mask = mask[local][:, kv_start:kv_end]
    k = gather(k_slots, layout, r, kv_start, kv_end)
    v = gather(v_slots, layout, r, kv_start, kv_end)
    return attend(np.asarray(q)[qo_start:qo_end], k, v, q_pos, k_pos, spec.variant, spec.sm_scale, mask, dtype)
