"""Workload 6: host cost of planning, ``plan()`` wall time including its copies to the GPU.

Decode, kv_len 4096 for every request, batch {1, 64, 256, 1024}; 32 query / 8 KV heads, head_dim 128, fp16,
page 16. ``plan()`` runs once per generation step on the host, so its cost adds to every step; FlashInfer's
tensor-core plan grows to milliseconds at batch 1024 (2271 us, measured on the H200). Each sample is
``plan(...); torch.cuda.synchronize()`` timed with the host clock, so the copies of the plan's arrays to the
GPU are counted; the median of the samples is reported.

Implementations:

- ``bsrattn-torch``, ``bsrattn-numba``: ``BatchAttention.plan`` on a prebuilt layout (a repeated plan refills
  the tier's buffers in place, as a serving loop would);
- ``bsrattn-scheduler``: ``bsrattn.scheduler.plan`` alone, host arrays only (the reference tier's options);
- ``bsrattn-layout``: building the layout, ``ba.layouts.paged`` from the page tables;
- ``flashinfer-cuda-core``, ``flashinfer-tensor-core``: ``BatchDecodeWithPagedKVCacheWrapper.plan`` from host
  (CPU) int32 page-table tensors;
- ``flex-create-block-mask``: FlexAttention's ``create_block_mask`` for the same lengths.

Run: ``python3 -m benchmarks.w6_plan_host [--quick]``.
"""

from __future__ import annotations

from functools import partial

import numpy as np

import bsrattn as ba
from bsrattn.indexing import ceil_div
from benchmarks import baselines, harness
from benchmarks.w2_paged_decode import DRY_SHAPE, GPU_SHAPE
from bsrattn.validation import make_spec

WORKLOAD = "w6_plan_host"
TITLE = "W6: plan() host time incl. copies to the GPU (decode, kv 4096, 32/8 heads, d128, fp16, page 16)"
BATCHES = (1, 64, 256, 1024)
KV_LEN = 4096


def page_tables(rng, batch: int, kv_len: int, page_size: int):
    """Scattered page tables: ``[batch][kv_len / page_size]`` pages of a random permutation of the pool."""
    n = ceil_div(kv_len, page_size)
    return rng.permutation(batch * n).reshape(batch, n)


def build_bsrattn_plan(tier, layout, shape):
    attn = ba.BatchAttention(backend=tier)
    args = dict(num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                q_dtype="float16", kv_dtype="float16")
    attn.plan(layout, **args)
    return lambda: attn.plan(layout, **args)


def build_scheduler(layout, shape):
    spec = make_spec(layout, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)
    options = ba.get_backend("reference").plan_options(spec)
    qo, kv = layout.qo_lens, layout.kv_lens
    return lambda: ba.scheduler.plan(qo, kv, **options)


def build_layout(tables, kv_len, shape):
    batch = len(tables)
    ones, lens = np.ones(batch, dtype=np.int64), np.full(batch, kv_len)
    return lambda: ba.layouts.paged(ones, tables, lens, shape.page_size, tables.size)


def build_flashinfer_plan(layout, shape, tensor_cores: bool):
    import torch

    fi = baselines.flashinfer()
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(baselines.workspace(), "NHD", use_tensor_cores=tensor_cores)
    indptr, indices, last = (torch.as_tensor(a, dtype=torch.int32) for a in
                             (layout.kv_indptr, layout.kv_indices, layout.kv_last_len))
    args = (indptr, indices, last, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size)
    kwargs = dict(q_data_type=torch.float16, kv_data_type=torch.float16)
    return lambda: wrapper.plan(*args, **kwargs)


def build_block_mask(layout, shape, device):
    import torch

    _, create_block_mask = baselines.flex_attention(device)
    kv_lens = torch.as_tensor(layout.kv_lens, device=device)
    width = int(layout.kv_lens.max())

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < kv_lens[b]

    return lambda: create_block_mask(mask_mod, B=layout.num_rows, H=None, Q_LEN=1, KV_LEN=width, device=device)


def run(suite) -> None:
    shape = DRY_SHAPE if suite.dry_run else GPU_SHAPE
    kv_len = 64 if suite.dry_run else KV_LEN
    items = (1, 8) if suite.dry_run else BATCHES
    tiers = ("reference",) if suite.dry_run else ("torch", "numba")
    for batch, config in suite.configs(items, lambda b: {"batch": b, "kv_len": kv_len}):
        tables = page_tables(suite.rng, batch, kv_len, shape.page_size)
        layout = ba.layouts.paged(np.ones(batch, dtype=np.int64), tables, np.full(batch, kv_len), shape.page_size,
                                  tables.size)
        for tier in tiers:
            suite.measure_host(config, f"bsrattn-{tier}", partial(build_bsrattn_plan, tier, layout, shape))
        suite.measure_host(config, "bsrattn-scheduler", partial(build_scheduler, layout, shape))
        suite.measure_host(config, "bsrattn-layout", partial(build_layout, tables, kv_len, shape))
        for name, tc in (("flashinfer-cuda-core", False), ("flashinfer-tensor-core", True)):
            suite.measure_host(config, name, partial(build_flashinfer_plan, layout, shape, tc), needs_cuda=True)
        suite.measure_host(config, "flex-create-block-mask", partial(build_block_mask, layout, shape, suite.device))


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
