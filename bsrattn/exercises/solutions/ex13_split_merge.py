"""Exercise 13, solved: a row's chunks, each attended on its own, folded left to right."""

import bsrattn as ba


def split_merge(state_of, kv_len, chunk):
    """``(o, lse)``: the states of the chunks ``[0, chunk), [chunk, 2 chunk), ...`` of ``kv_len`` slots, folded."""
    o, lse = state_of(0, min(chunk, kv_len))
    for start in range(chunk, kv_len, chunk):
        o, lse = ba.merge_state(o, lse, *state_of(start, min(start + chunk, kv_len)))
    return o, lse
