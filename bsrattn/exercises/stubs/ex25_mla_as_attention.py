"""Multi-head latent attention as attention: MLA's operands as q, k and v of one KV head read by every head.

MLA caches per token a latent ckv (Dc wide) and a rotary key kpe (Dr wide), and every query head h scores slot j
as sm_scale * (q_nope[h] . ckv[j] + q_pe[h] . kpe[j]) and reads ckv[j] itself as the value. Two dot products are
one over the concatenation, so that is ordinary attention (ba.attention) with ONE KV head and a GQA group of
G = H query heads:

    q = q_nope ⊕ q_pe    [nnz_qo, H, Dc + Dr]
    k = ckv ⊕ kpe        [..., 1, Dc + Dr]      one KV head: an axis of 1 before the last
    v = ckv              [..., 1, Dc]           narrower than the key: the key's first Dc columns

The latent comes first in both q and k, so that the value is the key's first Dc columns (a view: the cache is read
once). ckv and kpe are [num_pages, page_size, D] for a paged layout, or [slots, D] where the layout's block size is
1; q_nope and q_pe are [nnz_qo, H, Dc] and [nnz_qo, H, Dr]. ba.attention's default scale, 1 / sqrt(Dc + Dr), is
MLA's.

Check it: python -m bsrattn.exercises check 25
"""

import numpy as np


def mla_as_attention(q_nope, q_pe, ckv, kpe):  # [nnz_qo, H, Dc], [nnz_qo, H, Dr], [..., Dc], [..., Dr]
    """``(q [nnz_qo, H, Dc + Dr], k [..., 1, Dc + Dr], v [..., 1, Dc])``: the operands of ``ba.attention``."""
    raise NotImplementedError("exercise 25: concatenate latent then rotary parts, add a KV-head axis, v = ckv")
