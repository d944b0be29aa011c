"""Quest's page selection: keep the pages whose keys could score highest, by an upper bound of q . k.

Decode reads every key of a long context, though few of them matter. Quest keeps, for each query and KV head, only
a budget of pages. Scoring every key to choose them would cost what it saves, so it bounds each page's best score
from two vectors kept per page, the elementwise minimum and maximum of its keys (over the page's valid slots):

    for every key k on the page:   q . k = sum_d q_d k_d  <=  sum_d max(q_d * min_d, q_d * max_d)

(q_d k_d is largest at k_d = max_d when q_d > 0, and at k_d = min_d when q_d < 0.)

    page          0     1     2     3     4       the last page, partly filled, holds the newest tokens
    bound        2.1   7.9   0.3   5.5   1.0
    budget 3           ██          ██    ▌        select_pages(bounds, 3) -> [1, 3, 4]

page_bounds ignores the slots past kv_len on the last page: they hold stale values. select_pages always keeps the
last page, fills the rest of the budget with the highest bounds among the others (ties: the lower page first) and
returns the kept pages in increasing order, as `ba.layouts.quest` takes them; a budget of at least the number of
pages keeps them all.

Check it: python -m bsrattn.exercises check 9
"""

import numpy as np


def page_bounds(q, pages, kv_len):  # q [D]; pages [n_pages, page_size, D], one request's pages in order
    """``[n_pages]`` upper bounds of ``q . k`` over each page's valid keys (the first ``kv_len`` slots in all)."""
    raise NotImplementedError("exercise 9: each page's min and max key over its valid slots, then the bound")


def select_pages(bounds, budget):  # bounds [n_pages]; budget >= 1
    """The kept pages: a list of page numbers, increasing, the last page always among them."""
    raise NotImplementedError("exercise 9: the last page, plus the budget - 1 best of the others")
