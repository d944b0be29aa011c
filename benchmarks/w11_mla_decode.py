"""Workload 11: MLA decode at DeepSeek-V3's shapes (multi-head latent attention, the up-projections absorbed).

128 query heads over one latent row per token, ``ckv`` 512 wide and ``kpe`` 64 (bsrattn/mla.py has the formula);
one query row per request; pages of 64 and of 1 token scattered at random; batch {1, 32, 128} x kv_len
{4096, 32768} in bfloat16, the same grid in float16 at page 64. As serving engines keep it (SGLang's MLA pool),
the cache is one array ``[pages, page_size, 576]``, ``ckv`` its first 512 columns and ``kpe`` its last 64, and
the queries one ``[B, 128, 576]`` array: bsrattn and FlashInfer are given views of the two (``ckv =
cache[..., :512]``, ``kpe = cache[..., 512:]``, ``q_nope``, ``q_pe`` likewise), which bsrattn reads in place
(separate arrays would be joined, a copy of the cache, on every call) and FlashInfer by their strides.

Each latent slot is read once for all 128 heads, so the work is nearer compute than bandwidth:
``128 * (2 * 576 + 2 * 512)`` FLOPs a slot against ``576 * 2`` bytes, ~240 FLOPs a byte, above the H200's ~190
(its bf16 GEMM rate over its copy rate). Both are recorded: bytes ``sum(kv_len) * 576 * bytes per element`` (+
queries, outputs, page table) over the copy bandwidth, FLOPs ``sum(kv_len) * 128 * (2 * 576 + 2 * 512)`` over the
bf16 GEMM rate; the larger is the bound.

Implementations, each checked against the float64 reference, then timed in graph and eager mode:

- ``bsrattn-torch``: ``ba.BatchMLAAttention(backend="torch")`` planned once, ``run`` timed: the value is the
  key's first 512 columns, which the kernel reads from the key's tile (``LaunchConfig.value_in_key``);
  ``bsrattn-torch-value-apart``, the rung below it: ``ba.BatchAttention`` over the same cache as one KV head with
  ``v`` a contiguous copy of ``ckv`` (made outside timing), read by its own strides beside a key tile padded to
  1024; ``bsrattn-torch-core``, the same call on the torch tier's core (``kernel="core"``), the first rung.
- ``flashinfer-mla-fa2``, ``flashinfer-mla-fa3``: ``BatchMLAPagedAttentionWrapper`` on its two sm_90 backends
  (``cutlass`` is Blackwell's), planned once with ``sm_scale = 1 / sqrt(576)`` (bsrattn's default), ``run``
  timed on the same views; the target (docs/benchmarks.md) compares with the better of the two.
- ``sdpa-absorbed``: SDPA given a ready contiguous ``[B, 1, kv_len, 576]`` copy of each request's slots, the
  value its first 512 columns: the 128 heads are 128 query rows of the one latent head (``q [B, 1, 128, 576]``),
  so each request is one batched GEMM against its keys and nothing is repeated per head (SDPA's math form of
  ``enable_gqa`` repeats K and V for every query head: 128 copies). Recorded unavailable where SDPA refuses the
  shapes.

Run: ``python3 -m benchmarks.w11_mla_decode [--quick]``; ``--quick`` runs bfloat16 at batch {1, 32, 128} x 4096 on
both page sizes and 32 x 32768 at page 64.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

import bsrattn as ba
from bsrattn.testing import scattered_page_tables
from benchmarks import baselines, correctness, harness

WORKLOAD = "w11_mla_decode"
TITLE = "W11: MLA decode (DeepSeek-V3: 128 heads, ckv 512 + kpe 64 in one cache array; pages of 64 and 1; bf16, fp16)"
GRID = [(p, b, s) for p in (64, 1) for b in (1, 32, 128) for s in (4096, 32768)]
QUICK = [("bfloat16", 64, b, 4096) for b in (1, 32, 128)] + [("bfloat16", 64, 32, 32768)] + [
    ("bfloat16", 1, b, 4096) for b in (1, 32, 128)]
FLASHINFER_BACKENDS = ("fa2", "fa3")
# Query rows checked per configuration: a row's float64 reference costs 128 heads x its slots x (576 + 512)
# multiply-adds on the host, so a few rows spread over the batch (at 32768 slots the element budget keeps three).
CHECKED_ROWS = 8


@dataclass(frozen=True)
class Shape:
    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int

    @property
    def width(self) -> int:
        """A cache row and a query row: ``ckv ⊕ kpe``, ``q_nope ⊕ q_pe``."""
        return self.head_dim_ckv + self.head_dim_kpe


GPU_SHAPE = Shape(128, 512, 64)
DRY_SHAPE = Shape(8, 16, 8)
DRY_CONFIGS = (("float16", 4, 2, 30), ("float16", 1, 3, 48))


def configs(quick: bool) -> list:
    """``(dtype, page_size, batch, kv_len)``."""
    if quick:
        return list(QUICK)
    return [("bfloat16", p, b, s) for p, b, s in GRID] + [("float16", p, b, s) for p, b, s in GRID if p == 64]


@dataclass
class Case:
    shape: Shape
    dtype: str
    page_size: int
    kv_lens: np.ndarray  # [B]
    layout: ba.BSRLayout
    q: object  # [B, H, Dc + Dr]: q_nope ⊕ q_pe
    cache: object  # [num_pages, page_size, Dc + Dr]: ckv ⊕ kpe
    out: object  # [B, H, Dc]
    rows: np.ndarray
    expected: np.ndarray  # [len(rows), H, Dc]

    @property
    def batch(self) -> int:
        return int(self.kv_lens.size)

    @property
    def sm_scale(self) -> float:
        return 1.0 / float(np.sqrt(self.shape.width))

    @property
    def bytes_needed(self) -> int:
        s, elt = self.shape, self.cache.element_size()
        kv = int(self.kv_lens.sum()) * s.width * elt  # each latent slot once, for all heads
        qo = self.batch * s.num_heads * (s.width + s.head_dim_ckv) * elt
        return kv + qo + 4 * (self.layout.kv_indices.size + 2 * self.batch + 1)

    @property
    def flops(self) -> int:
        s = self.shape
        return int(self.kv_lens.sum()) * s.num_heads * (2 * s.width + 2 * s.head_dim_ckv)

    def operands(self, q, cache) -> tuple:
        """``q_nope, q_pe, ckv, kpe``: views of ``q`` and ``cache`` (torch tensors or their NumPy copies)."""
        dc = self.shape.head_dim_ckv
        return q[..., :dc], q[..., dc:], cache[..., :dc], cache[..., dc:]

    def check_args(self) -> dict:
        return dict(shape=(self.batch, self.shape.num_heads, self.shape.head_dim_ckv), rows=self.rows,
                    expected=self.expected, dtype=self.dtype, bytes_needed=self.bytes_needed, flops=self.flops)

    def plan_args(self) -> dict:
        s = self.shape
        return dict(num_heads=s.num_heads, head_dim_ckv=s.head_dim_ckv, head_dim_kpe=s.head_dim_kpe,
                    q_dtype=self.dtype, kv_dtype=self.dtype)

    def flashinfer_tables(self) -> tuple:
        """``qo_indptr``, ``kv_indptr`` (pages), ``kv_indices``, ``kv_len_arr`` (tokens): int32 on ``q``'s device."""
        import torch

        lay = self.layout
        return tuple(torch.as_tensor(a, dtype=torch.int32, device=self.q.device)
                     for a in (lay.qo_indptr, lay.kv_indptr, lay.kv_indices, self.kv_lens))


