"""Score transforms: the scale, the logits soft cap and ALiBi, in FlashInfer's order.

The variants that are functions of scores and positions change each score before the softmax, in this order:

    s = sm_scale * (q . k)
    s = cap * tanh(s / cap)               the soft cap, when cap > 0 (Gemma 2, Grok): scores stay inside (-cap, cap)
    s = s + slope * (k_pos - q_pos)       ALiBi, when a slope is given: a penalty growing with the distance

    soft cap 30     s    -10     20     50    500
                    ->  -9.65  17.48  27.93  30.00

The order matters: ALiBi comes after the cap, so a far key's penalty is not capped away. Match what bsrattn's tiers
do with `ba.Variant(logits_soft_cap=soft_cap, alibi_slopes=[alibi_slope])` for one head.

Check it: python -m bsrattn.exercises check 22
"""

import numpy as np


def transform(qk, q_pos, k_pos, sm_scale, soft_cap, alibi_slope):
    # qk [n, m] the products q . k; q_pos [n], k_pos [m] positions; soft_cap 0 is off; alibi_slope None is off
    """``[n, m]`` scores: scaled, capped, biased."""
    raise NotImplementedError("exercise 22: scale, then the cap, then ALiBi")
