"""Attention over a layout, row by row: the plainest statement of what every tier computes.

:func:`attention_rows` gives each block row's queries its whole KV at once. The cost is in the microkernel:
:func:`~bsrattn.reference.microkernel.attend_range` gathers the row's KV once and runs its queries through
:func:`~bsrattn.reference.microkernel.attend_tiles` (the fast path of the formula,
:func:`~bsrattn.reference.microkernel.attend`) in tiles of bounded size, each tile reading only the keys it
can see (a causal tile stops at its last query), so the float64 state of a whole prefill row is never one
``[Hq, qo_len, kv_len]`` array. The plan executor (:mod:`.executor`) computes the same states a work item
at a time through the same body; the two differ only by the plan's cuts and merges, not in speed per key.
"""

from __future__ import annotations

import numpy as np

from bsrattn.reference.gather import kv_as_slots
from bsrattn.reference.microkernel import attend_range
from bsrattn.reference.progress import Progress


def attention_rows(spec, q, k, v, *, k_scale=None, v_scale=None, dtype=np.float64):
    """Each block row's queries over its whole KV; returns ``(o [nnz_qo, Hq, Dv], lse [nnz_qo, Hq])`` in ``dtype``
    (``Dv``: the head dimension of ``v``, ``spec.dim_vo``)."""
    k_slots = kv_as_slots(k, spec, k_scale, dtype)
    v_slots = kv_as_slots(v, spec, v_scale, dtype)
    layout = spec.layout
    out = np.zeros((layout.nnz_qo, spec.num_qo_heads, spec.dim_vo), dtype)
    lse = np.full((layout.nnz_qo, spec.num_qo_heads), -np.inf, dtype)
    progress = Progress("reference attention", int(np.dot(layout.qo_lens, layout.kv_lens)))
    for r in range(layout.num_rows):
        qs, qe = int(layout.qo_indptr[r]), int(layout.qo_indptr[r + 1])
        out[qs:qe], lse[qs:qe] = attend_range(spec, q, k_slots, v_slots, r, qs, qe, 0, int(layout.kv_lens[r]), dtype)
        progress.advance((qe - qs) * int(layout.kv_lens[r]))
    progress.close()
    return out, lse
