"""Multi-head latent attention at DeepSeek-V3's shapes on a GPU (marked ``gpu``; skipped without one).

128 query heads over the latent cache (``Dc`` 512, ``Dr`` 64: keys 576 wide, values 512), pages of 64 slots and of
1, a decode batch of 1 and of 32 rows of 4096 keys, in float16 and bfloat16: ``bsrattn.mla_attention`` on the torch
tier against the reference tier in float64, on the same values. Run on the H200 with::

    python -m pytest tests/test_mla_gpu.py -m gpu -q -rs
"""

from __future__ import annotations

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import assert_close, scattered_page_tables

pytestmark = pytest.mark.gpu

H, DC, DR, KV = 128, 512, 64, 4096


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("page", [64, 1])
def test_deepseek_v3_decode_matches_the_reference(page, batch, dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(page * 100 + batch)
    kv_lens = [KV] * batch
    tables, num_pages = scattered_page_tables(rng, kv_lens, page, spare_pages=4)
    layout = ba.layouts.paged([1] * batch, tables, kv_lens, page_size=page, num_pages=num_pages)
    pool = (num_pages,) if page == 1 else (num_pages, page)
    shapes = ((batch, H, DC), (batch, H, DR), pool + (DC,), pool + (DR,))
    args = [torch.randn(s, dtype=getattr(torch, dtype), device="cuda") for s in shapes]
    out, lse = ba.mla_attention(*args, layout, backend="torch", return_lse=True)
    want_o, want_lse = ba.mla_attention(*[x.double().cpu().numpy() for x in args], layout, backend="reference",
                                        return_lse=True)
    name = f"page {page}, batch {batch}, {dtype}"
    assert_close(out.float().cpu().numpy(), want_o, "attention", dtype, name=f"{name} out")
    assert_close(lse.cpu().numpy(), want_lse, "lse", dtype, name=f"{name} lse")


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_deepseek_v3_decode_over_an_fp8_cache_with_scales(fp8):
    """An fp8 latent cache, ``ckv_scale`` and ``kpe_scale`` unequal, bf16 queries: the reference tier in float64 on
    the same dequantised values (``test_mla.py`` holds the same call to the formula under the simulators)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    kv_lens = [KV] * 8
    tables, num_pages = scattered_page_tables(rng, kv_lens, 64, spare_pages=4)
    layout = ba.layouts.paged([1] * 8, tables, kv_lens, page_size=64, num_pages=num_pages)
    q_nope, q_pe = (torch.randn((8, H, d), dtype=torch.bfloat16, device="cuda") for d in (DC, DR))
    cache = torch.randn((num_pages, 64, DC + DR), device="cuda").to(getattr(torch, fp8))
    args = (q_nope, q_pe, cache[..., :DC], cache[..., DC:])
    scales = dict(ckv_scale=0.5, kpe_scale=2.0)
    out = ba.mla_attention(*args, layout, backend="torch", **scales)
    want = ba.mla_attention(*[x.double().cpu().numpy() for x in args], layout, backend="reference", **scales)
    assert_close(out.float().cpu().numpy(), want, "attention", fp8, name=f"{fp8} out")
