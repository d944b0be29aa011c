"""A plan bound to its spec, run by :func:`~bsrattn.reference.executor.execute`; and the one-shot call.

The one-shot :func:`attention` plans nothing: it is :func:`~bsrattn.reference.rows.attention_rows`, row by
row, the plainest statement of the result.
"""

from __future__ import annotations

from bsrattn.reference.arrays import deliver, host
from bsrattn.reference.rows import attention_rows
from bsrattn.reference.executor import execute


class Runner:
    """A plan bound to its spec; ``run`` executes it with :func:`~bsrattn.reference.executor.execute`."""

    def __init__(self, spec, work_plan):
        self.spec = spec
        self.work_plan = work_plan

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        o, s = execute(self.work_plan, self.spec, host(q), host(k), host(v), k_scale=k_scale, v_scale=v_scale)
        return deliver(o, s, q, out, lse, return_lse, self.spec.variant.use_sigmoid)


def make_runner(spec, work_plan, previous=None):
    return Runner(spec, work_plan)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """Row-by-row attention in float64; ``out`` in ``q``'s dtype, ``lse`` float32 (float64 for float64 ``q``)."""
    o, s = attention_rows(spec, host(q), host(k), host(v), k_scale=k_scale, v_scale=v_scale)
    return deliver(o, s, q, out, lse, return_lse, spec.variant.use_sigmoid)
