"""Attention over a layout, row by row: the plainest statement of what every tier computes."""

from __future__ import annotations

import numpy as np

from bsrattn.reference.gather import kv_as_slots
from bsrattn.reference.microkernel import attend_range


def attention_rows(spec, q, k, v, *, k_scale=None, v_scale=None, dtype=np.float64):
    """Each block row's queries over its whole KV; returns ``(o [nnz_qo, Hq, D], lse [nnz_qo, Hq])`` in ``dtype``."""
    k_slots = kv_as_slots(k, spec, k_scale, dtype)
    v_slots = kv_as_slots(v, spec, v_scale, dtype)
    layout = spec.layout
    out = np.zeros((layout.nnz_qo, spec.num_qo_heads, spec.head_dim), dtype)
    lse = np.full((layout.nnz_qo, spec.num_qo_heads), -np.inf, dtype)
    for r in range(layout.num_rows):
        qs, qe = int(layout.qo_indptr[r]), int(layout.qo_indptr[r + 1])
        out[qs:qe], lse[qs:qe] = attend_range(spec, q, k_slots, v_slots, r, qs, qe, 0, int(layout.kv_lens[r]), dtype)
    return out, lse
