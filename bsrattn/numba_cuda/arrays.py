"""Array kinds at the numba tier's edge: NumPy in, NumPy out; device array in, device array out.

A call takes NumPy arrays (copied to the GPU for the call, results copied back) or device arrays used in
place: Numba's own, real or simulated, and anything with ``__cuda_array_interface__`` (a torch CUDA tensor,
a CuPy array). Results come back in the kind of the array they follow (``q`` for attention, ``o_a`` for a
merge): NumPy, a Numba device array, or a torch tensor when a torch tensor came in. bfloat16 and fp8 travel
as their raw bits (:mod:`.formats`); only NumPy (ml_dtypes) arrays can carry them here. A torch tensor on the
CPU is neither kind, and is refused (it would come back as NumPy).

A runner keeps the device views of a call's torch tensors for the calls after it with the same tensors
(:func:`tensor_key`); views it keeps do not hold their tensors (``device_array(..., hold=False)``).
"""

from __future__ import annotations

import sys

import numpy as np
from numba import cuda

from bsrattn.numba_cuda.formats import BITS, format_of, numpy_dtype, storage_dtype


def is_device(x) -> bool:
    """Whether ``x`` lives on the GPU (a Numba device array or any ``__cuda_array_interface__`` object)."""
    return bool(getattr(x, "__cuda_ndarray__", False)) or hasattr(x, "__cuda_array_interface__")


def _check_host(x, name: str) -> None:
    """Raise unless the host array ``x`` is NumPy's: a CPU torch tensor would come back as NumPy."""
    if type(x).__module__.split(".")[0] == "torch":
        raise TypeError(f"{name} is a torch tensor on {x.device}; the numba tier takes NumPy arrays or arrays on "
                        f"the GPU (a CUDA tensor, a Numba device array): pass {name}.numpy() or a CUDA tensor")


def row_stride(x) -> int | None:
    """Bytes from one row of ``x`` (a vector along its last axis) to the next, in C order, when its rows are
    contiguous and evenly spaced; None otherwise. A C-contiguous array's rows are; so are a slice of the last axis
    of one (MLA's value ``k[..., :Dc]``, rows a key's width apart) and a view with an inserted size-1 axis
    (``k[:, None]``). Size-1 axes have no stride that counts, nor has an empty array any.

    Examples
    --------
    >>> import numpy as np
    >>> k = np.zeros((3, 4, 1, 24), np.float32)
    >>> row_stride(k), row_stride(k[..., :16]), row_stride(k[:, ::2]), row_stride(k.swapaxes(0, 1))
    (96, 96, 192, None)
    """
    shape, strides, item = tuple(x.shape), tuple(x.strides), x.dtype.itemsize
    if 0 in shape:
        return shape[-1] * item
    if shape[-1] > 1 and strides[-1] != item:
        return None
    stride, span = None, None
    for n, s in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if n == 1:
            continue
        if stride is None:
            stride = s
        elif s != span:
            return None
        span = s * n
    if stride is None:
        return shape[-1] * item
    return stride if stride > 0 else None


def device_array(x, name: str, hold: bool = True, rows: bool = False):
    """``x`` as a C-contiguous Numba device array of its storage dtype: copied if on the host, else a view.

    ``hold=False``: a view of a ``__cuda_array_interface__`` object that does not keep the object alive (a view
    kept for later calls on the same memory, which each caller's own array keeps alive through its call).
    ``rows=True`` (``k`` and ``v``, which kernels read a row at a time): a device ``x`` need only have its rows
    contiguous and evenly spaced (:func:`row_stride`), and is viewed in place, as MLA's value ``k[..., :Dc]``.
    """
    fmt = format_of(x)
    if not is_device(x):
        _check_host(x, name)
        return cuda.to_device(np.ascontiguousarray(np.asarray(x)).view(storage_dtype(fmt)))
    if fmt in BITS:
        raise TypeError(f"the numba tier does not support {fmt} device arrays ({name}): Numba has no {fmt} type; "
                        f"pass {name} as a NumPy (ml_dtypes) array, or use the torch tier")
    if getattr(x, "__cuda_ndarray__", False):
        dev = x
    else:
        dev = cuda.as_cuda_array(x) if hold else cuda.from_cuda_array_interface(x.__cuda_array_interface__)
    if not dev.is_c_contiguous() and not (rows and row_stride(dev) is not None):
        what = "have its rows (the last axis) contiguous and evenly spaced" if rows else "be C-contiguous"
        raise ValueError(f"{name} must {what} on the device; got shape {tuple(dev.shape)}, "
                         f"strides {tuple(dev.strides)}")
    return dev


def tensor_key(x) -> tuple | None:
    """What a device view of the torch tensor ``x`` is made of, and what decides whether it may be viewed: its
    device, dtype, ``requires_grad`` (refused), address, shape and strides. None for anything but a plain strided
    ``torch.Tensor`` (a subclass may define its own ``__cuda_array_interface__``).

    Equal keys give equal views, whichever tensor object they come from; ``set_``, ``resize_`` or
    ``as_strided_`` on a tensor changes its key.

    Examples
    --------
    >>> import torch
    >>> x = torch.zeros(4, 3)
    >>> tensor_key(x) == tensor_key(x[:]), tensor_key(x) == tensor_key(x[1:]), tensor_key(x.T) == tensor_key(x)
    (True, False, False)
    """
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or x.layout is not torch.strided:
        return None
    return x.device, x.dtype, x.requires_grad, x.data_ptr(), x.shape, x.stride()


def resident(a, dtype):
    """``a`` (a host array) on the device as ``dtype``, of its shape, or ``[1]`` when empty: kernels take no empty
    arrays.

    Plan-time copies live here, not beside the kernels: under the CUDA simulator a running kernel's module has
    its ``cuda`` swapped for the simulator's stand-in, so a copy made there from another thread would fail.
    """
    a = np.ascontiguousarray(a, dtype=dtype)
    return cuda.to_device(a if a.size else np.zeros(1, dtype))


def empty(shape, fmt: str):
    """A new device array holding ``shape`` elements of ``fmt`` (as its storage dtype)."""
    return cuda.device_array(tuple(int(s) for s in shape), dtype=storage_dtype(fmt))


def target(buffer, shape, fmt: str, name: str):
    """Where a kernel writes a result: the caller's device ``buffer`` itself, or a new device array."""
    if buffer is not None and is_device(buffer):
        return device_array(buffer, name)
    if buffer is not None:
        _check_host(buffer, name)
    return empty(shape, fmt)


def to_host(dev, fmt: str) -> np.ndarray:
    """A device result as a NumPy array of ``fmt`` (bits viewed back as ml_dtypes)."""
    host = dev.copy_to_host()
    return host.view(numpy_dtype(fmt)) if fmt in BITS else host


def deliver(dev, fmt: str, like, buffer=None):
    """Hand a device result back in the caller's kind: into ``buffer`` if given, else like ``like``."""
    if buffer is not None:
        if not is_device(buffer):
            buffer[...] = to_host(dev, fmt)
        return buffer
    if not is_device(like):
        return to_host(dev, fmt)
    if type(like).__module__.split(".")[0] == "torch":
        import torch

        return torch.as_tensor(dev, device=like.device)
    return dev
