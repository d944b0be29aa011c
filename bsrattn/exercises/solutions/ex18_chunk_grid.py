"""Exercise 18, solved: a KV range cut at the absolute multiples of split_size inside it."""


def grid_chunks(kv_start, kv_end, split_size):
    """The chunks of ``kv_start:kv_end``: a list of ``(start, end)`` pairs, in order."""
    if kv_end == kv_start:
        return [(kv_start, kv_start)]
    first_cut = (kv_start // split_size + 1) * split_size
    cuts = [kv_start, *range(first_cut, kv_end, split_size), kv_end]
    return list(zip(cuts[:-1], cuts[1:]))
