"""The numba tier on a GPU: a memcheck target, and the Quest decode workload (W1 of ``docs/benchmarks.md``) timed.

    python3 tests/gpu_numba_check.py                 # W1 at seq_len 32768, budgets 512 and 64
    python3 tests/gpu_numba_check.py --sweep         # W1 at budget 512 under other launch settings
    compute-sanitizer --tool memcheck python3 tests/gpu_numba_check.py --memcheck

W1: batch 1, 32 query heads = 32 KV heads, head_dim 128, fp16, pages of 16; every head selects ``budget``
random distinct pages (sorted) of a 32768-token cache, stored HND so a (page, head) is contiguous, and run
through ``ba.layouts.quest`` (one row per head). Before timing, each configuration is checked against the
float64 reference on the selected pages, with the outputs poisoned (NaN) first so an unwritten element
fails. Timing: the planned run (``make_runner(...).run``, what ``BatchAttention.run`` calls) on device
arrays, CUDA events around the call, L2 flushed by zeroing a 256 MiB buffer before every sample, median of
200 samples after 10 warm-ups. Each sample is queued behind a 2 ms spin kernel, so the events time the GPU
work, not Python's launch overhead ("gpu"); "eager" is the host wall time of a synchronised call. The
bound is the bytes the work needs (K and V of the selected pages, q, out) over the 4.16 TB/s copy
bandwidth (read + written bytes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bsrattn as ba
from bsrattn.testing import assert_close, scattered_page_tables

COPY_BANDWIDTH = 4.16e12  # bytes/s, read + written, measured on the H200 (docs/benchmarks.md)
HEADS, HEAD_DIM, PAGE, SEQ_LEN = 32, 128, 16, 32768
FLUSH_BYTES = 256 << 20


def _cuda():
    from numba import cuda

    if not cuda.is_available():
        sys.exit("needs a CUDA GPU (and NUMBA_ENABLE_CUDASIM unset)")
    return cuda


# ---- the workload ---------------------------------------------------------------------------------------

class QuestCache:
    """W1's KV cache, HND ``[num_pages, HEADS, PAGE, HEAD_DIM]`` fp16, and its query; host copies kept for the
    reference, device copies made once (``to_device``) and reused by every budget and launch setting."""

    def __init__(self, seq_len: int = SEQ_LEN, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.rng, self.seq_len, self.num_pages = rng, seq_len, seq_len // PAGE
        shape = (self.num_pages, HEADS, PAGE, HEAD_DIM)
        self.k, self.v = (rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in range(2))
        self.q = rng.standard_normal((1, HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16)
        self.device = None

    def views(self):
        """``q [HEADS, 1, D]``, ``k, v [num_pages * HEADS, PAGE, 1, D]``: the per-head views Quest runs on."""
        return ba.layouts.per_head_views(self.q, self.k, self.v, HEADS)

    def device_views(self, cuda):
        if self.device is None:
            self.device = tuple(cuda.to_device(np.ascontiguousarray(x)) for x in self.views())
        return self.device

    def select(self, budget: int):
        """Each head's ``budget`` random distinct pages, sorted, and the layout over them."""
        selected = [np.sort(self.rng.choice(self.num_pages, budget, replace=False)) for _ in range(HEADS)]
        layout = ba.layouts.quest([np.arange(self.num_pages)], [self.seq_len], [selected], PAGE, self.num_pages,
                                  HEADS)
        return layout, selected

    def reference(self, selected):
        """The float64 reference on the selected pages only (a compact paged layout, one row per head)."""
        budget = selected[0].size
        compact = [np.stack([x[selected[h], h] for h in range(HEADS)]).reshape(HEADS * budget, PAGE, 1, HEAD_DIM)
                   for x in (self.k, self.v)]
        tables = [np.arange(h * budget, (h + 1) * budget) for h in range(HEADS)]
        layout = ba.layouts.paged([1] * HEADS, tables, [budget * PAGE] * HEADS, PAGE, HEADS * budget)
        return ba.attention(self.views()[0], *compact, layout, return_lse=True)


