"""Compiling and launching kernels, on a GPU or under the CUDA simulator: the decorators every kernel file
uses, and the launch, with what the simulator needs to run this tier's kernels correctly and fast enough.
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import numpy as np
from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


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
