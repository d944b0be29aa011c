"""Array kinds at the tier's edge: NumPy in, torch on the device, the caller's kind back out.

The kernels take torch tensors on one device: a CUDA GPU, or the CPU when Triton runs its interpreter
(``TRITON_INTERPRET=1``). NumPy arrays are accepted too and moved to the device; NumPy has no bfloat16 or
float8, so those come as ``ml_dtypes`` dtypes and cross as same-width integers, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from bsrattn.torch_cuda.config import interpreting
from bsrattn.validation import dtype_name

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
# Dtypes NumPy lacks cross as integers of the same width.
_BIT_VIEWS = {"bfloat16": (np.uint16, torch.int16), "float8_e4m3fn": (np.uint8, torch.uint8),
              "float8_e5m2": (np.uint8, torch.uint8)}
SUPPORTED = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def default_device() -> torch.device:
    """Where plan buffers live when no tensor says: the current CUDA device, or the CPU in the interpreter."""
    if interpreting() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def canonical_device(device) -> torch.device:
    """``device`` as a ``torch.device`` with its index: ``"cuda"`` means the current CUDA device, and a tensor
    there reports ``cuda:<index>``, so the two must compare equal."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(device: torch.device) -> None:
    """Raise unless the kernels can run on ``device``."""
    if device.type == "cuda" and not interpreting():
        return
    if device.type == "cpu" and interpreting():
        return
    where = "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)" if device.type == "cpu" else \
        "CUDA tensors cannot run under TRITON_INTERPRET=1"
    raise ValueError(f"the torch tier cannot run on {device}: {where}")


def to_torch(name: str, x, device: torch.device) -> torch.Tensor:
    """``x`` (torch tensor or NumPy array) as a tensor on ``device``; a tensor elsewhere raises ``ValueError``."""
    if isinstance(x, torch.Tensor):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the other inputs (and the plan's buffers) are on "
                             f"{device}; put every tensor on one device")
        return x
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or a NumPy array, got {type(x).__name__}")
    name_ = str(x.dtype)
    if name_ in _BIT_VIEWS:
        np_int, torch_int = _BIT_VIEWS[name_]
        t = torch.from_numpy(np.ascontiguousarray(x).view(np_int)).view(torch_int).view(TORCH_DTYPES[name_])
    else:
        t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy of ``t`` as NumPy, bfloat16 and float8 as ``ml_dtypes`` dtypes."""
    name = dtype_name(t)
    t = t.detach().cpu()
    if name in _BIT_VIEWS:
        import ml_dtypes

        np_int, torch_int = _BIT_VIEWS[name]
        return t.view(torch_int).numpy().view(np_int).view(getattr(ml_dtypes, name))
    return t.numpy()


def write_back(dest, result: torch.Tensor):
    """Put ``result`` into the caller's buffer ``dest`` (a tensor already written, or a NumPy array)."""
    if isinstance(dest, np.ndarray):
        dest[...] = to_numpy(result)
    return dest


def device_of(*xs) -> torch.device:
    """The device of the first torch tensor among ``xs`` (NumPy arrays have none), else the default."""
    for x in xs:
        if isinstance(x, torch.Tensor):
            return x.device
    return default_device()
