"""Exercise 12, solved: one block row, gathered, then the online softmax tile by tile."""

import numpy as np


def attend_row(q, k, v, layout, r, causal, tile_kv):  # q [qo_len, H, D]; k, v [num_blocks, Bc, H, D]
    """``(o [qo_len, H, D], lse [qo_len, H])`` of row ``r``'s queries over its keys."""
    qo_len, heads, head_dim = q.shape
    slots = layout.kv_slots(r)
    keys, values = k.reshape(-1, heads, head_dim)[slots], v.reshape(-1, heads, head_dim)[slots]
    q_pos = len(slots) - qo_len + np.arange(qo_len)
    m = np.full((qo_len, heads), -np.inf)
    l = np.zeros((qo_len, heads))
    acc = np.zeros((qo_len, heads, head_dim))
    for start in range(0, len(slots), tile_kv):
        k_tile, v_tile = keys[start:start + tile_kv], values[start:start + tile_kv]
        s = np.einsum("qhd,khd->qhk", q, k_tile) / np.sqrt(head_dim)
        if causal:
            k_pos = start + np.arange(len(k_tile))
            s = np.where((k_pos[None, :] <= q_pos[:, None])[:, None, :], s, -np.inf)
        m_new = np.maximum(m, s.max(axis=2))
        m_safe = np.where(m_new == -np.inf, 0.0, m_new)
        alpha = np.exp(m - m_safe)
        p = np.exp(s - m_safe[..., None])
        l = alpha * l + p.sum(axis=2)
        acc = alpha[..., None] * acc + np.einsum("qhk,khd->qhd", p, v_tile)
        m = m_new
    seen = l > 0
    o = np.where(seen[..., None], acc / np.where(seen, l, 1.0)[..., None], 0.0)
    return o, np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
