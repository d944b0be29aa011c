"""Workload 7 (CPU only, runs anywhere): the scheduler's makespan simulation and the read-amplification model.

**Makespan.** Decode batches of 32 and 256 requests whose KV lengths are drawn from four distributions (all
2048; U(512, 2048); U(4096, 16384); a ShareGPT-like lognormal) are scheduled on 132 CTAs twice: one CTA per
request in turn (``bsrattn.scheduler.round_robin``) and FlashInfer's Algorithm 1 (``bsrattn.scheduler.plan``:
split-KV chunks, longest first, least-loaded CTA). The table gives round-robin makespan / planned makespan under
the cost model ``q_rows + kv_slots`` per work item (median, min and max over the trials). This is what workload 4
measures on the GPU.

**Read amplification.** Workload 1's Quest pattern (32 heads, page 16, each head ``budget`` random pages of a
``seq_len`` cache) served by a kernel that loads aligned blocks of ``kernel_block_size`` tokens (a dense-mask
kernel such as FlexAttention with BLOCK_SIZE 128) reads every block holding a selected page:
``BSRLayout.read_amplification`` counts the slots read against the slots needed. Beside it, the expectation for
uniformly random pages: a block of ``k`` pages out of ``N`` is untouched by ``b`` picks with probability
``C(N-k, b) / C(N, b)``. A BSR kernel with Bc = 16 reads only what it needs (ratio 1).

Run: ``python3 -m benchmarks.w7_cpu_models [--quick]``; results in ``benchmarks/results/w7_cpu_models.json``.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

import bsrattn as ba
from benchmarks import harness, report

WORKLOAD = "w7_cpu_models"
TITLE = "W7: scheduler makespan simulation (132 CTAs) and the read-amplification model (CPU only)"
NUM_CTAS = 132
BATCHES = (32, 256)
SEQ_LENS = (4096, 8192, 16384, 32768)
BUDGETS = (64, 128, 256, 512)
KERNEL_BLOCKS = (16, 32, 64, 128)
HEADS, PAGE, HEAD_DIM = 32, 16, 128


def expected_ratio(n_pages: int, budget: int, page_size: int, kernel_block_size: int) -> float:
    """Expected slots read / slots needed when ``budget`` of ``n_pages`` pages are picked uniformly at random.

    >>> round(expected_ratio(2048, 64, 16, 128), 2)      # seq_len 32768, budget 64, kernel block 128
    7.19
    >>> expected_ratio(2048, 64, 16, 16)
    1.0
    """
    per_block = max(kernel_block_size // page_size, 1)
    sizes = [min(per_block, n_pages - start) for start in range(0, n_pages, per_block)]
    touched = 0.0
    for k in sizes:
        untouched = math.prod(max(n_pages - budget - i, 0) / (n_pages - i) for i in range(k))
        touched += 1.0 - untouched
    return touched * max(kernel_block_size, page_size) / (budget * page_size)


def quest_layout(rng, seq_len: int, budget: int) -> ba.BSRLayout:
    """One row per head over the logical token axis: head ``h`` keeps ``budget`` random pages, sorted."""
    n_pages = seq_len // PAGE
    selected = [np.sort(rng.choice(n_pages, budget, replace=False)) for _ in range(HEADS)]
    ones = np.ones(HEADS, dtype=np.int64)
    return ba.layouts.paged(ones, selected, ones * budget * PAGE, PAGE, n_pages)


def run(suite) -> None:
    trials = 2 if suite.dry_run else (10 if suite.quick else 50)
    seq_lens = (4096,) if suite.dry_run else ((4096, 32768) if suite.quick else SEQ_LENS)
    makespan = [("makespan", d, b) for d in ba.scheduler.DISTRIBUTIONS for b in BATCHES]
    amplification = [("read_amplification", s, b) for s in seq_lens for b in BUDGETS if b <= s // PAGE]
    for item, config in suite.configs(makespan + amplification, partial(_config, trials)):
        if item[0] == "makespan":
            _, dist, batch = item
            result = ba.scheduler.simulate(dist, batch, num_ctas=NUM_CTAS, trials=trials, seed=suite.args.seed)
            suite.add({"config": config, "impl": "plan vs round_robin", "status": "ok", "median": result.median,
                       "min": result.min, "max": result.max})
            continue
        _, seq_len, budget = item
        layout = quest_layout(suite.rng, seq_len, budget)
        for block in KERNEL_BLOCKS:
            amp = layout.read_amplification(block)
            suite.add({"config": {**config, "kernel_block_size": block}, "impl": f"block {block}", "status": "ok",
                       "needed_slots": amp.needed, "read_slots": amp.read, "ratio": amp.ratio,
                       "expected_ratio": expected_ratio(seq_len // PAGE, budget, PAGE, block),
                       "bytes_needed": amp.needed * HEAD_DIM * 2 * 2, "bytes_read": amp.read * HEAD_DIM * 2 * 2})


def _config(trials, item) -> dict:
    if item[0] == "makespan":
        return {"table": "makespan", "distribution": item[1], "batch": item[2], "num_ctas": NUM_CTAS,
                "trials": trials}
    return {"table": "read_amplification", "seq_len": item[1], "budget": item[2], "heads": HEADS}


def main(argv=None):
    suite = harness.Suite.from_argv(WORKLOAD, TITLE, argv, gpu=False, doc=__doc__)
    run(suite)
    suite.finish(table=lambda records: "\n".join(report.table_w7({"records": records})))


if __name__ == "__main__":
    main()
