"""The reference tier: NumPy, float64 by default — the executable spec of every layout, plan and merge.

Files match the other tiers': :mod:`.gather` (the load module), :mod:`.microkernel` (dense attention over
a gathered tile), :mod:`.merge` (⊕), :mod:`.executor` (a plan run CTA by CTA), plus :mod:`.attention`
(row-by-row attention, the plainest statement of the result).

The entry points take NumPy arrays or torch tensors (on the CPU or a GPU) and return the kind they were
given: a tensor is copied to the host (bfloat16 and float8 bit for bit, as their ``ml_dtypes`` types),
computed on exactly as the same NumPy array would be, and the result comes back as a tensor of the input's
dtype on its device.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bsrattn.reference import merge
from bsrattn.reference.attention import attention_rows
from bsrattn.reference.executor import execute
from bsrattn.reference.gather import kv_as_slots
from bsrattn.reference.merge import sum_states
from bsrattn.reference.microkernel import attend
from bsrattn.state import write_into
from bsrattn.validation import dtype_name

__all__ = ["attention", "attention_rows", "execute", "attend", "kv_as_slots", "merge_state", "merge_states",
           "add_states", "sum_states", "plan_options", "make_runner", "Runner"]

NUM_SMS = 132  # the H200 the reference models


# Dtypes NumPy has only through ml_dtypes cross between torch and NumPy as integers of the same width.
_BITS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def _is_torch(x) -> bool:
    # By module name, so that the reference tier never imports torch itself.
    return type(x).__module__.split(".")[0] == "torch"


def _host(x):
    """``x`` as NumPy: a torch tensor is copied to the host, bfloat16 and float8 as their ml_dtypes types."""
    if not _is_torch(x):
        return x
    import torch  # imported already: the caller passed a tensor

    name = dtype_name(x)
    t = x.detach().cpu()
    if name in _BITS:
        return t.view(getattr(torch, _BITS[name])).numpy().view(getattr(ml_dtypes, name))
    return t.numpy()


def _to_torch(result, like, dtype=None):
    """The NumPy ``result`` as a torch tensor of ``dtype`` (default: ``result``'s own) on ``like``'s device."""
    import torch

    result = np.ascontiguousarray(result)
    name = dtype_name(result)
    if name in _BITS:
        t = torch.from_numpy(result.view(_BITS[name])).view(getattr(torch, name))
    else:
        t = torch.from_numpy(result)
    return t.to(device=like.device, dtype=dtype)


def _finish(o, s, q, out, lse, return_lse, sigmoid):
    """The float64 state in ``q``'s dtype and kind (``lse`` float32, float64 for a float64 ``q``), written into
    ``out``/``lse`` where given."""
    wide = dtype_name(q) == "float64"
    if _is_torch(q):
        o = _to_torch(o, q, q.dtype)
        s = None if sigmoid else _to_torch(s.astype(np.float64 if wide else np.float32), q)
    else:
        o = o.astype(np.asarray(q).dtype)
        s = None if sigmoid else s.astype(np.float64 if wide else np.float32)
    o, s = write_into(o, s, out, lse)
    return o, (s if return_lse or lse is not None else None)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """Row-by-row attention in float64; ``out`` in ``q``'s dtype, ``lse`` float32 (float64 for float64 ``q``)."""
    o, s = attention_rows(spec, _host(q), _host(k), _host(v), k_scale=k_scale, v_scale=v_scale)
    return _finish(o, s, q, out, lse, return_lse, spec.variant.use_sigmoid)


def merge_state(o_a, lse_a, o_b, lse_b):
    """:func:`bsrattn.reference.merge.merge_state` (``⊕``), torch tensors in, torch tensors out."""
    o, s = merge.merge_state(_host(o_a), _host(lse_a), _host(o_b), _host(lse_b))
    return (_to_torch(o, o_a), _to_torch(s, o_a)) if _is_torch(o_a) else (o, s)


def merge_states(o, lse):
    """:func:`bsrattn.reference.merge.merge_states` (the fold over ``S``), torch tensors in, torch tensors out."""
    o_m, s = merge.merge_states(_host(o), _host(lse))
    return (_to_torch(o_m, o), _to_torch(s, o)) if _is_torch(o) else (o_m, s)


def add_states(o_a, o_b):
    """FlashSigmoid's merge of two states: the unnormalised outputs add."""
    o = np.asarray(_host(o_a)) + np.asarray(_host(o_b))
    return _to_torch(o, o_a) if _is_torch(o_a) else o


def plan_options(spec):
    """Scheduler options modelling a 132-SM GPU: one CTA per SM shared among the KV heads."""
    return dict(num_ctas=max(1, NUM_SMS // spec.num_kv_heads), tile_q=16, min_split_size=1, kv_align=1)


class Runner:
    """A plan bound to its spec; ``run`` executes it with :func:`~bsrattn.reference.executor.execute`."""

    def __init__(self, spec, work_plan):
        self.spec = spec
        self.work_plan = work_plan

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        o, s = execute(self.work_plan, self.spec, _host(q), _host(k), _host(v), k_scale=k_scale, v_scale=v_scale)
        return _finish(o, s, q, out, lse, return_lse, self.spec.variant.use_sigmoid)


def make_runner(spec, work_plan, previous=None):
    return Runner(spec, work_plan)
