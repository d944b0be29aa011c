"""Split a row's KV into chunks, attend to each on its own, and merge the states in order.

The scheduler (exercise 15) cuts a long row's KV into chunks of `chunk` slots so that several CTAs can share it;
each chunk's state is computed on its own, and ⊕ (exercise 2) folds them, left to right:

    KV    [0 ....... c) [c ...... 2c) [2c ... kv_len)
            state 0       state 1       state 2          ->  (state 0 ⊕ state 1) ⊕ state 2

The fold order is part of the contract: ⊕ is associative in exact arithmetic but not in floating point, and
bsrattn gives the same bits on every run. state_of(kv_start, kv_end) returns the state of the row's queries over its
logical slots kv_start:kv_end, (o [n, H, D], lse [n, H]). Call it once per chunk (a row with no key is one empty
chunk, state_of(0, 0)) and fold with `ba.merge_state`: the grader compares the bits with that fold.

Check it: python -m bsrattn.exercises check 13
"""

import bsrattn as ba


def split_merge(state_of, kv_len, chunk):
    """``(o, lse)``: the states of the chunks ``[0, chunk), [chunk, 2 chunk), ...`` of ``kv_len`` slots, folded."""
    raise NotImplementedError("exercise 13: one state_of call per chunk, folded left to right with ba.merge_state")
