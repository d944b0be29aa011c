"""The LSE of a row of scores: log(sum(exp(s))) in natural log, without overflow; -inf for an empty row.

An attention state carries, beside its output, the log-sum-exp of the scores it has seen:

    lse = log(sum_j exp(s_j))           natural log, as every bsrattn tier returns it

Computed as written it overflows: exp(1000.0) is inf in float64. Shift by the row's maximum first,

    m = max_j s_j,    lse = m + log(sum_j exp(s_j - m))

so that the largest term is exp(0) = 1 and no term overflows. A row that sees no key (no scores at all,
or only masked ones, -inf) has lse = -inf: the empty state, which the merge of exercise 2 leaves unchanged.

    s = [1.0, 2.0, 3.0]          ->  3.4076...
    s = [1000.0, 1001.0]         ->  1001.3132...    (not inf)
    s = [],  s = [-inf, -inf]    ->  -inf

Check it: python -m bsrattn.exercises check 1
"""

import numpy as np


def lse(s):  # s [n] float64, -inf for a masked key
    """The natural-log LSE of the scores ``s``: a float, ``-inf`` when ``s`` is empty or all ``-inf``."""
    raise NotImplementedError("exercise 1: return m + log(sum(exp(s - m))), with m = max(s)")
