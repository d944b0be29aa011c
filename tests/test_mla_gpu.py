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
