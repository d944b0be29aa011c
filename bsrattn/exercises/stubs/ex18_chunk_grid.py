"""The deterministic chunk grid: KV cut at absolute multiples of split_size, whatever else is in the batch.

Algorithm 1's L_kv (exercise 15) depends on every row's length: add a request to the batch, and every other
row's chunks move, its states fold at other places, and its last bits change. Batch invariance needs cuts that
depend on a row's own positions alone: at every multiple of split_size (`ba.scheduler.plan(...,
fixed_split_size=S)`, and deterministic mode's grid, `ba.attention(..., deterministic=True, split_size=S)`).

    split_size 64    KV 0:150     [0, 64) [64, 128) [128, 150)
    a piece of it    KV 100:150             [100, 128) [128, 150)       the cuts stay where they were

Cut the range kv_start:kv_end at every multiple of split_size strictly inside it; an empty range is one empty
chunk, (kv_start, kv_start). A piece of a row that starts on the grid (a cascade level, a chunked prefill's
later piece) is then cut exactly where the whole row is, so its chunks' states are the same bits.

Check it: python -m bsrattn.exercises check 18
"""


def grid_chunks(kv_start, kv_end, split_size):
    """The chunks of ``kv_start:kv_end``: a list of ``(start, end)`` pairs, in order."""
    raise NotImplementedError("exercise 18: cut at each multiple of split_size inside the range")
