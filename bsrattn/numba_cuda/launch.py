"""Compiling and launching kernels, on a GPU or under the CUDA simulator: the decorators every kernel file
uses, and the launch, with what the simulator needs to run this tier's kernels correctly and fast enough.

:func:`run` launches through Numba's dispatcher, as ``kernel[grid, threads](*args)``. A runner's launches, made
again and again with mostly the same arguments, go through a :class:`Launch` instead: the first through Numba,
the later ones with the compiled kernel and the converted arguments Numba used, kept (on a GPU; under the
simulator every launch goes through Numba).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from types import SimpleNamespace

import numpy as np
from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


def where_kernels_run() -> str:
    """``"simulator"`` or ``"gpu"``: where this tier's kernels can run in this process, read when it loads.

    Raises
    ------
    bsrattn.BackendError
        Neither: no CUDA GPU, and Numba's CUDA simulator off. The message says which variable to set, and when
        (Numba reads it once, when it is first imported).
    """
    if SIMULATOR:
        return "simulator"
    if cuda.is_available():
        return "gpu"
    from bsrattn.backends import BackendError

    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        raise BackendError("the numba tier found no CUDA GPU, and NUMBA_ENABLE_CUDASIM was set after numba was "
                           "imported, which Numba does not see: restart the process with it set (on the command "
                           "line, or in the program's first lines, before anything imports numba)")
    raise BackendError("the numba tier needs a CUDA GPU or Numba's CUDA simulator, and this machine has no GPU that "
                       "Numba can use: set NUMBA_ENABLE_CUDASIM=1 before numba is imported (on the command line, "
                       "or in the program's first lines) to run it in the simulator")


def kernel(fn, threads: int, min_blocks: int = 0):
    """``fn`` as a kernel launched with ``threads`` threads a block; ``min_blocks > 0`` also asks the compiler
    to fit that many blocks on an SM (a launch bound: it caps registers, possibly spilling)."""
    if SIMULATOR:
        return cuda.jit(fn)
    return cuda.jit(fn, launch_bounds=(threads, min_blocks) if min_blocks else threads)


def device(fn):
    """``fn`` as a device function, inlined into its callers (minitorch's re-decoration of shared helpers).

    Device functions here take the thread index as an argument and touch no CUDA state (kernels own the
    barriers and the shared and local arrays), so under the simulator they stay plain Python functions: the
    simulator's device-function wrapper swaps module globals under two locks on every call, which in the
    inner loops costs far more than the arithmetic.
    """
    return fn if SIMULATOR else cuda.jit(device=True, inline="always")(fn)


def _fma(a, b, c):
    return a * b + c


ops = SimpleNamespace(fma=_fma) if SIMULATOR else cuda
"""Where device functions find ``ops.fma(a, b, c)``: ``a * b + c`` as one explicit FMA (one rounding) on a GPU,
whatever the code around it, where the compiler's own fusing of a multiply with an add depends on that code.
(Numba types ``cuda.fma`` as an attribute of the module, so the GPU's is numba.cuda itself.) In the simulator,
whose device functions are plain Python (:func:`device`) and see only their own module's globals, two
roundings of NumPy scalars: the same every time."""


_simulated_launch = threading.Lock()


def run(kernel, grid, threads, *args):
    """Launch ``kernel[grid, threads](*args)``; under the simulator, one launch at a time, with the GIL handed
    between threads every 50 µs instead of 5 ms for the launch's duration.

    The simulator runs a block's threads as Python threads and releases a ``syncthreads`` barrier from a
    polling thread; at the default switch interval every barrier waits milliseconds for the GIL. Two launches
    from two Python threads at once would share its per-process state (the switch interval, the simulated
    thread context), so they take turns, as launches on one stream do on a GPU.
    """
    if not SIMULATOR:
        kernel[grid, threads](*args)
        return
    with _simulated_launch:
        previous = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)
        try:
            kernel[grid, threads](*args)
        finally:
            sys.setswitchinterval(previous)


def _numba_launcher():
    """What Numba's compiled kernels launch with: cuda.core's ``launch`` and ``LaunchConfig`` as
    ``numba.cuda.dispatcher`` imports them (numba-cuda 0.24 on), and the current CUDA context's handle. None
    under the simulator, and on earlier numba-cuda, whose kernels launch through its own driver wrapper."""
    if SIMULATOR:
        return None
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv import driver

    if not hasattr(dispatcher, "launch") or not hasattr(dispatcher, "LaunchConfig"):
        return None
    return SimpleNamespace(launch=dispatcher.launch, config=dispatcher.LaunchConfig,
                           context=lambda: int(driver.driver.cuCtxGetCurrent()))


_LAUNCHER = _numba_launcher()

KEEPS_LAUNCHES = True
"""Whether a :class:`Launch` keeps what Numba launched with, where it can; False sends every launch through
Numba (the tests compare the two)."""

_INTEGERS = frozenset({bool, int, np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                       np.uint64})
_FLOATS = frozenset({float, np.float16, np.float32, np.float64})
_DOUBLE = struct.Struct("<d")


def argument_key(arg):
    """What Numba's conversion of one kernel argument, and the argument's Numba type, depend on; None for a kind
    of argument that a :class:`Launch` never keeps converted.

    Numba passes a device array as its size, item size, address, shape and strides, and types it by its dtype,
    dimensions and layout (which follow from the shape and strides): the key is the array's class, address,
    shape, strides and dtype. A scalar is typed by its Python type and passed as a C value of that type: the key
    is the type and the value, a float's by its bits (``-0.0 == 0.0``, ``nan != nan``). Host arrays (which Numba
    copies to the device and back on each launch) and other objects are None.

    Examples
    --------
    >>> import numpy as np
    >>> argument_key(16), argument_key(np.float32(0.5)) != argument_key(np.float32(-0.5)), argument_key(np.zeros(2))
    ((<class 'int'>, 16), True, None)
    """
    if getattr(arg, "__cuda_ndarray__", False):
        return type(arg), arg.device_ctypes_pointer.value, arg.shape, arg.strides, arg.dtype
    kind = type(arg)
    if kind in _INTEGERS:
        return kind, arg
    if kind in _FLOATS:
        return kind, _DOUBLE.pack(arg)
    return None


class Launch:
    """:func:`run` at one call site (a runner's persistent kernel, its merge), with Numba's host work kept between
    launches.

    ``kernel[grid, threads](*args)`` types every argument to select the compiled overload, then converts each
    into the C arguments of the launch (a device array: a new view of its address, shape and strides), under
    checks of the CUDA context. A decode call (two launches, 29 arguments) costs many times its GPU time in host
    work that way; its launches kept (and the device views of its tensors, :mod:`.runner`) cost a fraction of
    that (the figures: ``benchmarks/NOTES.md``, the numba tier's ladder).

    A ``Launch`` makes its first launch through Numba, then keeps the overload Numba selected, the arguments as
    that overload's own ``_prepare_args`` converts them (so they are what Numba would pass, in its ABI), the
    launch configuration and the stream Numba launched on. A later launch of the same kernel, grid and block
    in the same CUDA context compares each argument's :func:`argument_key` with the kept one; an argument whose
    key changed is converted again, alone, when its Numba type is still the overload's, and the kernel is
    launched with the kept list, as Numba launches it. Anything else (another kernel, grid or context, a changed
    Numba type, an argument kind :func:`argument_key` does not key) goes through Numba again, and what that
    launch used is kept.

    Kept only where Numba's launch is the cuda.core call this repeats (:func:`_numba_launcher`), and only for
    a plain kernel: not compiled in debug mode (Numba reads its error flag after each launch), not cooperative,
    without argument extensions, with no argument that Numba copies to or from the host. Set
    :data:`KEEPS_LAUNCHES` to False to send every launch through Numba. Not thread-safe: a runner launches
    under its lock.
    """

    __slots__ = ("_kept",)

    def __init__(self):
        self._kept = None

    def __call__(self, kernel, grid, threads, *args):
        if _LAUNCHER is None or not KEEPS_LAUNCHES:
            run(kernel, grid, threads, *args)
            return
        keys = tuple(map(argument_key, args))
        kept = self._kept
        if kept is not None and kept.kernel is kernel and kept.grid == grid and kept.threads == threads \
                and kept.context == _LAUNCHER.context():
            arguments = kept.update(args, keys)
            if arguments is not None:
                _LAUNCHER.launch(kept.stream, kept.config, kept.function, *arguments)
                return
        self._kept = None
        run(kernel, grid, threads, *args)
        if None not in keys:
            self._kept = _Kept.after(kernel, grid, threads, args, keys)


class _Kept:
    """What a :class:`Launch` keeps of a launch Numba made: its site, the selected overload, the converted
    arguments with each argument's key and span in them, and what Numba launched them with."""

    __slots__ = ("kernel", "grid", "threads", "context", "compiled", "types", "stream", "config", "function",
                 "keys", "spans", "arguments")

    @classmethod
    def after(cls, kernel, grid, threads, args, keys):
        """The launch ``kernel[grid, threads](*args)`` just made, or None when it cannot be repeated as kept.

        The overload is the one compiled for the arguments' Numba types (``typeof_pyval``, as Numba types them
        for its own look-up), which Numba's overload resolution selects whenever it exists: an exact match.
        """
        configured = kernel[grid, threads]
        if getattr(kernel, "_launch_config_sensitive", False) or getattr(configured, "pre_launch_callbacks", None):
            return None
        types = tuple(kernel.typeof_pyval(a) for a in args)
        compiled = kernel.overloads.get(types)
        if compiled is None or compiled.debug or compiled.cooperative or compiled.extensions \
                or getattr(compiled, "launch_config_sensitive", False):
            return None
        context = _LAUNCHER.context()
        if not context:
            return None
        kept = cls()
        kept.kernel, kept.grid, kept.threads, kept.context = kernel, grid, threads, context
        kept.compiled, kept.types, kept.stream = compiled, types, configured.stream
        kept.config = _LAUNCHER.config(grid=configured.griddim, block=configured.blockdim,
                                       shmem_size=configured.sharedmem)
        kept.function = compiled._codelibrary.get_cufunc().kernel
        kept.keys, kept.spans, kept.arguments = keys, [], []
        for ty, arg in zip(types, args):
            start = len(kept.arguments)
            if not kept._convert(ty, arg, kept.arguments):
                return None
            kept.spans.append(slice(start, len(kept.arguments)))
        return kept

    def _convert(self, ty, arg, into) -> bool:
        """Append ``arg``'s C arguments to ``into``, as Numba's launch converts it; False if the conversion left
        work for after the launch (a copy back to the host), which a kept launch would skip."""
        after = []
        self.compiled._prepare_args(ty, arg, self.stream, after, into)
        return not after

    def update(self, args, keys):
        """The kept arguments, with those of ``args`` whose key changed converted again; None when that cannot
        be done (a different number of arguments, an argument not keyed, a changed Numba type)."""
        if keys == self.keys:
            return self.arguments
        if len(keys) != len(self.keys) or None in keys:
            return None
        changed = []
        for i, (key, old) in enumerate(zip(keys, self.keys)):
            if key == old:
                continue
            piece = []
            if self.kernel.typeof_pyval(args[i]) != self.types[i] or not self._convert(self.types[i], args[i], piece):
                return None
            changed.append((i, piece))
        for i, piece in changed:
            self.arguments[self.spans[i]] = piece
        self.keys = keys
        return self.arguments


def _thread_safe_simulated_shared_memory():
    """Make the simulator's ``cuda.shared.array`` safe for the threads of one block.

    The simulator keys a block's shared arrays by the calling source line and creates one on first use with
    an unlocked check-then-set, so two threads allocating at the same moment can each get their own array
    (seen here about once in a hundred launches: a block whose threads no longer share ``q_tile``). This is
    the same lookup under a lock, keyed by the caller's frame (which is also much cheaper than the
    simulator's full stack extraction). Dynamic shared memory (``shape == 0``) is left to the simulator.
    """
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernelapi

    simulated = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return simulated(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(site)
            if found is None:
                dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
                found = self._allocations[site] = np.empty(shape, dtype)
        return found

    kernelapi.FakeCUDAShared.array = array


if SIMULATOR:
    _thread_safe_simulated_shared_memory()
