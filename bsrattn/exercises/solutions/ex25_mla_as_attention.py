"""Exercise 25, solved: MLA's operands as attention of one KV head, key ckv ⊕ kpe, value ckv."""

import numpy as np


def mla_as_attention(q_nope, q_pe, ckv, kpe):  # [nnz_qo, H, Dc], [nnz_qo, H, Dr], [..., Dc], [..., Dr]
    """``(q [nnz_qo, H, Dc + Dr], k [..., 1, Dc + Dr], v [..., 1, Dc])``: the operands of ``ba.attention``."""
    q = np.concatenate([q_nope, q_pe], axis=-1)
    k = np.concatenate([ckv, kpe], axis=-1)[..., None, :]
    return q, k, k[..., :ckv.shape[-1]]
