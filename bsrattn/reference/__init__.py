"""The reference tier: NumPy, float64 by default — the executable spec of every layout, plan and merge.

Files match the other tiers': :mod:`.gather` (the load module), :mod:`.microkernel` (dense attention over
a gathered tile), :mod:`.merge` (⊕), :mod:`.executor` (a plan run CTA by CTA), plus :mod:`.attention`
(row-by-row attention, the plainest statement of the result).
"""

from __future__ import annotations

import numpy as np

from bsrattn.reference.attention import attention_rows
from bsrattn.reference.executor import execute
from bsrattn.reference.gather import kv_as_slots
from bsrattn.reference.merge import merge_state, merge_states, sum_states
from bsrattn.reference.microkernel import attend
from bsrattn.state import write_into

__all__ = ["attention", "attention_rows", "execute", "attend", "kv_as_slots", "merge_state", "merge_states",
           "add_states", "sum_states", "plan_options", "make_runner", "Runner"]

NUM_SMS = 132  # the H200 the reference models


def _finish(o, s, q, out, lse, return_lse, sigmoid):
    q = np.asarray(q)
    o = o.astype(q.dtype)
    s = None if sigmoid else s.astype(np.float64 if q.dtype == np.float64 else np.float32)
    o, s = write_into(o, s, out, lse)
    return o, (s if return_lse or lse is not None else None)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """Row-by-row attention in float64; ``out`` in ``q``'s dtype, ``lse`` float32 (float64 for float64 ``q``)."""
    o, s = attention_rows(spec, q, k, v, k_scale=k_scale, v_scale=v_scale)
    return _finish(o, s, q, out, lse, return_lse, spec.variant.use_sigmoid)


def add_states(o_a, o_b):
    """FlashSigmoid's merge of two states: the unnormalised outputs add."""
    return np.asarray(o_a) + np.asarray(o_b)


def plan_options(spec):
    """Scheduler options modelling a 132-SM GPU: one CTA per SM shared among the KV heads."""
    return dict(num_ctas=max(1, NUM_SMS // spec.num_kv_heads), tile_q=16, min_split_size=1, kv_align=1)


class Runner:
    """A plan bound to its spec; ``run`` executes it with :func:`~bsrattn.reference.executor.execute`."""

    def __init__(self, spec, work_plan):
        self.spec = spec
        self.work_plan = work_plan

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        o, s = execute(self.work_plan, self.spec, q, k, v, k_scale=k_scale, v_scale=v_scale)
        return _finish(o, s, q, out, lse, return_lse, self.spec.variant.use_sigmoid)


def make_runner(spec, work_plan, previous=None):
    return Runner(spec, work_plan)
