"""Tile shapes and launch parameters: what ``plan_options`` gives the scheduler and what a kernel is built with.

On a GPU the sizes are chosen for bandwidth (the Quest decode workload, W1 of ``docs/benchmarks.md``): 4 warps per
block, 64 keys gathered per step (with fp16 and head_dim 128 the K and V tiles are 33 KB of shared memory),
the next tile's loads in flight while a tile is computed, and a plan balanced over the blocks that are
resident at once. W1 of the benchmark suite times them (``benchmarks/NOTES.md``).

The simulator runs every CUDA thread as a Python thread and pays milliseconds per barrier, so there the
same kernels run with 8 threads a block, 16-key tiles and 4 CTAs per KV head: small enough to be quick,
enough to exercise multi-tile rows, query sub-tiles, split KV and threads that own several elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from bsrattn.indexing import ceil_div
from bsrattn.numba_cuda.formats import storage_dtype
from bsrattn.numba_cuda.launch import SIMULATOR

if SIMULATOR:
    NUM_THREADS = 8       # threads per block of the attention kernel
    TILE_KV = 16          # keys gathered into shared memory per step (an upper bound, see choose_tiles)
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
    return max(1, ceil_div(n, threads))


@dataclass(frozen=True)
class Config:
    """Everything a compiled attention kernel is specialised on."""

    head_dim: int                # of q and k: the width of q . k
    dim_vo: int                  # of v, the accumulator and out (head_dim but for head_dim_vo, as MLA's)
    group_size: int              # query heads a block holds per query row: the KV head's, or a share of them
    q_format: str           # also the output's
    kv_format: str
    compute_name: str       # "float32", or "float64" for float64 inputs
    kv_hnd: bool            # k/v stored HND ([blocks, Hkv, Bc, D]) rather than NHD
    causal: bool
    window: bool            # a sliding window (window_left >= 0)
    soft_cap: bool
    alibi: bool
    sigmoid: bool
    rope: bool              # fused RoPE: q and each K tile turned at their positions
    custom_mask: bool
    word_size: int          # bytes per copied word
    num_threads: int
    tile_kv: int
    tile_rows: int          # query rows per sub-tile
    min_blocks: int = 0     # launch bound: blocks per SM the compiler must fit (0: its choice)
    head_groups: int = 1    # blocks sharing one KV head's query heads, group_size each (see choose_tiles)

    @property
    def hidden_keys(self) -> bool:
        """Whether a key inside an item's range can be hidden from some of its queries (causal, window,
        custom mask): such pairs are tracked in shared memory, so that their ``v`` never reaches ``P @ V``."""
        return self.causal or self.window or self.custom_mask

    @property
    def compute(self):
        """The compute scalar type (a NumPy type: a cast in kernels and in the simulator alike)."""
        return np.dtype(self.compute_name).type

    @property
    def word(self) -> np.dtype:
        return np.dtype(f"u{self.word_size}")

    @property
    def element(self) -> np.dtype:
        """How a gathered K/V element is stored (the raw bits for bf16 and fp8)."""
        return np.dtype(storage_dtype(self.kv_format))

    @property
    def row_words(self) -> int:
        """Words per K row."""
        return self.head_dim * self.element.itemsize // self.word_size

    @property
    def v_row_words(self) -> int:
        """Words per V row (``dim_vo`` elements)."""
        return self.dim_vo * self.element.itemsize // self.word_size

    @property
    def row_stride(self) -> int:
        """Words per row of the shared K tile: one word of padding staggers rows across the memory banks, so
        threads reading different keys' rows do not all queue on one bank."""
        return self.row_words + 1

    @property
    def v_row_stride(self) -> int:
        """Words per row of the shared V tile, padded as :attr:`row_stride`."""
        return self.v_row_words + 1

    @property
    def max_nq(self) -> int:
        return self.tile_rows * self.group_size

    @property
    def acc_per_thread(self) -> int:
        """Accumulator elements each thread holds: one per (query, value dimension), spread over the threads."""
        return ceil_div(self.max_nq * self.dim_vo, self.num_threads)

    @property
    def words_per_thread(self) -> int:
        """Words of one K tile each thread copies."""
        return ceil_div(self.tile_kv * self.row_words, self.num_threads)

    @property
    def v_words_per_thread(self) -> int:
        """Words of one V tile each thread copies."""
        return ceil_div(self.tile_kv * self.v_row_words, self.num_threads)


