"""Launch geometry: the tier's named tile sizes, on a GPU and under the CUDA simulator.

On a GPU the sizes are chosen for bandwidth (the Quest decode workload, W1 of ``docs/benchmarks.md``): 4 warps per
block, 64 keys gathered per step (with fp16 and head_dim 128 the K and V tiles are 33 KB of shared memory),
the next tile's loads in flight while a tile is computed, and a plan balanced over the blocks that are
resident at once. ``tests/gpu_numba_check.py --sweep`` times the alternatives.

The simulator runs every CUDA thread as a Python thread and pays milliseconds per barrier, so there the
same kernels run with 8 threads a block, 16-key tiles and 4 CTAs per KV head: small enough to be quick,
enough to exercise multi-tile rows, query sub-tiles, split KV and threads that own several elements.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)

if SIMULATOR:
    NUM_THREADS = 8       # threads per block of the attention kernel
    TILE_KV = 16          # keys gathered into shared memory per step (an upper bound, see executor.choose_tiles)
    MAX_QUERIES = 4       # (query row, head) pairs a block holds at once: tile_q = MAX_QUERIES // group_size
    KV_ALIGN = 4          # split-KV chunks are multiples of this many keys
    MERGE_THREADS = 32    # threads per block of the merge kernels
else:
    NUM_THREADS = 128
    TILE_KV = 64
    MAX_QUERIES = 16
    KV_ALIGN = 16         # one page of 16: Quest/paged chunks then start on page boundaries
    MERGE_THREADS = 128
CTAS_PER_SM = 2           # resident attention blocks per SM that the plan is balanced over (GPU): the
                          # fp16 head_dim-128 decode kernel takes ~250 registers a thread, so 2 blocks fit
MIN_BLOCKS_PER_SM = 0     # launch bound asking the compiler to fit this many blocks per SM (0: its choice)
SIMULATED_CTAS = 4        # CTAs per KV head in the simulator
SHARED_MEMORY_LIMIT = 48 * 1024  # static shared memory one block may declare


def num_ctas(num_kv_heads: int) -> int:
    """CTAs per KV head: one wave of ``CTAS_PER_SM`` blocks on every SM, shared among the KV heads."""
    if SIMULATOR:
        return SIMULATED_CTAS
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return max(1, sms * CTAS_PER_SM // num_kv_heads)


def blocks_for(n: int, threads: int = MERGE_THREADS) -> int:
    """Blocks of ``threads`` covering ``n`` elements (at least one).

    Examples
    --------
    >>> blocks_for(1000, 128), blocks_for(0, 128)
    (8, 1)
    """
    return max(1, -(-n // threads))


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
