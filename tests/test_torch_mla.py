"""The torch tier's side of values narrower than keys (``head_dim_vo``, multi-head latent attention) that
``test_mla.py`` does not see: ``v`` as a view into ``k``'s rows read from the key's tile (``value_in_key``), ``v``
apart from ``k`` read by its own strides, and the partial-state workspace as wide as ``v`` through ``cuda_graph``
re-plans over one set of buffers."""

from __future__ import annotations

import numpy as np
import torch

import bsrattn as ba
from bsrattn.testing import assert_close
from bsrattn.torch_cuda import config as tcfg

DEVICE = "cpu" if tcfg.interpreting() else "cuda"
HQ, D, DV = 4, 24, 16


def _paged(kv_lens, rng, num_pages=12, page_size=4):
    pages = [int(np.ceil(n / page_size)) for n in kv_lens]
    order = rng.permutation(num_pages)[:sum(pages)]
    tables = np.split(order, np.cumsum(pages)[:-1])
    return ba.layouts.paged([1] * len(kv_lens), tables, kv_lens, page_size=page_size, num_pages=num_pages)


def test_v_in_k_read_from_the_key_v_apart_by_its_strides_and_the_workspace_as_wide_as_v():
    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((12, 4, 1, D)).astype(np.float32)).to(DEVICE)
    v = k[..., :DV]  # MLA's value: the key's first DV elements, strides of the key's rows
    assert not v.is_contiguous()
    attn = ba.BatchAttention(backend="torch", cuda_graph=True)
    buffers = None
    for kv_lens in ([30, 9], [17, 26]):  # a re-plan of the same batch stays in the buffers a graph recorded
        layout = _paged(kv_lens, rng)
        attn.plan(layout, HQ, 1, D, head_dim_vo=DV, num_ctas=3, q_dtype="float32", kv_dtype="float32")
        assert attn.work_plans[0].num_merges > 0, "rows are split: the workspace is used"
        runner = attn._runners[0]
        assert runner.buffers.part_o.shape[-1] == DV
        assert buffers is None or runner.buffers is buffers
        buffers = runner.buffers
        q = torch.from_numpy(rng.standard_normal((2, HQ, D)).astype(np.float32)).to(DEVICE)
        apart = v.contiguous() + 1.0  # in memory of its own, and not the key's values
        for value, in_key in ((v, True), (apart, False)):
            want_o, want_lse = ba.attention(q.cpu().numpy(), k.cpu().numpy(), value.cpu().numpy(), layout,
                                            return_lse=True)
            out, lse = attn.run(q, k, value, return_lse=True)
            assert out.shape == (2, HQ, DV)
            assert runner.launch_config("float32", "NHD", True, value_in_key=in_key) in runner.buffers.launches
            name = f"kv {kv_lens}, v {'in' if in_key else 'apart from'} k"
            assert_close(out.cpu().numpy(), want_o, "attention", "float32", name=f"{name} out")
            assert_close(lse.cpu().numpy(), want_lse, "lse", "float32", name=f"{name} lse")