def make_case(suite, shape: Shape, dtype: str, page_size: int, kv_lens) -> Case:
    """Random queries, a random cache with pages scattered by a random permutation, and the reference rows."""
    import torch

    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    tables, num_pages = scattered_page_tables(suite.rng, kv_lens, page_size)
    kw = dict(dtype=getattr(torch, dtype), device=suite.device)
    q = torch.randn(kv_lens.size, shape.num_heads, shape.width, **kw)
    cache = torch.randn(num_pages, page_size, shape.width, **kw)
    layout = ba.layouts.paged(np.ones_like(kv_lens), tables, kv_lens, page_size, num_pages)
    # MLA is attention of one KV head whose key is the cache row and whose value is its ckv part.
    k = cache.reshape(num_pages, page_size, 1, shape.width)
    rows = correctness.sample_rows(layout, 1, shape.width, max_rows=CHECKED_ROWS)
    expected = correctness.reference_rows(layout, q, k, k[..., :shape.head_dim_ckv], rows)
    out = torch.full((kv_lens.size, shape.num_heads, shape.head_dim_ckv), float("nan"), **kw)
    return Case(shape, dtype, page_size, kv_lens, layout, q, cache, out, rows, expected)


def build_bsrattn(case, tier: str, kernel: str | None = None):
    """``BatchMLAAttention(tier, kernel)`` planned here, ``run`` on the views; the reference tier (dry runs) on views
    of NumPy copies, without ``out``."""
    attn = ba.BatchMLAAttention(backend=tier, kernel=kernel)
    attn.plan(case.layout, **case.plan_args())
    if tier == "reference":
        operands = case.operands(case.q.numpy(), case.cache.numpy())
        return lambda: attn.run(*operands)
    operands = case.operands(case.q, case.cache)
    return lambda: attn.run(*operands, out=case.out)


