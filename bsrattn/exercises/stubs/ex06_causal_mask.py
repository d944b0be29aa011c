"""The bottom-right causal mask of a block row: which keys each query sees.

A row's queries are its newest tokens: the last qo_len of its kv_len positions (a decode, an append after a
cached prefix, a whole prefill when qo_len = kv_len). Query i sits at position kv_len - qo_len + i and sees the
keys at positions up to its own:

    qo_len = 3, kv_len = 7: the queries sit at positions 4, 5, 6

                  k:  0 1 2 3 4 5 6
        q0 (pos 4)    x x x x x . .
        q1 (pos 5)    x x x x x x .
        q2 (pos 6)    x x x x x x x

Aligned top-left instead (np.tril), a decode query would see only the first key. With more queries than keys,
the first queries sit at negative positions and see nothing. Match
`ba.Variant(causal=True).position_mask(qo_len, kv_len)`.

Check it: python -m bsrattn.exercises check 6
"""

import numpy as np


def causal_mask(qo_len, kv_len):
    """``[qo_len, kv_len]`` bool, True where query ``i`` sees key ``j``."""
    raise NotImplementedError("exercise 6: compare each key's position with each query's, kv_len - qo_len + i")