def shared_bytes(head_dim, group_size, tile_rows, tile_kv, row_bytes, word_size, compute_size, rope=False,
                 v_row_bytes=None) -> int:
    """Static shared memory of one block: the K tile (rows of ``row_bytes``) and the V tile (``v_row_bytes``,
    default ``row_bytes``), queries, scores and probabilities, running state, tile rows, the visible (query, key)
    pairs of a tile (one byte each), and with fused RoPE the turned K tile in the compute precision."""
    nq = tile_rows * group_size
    v_row_bytes = row_bytes if v_row_bytes is None else v_row_bytes
    kv = tile_kv * (row_bytes + v_row_bytes + 2 * word_size)
    turned = tile_kv * head_dim if rope else 0
    return (kv + compute_size * (nq * head_dim + 2 * nq * tile_kv + 5 * nq + turned) + 8 * tile_kv
            + nq * tile_kv)


def query_tile_rows(group_size: int) -> int:
    """Query rows a block holds at once: ``MAX_QUERIES // G``, at least one (the plan's ``tile_q``).

    Examples
    --------
    >>> from bsrattn.numba_cuda import config
    >>> query_tile_rows(1) == config.MAX_QUERIES, query_tile_rows(10 * config.MAX_QUERIES)
    (True, 1)
    """
    return max(1, MAX_QUERIES // group_size)


def choose_tiles(head_dim, group_size, kv_itemsize, word_size, compute_size, item_rows, rope=False, dim_vo=None):
    """``(tile_rows, tile_kv, head_groups)``: :func:`query_tile_rows`, or fewer when no work item has more query
    rows (decode: 1); the largest power-of-two KV tile up to ``TILE_KV`` whose shared memory (K rows of
    ``head_dim``, V rows of ``dim_vo``, default ``head_dim``; with the turned K tile of fused RoPE when ``rope``)
    fits ``SHARED_MEMORY_LIMIT``; and the blocks a KV head's ``group_size`` query heads are shared among, 1 unless
    their queries alone leave no room (MLA's 64 or 128 heads over one latent head of 576): then the fewest whose
    equal shares of the heads fit.

    Examples
    --------
    >>> from bsrattn.numba_cuda import config
    >>> rows, tile_kv, groups = choose_tiles(128, 1, 2, 8, 4, item_rows=1)   # fp16 decode, head_dim 128
    >>> rows, tile_kv == config.TILE_KV, groups
    (1, True, 1)
    >>> choose_tiles(576, 128, 2, 8, 4, item_rows=1, dim_vo=512)[2] > 1     # MLA decode, 128 heads
    True
    """
    tile_rows = max(1, min(query_tile_rows(group_size), item_rows))
    dim_vo = head_dim if dim_vo is None else dim_vo
    for head_groups in (g for g in range(1, group_size + 1) if group_size % g == 0):
        tile_kv = TILE_KV
        while tile_kv >= 1:
            if shared_bytes(head_dim, group_size // head_groups, tile_rows, tile_kv, head_dim * kv_itemsize,
                            word_size, compute_size, rope, dim_vo * kv_itemsize) <= SHARED_MEMORY_LIMIT:
                return tile_rows, tile_kv, head_groups
            tile_kv //= 2
    widths = f"head_dim={head_dim}" + (f", head_dim_vo={dim_vo}," if dim_vo != head_dim else "")
    raise ValueError(f"{widths} does not fit the numba tier's {SHARED_MEMORY_LIMIT} bytes of shared memory per "
                     f"block, even one query head at a time")


def plan_options(spec) -> dict:
    """Scheduler options for this tier: one wave of resident blocks, query tiles of ``MAX_QUERIES // G`` rows,
    KV chunks in multiples of ``KV_ALIGN`` keys.

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn.validation import make_spec
    >>> spec = make_spec(ba.layouts.ragged([1], [100]), num_qo_heads=8, num_kv_heads=2, head_dim=64)
    >>> sorted(plan_options(spec))
    ['kv_align', 'min_split_size', 'num_ctas', 'tile_q']
    """
    return dict(num_ctas=num_ctas(spec.num_kv_heads), tile_q=query_tile_rows(spec.group_size),
                min_split_size=KV_ALIGN, kv_align=KV_ALIGN)
