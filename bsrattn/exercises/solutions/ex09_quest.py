"""Exercise 9, solved: Quest's per-page bound and its top-budget selection."""

import numpy as np


def page_bounds(q, pages, kv_len):  # q [D]; pages [n_pages, page_size, D], one request's pages in order
    """``[n_pages]`` upper bounds of ``q . k`` over each page's valid keys (the first ``kv_len`` slots in all)."""
    n_pages, page_size, _ = pages.shape
    valid = (np.arange(n_pages * page_size) < kv_len).reshape(n_pages, page_size, 1)
    low = np.where(valid, pages, np.inf).min(axis=1)
    high = np.where(valid, pages, -np.inf).max(axis=1)
    return np.maximum(q * low, q * high).sum(axis=1)


def select_pages(bounds, budget):  # bounds [n_pages]; budget >= 1
    """The kept pages: a list of page numbers, increasing, the last page always among them."""
    n_pages = len(bounds)
    if n_pages <= budget:
        return list(range(n_pages))
    best = np.argsort(-np.asarray(bounds[:-1]), kind="stable")[:budget - 1]  # stable: ties to the lower page
    return sorted(int(p) for p in best) + [n_pages - 1]
