"""Exercise 14, solved: a plan's merge lists folded in the order they list the partials."""

import bsrattn as ba


def merge_plan(plan, part_o, part_lse, out, lse):
    """``(out, lse)`` with every merge of ``plan`` folded into its rows (in place or not)."""
    for m in range(plan.num_merges):
        qs, qe = int(plan.merge_qo_start[m]), int(plan.merge_qo_end[m])
        n = qe - qs
        first, *rest = plan.merge_partials[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]
        o, s = part_o[first:first + n], part_lse[first:first + n]
        for p in rest:
            o, s = ba.merge_state(o, s, part_o[p:p + n], part_lse[p:p + n])
        out[qs:qe], lse[qs:qe] = o, s
    return out, lse
