"""FlashInfer's own MLA test shapes, sampled, against a float64 oracle of MLA's formula on every tier.

FlashInfer tests its ``BatchMLAPagedAttentionWrapper`` (``tests/attention/test_deepseek_mla.py``) on four grids of
DeepSeek's widths (``Dc`` 512, ``Dr`` 64), listed in :data:`GRIDS`: requests of three KV lengths each (one of them
possibly empty) on pages of one slot; one KV length per batch on pages of 1 and 16; slots past each request's length
in its last page holding NaN, on pages of 16 and 32; and no rotary part at all (``Dr`` 0). Together they hold
thousands of points, so the tests draw a few at random with a fixed seed (:func:`draw`) rather than enumerate
them, each at most :data:`CPU_WORK` or :data:`GPU_WORK` (query row, head, KV slot) triples so the float64 oracle stays
cheap on the host. Pages are scattered over the pool, unlike FlashInfer's, which lays them in order; causal rows are
kept where a query sees no key (FlashInfer skips them), since bsrattn defines those (``out = 0``, ``lse = -inf``).

On the CPU the reference tier runs eight draws, and Numba's simulator and Triton's interpreter (too slow for 576-wide
keys over thousands of slots) two small ones: one length on pages of 1 or 16, and NaN past the lengths; on a GPU
every tier and both kernels of each run twelve larger draws. All in float16, as FlashInfer tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.testing import assert_close, scattered_page_tables
from test_mla import oracle
from test_tiers import CORE_TIERS, TIERS, load_tier

ODD = tuple(range(1, 18, 2))
GRIDS = {  # name: axis -> the values FlashInfer's grid takes (kv_len: one tuple per request of a group)
    "three lengths a group, page 1": dict(batch=(1, 3, 5, 7), kv_len=((0, 1, 3, 11), (17, 33, 79, 114),
                                                                     (514, 2743, 8736)),
                                          qo_len=ODD, num_heads=(16, 64), causal=(False, True), page_size=(1,),
                                          head_dim_kpe=(64,)),
    "one length, pages of 1 and 16": dict(batch=(1, 3, 5, 7, 157), kv_len=((0, 17, 33, 96, 97, 114, 514, 1024),),
                                          qo_len=ODD, num_heads=(16,), causal=(False, True), page_size=(1, 16),
                                          head_dim_kpe=(64,)),
    "slots past the length hold NaN": dict(batch=(1, 2, 3, 4, 5, 6, 7, 157), kv_len=((17, 33, 75, 197),),
                                           qo_len=(3, 7, 17), num_heads=(16,), causal=(False, True),
                                           page_size=(16, 32), head_dim_kpe=(64,), nan_tail=(True,)),
    "without a rotary part": dict(batch=(2,), kv_len=((97,),), qo_len=(3,), num_heads=(16,), causal=(False,),
                                  page_size=(16,), head_dim_kpe=(0,)),
}
DC = 512
CPU_WORK, GPU_WORK = 2_000_000, 5_000_000  # (query row, head, KV slot) triples a draw may hold


def draw(n: int, max_work: int, seed: int) -> list:
    """``n`` points of the grids, each a dict of the axes (``kv_lens``: the lengths of one group of requests),
    every grid first once in turn, then at random; a point over ``max_work`` is drawn again."""
    rng = np.random.default_rng(seed)
    names, points = list(GRIDS), []
    while len(points) < n:
        name = names[len(points) % len(names)] if len(points) < len(names) else str(rng.choice(names))
        grid = GRIDS[name]
        point = {axis: values[rng.integers(len(values))] for axis, values in grid.items() if axis != "kv_len"}
        point.update(grid=name, kv_lens=[int(lens[rng.integers(len(lens))]) for lens in grid["kv_len"]])
        point.setdefault("nan_tail", False)
        if _work(point) <= max_work:
            points.append(point)
    return points


def _work(point) -> int:
    return point["batch"] * point["qo_len"] * point["num_heads"] * sum(point["kv_lens"])


def _case(point, tier, dtype, seed):
    """``(args, values, layout)``: MLA's operands for ``point`` in the tier's array kind and ``dtype``, their values
    as float64 NumPy, and the paged layout over a pool whose pages are scattered."""
    rng = np.random.default_rng(seed)
    kv_lens = point["kv_lens"] * point["batch"]
    qo_lens = [point["qo_len"]] * len(kv_lens)
    page, dr, heads = point["page_size"], point["head_dim_kpe"], point["num_heads"]
    tables, num_pages = scattered_page_tables(rng, kv_lens, page, spare_pages=1)
    layout = ba.layouts.paged(qo_lens, tables, kv_lens, page_size=page, num_pages=num_pages)
    pool = (num_pages, page)
    values = [rng.standard_normal(s).astype(dtype).astype(np.float64) for s in
              ((layout.nnz_qo, heads, DC), (layout.nnz_qo, heads, dr), pool + (DC,), pool + (dr,))]
    if point["nan_tail"]:  # every slot no request reads: the last pages' tails and the spare page
        read = np.zeros(num_pages * page, bool)
        for r in range(layout.num_rows):
            read[layout.kv_slots(r)] = True
        for cache in values[2:]:
            cache.reshape(num_pages * page, -1)[~read] = np.nan
    return [tier.array(v, dtype) for v in values], values, layout


def _check(tier, point, dtype, seed):
    args, values, layout = _case(point, tier, dtype, seed)
    out, lse = ba.mla_attention(*args, layout, variant=ba.Variant(causal=point["causal"]), backend=tier.backend,
                                return_lse=True)
    want_o, want_lse = oracle(*values, layout, causal=point["causal"])
    name = f"{tier.name} {point}"
    assert_close(tier.numpy(out), want_o, "attention", dtype, name=f"{name} out")
    assert_close(tier.numpy(lse), want_lse, "lse", dtype, name=f"{name} lse")


CPU_POINTS = draw(8, CPU_WORK, seed=0)
EMULATED_POINTS = [  # two small points of the grids, picked: a causal row on pages of 1, NaN past the lengths
    dict(grid="one length, pages of 1 and 16", batch=1, kv_lens=[114], qo_len=3, num_heads=16, causal=True,
         page_size=1, head_dim_kpe=64, nan_tail=False),
    dict(grid="slots past the length hold NaN", batch=2, kv_lens=[17], qo_len=3, num_heads=16, causal=False,
         page_size=16, head_dim_kpe=64, nan_tail=True),
]
GPU_POINTS = draw(12, GPU_WORK, seed=2)


@pytest.mark.parametrize("point", CPU_POINTS, ids=[f"{i}-{p['grid']}" for i, p in enumerate(CPU_POINTS)])
def test_flashinfers_mla_shapes_on_the_reference_tier(point):
    _check(load_tier("reference"), point, "float16", seed=1)


@pytest.mark.parametrize("name", [t for t in TIERS + CORE_TIERS if t != "reference"])
def test_flashinfers_mla_shapes_on_the_gpu_tiers_small_draws(name):
    tier = load_tier(name)
    for i, point in enumerate(EMULATED_POINTS):
        _check(tier, point, "float16", seed=20 + i)


def test_the_draws_reach_every_grid_and_its_hard_cases():
    """The sample is not a handful of easy points: every grid, an empty request, a causal row, NaN tails."""
    points = CPU_POINTS + GPU_POINTS
    assert {p["grid"] for p in CPU_POINTS} == {p["grid"] for p in GPU_POINTS} == set(GRIDS)
    assert any(0 in p["kv_lens"] for p in points)
    assert any(p["causal"] for p in CPU_POINTS) and any(p["nan_tail"] for p in CPU_POINTS)
    assert all(_work(p) <= CPU_WORK for p in CPU_POINTS)
    for p in EMULATED_POINTS:  # picked by hand, but from the grids
        grid = GRIDS[p["grid"]]
        assert all(p[axis] in values for axis, values in grid.items() if axis != "kv_len"), p
        assert all(n in lens for n, lens in zip(p["kv_lens"], grid["kv_len"])), p


@pytest.mark.gpu
@pytest.mark.parametrize("name", TIERS + CORE_TIERS)
def test_flashinfers_mla_shapes_on_every_tier(name):
    tier = load_tier(name)
    for i, point in enumerate(GPU_POINTS):
        _check(tier, point, "float16", seed=10 + i)
