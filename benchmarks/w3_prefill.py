"""Workload 3: ragged, paged and shared-prefix causal prefill, in TFLOP/s.

Batch 16 with lengths constant (1024), uniform U(256, 1792) and Zipf (mean ~1024), and one request of 8192;
32 query / 8 KV heads, head_dim 128, bf16, causal, every request's queries over its own keys
(``qo_len == kv_len``). FLOPs count the causal triangle once: ``4 * head_dim * num_qo_heads * L (L + 1) / 2`` per
request (two matmuls, two FLOPs per multiply-add). The bound is those FLOPs over the bf16 GEMM rate.

Shared prefix (``16 x (4096 shared + 512)``, ``kv_layout=cascade``): 16 requests prefill 512 tokens each after a
4096-token prefix they share (a system prompt already in the cache): every query sees the whole prefix, then its
own tokens causally, ``4 * D * Hq * (512 * 4096 + 512 * 513 / 2)`` FLOPs a request. The cascade
(``ba.layouts.shared_prefix``: one block row of all 8192 queries over the prefix, then each request's suffix)
against the same pages as one paged layout (each request's table: the prefix's pages, then its own).

Implementations, each checked against the float64 reference, then timed in graph and eager mode:

- ``bsrattn-torch``: ``ba.layouts.ragged`` (Bc = 1, KV contiguous per request), planned once; in the full run
  also ``ba.layouts.paged`` with page 16 (``kv_layout=paged`` rows); ``bsrattn-torch-deterministic``, the same
  ragged call in deterministic mode (default ``split_size``); ``bsrattn-torch-core``, the same call on the torch
  tier's core (``kernel="core"``: the paper's kernel at teaching size, the first rung).
- ``flashinfer-fa2``, ``flashinfer-fa3``: ``BatchPrefillWithRaggedKVCacheWrapper`` (paged: ``...PagedKVCache...``)
  with ``backend="fa2"`` / ``"fa3"``.
- ``sdpa``: PyTorch's default SDPA (cuDNN / flash) batched when the lengths are equal, else one call per request
  (outputs concatenated, timed).
- ``bsrattn-gluon-ws`` (ragged rows, on sm_90): the warp-specialised Gluon kernel of ``gluon_prefill.py``, called
  directly (not yet behind ``BatchAttention``): the next rung of the torch tier's prefill.
- Shared prefix: ``bsrattn-torch-cascade`` (the cascade) and ``bsrattn-torch`` (the paged layout);
  ``flashinfer-cascade-fa2`` (two fa2 paged prefill wrappers and ``merge_state_in_place``, W5's) and
  ``flashinfer-fa2``/``-fa3`` on the paged layout.

Run: ``python3 -m benchmarks.w3_prefill [--quick]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

import bsrattn as ba
from bsrattn.indexing import ceil_div
from bsrattn.testing import scattered_page_tables
from benchmarks import baselines, correctness, harness

WORKLOAD = "w3_prefill"
TITLE = "W3: ragged causal prefill (32/8 heads, d128, bf16; TFLOP/s, causal FLOPs counted once)"
LENGTHS = (("const", 16, 1024), ("uniform", 16, 256, 1792), ("zipf", 16, 1024), ("const", 1, 8192))


@dataclass(frozen=True)
class Shape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str


GPU_SHAPE = Shape(32, 8, 128, 16, "bfloat16")
DRY_SHAPE = Shape(4, 2, 16, 4, "float16")
SHARED = ("shared", 16, 4096, 512)
"""Batch, tokens of the prefix every request shares, tokens each request prefills after it."""
DRY_CONFIGS = ((("const", 2, 24), "ragged"), (("uniform", 3, 8, 40), "ragged"), (("zipf", 3, 16), "paged"),
               (("shared", 3, 8, 5), "cascade"))


def configs(quick: bool) -> list:
    """``(length spec, kv layout)`` pairs: ragged always, paged (page 16) in the full run, the shared prefix."""
    return ([(spec, "ragged") for spec in LENGTHS] + ([] if quick else [(spec, "paged") for spec in LENGTHS])
            + [(SHARED, "cascade")])


def label(spec) -> str:
    """``"16 x 1024"``, ``"16 x U(256,1792)"``, ``"16 x Zipf(mean 1024)"``."""
    kind, batch, *args = spec
    text = {"const": lambda: f"{args[0]}", "uniform": lambda: f"U({args[0]},{args[1]})",
            "zipf": lambda: f"Zipf(mean {args[0]})", "shared": lambda: f"({args[0]} shared + {args[1]})"}[kind]()
    return f"{batch} x {text}"


def lengths(rng, spec) -> np.ndarray:
    """``[batch]`` lengths; Zipf: ``L_i ~ 1 / i`` scaled to the mean, in random order (heavy-tailed, deterministic)."""
    kind, batch, *args = spec
    if kind == "const":
        return np.full(batch, args[0])
    if kind == "uniform":
        return rng.integers(args[0], args[1] + 1, size=batch)
    weights = 1.0 / np.arange(1, batch + 1)
    return rng.permutation(np.maximum(np.round(weights / weights.mean() * args[0]), 1).astype(np.int64))


def causal_flops(lens, num_qo_heads: int, head_dim: int) -> int:
    """``4 * D * Hq * sum L (L + 1) / 2``: QK^T and PV over the causal triangle, counted once.

    >>> causal_flops([1024] * 16, 32, 128)
    137573171200
    """
    lens = np.asarray(lens, dtype=np.int64)
    return int(4 * head_dim * num_qo_heads * (lens * (lens + 1) // 2).sum())


@dataclass
class Case:
    shape: Shape
    lens: np.ndarray  # [B]
    kv_layout: str  # "ragged" or "paged"
    layout: ba.BSRLayout
    q: object  # [nnz, Hq, D]
    k: object  # ragged [nnz, Hkv, D]; paged [P, page, Hkv, D]
    v: object
    k_ragged: object  # [nnz, Hkv, D]: the same keys in request order (for SDPA)
    v_ragged: object
    out: object  # [nnz, Hq, D]
    rows: np.ndarray
    expected: np.ndarray
    paged: ba.BSRLayout | None = None  # a shared-prefix case: the cascade's pages as one paged layout
    flops: int | None = None  # a shared-prefix case's (the others': causal_flops of lens)
    kv_tokens: int | None = None  # a shared-prefix case's keys, the prefix once (the others': sum of lens)

    def check_args(self) -> dict:
        s = self.shape
        nnz = int(self.lens.sum())
        elem = self.q.element_size()
        flops = causal_flops(self.lens, s.num_qo_heads, s.head_dim) if self.flops is None else self.flops
        kv_tokens = nnz if self.kv_tokens is None else self.kv_tokens
        return dict(shape=(nnz, s.num_qo_heads, s.head_dim), rows=self.rows, expected=self.expected, dtype=s.dtype,
                    flops=flops, bytes_needed=(2 * nnz * s.num_qo_heads + 2 * kv_tokens * s.num_kv_heads) * s.head_dim
                    * elem)

    def tensors(self, *arrays):
        import torch

        return tuple(torch.as_tensor(a, dtype=torch.int32, device=self.q.device) for a in arrays)


def make_case(suite, shape: Shape, lens, kv_layout: str) -> Case:
    import torch

    lens = np.asarray(lens, dtype=np.int64)
    nnz = int(lens.sum())
    kw = dict(dtype=getattr(torch, shape.dtype), device=suite.device)
    q = torch.randn(nnz, shape.num_qo_heads, shape.head_dim, **kw)
    k_ragged = torch.randn(nnz, shape.num_kv_heads, shape.head_dim, **kw)
    v_ragged = torch.randn(nnz, shape.num_kv_heads, shape.head_dim, **kw)
    if kv_layout == "ragged":
        layout = ba.layouts.ragged(lens, lens)
        k, v = k_ragged, v_ragged
    else:
        tables, num_pages = scattered_page_tables(suite.rng, lens, shape.page_size)
        layout = ba.layouts.paged(lens, tables, lens, shape.page_size, num_pages)
        pool = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
        k, v = torch.randn(pool, **kw), torch.randn(pool, **kw)
        slots = torch.as_tensor(np.concatenate([layout.kv_slots(r) for r in range(layout.num_rows)]),
                                device=suite.device)
        k_ragged = k.reshape(-1, shape.num_kv_heads, shape.head_dim)[slots]
        v_ragged = v.reshape(-1, shape.num_kv_heads, shape.head_dim)[slots]
    rows = correctness.sample_rows(layout, shape.num_kv_heads, shape.head_dim, causal=True)
    expected = correctness.reference_rows(layout, q, k, v, rows, causal=True)
    out = torch.full(q.shape, float("nan"), **kw)
    return Case(shape, lens, kv_layout, layout, q, k, v, k_ragged, v_ragged, out, rows, expected)


def make_shared_case(suite, shape: Shape, spec) -> Case:
    """``spec = ("shared", batch, prefix_len, own_len)``: the cascade over scattered pages, and the same pages as
    one paged layout."""
    import torch

    _, batch, prefix_len, own = spec
    page = shape.page_size
    if prefix_len % page:
        raise ValueError(f"prefix_len={prefix_len} must be a multiple of the page size {page}: each request's own "
                         f"tokens start on a fresh page in both layouts")
    n_prefix, n_own = prefix_len // page, ceil_div(own, page)
    perm = suite.rng.permutation(n_prefix + batch * n_own)
    prefix_pages, own_tables = perm[:n_prefix], perm[n_prefix:].reshape(batch, n_own)
    lens = np.full(batch, own, dtype=np.int64)
    cascade = ba.layouts.shared_prefix(lens, prefix_pages, prefix_len, own_tables, lens, page, perm.size)
    paged = ba.layouts.paged(lens, [np.concatenate([prefix_pages, t]) for t in own_tables], lens + prefix_len, page,
                             perm.size)
    kw = dict(dtype=getattr(torch, shape.dtype), device=suite.device)
    q = torch.randn(int(lens.sum()), shape.num_qo_heads, shape.head_dim, **kw)
    pool = (perm.size, page, shape.num_kv_heads, shape.head_dim)
    k, v = torch.randn(pool, **kw), torch.randn(pool, **kw)
    # The prefix is shared, so many rows cost little more than one to check.
    rows = correctness.sample_rows(paged, shape.num_kv_heads, shape.head_dim, causal=True, max_rows=16)
    expected = correctness.reference_rows(paged, q, k, v, rows, causal=True)
    out = torch.full(q.shape, float("nan"), **kw)
    flops = 4 * shape.head_dim * shape.num_qo_heads * batch * (own * prefix_len + own * (own + 1) // 2)
    return Case(shape, lens, "cascade", cascade, q, k, v, None, None, out, rows, expected, paged=paged, flops=flops,
                kv_tokens=prefix_len + batch * own)


def _levels(case, layouts) -> list:
    """``(qo_indptr, kv_indptr, kv_indices, kv_last_len)`` int32 tensors per layout (FlashInfer's plan inputs)."""
    return [case.tensors(lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_len) for lay in layouts]


def build_flashinfer_cascade(case):
    import torch

    s = case.shape
    run = baselines.cascade_fa2(_levels(case, case.layout.levels), num_qo_heads=s.num_qo_heads,
                                num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, page_size=s.page_size,
                                dtype=getattr(torch, s.dtype))
    return lambda: run(case.q, (case.k, case.v))


def build_flashinfer(case, backend: str):
    import torch

    s = case.shape
    heads = dict(num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                 dtype=getattr(torch, s.dtype), causal=True, backend=backend)
    lay = case.layout if case.paged is None else case.paged
    if case.kv_layout == "ragged":
        wrapper = baselines.ragged_prefill_wrapper(*case.tensors(lay.qo_indptr, lay.kv_indptr), **heads)
        return lambda: wrapper.run(case.q, case.k, case.v, out=case.out)
    wrapper = baselines.paged_prefill_wrapper(*_levels(case, [lay])[0], page_size=s.page_size, **heads)
    return lambda: wrapper.run(case.q, (case.k, case.v), out=case.out)


def build_gluon(case):
    """The standalone warp-specialised Gluon kernel (``gluon_prefill.py``) on a ragged case."""
    import torch

    from benchmarks import gluon_prefill

    reason = gluon_prefill.unavailable(case.q.device)
    if reason:
        raise harness.Unavailable(reason)
    tiles = torch.as_tensor(gluon_prefill.tile_table(case.lens, causal=True), device=case.q.device)
    return lambda: gluon_prefill.prefill(case.q, case.k, case.v, case.lens, causal=True, tiles=tiles, out=case.out)[0]


def build_sdpa(case):
    """Batched SDPA for equal lengths (views, no copy); one call per request otherwise."""
    import torch
    import torch.nn.functional as F

    s = case.shape
    lens = case.lens.tolist()
    if len(set(lens)) == 1:
        b, n = len(lens), lens[0]
        q4 = case.q.view(b, n, s.num_qo_heads, s.head_dim).transpose(1, 2)
        k4 = case.k_ragged.view(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v4 = case.v_ragged.view(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        return lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
    parts = [tuple(x[lo:hi].transpose(0, 1)[None] for x in (case.q, case.k_ragged, case.v_ragged))
             for lo, hi in zip(bounds[:-1], bounds[1:])]

    def run():
        outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                for q, k, v in parts]
        return torch.cat(outs)

    return run


def _sdpa_view(case):
    """Batched SDPA returns ``[B, Hq, L, D]``; the check wants ``[nnz, Hq, D]``."""
    if len(set(case.lens.tolist())) > 1:
        return None
    return lambda y: y.transpose(1, 2)


def run(suite) -> None:
    shape = DRY_SHAPE if suite.dry_run else GPU_SHAPE
    items = DRY_CONFIGS if suite.dry_run else configs(suite.quick)
    for (spec, kv_layout), config in suite.configs(items, lambda c: {"lengths": label(c[0]), "kv_layout": c[1]}):
        case = (make_shared_case(suite, shape, spec) if kv_layout == "cascade" else
                make_case(suite, shape, lengths(suite.rng, spec), kv_layout))
        plan = dict(num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                    variant=ba.Variant(causal=True), q_dtype=shape.dtype, kv_dtype=shape.dtype)
        tier = "reference" if suite.dry_run else "torch"
        if case.paged is not None:
            harness.measure_bsrattn(suite, config, f"bsrattn-{tier}-cascade", tier, case.layout, case.q, case.k,
                                    case.v, plan=plan, out=case.out, **case.check_args())
            suite.measure(config, "flashinfer-cascade-fa2", partial(build_flashinfer_cascade, case), needs_cuda=True,
                          **case.check_args())
        harness.measure_bsrattn(suite, config, f"bsrattn-{tier}", tier, case.layout if case.paged is None else
                                case.paged, case.q, case.k, case.v, plan=plan, out=case.out, **case.check_args())
        if tier == "torch":  # the first rung: the paper's kernel at teaching size
            harness.measure_bsrattn(suite, config, "bsrattn-torch-core", tier, case.layout if case.paged is None
                                    else case.paged, case.q, case.k, case.v, plan=plan, out=case.out, kernel="core",
                                    **case.check_args())
        for backend in ("fa2", "fa3"):
            suite.measure(config, f"flashinfer-{backend}", partial(build_flashinfer, case, backend), out=case.out,
                          needs_cuda=True, **case.check_args())
        if kv_layout == "ragged":
            harness.measure_bsrattn(suite, config, f"bsrattn-{tier}-deterministic", tier, case.layout, case.q,
                                    case.k, case.v, plan=dict(plan, deterministic=True), out=case.out,
                                    **case.check_args())
            suite.measure(config, "sdpa", partial(build_sdpa, case), view=_sdpa_view(case), **case.check_args())
            if tier == "torch":
                suite.measure(config, "bsrattn-gluon-ws", partial(build_gluon, case), out=case.out, needs_cuda=True,
                              **case.check_args())
        del case


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
