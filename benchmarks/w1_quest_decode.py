"""Workload 1: fine-grained sparse decode, the Quest pattern (paper App. G.5).

Batch 1, 32 query heads = 32 KV heads, head_dim 128, fp16, page size 16. The cache of ``seq_len`` tokens is
stored HND ``[pages, heads, page, head_dim]`` with its pages scattered (a random page table); every head keeps
its own ``budget`` random distinct pages, sorted. The work needs exactly those pages, so the bound is
``heads * budget * page * head_dim * 2 (K and V) * 2 bytes`` over the copy bandwidth.

Implementations, each checked against the float64 reference, then timed in graph and eager mode:

- ``bsrattn-torch``, ``bsrattn-numba``: ``ba.layouts.quest`` (one BSR row per head) and ``per_head_views``
  (the heads folded into the batch); ``BatchAttention`` planned once, ``run`` timed; ``bsrattn-torch-core``, the
  same call on the torch tier's core (``kernel="core"``: the paper's kernel at teaching size, the first rung).
- ``flashinfer-cuda-core``: FlashInfer's decode with the per-head pages folded into the batch the same way.
- ``sdpa-mask``: SDPA over the whole cache (given a ready contiguous ``[1, H, seq_len, D]`` copy) with a
  boolean mask of the selected tokens.
- ``flex-b128``, ``flex-b16``: FlexAttention on that copy with a block mask of 128 (16) tokens per block.
- ``gather-sdpa``: gather each head's selected pages, then SDPA over them (the gather is timed).

Run: ``python3 -m benchmarks.w1_quest_decode [--quick]``; results in ``benchmarks/results/w1_quest_decode.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

import bsrattn as ba
from benchmarks import baselines, correctness, harness

WORKLOAD = "w1_quest_decode"
TITLE = "W1: Quest sparse decode (batch 1, 32/32 heads, d128, fp16, page 16, per-head pages)"
SEQ_LENS = (4096, 8192, 16384, 32768)
BUDGETS = (64, 128, 256, 512)
QUICK = ((4096, 64), (32768, 64), (32768, 512))


@dataclass(frozen=True)
class Shape:
    heads: int
    head_dim: int
    page_size: int


GPU_SHAPE = Shape(heads=32, head_dim=128, page_size=16)
DRY_SHAPE = Shape(heads=2, head_dim=16, page_size=4)
DRY_CONFIGS = ((256, 8),)


def configs(quick: bool) -> list:
    """``(seq_len, budget)`` pairs; a budget above the number of pages is left out."""
    if quick:
        return list(QUICK)
    return [(s, b) for s in SEQ_LENS for b in BUDGETS if b <= s // GPU_SHAPE.page_size]


@dataclass
class Case:
    seq_len: int
    budget: int
    shape: Shape
    table: np.ndarray  # [n_pages] logical page -> pool page
    selected: np.ndarray  # [heads, budget] logical pages each head keeps, sorted
    layout: ba.BSRLayout
    q: object  # [1, heads, D]
    k: object  # [n_pages, heads, page, D] (HND)
    v: object  # [n_pages, heads, page, D]
    views: tuple  # per_head_views: q [heads, 1, D], k, v [n_pages * heads, page, 1, D]
    out: object  # [heads, 1, D], NaN-poisoned before each checked run
    rows: np.ndarray
    expected: np.ndarray  # [len(rows), 1, D]

    @property
    def bytes_needed(self) -> int:
        h, d, page = self.shape.heads, self.shape.head_dim, self.shape.page_size
        return h * self.budget * page * d * 2 * 2 + 2 * h * d * 2 + h * self.budget * 4


def make_case(suite, seq_len: int, budget: int, shape: Shape) -> Case:
    import torch

    h, d, page = shape.heads, shape.head_dim, shape.page_size
    n_pages = seq_len // page
    table = suite.rng.permutation(n_pages)
    selected = np.sort(np.stack([suite.rng.choice(n_pages, budget, replace=False) for _ in range(h)]), axis=1)
    kw = dict(dtype=torch.float16, device=suite.device)
    q = torch.randn(1, h, d, **kw)
    k = torch.randn(n_pages, h, page, d, **kw)
    v = torch.randn(n_pages, h, page, d, **kw)
    layout = ba.layouts.quest([table], [seq_len], [selected], page, n_pages, h)
    views = ba.layouts.per_head_views(q, k, v, h)
    rows = correctness.sample_rows(layout, 1, d)
    expected = correctness.reference_rows(layout, *views, rows)
    out = torch.full((h, 1, d), float("nan"), **kw)
    return Case(seq_len, budget, shape, table, selected, layout, q, k, v, views, out, rows, expected)


def _token_mask(case):
    """``[heads, seq_len]`` bool: the logical tokens each head attends."""
    import torch

    page = case.shape.page_size
    tokens = (case.selected[:, :, None] * page + np.arange(page)).reshape(case.shape.heads, -1)
    mask = torch.zeros(case.shape.heads, case.seq_len, dtype=torch.bool, device=case.q.device)
    mask[torch.arange(case.shape.heads)[:, None], torch.as_tensor(tokens, device=case.q.device)] = True
    return mask


def _logical_copy(case, x):
    """``[1, heads, seq_len, D]``: the pool in logical token order, as a dense-attention baseline wants it."""
    import torch

    h, d = case.shape.heads, case.shape.head_dim
    return x[torch.as_tensor(case.table, device=x.device)].permute(1, 0, 2, 3).reshape(1, h, case.seq_len, d)


def build_flashinfer(case):
    import torch

    q, k, v = case.views
    i32 = dict(dtype=torch.int32, device=case.q.device)
    wrapper = baselines.decode_wrapper(
        torch.as_tensor(case.layout.kv_indptr, **i32), torch.as_tensor(case.layout.kv_indices, **i32),
        torch.as_tensor(case.layout.kv_last_len, **i32), num_qo_heads=1, num_kv_heads=1,
        head_dim=case.shape.head_dim, page_size=case.shape.page_size, q_dtype=torch.float16,
        kv_dtype=torch.float16, tensor_cores=False)
    return lambda: wrapper.run(q, (k, v), out=case.out)


def build_sdpa_mask(case):
    import torch.nn.functional as F

    h, d = case.shape.heads, case.shape.head_dim
    kc, vc = _logical_copy(case, case.k), _logical_copy(case, case.v)
    mask = _token_mask(case)[None, :, None, :]
    q4 = case.q.reshape(1, h, 1, d)
    return lambda: F.scaled_dot_product_attention(q4, kc, vc, attn_mask=mask)


def build_flex(case, block_size: int):
    flex, create_block_mask = baselines.flex_attention(case.q.device.type)
    h, d = case.shape.heads, case.shape.head_dim
    kc, vc = _logical_copy(case, case.k), _logical_copy(case, case.v)
    tokens = _token_mask(case)

    def mask_mod(b, head, q_idx, kv_idx):
        return tokens[head, kv_idx]

    block_mask = create_block_mask(mask_mod, B=None, H=h, Q_LEN=1, KV_LEN=case.seq_len, device=case.q.device.type,
                                   BLOCK_SIZE=block_size)
    q4 = case.q.reshape(1, h, 1, d)
    return lambda: flex(q4, kc, vc, block_mask=block_mask)


def build_gather_sdpa(case):
    import torch
    import torch.nn.functional as F

    h, d, page = case.shape.heads, case.shape.head_dim, case.shape.page_size
    pages = torch.as_tensor(case.table[case.selected], device=case.q.device)  # [heads, budget] pool pages
    head = torch.arange(h, device=case.q.device)[:, None]
    q4 = case.q.reshape(1, h, 1, d)

    def run():
        kg = case.k[pages, head].reshape(1, h, case.budget * page, d)
        vg = case.v[pages, head].reshape(1, h, case.budget * page, d)
        return F.scaled_dot_product_attention(q4, kg, vg)

    return run


def run(suite) -> None:
    shape = DRY_SHAPE if suite.dry_run else GPU_SHAPE
    items = DRY_CONFIGS if suite.dry_run else configs(suite.quick)
    tiers = ("reference",) if suite.dry_run else ("torch", "numba")
    for (seq_len, budget), config in suite.configs(items, lambda c: {"seq_len": c[0], "budget": c[1]}):
        case = make_case(suite, seq_len, budget, shape)
        common = dict(shape=(shape.heads, 1, shape.head_dim), rows=case.rows, expected=case.expected,
                      dtype="float16", bytes_needed=case.bytes_needed)
        plan = dict(num_qo_heads=1, num_kv_heads=1, head_dim=shape.head_dim, q_dtype="float16", kv_dtype="float16")
        for tier in tiers:
            harness.measure_bsrattn(suite, config, f"bsrattn-{tier}", tier, case.layout, *case.views, plan=plan,
                                    out=case.out, **common)
        if not suite.dry_run:  # the first rung: the paper's kernel at teaching size
            harness.measure_bsrattn(suite, config, "bsrattn-torch-core", "torch", case.layout, *case.views,
                                    plan=plan, out=case.out, kernel="core", **common)
        suite.measure(config, "flashinfer-cuda-core", partial(build_flashinfer, case), out=case.out,
                      needs_cuda=True, **common)
        suite.measure(config, "sdpa-mask", partial(build_sdpa_mask, case), **common)
        suite.measure(config, "flex-b128", partial(build_flex, case, 128), **common)
        if not suite.quick or (seq_len, budget) == QUICK[0]:
            suite.measure(config, "flex-b16", partial(build_flex, case, 16), **common)
        suite.measure(config, "gather-sdpa", partial(build_gather_sdpa, case), **common)
        del case


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
