"""Launch geometry: the tier's named tile sizes, on a GPU and under the CUDA simulator.

On a GPU the sizes are chosen for bandwidth (the Quest decode workload of ``BENCHMARKS.md``): 4 warps per
block, 64 keys gathered per step (with fp16 and head_dim 128 the K and V tiles are 33 KB of shared memory,
so several blocks share an SM and their loads overlap), 4 resident blocks per SM per KV head. The simulator
runs every CUDA thread as a Python thread, so there the same kernels run with one warp's worth of threads,
8-key tiles and 4 CTAs, which still exercises multi-tile rows, query sub-tiles and split KV at tiny sizes.
"""

from __future__ import annotations

import sys

from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)

if SIMULATOR:
    NUM_THREADS = 8       # threads per block of the attention kernel
    TILE_KV = 16           # keys gathered into shared memory per step (an upper bound, see executor.choose_tiles)
    MAX_QUERIES = 4       # (query row, head) pairs a block holds at once: tile_q = MAX_QUERIES // group_size
    KV_ALIGN = 4          # split-KV chunks are multiples of this many keys
    MERGE_THREADS = 32    # threads per block of the merge kernels
else:
    NUM_THREADS = 128
    TILE_KV = 64
    MAX_QUERIES = 16
    KV_ALIGN = 16         # one page of 16: Quest/paged chunks then start on page boundaries
    MERGE_THREADS = 128
CTAS_PER_SM = 4           # resident attention blocks per SM that the plan is balanced over (GPU)
SIMULATED_CTAS = 4        # CTAs per KV head in the simulator
SHARED_MEMORY_LIMIT = 48 * 1024  # static shared memory one block may declare


def num_ctas(num_kv_heads: int) -> int:
    """CTAs per KV head: one wave of ``CTAS_PER_SM`` blocks on every SM, shared among the KV heads."""
    if SIMULATOR:
        return SIMULATED_CTAS
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return max(1, sms * CTAS_PER_SM // num_kv_heads)


def blocks_for(n: int, threads: int = MERGE_THREADS) -> int:
    """Blocks of ``threads`` covering ``n`` elements (at least one)."""
    return max(1, -(-n // threads))


def device(fn):
    """``fn`` as a device function, inlined into its callers (minitorch's re-decoration of shared helpers).

    Device functions here take the thread index as an argument and touch no CUDA state (kernels own the
    barriers and the shared and local arrays), so under the simulator they stay plain Python functions: the
    simulator's device-function wrapper swaps module globals under two locks on every call, which in the
    inner loops costs far more than the arithmetic.
    """
    return fn if SIMULATOR else cuda.jit(device=True, inline="always")(fn)


def run(kernel, grid, threads, *args):
    """Launch ``kernel[grid, threads](*args)``; under the simulator, with the GIL handed between threads every
    50 µs instead of 5 ms for the launch's duration.

    The simulator runs a block's threads as Python threads and releases a ``syncthreads`` barrier from a
    polling thread; at the default switch interval every barrier waits milliseconds for the GIL.
    """
    if not SIMULATOR:
        kernel[grid, threads](*args)
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        kernel[grid, threads](*args)
    finally:
        sys.setswitchinterval(previous)
