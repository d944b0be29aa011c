"""Exercise 15, solved: Algorithm 1's chunk size, work items and longest-first assignment."""

import heapq


def chunk_size(qo_lens, kv_lens, num_ctas, tile_q):  # qo_lens, kv_lens [R]
    """``L_kv``, an int."""
    total = sum(-(-int(qo) // tile_q) * int(kv) for qo, kv in zip(qo_lens, kv_lens))
    return max(-(-total // num_ctas), 1)


def work_items(qo_lens, kv_lens, tile_q, chunk):
    """The items, a list of ``(row, qo_start, qo_end, kv_start, kv_end)`` in (row, tile, chunk) order."""
    items, q_base = [], 0
    for row, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        for qo_start in range(q_base, q_base + qo, tile_q):
            qo_end = min(qo_start + tile_q, q_base + qo)
            for kv_start in range(0, max(kv, 1), chunk):  # a row with no keys: one chunk, 0:0
                items.append((row, qo_start, qo_end, kv_start, min(kv_start + chunk, kv)))
        q_base += qo
    return items


def assign(costs, num_ctas):  # costs [W]
    """``[W]``: the CTA each item runs on."""
    longest_first = sorted(range(len(costs)), key=lambda w: -costs[w])  # sorted is stable: ties keep item order
    loads = [(0, cta) for cta in range(num_ctas)]                     # already a heap; ties pop the lower id
    owner = [0] * len(costs)
    for w in longest_first:
        load, cta = heapq.heappop(loads)
        owner[w] = cta
        heapq.heappush(loads, (load + costs[w], cta))
    return owner
