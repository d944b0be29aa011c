"""The merges of a WorkPlan: fold each split query tile's partial states, in the order the plan lists them.

A `ba.scheduler.WorkPlan` gives every work item of a split query tile a slot for its partial state in a workspace;
once every CTA has run, merge m folds, for each of its query rows, the partial rows the plan lists:

    merge m    query rows  qs = merge_qo_start[m] .. qe = merge_qo_end[m]        (n = qe - qs rows)
               partials    p_0, p_1, ... = merge_partials[merge_indptr[m] : merge_indptr[m + 1]]
               out[qs + i] = part[p_0 + i] ⊕ part[p_1 + i] ⊕ ...                   folded left to right

    part_o  [num_partial_rows, H, D]      part_lse  [num_partial_rows, H]
    out     [nnz_qo, H, D]                lse       [nnz_qo, H]

The rows that no merge lists were written by their (unsplit) items already: leave them as they are. Fold with
`ba.merge_state` (it merges whole [n, H, D] blocks of states at once); the grader compares the bits with the fold in
plan order.

Check it: python -m bsrattn.exercises check 14
"""

import bsrattn as ba


def merge_plan(plan, part_o, part_lse, out, lse):
    """``(out, lse)`` with every merge of ``plan`` folded into its rows (in place or not)."""
    raise NotImplementedError("exercise 14: for each merge, fold its partials in the listed order")
