"""Array kinds at the tier's edge: NumPy in, torch on the device, the caller's kind back out.

The kernels take torch tensors on one device: a CUDA GPU, or the CPU when Triton runs its interpreter
(``TRITON_INTERPRET=1``). NumPy arrays are accepted too and moved to the device; NumPy has no bfloat16 or
float8, so those come as ``ml_dtypes`` dtypes and cross as same-width integers, bit for bit.

The interpreter computes some dtypes wrongly, without an error: bfloat16 attention comes out near 1e9. Under
``TRITON_INTERPRET=1`` the attention inputs are refused in those dtypes (:data:`INTERPRETER_WRONG`). The
others are right there: float8 KV (cast to float16 in the kernel) and the merge kernels, which widen their
inputs, bfloat16 included, to float32 as they load them.
"""

from __future__ import annotations

import numpy as np
import torch

from bsrattn.torch_cuda.config import interpreter_changed, interpreting
from bsrattn.validation import dtype_name

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
# Dtypes NumPy lacks cross as integers of the same width.
_BIT_VIEWS = {"bfloat16": (np.uint16, torch.int16), "float8_e4m3fn": (np.uint8, torch.uint8),
              "float8_e5m2": (np.uint8, torch.uint8)}
SUPPORTED = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
INTERPRETER_WRONG = {torch.bfloat16: "the Triton interpreter computes bfloat16 arithmetic wrongly; run bfloat16 on a GPU"}
"""Dtypes of ``q``, ``k``, ``v`` that the attention kernel computes wrongly in the Triton interpreter, and why."""
_ATTENTION_INPUTS = ("q", "k", "v")
"""The inputs the attention kernel computes on in their own dtype (``tl.dot`` of their tiles)."""


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


def check_device(device: torch.device, whose: str | None = None) -> None:
    """Raise unless the kernels can run on ``device``; ``whose`` (``"the inputs"``) says whose device it is."""
    if device.type == ("cpu" if interpreting() else "cuda"):
        return
    if device.type == "meta":
        why = "a meta tensor holds no data"
    elif device.type in ("cpu", "cuda") and interpreter_changed():
        why = (f"TRITON_INTERPRET changed after the tier was imported, whose kernels Triton had then made for "
               f"{'its CPU interpreter' if interpreting() else 'a GPU'}; restart the process with the variable set "
               f"as wanted before bsrattn's torch tier is imported")
    elif device.type == "cpu":
        why = "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
    elif device.type == "cuda":
        why = "CUDA tensors cannot run under TRITON_INTERPRET=1"
    else:
        why = "the kernels run on CUDA GPUs, or on the CPU under TRITON_INTERPRET=1"
    of = f" (the device of {whose})" if whose else ""
    raise ValueError(f"the torch tier cannot run on {device}{of}: {why}")


def check_interpretable(name: str, dtype) -> None:
    """Raise ``TypeError`` if ``name`` (``q``, ``k`` or ``v``) of torch ``dtype`` would be computed wrongly
    here: under ``TRITON_INTERPRET=1``, in a dtype of :data:`INTERPRETER_WRONG`."""
    why = INTERPRETER_WRONG.get(dtype)
    if why is not None and interpreting():
        raise TypeError(f"{name} has dtype {str(dtype).removeprefix('torch.')}: {why}")


def to_torch(name: str, x, device: torch.device) -> torch.Tensor:
    """``x`` (torch tensor or NumPy array) as a tensor on ``device``; a tensor elsewhere raises ``ValueError``.

    ``q``, ``k`` and ``v`` in a dtype the Triton interpreter computes wrongly raise ``TypeError`` there (see
    :func:`check_interpretable`), before anything is copied.
    """
    if isinstance(x, torch.Tensor):
        if name in _ATTENTION_INPUTS:
            check_interpretable(name, x.dtype)
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the other inputs (and the plan's buffers) are on "
                             f"{device}; put every tensor on one device")
        return x
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or a NumPy array, got {type(x).__name__}")
    name_ = str(x.dtype)
    if name in _ATTENTION_INPUTS:
        check_interpretable(name, TORCH_DTYPES.get(name_))
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
    """The device of the first torch tensor among ``xs`` (NumPy arrays have none), else the default.

    Raises ``ValueError`` if the kernels cannot run there (:func:`check_device`): a tensor elsewhere than the
    first is refused by :func:`to_torch`, naming it.
    """
    for x in xs:
        if isinstance(x, torch.Tensor):
            check_device(x.device, "the inputs")
            return x.device
    return default_device()
