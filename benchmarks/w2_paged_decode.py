"""Workload 2: paged decode, fp16 / bf16 / fp8-e4m3 KV.

32 query / 8 KV heads, head_dim 128, page size 16, pages scattered at random over an NHD pool
``[pages, 16, 8, 128]``; batch {1, 16, 64, 256} x kv_len {1k, 4k, 16k, 32k}, and 32 requests of
kv_len ~ U(4096, 16384). The work reads every KV byte once: the bound is
``sum(kv_len) * 8 heads * 128 * 2 (K and V) * bytes per element`` (+ queries, outputs, page table) over the copy
bandwidth. A decode kernel only reads, and a read stream can beat the copy rate (about 4.6 TB/s against 4.2
measured on the H200), so the fraction can exceed 1.

Implementations, each checked against the float64 reference, then timed in graph and eager mode:

- ``bsrattn-torch`` (and ``bsrattn-numba``, fp16, full run only): ``ba.layouts.paged``, planned once;
  ``bsrattn-torch-core``, the same call on the torch tier's core (``kernel="core"``), the first rung.
- ``flashinfer-cuda-core``, ``flashinfer-tensor-core``: ``BatchDecodeWithPagedKVCacheWrapper`` without and with
  ``use_tensor_cores``; the target (docs/benchmarks.md) compares with the better of the two.
- ``sdpa-contiguous``: SDPA given a ready contiguous ``[B, 8, kv_len, 128]`` copy (padded with a mask for
  variable lengths); ``sdpa-gather``: the page gather then SDPA, both timed. Not for fp8 KV.

Run: ``python3 -m benchmarks.w2_paged_decode [--quick]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

import bsrattn as ba
from bsrattn.testing import scattered_page_tables
from benchmarks import baselines, correctness, harness

WORKLOAD = "w2_paged_decode"
TITLE = "W2: paged decode (32/8 heads, d128, page 16, scattered pages; fp16, bf16, fp8-e4m3 KV)"
VARIABLE = "U(4096,16384)"
GRID = [(b, s) for b in (1, 16, 64, 256) for s in (1024, 4096, 16384, 32768)] + [(32, VARIABLE)]
SUBSET = [(1, 1024), (1, 16384), (16, 4096), (64, 4096), (256, 16384), (32, VARIABLE)]
QUICK = ([("float16", b, s) for b, s in ((1, 1024), (16, 4096), (256, 16384), (32, VARIABLE))]
         + [("float8_e4m3fn", 1, 1024), ("float8_e4m3fn", 256, 16384)])
K_SCALE, V_SCALE = 0.75, 1.25  # fp8 dequantisation scales: not 1, so a kernel that ignores them fails


@dataclass(frozen=True)
class Shape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


GPU_SHAPE = Shape(32, 8, 128, 16)
DRY_SHAPE = Shape(4, 2, 16, 4)
DRY_CONFIGS = (("float16", 2, 32), ("float16", 3, "U(16,64)"))


def configs(quick: bool) -> list:
    """``(kv dtype, batch, kv_len)``; kv_len is an int or ``"U(lo,hi)"``."""
    if quick:
        return list(QUICK)
    return ([("float16", b, s) for b, s in GRID] + [("bfloat16", b, s) for b, s in SUBSET]
            + [("float8_e4m3fn", b, s) for b, s in SUBSET])


def kv_lengths(rng, batch: int, kv) -> np.ndarray:
    """``[batch]`` lengths: ``kv`` itself, or uniform draws for ``"U(lo,hi)"`` (inclusive)."""
    if isinstance(kv, str):
        lo, hi = (int(x) for x in kv[2:-1].split(","))
        return rng.integers(lo, hi + 1, size=batch)
    return np.full(batch, int(kv))


@dataclass
class Case:
    shape: Shape
    kv_dtype: str
    q_dtype: str
    kv_lens: np.ndarray  # [B]
    tables: list  # [B][pages_b] pool pages
    layout: ba.BSRLayout
    q: object  # [B, Hq, D]
    k: object  # [P, page, Hkv, D] (NHD)
    v: object
    out: object  # [B, Hq, D]
    rows: np.ndarray
    expected: np.ndarray
    scales: dict  # k_scale / v_scale for fp8, else empty

    @property
    def batch(self) -> int:
        return int(self.kv_lens.size)

    @property
    def pool_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def bytes_needed(self) -> int:
        s = self.shape
        kv = int(self.kv_lens.sum()) * s.num_kv_heads * s.head_dim * 2 * self.k.element_size()
        qo = 2 * self.batch * s.num_qo_heads * s.head_dim * self.q.element_size()
        return kv + qo + 4 * (self.layout.kv_indices.size + 2 * self.batch + 1)

    def check_args(self) -> dict:
        dtype = self.kv_dtype if self.kv_dtype.startswith("float8") else self.q_dtype
        return dict(shape=(self.batch, self.shape.num_qo_heads, self.shape.head_dim), rows=self.rows,
                    expected=self.expected, dtype=dtype, bytes_needed=self.bytes_needed)

    def plan_args(self) -> dict:
        s = self.shape
        return dict(num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                    q_dtype=self.q_dtype, kv_dtype=self.kv_dtype)

    def page_table_tensors(self, device=None):
        """``kv_indptr``, ``kv_indices``, ``kv_last_len`` as int32 tensors (FlashInfer's plan inputs)."""
        import torch

        device = self.q.device if device is None else device
        lay = self.layout
        return tuple(torch.as_tensor(a, dtype=torch.int32, device=device)
                     for a in (lay.kv_indptr, lay.kv_indices, lay.kv_last_len))


def make_case(suite, shape: Shape, kv_dtype: str, kv_lens) -> Case:
    """Random q, a random pool with pages scattered by a random permutation, and the reference rows."""
    import torch

    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    tables, num_pages = scattered_page_tables(suite.rng, kv_lens, shape.page_size)
    q_dtype = "float16" if kv_dtype.startswith("float8") else kv_dtype
    qt = getattr(torch, q_dtype)
    dev = suite.device
    q = torch.randn(kv_lens.size, shape.num_qo_heads, shape.head_dim, dtype=qt, device=dev)
    pool = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    k = torch.randn(pool, dtype=qt, device=dev).to(getattr(torch, kv_dtype))
    v = torch.randn(pool, dtype=qt, device=dev).to(getattr(torch, kv_dtype))
    layout = ba.layouts.paged(np.ones_like(kv_lens), tables, kv_lens, shape.page_size, num_pages)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if kv_dtype.startswith("float8") else {}
    rows = correctness.sample_rows(layout, shape.num_kv_heads, shape.head_dim)
    expected = correctness.reference_rows(layout, q, k, v, rows, **scales)
    out = torch.full(q.shape, float("nan"), dtype=qt, device=dev)
    return Case(shape, kv_dtype, q_dtype, kv_lens, tables, layout, q, k, v, out, rows, expected, scales)


def build_flashinfer(case, *, tensor_cores: bool, disable_split_kv: bool = False):
    import torch

    s = case.shape
    wrapper = baselines.decode_wrapper(*case.page_table_tensors(), num_qo_heads=s.num_qo_heads,
                                       num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, page_size=s.page_size,
                                       q_dtype=getattr(torch, case.q_dtype), kv_dtype=getattr(torch, case.kv_dtype),
                                       tensor_cores=tensor_cores, disable_split_kv=disable_split_kv)
    return lambda: wrapper.run(case.q, (case.k, case.v), out=case.out, **case.scales)


def _slots(case):
    """``[B, max_kv]`` pool slots of each request's tokens (padded with slot 0) and ``[B, max_kv]`` validity."""
    width = int(case.kv_lens.max())
    slots = np.zeros((case.batch, width), dtype=np.int64)
    valid = np.zeros((case.batch, width), dtype=bool)
    for b in range(case.batch):
        row = case.layout.kv_slots(b)
        slots[b, :row.size] = row
        valid[b, :row.size] = True
    return slots, valid


def build_sdpa_contiguous(case):
    """SDPA on a contiguous ``[B, Hkv, kv, D]`` copy made here (untimed); a mask when lengths differ."""
    import torch
    import torch.nn.functional as F

    if case.kv_dtype.startswith("float8"):
        raise harness.Unavailable("SDPA takes no fp8 KV")
    s = case.shape
    harness.require_free(2 * case.batch * int(case.kv_lens.max()) * s.num_kv_heads * s.head_dim
                         * case.k.element_size(), "the contiguous copy")
    slots, valid = (torch.as_tensor(a, device=case.q.device) for a in _slots(case))
    kc = case.k.reshape(-1, s.num_kv_heads, s.head_dim)[slots].transpose(1, 2).contiguous()
    vc = case.v.reshape(-1, s.num_kv_heads, s.head_dim)[slots].transpose(1, 2).contiguous()
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    q4 = case.q.reshape(case.batch, s.num_qo_heads, 1, s.head_dim)
    return lambda: F.scaled_dot_product_attention(q4, kc, vc, attn_mask=mask, enable_gqa=True)


def build_sdpa_gather(case):
    """Gather each request's pages into ``[B, kv, Hkv, D]`` then SDPA, both timed (equal lengths only)."""
    import torch
    import torch.nn.functional as F

    if case.kv_dtype.startswith("float8"):
        raise harness.Unavailable("SDPA takes no fp8 KV")
    if len(set(case.kv_lens.tolist())) > 1:
        raise harness.Unavailable("equal lengths only (the padded, masked variant is sdpa-contiguous)")
    harness.require_free(2 * case.pool_bytes, "the gathered copy (eager and graph)")
    s = case.shape
    slots = torch.as_tensor(_slots(case)[0], device=case.q.device)
    q4 = case.q.reshape(case.batch, s.num_qo_heads, 1, s.head_dim)

    def run():
        kg = case.k.reshape(-1, s.num_kv_heads, s.head_dim)[slots].transpose(1, 2)
        vg = case.v.reshape(-1, s.num_kv_heads, s.head_dim)[slots].transpose(1, 2)
        return F.scaled_dot_product_attention(q4, kg, vg, enable_gqa=True)

    return run


def measure_bsrattn(suite, config, case, tier, name=None, kernel=None, **plan_extra):
    """``bsrattn-<tier>`` (or ``name``) on ``case``: plan once, ``run`` timed; ``kernel="core"``: the tier's core."""
    harness.measure_bsrattn(suite, config, name or f"bsrattn-{tier}", tier, case.layout, case.q, case.k, case.v,
                            plan={**case.plan_args(), **plan_extra}, out=case.out, run=case.scales, kernel=kernel,
                            **case.check_args())


def run(suite) -> None:
    shape = DRY_SHAPE if suite.dry_run else GPU_SHAPE
    items = DRY_CONFIGS if suite.dry_run else configs(suite.quick)
    for (kv_dtype, batch, kv), config in suite.configs(
            items, lambda c: {"dtype": c[0], "batch": c[1], "kv_len": c[2]}):
        case = make_case(suite, shape, kv_dtype, kv_lengths(suite.rng, batch, kv))
        fp8 = kv_dtype.startswith("float8")
        if suite.dry_run:
            measure_bsrattn(suite, config, case, "reference")
        else:
            measure_bsrattn(suite, config, case, "torch")
            if not fp8:  # the first rung: the paper's kernel at teaching size
                measure_bsrattn(suite, config, case, "torch", name="bsrattn-torch-core", kernel="core")
            if not suite.quick and kv_dtype == "float16":
                measure_bsrattn(suite, config, case, "numba")
        suite.measure(config, "flashinfer-cuda-core", partial(build_flashinfer, case, tensor_cores=False),
                      out=case.out, needs_cuda=True, **case.check_args())
        if not (fp8 and suite.quick):
            suite.measure(config, "flashinfer-tensor-core", partial(build_flashinfer, case, tensor_cores=True),
                          out=case.out, needs_cuda=True, **case.check_args())
        if not fp8:
            suite.measure(config, "sdpa-contiguous", partial(build_sdpa_contiguous, case), **case.check_args())
            if not isinstance(kv, str):
                suite.measure(config, "sdpa-gather", partial(build_sdpa_gather, case), **case.check_args())
        del case


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