def needed_bytes(budget: int) -> int:
    kv = 2 * HEADS * budget * PAGE * HEAD_DIM * 2
    return kv + 2 * HEADS * HEAD_DIM * 2  # + q read + out written


# ---- timing ------------------------------------------------------------------------------------------------

def _helpers(cuda):
    @cuda.jit
    def spin(ns):
        waited = 0
        while waited < ns:
            cuda.nanosleep(np.uint32(1000))
            waited += 1000

    @cuda.jit
    def zero(buf):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < buf.size:
            buf[i] = 0
            i += stride

    return spin, zero


def time_gpu(cuda, call, samples=200, warmup=10):
    """Median GPU microseconds of ``call()`` (L2 flushed before each sample) and median eager wall time."""
    spin, zero = _helpers(cuda)
    flush = cuda.device_array(FLUSH_BYTES // 8, dtype=np.int64)
    start, end = cuda.event(), cuda.event()
    for _ in range(warmup):
        call()
    cuda.synchronize()
    gpu = []
    for _ in range(samples):
        spin[1, 1](np.uint32(2_000_000))
        zero[1024, 256](flush)
        start.record()
        call()
        end.record()
        end.synchronize()
        gpu.append(cuda.event_elapsed_time(start, end) * 1e3)
    eager = []
    for _ in range(samples // 4):
        zero[1024, 256](flush)
        cuda.synchronize()
        t0 = time.perf_counter()
        call()
        cuda.synchronize()
        eager.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(gpu)), float(np.median(eager))


def _kernel_report(runner, cfg) -> str:
    """Registers and shared memory of the compiled attention kernel, and the plan it ran."""
    from bsrattn.numba_cuda import executor

    kernel = executor.persistent_kernel(cfg)
    regs = sorted(set(kernel.get_regs_per_thread().values()))
    smem = sorted(set(kernel.get_shared_mem_per_block().values()))
    work_plan = runner.work_plan
    return (f"    kernel: tile_kv {cfg.tile_kv}, {cfg.num_threads} threads, min_blocks {cfg.min_blocks}, "
            f"{cfg.word_size}-byte loads: {regs} registers/thread, {smem} B shared/block\n"
            f"    plan: {work_plan.num_ctas} CTAs, {work_plan.num_items} items, chunks of {work_plan.kv_chunk_size} "
            f"keys, {work_plan.num_merges} merges")


def run_w1(cuda, cache: QuestCache, budget: int, label: str = "") -> dict:
    """Check W1 at ``budget`` against the reference (poisoned outputs), then time it."""
    from bsrattn.numba_cuda import make_runner, plan_options
    from bsrattn.validation import make_spec

    layout, selected = cache.select(budget)
    dq, dk, dv = cache.device_views(cuda)
    spec = make_spec(layout, 1, 1, HEAD_DIM, q_dtype="float16", kv_dtype="float16")  # per-head views: G = 1
    runner = make_runner(spec, ba.scheduler.plan(layout.qo_lens, layout.kv_lens, **plan_options(spec)))
    out = cuda.to_device(np.full(dq.shape, np.nan, np.float16))
    lse = cuda.to_device(np.full(dq.shape[:2], np.nan, np.float32))
    runner.run(dq, dk, dv, out=out, lse=lse, return_lse=True)
    want_o, want_lse = cache.reference(selected)
    assert_close(out.copy_to_host().astype(np.float64), want_o, "attention", "float16", name=f"W1 budget {budget}")
    assert_close(lse.copy_to_host(), want_lse, "lse", "float16", name=f"W1 budget {budget} lse")
    cfg = runner.config("float16", "float16", "NHD", 8)  # the configuration run() resolved
    gpu_us, eager_us = time_gpu(cuda, lambda: runner.run(dq, dk, dv, out=out, lse=lse))
    bound_us = needed_bytes(budget) / COPY_BANDWIDTH * 1e6
    result = dict(budget=budget, gpu_us=gpu_us, eager_us=eager_us, bound_us=bound_us,
                  fraction=bound_us / gpu_us, label=label)
    print(f"W1 seq_len {cache.seq_len} budget {budget:4d} {label}: gpu {gpu_us:7.1f} us, eager {eager_us:7.1f} us, "
          f"bound {bound_us:5.1f} us -> {100 * result['fraction']:.0f}% of copy bandwidth "
          f"({needed_bytes(budget) / gpu_us / 1e6:.2f} TB/s)")
    print(_kernel_report(runner, cfg))
    return result


SWEEP = [  # (NUM_THREADS, TILE_KV, MIN_BLOCKS_PER_SM, CTAS_PER_SM); the first is the default
    (128, 64, 0, 2), (128, 64, 0, 4), (128, 32, 0, 2), (128, 32, 3, 3), (128, 64, 3, 3), (64, 32, 0, 4),
    (64, 64, 0, 4), (256, 64, 0, 2),
]


def sweep(cuda, cache: QuestCache):
    from bsrattn.numba_cuda import config

    defaults = (config.NUM_THREADS, config.TILE_KV, config.MIN_BLOCKS_PER_SM, config.CTAS_PER_SM)
    results = []
    for setting in SWEEP:
        config.NUM_THREADS, config.TILE_KV, config.MIN_BLOCKS_PER_SM, config.CTAS_PER_SM = setting
        label = "threads {} tile {} min_blocks {} ctas/SM {}".format(*setting)
        results.append(run_w1(cuda, cache, 512, label))
    config.NUM_THREADS, config.TILE_KV, config.MIN_BLOCKS_PER_SM, config.CTAS_PER_SM = defaults
    best = min(results, key=lambda r: r["gpu_us"])
    print(f"best: {best['label']}: {best['gpu_us']:.1f} us, {100 * best['fraction']:.0f}% of copy bandwidth")


# ---- memcheck target ---------------------------------------------------------------------------------------

def memcheck(cuda):
    """One representative paged call (GQA 32/8, splits, merges) and one Quest call, each checked."""
    rng = np.random.default_rng(1)
    kv_lens = np.array([1, 63, 64, 65, 700, 1500])
    tables, num_pages = scattered_page_tables(rng, kv_lens, PAGE, spare_pages=4)
    layout = ba.layouts.paged([1, 1, 2, 1, 3, 1], tables, kv_lens, PAGE, num_pages)
    q = rng.standard_normal((layout.nnz_qo, 32, HEAD_DIM)).astype(np.float16)
    k, v = (rng.standard_normal((num_pages, PAGE, 8, HEAD_DIM)).astype(np.float16) for _ in range(2))
    variant = ba.Variant(causal=True)
    got_o, got_lse = ba.attention(q, k, v, layout, variant=variant, backend="numba", return_lse=True)
    want_o, want_lse = ba.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), layout,
                                    variant=variant, return_lse=True)
    assert_close(got_o.astype(np.float64), want_o, "attention", "float16", name="paged")
    assert_close(got_lse, want_lse, "lse", "float16", name="paged lse")
    cache = QuestCache(seq_len=4096)
    layout, selected = cache.select(64)
    got_o, got_lse = ba.attention(*cache.views(), layout, backend="numba", return_lse=True)
    want_o, want_lse = cache.reference(selected)
    assert_close(got_o.astype(np.float64), want_o, "attention", "float16", name="quest")
    assert_close(got_lse, want_lse, "lse", "float16", name="quest lse")
    cuda.synchronize()
    print("memcheck run: paged (GQA 32/8, split KV) and Quest calls match the reference")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memcheck", action="store_true", help="one checked paged + Quest call, for compute-sanitizer")
    parser.add_argument("--sweep", action="store_true", help="W1 at budget 512 under several launch settings")
    args = parser.parse_args(argv)
    cuda = _cuda()
    print(f"device: {cuda.get_current_device().name}, numba-cuda kernels compile on first use")
    if args.memcheck:
        memcheck(cuda)
        return 0
    cache = QuestCache()
    if args.sweep:
        sweep(cuda, cache)
    else:
        for budget in (512, 64):
            run_w1(cuda, cache, budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
