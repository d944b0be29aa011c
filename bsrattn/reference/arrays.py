"""Array kinds at the tier's edge: NumPy inside, torch tensors (on the CPU or a GPU) accepted and handed back.

A tensor is copied to the host (bfloat16 and float8 bit for bit, as their ``ml_dtypes`` types), computed on
exactly as the same NumPy array would be, and the result comes back as a tensor of the input's dtype on its
device. The tier never imports torch itself: a tensor is recognised by its type's module.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bsrattn.state import write_into
from bsrattn.validation import dtype_name, lse_dtype

# Dtypes NumPy has only through ml_dtypes cross between torch and NumPy as integers of the same width.
_BITS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (by its type's module, so that this tier never imports torch)."""
    return type(x).__module__.split(".")[0] == "torch"


def host(x):
    """``x`` as NumPy: a torch tensor is copied to the host, bfloat16 and float8 as their ml_dtypes types."""
    if not is_torch(x):
        return x
    import torch  # imported already: the caller passed a tensor

    name = dtype_name(x)
    t = x.detach().cpu()
    if name in _BITS:
        return t.view(getattr(torch, _BITS[name])).numpy().view(getattr(ml_dtypes, name))
    return t.numpy()


def to_torch(result, like, dtype=None):
    """The NumPy ``result`` as a torch tensor of ``dtype`` (default: ``result``'s own) on ``like``'s device."""
    import torch

    result = np.ascontiguousarray(result)
    name = dtype_name(result)
    if name in _BITS:
        t = torch.from_numpy(result.view(_BITS[name])).view(getattr(torch, name))
    else:
        t = torch.from_numpy(result)
    return t.to(device=like.device, dtype=dtype)


def deliver(o, s, q, out, lse, return_lse, sigmoid):
    """The float64 state in ``q``'s dtype and kind (``lse`` float32, float64 for a float64 ``q``), written into
    ``out``/``lse`` where given."""
    if is_torch(q):
        o = to_torch(o, q, q.dtype)
        s = None if sigmoid else to_torch(s.astype(lse_dtype(q)), q)
    else:
        o = o.astype(np.asarray(q).dtype)
        s = None if sigmoid else s.astype(lse_dtype(q))
    o, s = write_into(o, s, out, lse)
    return o, (s if return_lse or lse is not None else None)