def build_value_apart(case):
    """``BatchAttention`` on the torch tier over the cache as one KV head, ``v`` a contiguous copy of ``ckv`` made
    here (untimed): the general path for values narrower than keys, beside which ``bsrattn-torch`` is measured."""
    s = case.shape
    attn = ba.BatchAttention(backend="torch")
    attn.plan(case.layout, s.num_heads, 1, s.width, head_dim_vo=s.head_dim_ckv, q_dtype=case.dtype,
              kv_dtype=case.dtype)
    k = case.cache.reshape(*case.cache.shape[:2], 1, s.width)  # [num_pages, page_size, 1, Dc + Dr]
    v = k[..., :s.head_dim_ckv].contiguous()  # [num_pages, page_size, 1, Dc], memory of its own
    return lambda: attn.run(case.q, k, v, out=case.out)


def measure_bsrattn(suite, config, case, tier, name=None, kernel=None):
    """``bsrattn-<tier>`` (or ``name``) on ``case``: plan once, ``run`` timed; ``kernel="core"``: the tier's core."""
    suite.measure(config, name or f"bsrattn-{tier}", partial(build_bsrattn, case, tier, kernel),
                  out=case.out if tier != "reference" else None, **case.check_args())


def build_flashinfer(case, backend: str):
    import torch

    s = case.shape
    wrapper = baselines.mla_wrapper(*case.flashinfer_tables(), num_heads=s.num_heads, head_dim_ckv=s.head_dim_ckv,
                                    head_dim_kpe=s.head_dim_kpe, page_size=case.page_size, sm_scale=case.sm_scale,
                                    dtype=getattr(torch, case.dtype), backend=backend)
    operands = case.operands(case.q, case.cache)
    return lambda: wrapper.run(*operands, out=case.out)


def build_sdpa_absorbed(case):
    """SDPA on a contiguous ``[B, 1, kv_len, Dc + Dr]`` copy made here (untimed), the heads as query rows of the one
    latent head; every configuration has one kv_len for the whole batch."""
    import torch
    import torch.nn.functional as F

    s = case.shape
    kv_len = int(case.kv_lens[0])
    harness.require_free(case.batch * kv_len * s.width * case.cache.element_size(), "the contiguous copy")
    slots = torch.as_tensor(np.stack([case.layout.kv_slots(b) for b in range(case.batch)]), device=case.q.device)
    k = case.cache.reshape(-1, s.width)[slots].unsqueeze(1)  # [B, 1, kv_len, Dc + Dr]
    v = k[..., :s.head_dim_ckv]  # [B, 1, kv_len, Dc]: ckv, read from the same copy
    q = case.q.unsqueeze(1)  # [B, 1, H, Dc + Dr]

    def run():
        return F.scaled_dot_product_attention(q, k, v, scale=case.sm_scale)  # [B, 1, H, Dc]

    try:
        run()
    except RuntimeError as exc:  # no SDPA kernel for these head dimensions here, or no memory for its temporaries
        raise harness.Unavailable(f"SDPA refuses q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                                  f"{exc}") from exc
    return run


def run(suite) -> None:
    shape = DRY_SHAPE if suite.dry_run else GPU_SHAPE
    items = DRY_CONFIGS if suite.dry_run else configs(suite.quick)
    for (dtype, page_size, batch, kv), config in suite.configs(
            items, lambda c: {"dtype": c[0], "page_size": c[1], "batch": c[2], "kv_len": c[3]}):
        case = make_case(suite, shape, dtype, page_size, np.full(batch, kv))
        if suite.dry_run:
            measure_bsrattn(suite, config, case, "reference")
        else:
            measure_bsrattn(suite, config, case, "torch")
            suite.measure(config, "bsrattn-torch-value-apart", partial(build_value_apart, case), out=case.out,
                          **case.check_args())
            measure_bsrattn(suite, config, case, "torch", name="bsrattn-torch-core", kernel="core")
        for backend in FLASHINFER_BACKENDS:
            suite.measure(config, f"flashinfer-mla-{backend}", partial(build_flashinfer, case, backend),
                          out=case.out, needs_cuda=True, **case.check_args())
        suite.measure(config, "sdpa-absorbed", partial(build_sdpa_absorbed, case), **case.check_args())
        del case


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
