"""The reference tier: NumPy, float64 by default — the executable spec of every layout, plan and merge.

Files match the other tiers': :mod:`.gather` (the load module), :mod:`.microkernel` (dense attention over
a gathered tile: the formula, and its fast path), :mod:`.merge` (⊕), :mod:`.executor` (a plan run CTA by
CTA), :mod:`.runner` (a plan bound to its spec, and the one-shot call), :mod:`.config` (plan options) and
:mod:`.arrays` (array kinds in and out), plus :mod:`.rows` (row-by-row attention, the plainest statement of
the result), :mod:`.deterministic` (deterministic mode's chunk grid) and :mod:`.progress` (progress reports
of long calls).

The entry points take NumPy arrays or torch tensors (on the CPU or a GPU) and return the kind they were
given (:mod:`.arrays`).
"""

from __future__ import annotations

import numpy as np

from bsrattn.reference import merge
from bsrattn.reference.arrays import host, is_torch, to_torch
from bsrattn.reference.rows import attention_rows
from bsrattn.reference.config import plan_options
from bsrattn.reference.executor import execute
from bsrattn.reference.gather import kv_as_slots
from bsrattn.reference.merge import sum_states
from bsrattn.reference.microkernel import attend
from bsrattn.reference.runner import Runner, attention, make_runner

HEAD_DIM_VO = True  # v and out may be narrower than q and k (multi-head latent attention)

__all__ = ["attention", "attention_rows", "execute", "attend", "kv_as_slots", "merge_state", "merge_states",
           "add_states", "sum_states", "plan_options", "make_runner", "Runner"]


def merge_state(o_a, lse_a, o_b, lse_b):
    """:func:`bsrattn.reference.merge.merge_state` (``⊕``), torch tensors in, torch tensors out."""
    o, s = merge.merge_state(host(o_a), host(lse_a), host(o_b), host(lse_b))
    return (to_torch(o, o_a), to_torch(s, o_a)) if is_torch(o_a) else (o, s)


def merge_states(o, lse):
    """:func:`bsrattn.reference.merge.merge_states` (the fold over ``S``), torch tensors in, torch tensors out."""
    o_m, s = merge.merge_states(host(o), host(lse))
    return (to_torch(o_m, o), to_torch(s, o)) if is_torch(o) else (o_m, s)


def add_states(o_a, o_b):
    """FlashSigmoid's merge of two states: the unnormalised outputs add."""
    o = np.asarray(host(o_a)) + np.asarray(host(o_b))
    return to_torch(o, o_a) if is_torch(o_a) else o
