"""Workload 5: shared prefix, the cascade against plain paged decode.

A prefix of {1k, 8k, 32k} tokens shared by {16, 64} requests, each with a unique suffix of 256 tokens, decode
(one query each); 32 query = 32 KV heads, head_dim 128, fp16, page 16, pages scattered. Plain decode reads the
prefix once per request; the cascade (``ba.layouts.shared_prefix``: the prefix level puts every request's query
in one block row, merged with the suffix level by ⊕) reads it once. The bound is the distinct bytes,
``(prefix + batch * 256) * heads * 128 * 2 (K and V) * 2 bytes`` over the copy bandwidth, for every
implementation: it is the same attention.

Implementations, each checked against the float64 reference, then timed in graph and eager mode:

- ``bsrattn-torch-cascade`` (the ``Cascade`` through ``BatchAttention``) and ``bsrattn-torch-plain``;
- ``flashinfer-cascade-fa2`` (two fa2 prefill wrappers and ``merge_state_in_place``, what
  ``MultiLevelCascadeAttentionWrapper`` does), in the full run ``flashinfer-cascade`` (that wrapper as shipped);
- ``flashinfer-plain-tensor-core``, ``flashinfer-plain-cuda-core``: decode over each request's whole page table.

The report gives the speedup of each cascade over the best plain decode of its library.

Run: ``python3 -m benchmarks.w5_cascade [--quick]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

import bsrattn as ba
from bsrattn.indexing import ceil_div
from benchmarks import baselines, correctness, harness
from benchmarks.w2_paged_decode import Shape

WORKLOAD = "w5_cascade"
TITLE = "W5: shared-prefix decode, cascade vs plain paged decode (suffix 256, 32/32 heads, d128, fp16)"
PREFIXES = (1024, 8192, 32768)
BATCHES = (16, 64)
QUICK = ((1024, 16), (8192, 64), (32768, 64))
SUFFIX = 256
GPU_SHAPE = Shape(32, 32, 128, 16)
DRY_SHAPE = Shape(2, 2, 16, 4)
DRY_CONFIGS = ((24, 3),)
DRY_SUFFIX = 8


def configs(quick: bool) -> list:
    """``(prefix_len, batch)`` pairs."""
    return list(QUICK) if quick else [(p, b) for p in PREFIXES for b in BATCHES]


@dataclass
class Case:
    shape: Shape
    prefix_len: int
    suffix_len: int
    batch: int
    cascade: ba.Cascade
    plain: ba.BSRLayout
    q: object  # [B, H, D]
    k: object  # [P, page, H, D] (NHD)
    v: object
    out: object  # [B, H, D]
    rows: np.ndarray
    expected: np.ndarray

    def check_args(self) -> dict:
        s = self.shape
        tokens = self.prefix_len + self.batch * self.suffix_len
        elem = self.q.element_size()
        nbytes = tokens * s.num_kv_heads * s.head_dim * 2 * elem + 2 * self.batch * s.num_qo_heads * s.head_dim * elem
        return dict(shape=(self.batch, s.num_qo_heads, s.head_dim), rows=self.rows, expected=self.expected,
                    dtype="float16", bytes_needed=nbytes)

    def levels(self, layouts):
        """``(qo_indptr, kv_indptr, kv_indices, kv_last_len)`` int32 tensors per layout (FlashInfer's plan inputs)."""
        import torch

        return [tuple(torch.as_tensor(a, dtype=torch.int32, device=self.q.device)
                      for a in (lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_len)) for lay in layouts]


def make_case(suite, shape: Shape, prefix_len: int, batch: int, suffix_len: int) -> Case:
    import torch

    page = shape.page_size
    if prefix_len % page:
        raise ValueError(f"prefix_len={prefix_len} must be a multiple of the page size {page}: the suffix starts "
                         f"on a fresh page in both layouts")
    n_prefix, n_suffix = prefix_len // page, ceil_div(suffix_len, page)
    perm = suite.rng.permutation(n_prefix + batch * n_suffix)
    prefix_pages, suffix_tables = perm[:n_prefix], perm[n_prefix:].reshape(batch, n_suffix)
    ones = np.ones(batch, dtype=np.int64)
    cascade = ba.layouts.shared_prefix(ones, prefix_pages, prefix_len, suffix_tables, ones * suffix_len, page,
                                       perm.size)
    plain = ba.layouts.paged(ones, [np.concatenate([prefix_pages, t]) for t in suffix_tables],
                             ones * (prefix_len + suffix_len), page, perm.size)
    kw = dict(dtype=torch.float16, device=suite.device)
    q = torch.randn(batch, shape.num_qo_heads, shape.head_dim, **kw)
    pool = (perm.size, page, shape.num_kv_heads, shape.head_dim)
    k, v = torch.randn(pool, **kw), torch.randn(pool, **kw)
    # The prefix is shared, so 8 rows cost little more than one: check 8 even at a 32k prefix.
    rows = correctness.sample_rows(plain, shape.num_kv_heads, shape.head_dim, max_rows=8, max_elements=1 << 28)
    expected = correctness.reference_rows(plain, q, k, v, rows)
    out = torch.full(q.shape, float("nan"), **kw)
    return Case(shape, prefix_len, suffix_len, batch, cascade, plain, q, k, v, out, rows, expected)


def build_flashinfer_cascade(case, shipped: bool):
    import torch

    s = case.shape
    args = dict(num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                page_size=s.page_size, dtype=torch.float16)
    levels = case.levels(case.cascade.levels)
    if shipped:
        wrapper = baselines.cascade_shipped(levels, **args)
        return lambda: wrapper.run(case.q, (case.k, case.v))
    run = baselines.cascade_fa2(levels, **args)
    return lambda: run(case.q, (case.k, case.v))


def build_flashinfer_plain(case, tensor_cores: bool):
    import torch

    s = case.shape
    _, indptr, indices, last = case.levels([case.plain])[0]
    wrapper = baselines.decode_wrapper(indptr, indices, last, num_qo_heads=s.num_qo_heads,
                                       num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, page_size=s.page_size,
                                       q_dtype=torch.float16, kv_dtype=torch.float16, tensor_cores=tensor_cores)
    return lambda: wrapper.run(case.q, (case.k, case.v), out=case.out)


def run(suite) -> None:
    shape = DRY_SHAPE if suite.dry_run else GPU_SHAPE
    items = DRY_CONFIGS if suite.dry_run else configs(suite.quick)
    suffix = DRY_SUFFIX if suite.dry_run else SUFFIX
    tier = "reference" if suite.dry_run else "torch"
    for (prefix_len, batch), config in suite.configs(
            items, lambda c: {"prefix_len": c[0], "batch": c[1], "suffix_len": suffix}):
        case = make_case(suite, shape, prefix_len, batch, suffix)
        plan = dict(num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                    q_dtype="float16", kv_dtype="float16")
        for kind, layout in (("cascade", case.cascade), ("plain", case.plain)):
            harness.measure_bsrattn(suite, config, f"bsrattn-{tier}-{kind}", tier, layout, case.q, case.k, case.v,
                                    plan=plan, out=case.out, **case.check_args())
        suite.measure(config, "flashinfer-cascade-fa2", partial(build_flashinfer_cascade, case, False),
                      needs_cuda=True, **case.check_args())
        if not suite.quick:
            suite.measure(config, "flashinfer-cascade", partial(build_flashinfer_cascade, case, True),
                          needs_cuda=True, **case.check_args())
        for name, tc in (("flashinfer-plain-tensor-core", True), ("flashinfer-plain-cuda-core", False)):
            suite.measure(config, name, partial(build_flashinfer_plain, case, tc), out=case.out, needs_cuda=True,
                          **case.check_args())
        del case


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
