"""Algorithm 1, FlashInfer's scheduler: KV chunks of L_kv, longest first, each onto the least-loaded CTA.

Plan time, on the host, from the lengths alone:

1. chunk size    L_kv = ceil( sum_r ceil(qo_len_r / T_q) * kv_len_r / num_ctas ), at least 1
2. work items    each row's queries in tiles of T_q rows, each tile's KV in chunks of L_kv slots, in (row, tile,
                 chunk) order. An item is (row, qo_start, qo_end, kv_start, kv_end): query rows absolute (rows of
                 q), KV slots logical. A row with no keys still has one item per tile, over KV 0:0; a row with no
                 queries has none. An item costs (qo_end - qo_start) + (kv_end - kv_start).
3. assignment    the items handed out longest first (ties: the earlier item first), each to the CTA whose load is
                 the least so far (ties: the lower CTA id): a min-heap of (load, cta).

    qo_lens [1, 1], kv_lens [100, 10], num_ctas 4, T_q 1        L_kv = ceil(110 / 4) = 28
    items   (0, 0,1, 0,28)  (0, 0,1, 28,56)  (0, 0,1, 56,84)  (0, 0,1, 84,100)  (1, 1,2, 0,10)
    cost     29              29               29               17                11
    CTA      0               1                2                3                 3

Match `ba.scheduler.plan(qo_lens, kv_lens, num_ctas=num_ctas, tile_q=tile_q)`: its kv_chunk_size, its items (it
stores them in CTA order) and the CTA of each.

Check it: python -m bsrattn.exercises check 15
"""

import heapq


def chunk_size(qo_lens, kv_lens, num_ctas, tile_q):  # qo_lens, kv_lens [R]
    """``L_kv``, an int."""
    raise NotImplementedError("exercise 15: the query tiles times their KV, shared out over the CTAs")


def work_items(qo_lens, kv_lens, tile_q, chunk):
    """The items, a list of ``(row, qo_start, qo_end, kv_start, kv_end)`` in (row, tile, chunk) order."""
    raise NotImplementedError("exercise 15: loop over rows, their query tiles, and the tiles' KV chunks")


def assign(costs, num_ctas):  # costs [W]
    """``[W]``: the CTA each item runs on."""
    raise NotImplementedError("exercise 15: longest first, each onto the top of a min-heap of (load, cta)")
