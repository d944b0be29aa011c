"""The numba tier's kept launches on a GPU (marked ``gpu``; skipped, with the reason, where there is none).

A ``BatchAttention`` of the numba tier keeps, after a call's first launches, the overload Numba selected and
the arguments it converted (``launch.Launch``), and the device views of the call's torch tensors
(``runner._call_key``). Every call here is compared bit for bit with the same call made by a fresh object, planned
alike, whose every launch goes through Numba's dispatcher (``launch.KEEPS_LAUNCHES = False``): the kernels are
deterministic, so any stale argument (an old address, shape or scale) shows as a difference. The calls change
what a serving loop changes: other tensors of the same shapes (a model's layers), a fresh output, a buffer
re-pointed in place, the scales, a re-plan for another batch; with a plan that splits the KV (the merge kernel
launches too) and one that does not. And the kept launches are really used: after the first call, no launch
goes through Numba. Run on the H200::

    python -m pytest tests/test_numba_launch_gpu.py -m gpu -q -rs
"""

from __future__ import annotations

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import scattered_page_tables

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 32, 8, 128, 16


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    from numba import cuda

    if not torch.cuda.is_available() or not cuda.is_available():
        pytest.skip("torch or numba sees no CUDA GPU")
    return torch


@pytest.fixture
def through_numba(monkeypatch):
    """Count the launches that go through Numba's dispatcher (``launch.run``)."""
    from bsrattn.numba_cuda import launch

    calls = []
    through = launch.run
    monkeypatch.setattr(launch, "run", lambda *args: (calls.append(args[0]), through(*args)))
    return calls


def _decode(torch, seed, kv_lens):
    """A decode step over a paged fp16 cache: ``layout, q, k, v, out`` (out NaN-filled)."""
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens)
    tables, num_pages = scattered_page_tables(rng, kv_lens, PAGE, spare_pages=4)
    layout = ba.layouts.paged(np.ones_like(kv_lens), tables, kv_lens, PAGE, num_pages)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(layout.nnz_qo, HQ, D, device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn(num_pages, PAGE, HKV, D, device="cuda", dtype=torch.float16, generator=gen) for _ in "kv")
    return layout, q, k, v, torch.full_like(q, float("nan"))


def _planned(layout, plan_kwargs):
    attn = ba.BatchAttention(backend="numba")
    attn.plan(layout, HQ, HKV, D, q_dtype="float16", kv_dtype="float16", **plan_kwargs)
    return attn


def _expected(torch, monkeypatch, layout, plan_kwargs, q, k, v, **scales):
    """``(out, lse)`` of the call by a fresh object whose launches all go through Numba's dispatcher."""
    from bsrattn.numba_cuda import launch

    with monkeypatch.context() as patch:
        patch.setattr(launch, "KEEPS_LAUNCHES", False)
        out, lse = _planned(layout, plan_kwargs).run(q, k, v, return_lse=True, **scales)
        torch.cuda.synchronize()
    return out.clone(), lse.clone()


def _same_bits(torch, got, want, what):
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16 if got.dtype == torch.float16 else torch.int32),
                       want.view(torch.int16 if want.dtype == torch.float16 else torch.int32)), what


PLANS = {"tier's plan": {}, "unsplit": dict(disable_split_kv=True), "split": dict(num_ctas=16, fixed_split_size=128)}


@pytest.mark.parametrize("plan", PLANS)
def test_kept_launches_give_numbas_bits(torch, monkeypatch, through_numba, plan):
    from bsrattn.numba_cuda import launch

    plan_kwargs = PLANS[plan]
    layout, q, k, v, out = _decode(torch, 0, [1024, 700, 33, 257])
    _, q2, k2, v2, out2 = _decode(torch, 1, [1024, 700, 33, 257])  # a second layer: same shapes, other tensors
    attn = _planned(layout, plan_kwargs)
    work_plan = attn.work_plans[0]
    assert (work_plan.num_merges > 0) == (plan != "unsplit")  # the tier's plan splits the 1024 and 700 keys
    lse = torch.full(out.shape[:2], float("nan"), device="cuda")

    def check(what, q, k, v, out, lse=None, return_lse=False, **scales):
        launched = len(through_numba)
        want_o, want_lse = _expected(torch, monkeypatch, layout, plan_kwargs, q, k, v, **scales)
        del through_numba[launched:]  # only this object's launches count
        got = attn.run(q, k, v, out=out, lse=lse, return_lse=return_lse, **scales)
        got_o, got_lse = got if return_lse else (got, lse)
        assert out is None or got_o is out
        _same_bits(torch, got_o, want_o, f"{what}: out")
        if got_lse is not None:
            _same_bits(torch, got_lse, want_lse, f"{what}: lse")

    through_numba.clear()
    check("first call", q, k, v, out)
    assert len(through_numba) == 1 + (work_plan.num_merges > 0)  # compiles and selects the overloads
    kept = attn._runners[0]._launches[0]._kept
    assert kept is not None and kept.compiled in kept.kernel.overloads.values()
    through_numba.clear()
    out.fill_(float("nan"))
    check("same tensors", q, k, v, out)
    check("other tensors of the same shapes", q2, k2, v2, out2)
    check("back to the first", q, k, v, out)
    check("q and out of one layer, k and v of the other", q, k2, v2, out)
    check("a new output each call", q2, k, v, None)
    check("an lse buffer", q, k, v, out, lse=lse)
    check("lse returned", q2, k2, v2, out2, return_lse=True)
    check("scales", q, k, v, out, k_scale=0.5, v_scale=2.0)
    check("scales back to none", q, k, v, out)
    moved = torch.full_like(out, float("nan"))
    out.set_(moved)  # the same tensor object, re-pointed at other memory
    check("out re-pointed in place", q, k, v, out)
    assert out.data_ptr() == moved.data_ptr()
    assert through_numba == [], "a call after the first went through Numba's dispatcher"
    assert attn._runners[0]._launches[0]._kept is kept

    # Another batch: a re-plan; then its calls are kept again.
    layout, q3, k3, v3, out3 = _decode(torch, 2, [90, 2048, 16, 5, 600])
    attn.plan(layout, HQ, HKV, D, q_dtype="float16", kv_dtype="float16", **plan_kwargs)
    check("after a re-plan", q3, k3, v3, out3)
    check("after a re-plan, again", q3, k3, v3, out3)
    _, q4, k4, v4, out4 = _decode(torch, 3, [90, 2048, 16, 5, 600])
    through_numba.clear()
    check("after a re-plan, other tensors", q4, k4, v4, out4)
    check("after a re-plan, mixed", q3, k4, v4, out3, return_lse=True)
    assert through_numba == []

    # Sent through Numba again, and back.
    monkeypatch.setattr(launch, "KEEPS_LAUNCHES", False)
    check("every launch through Numba", q3, k3, v3, out3)
    assert through_numba
    monkeypatch.setattr(launch, "KEEPS_LAUNCHES", True)
    check("kept again", q3, k3, v3, out3)
