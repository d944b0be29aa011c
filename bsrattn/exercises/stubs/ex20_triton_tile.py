"""One tile of a Triton kernel: K/V rows gathered through slot indices, tl.dot, the online softmax.

The torch tier's kernels (bsrattn/torch_cuda/microkernel.py) in one small program: a block of BLOCK_M queries
against keys gathered BLOCK_N at a time through an index array (the sparse load path), then a dense tl.dot:

    slots [num_keys]       logical key j lives at pool row slots[j]
    k, v  [num_slots, D]   the pool            q, o [num_queries, D]      lse [num_queries], natural log

    program p: queries p*BLOCK_M ...         for each tile of keys  j = start .. start + BLOCK_N - 1
                                               slot = load(slots_ptr + j)                  the gather's indices
                                               k, v = load(k_ptr + slot * D + d), ...      [BLOCK_N, D] rows
                                               s    = tl.dot(q, tl.trans(k)) * sm_scale    -inf past num_keys
                                               exercise 10's update of (m_i, l_i, acc)

The query load, the running state and the final store are written; write the body of the loop. Masked loads
(mask=..., other=...) keep every load inside its array, and a key past num_keys must weigh exactly 0. Give tl.dot
input_precision="ieee": on a GPU its float32 default is TF32. Without a GPU it runs in Triton's interpreter
(TRITON_INTERPRET=1, which the check command sets) on CPU tensors.

Check it: python -m bsrattn.exercises check 20
"""

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
        raise NotImplementedError("exercise 20: gather the tile's k and v through slots, tl.dot, update m_i, l_i, acc")
    seen = l_i > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + rows[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
    tl.store(lse_ptr + rows, lse, mask=row_ok)
