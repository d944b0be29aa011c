"""A :class:`~bsrattn.scheduler.WorkPlan` executed as a GPU would, CTA by CTA, then the merge.

This is the executable spec of the numba and torch executors: each CTA walks its work items in plan order;
an item of a split tile writes its partial state into its workspace rows, an unsplit item writes the output
directly; then each merge list folds its partial states in the order the plan gives. The result is a pure
function of the inputs and the plan (no order depends on timing).

An item's state is :func:`~bsrattn.reference.microkernel.attend_range`, the body the row-by-row
:func:`~bsrattn.reference.rows.attention_rows` uses too: its KV range gathered once, its queries in
tiles of bounded size that read only the keys they can see. Neither path holds a ``[Hq, qo_len, kv_len]``
array for a whole row: for a 2048-token prefill that is gigabytes of float64, slow to fill and to reduce, and
would make the row-by-row path slower than the executor's 16-query items. In deterministic mode an item's state
is :func:`~bsrattn.reference.deterministic.grid_state` instead (:mod:`.deterministic`).
"""

from __future__ import annotations

import numpy as np

from bsrattn.reference.deterministic import grid_state
from bsrattn.reference.gather import kv_as_slots
from bsrattn.reference.merge import merge_state, sum_states
from bsrattn.reference.microkernel import attend_range
from bsrattn.reference.progress import Progress


def execute(work_plan, spec, q, k, v, *, k_scale=None, v_scale=None, dtype=np.float64):
    """Run ``work_plan`` on ``q [nnz_qo, Hq, D]``, ``k, v`` (any accepted storage); ``(o [nnz_qo, Hq, Dv], lse)``
    in ``dtype``, ``Dv`` the head dimension of ``v`` (``spec.dim_vo``)."""
    k_slots = kv_as_slots(k, spec, k_scale, dtype)
    v_slots = kv_as_slots(v, spec, v_scale, dtype)
    shape = (spec.layout.nnz_qo, spec.num_qo_heads, spec.dim_vo)
    out = np.zeros(shape, dtype)
    lse = np.full(shape[:2], -np.inf, dtype)
    part_o = np.full((work_plan.num_partial_rows,) + shape[1:], np.nan, dtype)
    part_lse = np.full((work_plan.num_partial_rows, shape[1]), np.nan, dtype)
    q = np.asarray(q)
    rows = (work_plan.item_qo_end - work_plan.item_qo_start).astype(np.int64)
    sizes = rows * (work_plan.item_kv_end - work_plan.item_kv_start)
    progress = Progress("reference executor", int(sizes.sum()))
    # Deterministic mode: an item's chunks of the grid, each computed row by row, folded (grid_state).
    state_of = attend_range if spec.split_size is None else grid_state
    for cta in range(work_plan.num_ctas):
        for w in range(work_plan.cta_indptr[cta], work_plan.cta_indptr[cta + 1]):
            qs, qe = int(work_plan.item_qo_start[w]), int(work_plan.item_qo_end[w])
            o, s = state_of(spec, q, k_slots, v_slots, int(work_plan.item_row[w]), qs, qe,
                            int(work_plan.item_kv_start[w]), int(work_plan.item_kv_end[w]), dtype)
            p = int(work_plan.item_partial[w])
            if p < 0:
                out[qs:qe], lse[qs:qe] = o, s
            else:
                part_o[p:p + qe - qs], part_lse[p:p + qe - qs] = o, s
            progress.advance(sizes[w])
    progress.close()
    for m in range(work_plan.num_merges):
        qs, qe = int(work_plan.merge_qo_start[m]), int(work_plan.merge_qo_end[m])
        starts = work_plan.merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]
        if spec.variant.use_sigmoid:
            out[qs:qe] = sum_states(np.stack([part_o[p:p + qe - qs] for p in starts], axis=1))
            continue
        acc_o, acc_lse = part_o[starts[0]:starts[0] + qe - qs], part_lse[starts[0]:starts[0] + qe - qs]
        for p in starts[1:]:
            acc_o, acc_lse = merge_state(acc_o, acc_lse, part_o[p:p + qe - qs], part_lse[p:p + qe - qs])
        out[qs:qe], lse[qs:qe] = acc_o, acc_lse
    if spec.variant.use_sigmoid:
        lse[:] = np.nan
    return out, lse
