"""A page table as BSR: the kv_indptr, kv_indices and kv_last_len of a paged KV cache.

A paged cache stores each request's keys in pages of page_size slots, scattered over one pool. In BSR words a
request is a block row, a page is a block of Bc = page_size slots, and the page table *is* the indices array:

                KV pool: pages of Bc = 16 slots
                p0   p1   p2   p3   p4   p5   p6   p7
    request 0 [ ██ |    |    | ██ |    | ▌  |    |    ]   page table [0, 3, 5], kv_len 40
    request 1 [    | ██ | ▌  |    |    |    |    |    ]   page table [1, 2],    kv_len 20
    request 2 [    |    |    |    | ██ |    | ██ | ██ ]   page table [4, 6, 7], kv_len 48

    kv_indptr   = [0, 3, 5, 8]               row r owns kv_indices[kv_indptr[r]:kv_indptr[r+1]]
    kv_indices  = [0, 3, 5, 1, 2, 4, 6, 7]   the pages each row reads, in order, row after row
    kv_last_len = [8, 4, 16]                 the valid slots of each row's last page, 1..page_size

A request of kv_len tokens uses the first ceil(kv_len / page_size) pages of its table; the rest (pages
reserved for tokens to come) is not part of the layout. A request with no tokens has no pages, and kv_last_len
0. `ba.layouts.paged` builds the same arrays, inside a `ba.BSRLayout`.

Check it: python -m bsrattn.exercises check 3
"""

import numpy as np


def page_table_to_bsr(page_tables, kv_lens, page_size):  # page_tables [B][>= pages needed]; kv_lens [B]
    """``(kv_indptr [B+1], kv_indices [nnz], kv_last_len [B])``, integer arrays, of a paged batch."""
    raise NotImplementedError("exercise 3: count each request's pages, concatenate their ids, cut the last page")
