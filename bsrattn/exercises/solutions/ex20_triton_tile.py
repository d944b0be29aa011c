"""Exercise 20, solved: a gathered K/V tile, tl.dot, and the online softmax, in Triton."""

import triton
import triton.language as tl


@triton.jit
def attend_tile(q_ptr, k_ptr, v_ptr, slots_ptr, o_ptr, lse_ptr, num_queries, num_keys, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Attention of queries ``program_id * BLOCK_M ...`` over the ``num_keys`` keys at ``slots``: ``o`` and ``lse``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    row_ok = rows < num_queries
    q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_ok = j < num_keys
        slot = tl.load(slots_ptr + j, mask=key_ok, other=0)
        k = tl.load(k_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        # Every tile holds a key below num_keys, so m_new is finite: no -inf shift to guard.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    seen = l_i > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + rows[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
    tl.store(lse_ptr + rows, lse, mask=row_ok)
