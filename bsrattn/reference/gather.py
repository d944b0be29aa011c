"""The load module, as NumPy: which pool slots a (row, KV range) reads, and the KV rows at those slots.

A kernel gathers the selected KV rows into fast memory before its dense microkernel; here the "fast
memory" is a NumPy array. KV is scaled on load (``x.astype(f64) * scale``: fp8's dequantisation, or the
``k_scale``/``v_scale`` of any KV dtype), which is the spec the other tiers' scales must match.
"""

from __future__ import annotations

import numpy as np

from bsrattn import indexing
from bsrattn.validation import AttentionSpec


def kv_as_slots(x, spec: AttentionSpec, scale=None, dtype=np.float64) -> np.ndarray:
    """``k`` or ``v`` in any accepted storage as ``[num_slots, num_kv_heads, D]`` in ``dtype`` (``D``: its own head
    dimension, ``v``'s ``spec.dim_vo``).

    ``scale`` multiplies the KV after the cast (``k_scale``/``v_scale``, of any KV dtype; 1 when None).
    """
    x = np.asarray(x)
    if spec.kv_view == "HND":
        x = x.transpose(0, 2, 1, 3)
    x = x.reshape(-1, spec.num_kv_heads, x.shape[-1]).astype(dtype, copy=False)
    if scale is not None:
        x = x * dtype(scale)
    return x


def row_slots(layout, r: int, kv_start: int, kv_end: int) -> np.ndarray:
    """Pool slots of row ``r``'s logical KV slots ``kv_start:kv_end`` (the sparse path)."""
    i = np.arange(kv_start, kv_end, dtype=np.int64)
    return indexing.sparse_slot(layout.kv_indices.astype(np.int64), int(layout.kv_indptr[r]), layout.block_size, i)


def gather(kv_slots: np.ndarray, layout, r: int, kv_start: int, kv_end: int) -> np.ndarray:
    """``[kv_end - kv_start, num_kv_heads, head_dim]``: the KV rows of a range of row ``r``.

    A range whose slots are consecutive (ragged and dense layouts: the affine path) is a view of the pool, not
    a copy; the values are the same either way.
    """
    slots = row_slots(layout, r, kv_start, kv_end)
    if slots.size and slots[-1] - slots[0] == slots.size - 1 and (np.diff(slots) == 1).all():
        return kv_slots[slots[0]:slots[-1] + 1]
    return kv_slots[slots]
