"""The torch tier's plan buffers: what ``PlanBuffers.fill`` writes, checked against a plain construction.

The item table is what the kernels read (``bsrattn.items.ITEM_FIELDS``; the numba tier's ``item_table`` too),
so every section is rebuilt here field by field, by name, from the work plan and the layout's own views
(``kv_slots``, ``kv_lens``, ``mask_indptr``), and compared bit for bit on random layouts of every kind: paged,
ragged, custom masks, multi-row query tiles, split and unsplit plans, plans without merges. Refills go in place
over a previous plan's contents, through the compiled pass and through its pure-Python fallback. A separately
staged buffer on the CPU shows that a refill copies the bytes the plan uses and no more, and that the kernel
needs no others. Host-side and fast.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn import scheduler
from bsrattn.testing import assert_close
from bsrattn.torch_cuda import config as tcfg
from bsrattn.torch_cuda import plan_buffers
from bsrattn.items import ITEM, ITEM_FIELDS, ITEM_STRIDE, item_table
from bsrattn.torch_cuda.plan_buffers import Capacity, PlanBuffers
from bsrattn.torch_cuda.runner import Runner
from bsrattn.validation import make_spec
from helpers import compiled_or_python
from strategies import layout_cases, plan_kwargs

DEVICE = torch.device("cpu" if tcfg.interpreting() else "cuda")
HQ, HKV, HEAD_DIM = 4, 2, 16


def expected_sections(work_plan, layout, alibi_slopes=None, rope_freqs=None, rope_positions=None) -> dict:
    """Each section's content, built field by field with loops over items and rows."""
    wp = work_plan
    merge_of_partial = {}
    for m in range(wp.num_merges):
        for j in range(wp.merge_indptr[m], wp.merge_indptr[m + 1]):
            merge_of_partial[int(wp.merge_partials[j])] = m
    rows = []
    for w in range(wp.num_items):
        r = int(wp.item_row[w])
        slots = layout.kv_slots(r)
        affine = slots.size > 0 and bool((np.diff(slots) == 1).all())
        partial = int(wp.item_partial[w])
        m = merge_of_partial[partial] if partial >= 0 else -1
        field = dict(qo_start=wp.item_qo_start[w], qo_end=wp.item_qo_end[w], kv_start=wp.item_kv_start[w],
                     kv_end=wp.item_kv_end[w], partial=partial, merge=m,
                     parts_lo=wp.merge_indptr[m] if m >= 0 else 0, parts_hi=wp.merge_indptr[m + 1] if m >= 0 else 0,
                     qo_first=layout.qo_indptr[r], qo_len=layout.qo_lens[r], kv_len=layout.kv_lens[r],
                     block_start=layout.kv_indptr[r], first_slot=slots[0] if affine else -1,
                     mask_start=layout.mask_indptr[r] if layout.custom_mask is not None else 0, row=r,
                     rope_offset=0 if rope_positions is None else rope_positions[1][r])
        rows.append([int(field[name]) for name in ITEM_FIELDS] + [0] * (ITEM_STRIDE - len(ITEM_FIELDS)))
    sections = {"cta_indptr": wp.cta_indptr, "items": np.array(rows, dtype=np.int32).reshape(-1),
                "merge_partials": wp.merge_partials, "kv_indices": layout.kv_indices}
    for name, values in (("alibi", alibi_slopes), ("rope", rope_freqs)):
        if values is not None:
            sections[name] = np.asarray(values, dtype=np.float32).view(np.int32)
    if rope_positions is not None:
        sections["rope_q"] = np.asarray(rope_positions[0], dtype=np.int32)
    return sections


def written(buffers, expected) -> dict:
    """The device buffer's content of each section, as long as its expected content."""
    return {name: buffers.section(name)[:len(want)].cpu().numpy() for name, want in expected.items()}


def assert_packed(buffers, work_plan, layout, alibi_slopes=None, rope_freqs=None, rope_positions=None):
    want = expected_sections(work_plan, layout, alibi_slopes, rope_freqs, rope_positions)
    for name, got in written(buffers, want).items():
        np.testing.assert_array_equal(got, want[name], err_msg=f"section {name}")
    # The numba tier uploads the same item rows, packed alone.
    np.testing.assert_array_equal(item_table(work_plan, layout, None if rope_positions is None else rope_positions[1])
                                  .reshape(-1), want["items"], err_msg="item_table")
    if layout.custom_mask is not None:
        got = buffers.mask[:layout.custom_mask.size].cpu().numpy()
        np.testing.assert_array_equal(got, layout.custom_mask.view(np.uint8), err_msg="custom mask")


@st.composite
def planned_layouts(draw):
    """A layout of any kind (one level of a cascade), a plan over it, and the float sections (ALiBi slopes and
    RoPE frequencies, or none) and RoPE's positions (a query's, a row's first slot's; or none)."""
    case = draw(layout_cases())
    levels = getattr(case.layout, "levels", (case.layout,))
    layout = levels[draw(st.integers(0, len(levels) - 1))]
    options = draw(plan_kwargs(max_ctas=6, max_tile_q=4, max_split=12))
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, **options)
    def floats(n):
        return st.one_of(st.none(), st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n))

    def positions(n):
        return st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n).map(lambda x: np.array(x, np.int64))

    rope_positions = draw(st.one_of(st.none(), st.tuples(positions(layout.nnz_qo), positions(layout.num_rows))))
    return layout, work_plan, dict(alibi_slopes=draw(floats(HQ)), rope_freqs=draw(floats(HEAD_DIM // 2)),
                                   rope_positions=rope_positions)


def _capacity(*planned):
    """Room for every plan in ``planned`` (same num_ctas)."""
    needs = [Capacity.needed(wp, layout, sections["rope_positions"] is not None) for layout, wp, sections in planned]
    return Capacity(needs[0].num_ctas, *(max(getattr(n, f) for n in needs) for f in
                                          ("items", "merges", "partials", "nnz", "mask", "partial_rows", "queries")))


implementation = compiled_or_python(scheduler._core, plan_buffers._packer)


def test_packed_sections_equal_a_plain_construction(implementation):
    @given(planned_layouts(), planned_layouts())
    def check(first, second):
        # The second plan is written over the first: a refill in place, as a serving loop does it.
        if first[1].num_ctas != second[1].num_ctas:
            second = (second[0], scheduler.plan(second[0].qo_lens, second[0].kv_lens, num_ctas=first[1].num_ctas),
                      second[2])
        buffers = PlanBuffers(_capacity(first, second), HQ, HKV, HEAD_DIM, DEVICE)
        for layout, work_plan, float_sections in (first, second):
            buffers.fill(work_plan, layout, **float_sections)
            assert_packed(buffers, work_plan, layout, **float_sections)

    check()


def test_decode_batch_without_merges():
    """The W6 shape in small: one query row per request, long scattered page tables, one item per request."""
    rng = np.random.default_rng(0)
    tables = rng.permutation(64 * 16).reshape(64, 16)
    tables[3] = np.arange(16) + 16 * 7  # one request on consecutive pages: the affine path
    layout = ba.layouts.paged(np.ones(64, dtype=np.int64), tables, np.full(64, 250), 16, tables.size)
    work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=5, tile_q=4, min_split_size=256,
                               kv_align=64)
    assert work_plan.num_merges == 0 and work_plan.num_items == 64
    buffers = PlanBuffers(Capacity.needed(work_plan, layout), HQ, HKV, HEAD_DIM, DEVICE)
    buffers.fill(work_plan, layout)
    assert_packed(buffers, work_plan, layout)
    items = buffers.section("items")[:64 * ITEM_STRIDE].cpu().numpy().reshape(64, ITEM_STRIDE)
    affine = items[items[:, ITEM["first_slot"]] >= 0]
    assert affine[:, ITEM["row"]].tolist() == [3] and affine[0, ITEM["first_slot"]] == 16 * 7 * 16


def test_affine_rows_take_the_dense_path():
    lay = ba.layouts.vector_sparse([[4, 5, 6, 7], [9, 2, 3], [], [11]], [1, 1, 1, 1], num_slots=12)
    paged = ba.layouts.paged([1, 1], [[3, 4, 5], [2, 0]], kv_lens=[20, 9], page_size=8, num_pages=6)
    for layout, want in ((lay, [4, -1, -1, 11]), (paged, [24, -1])):
        work_plan = scheduler.plan(layout.qo_lens, layout.kv_lens, num_ctas=2, disable_split_kv=True)
        buffers = PlanBuffers(Capacity.needed(work_plan, layout), HQ, HKV, HEAD_DIM, DEVICE)
        buffers.fill(work_plan, layout)
        items = buffers.section("items")[:work_plan.num_items * ITEM_STRIDE].cpu().numpy().reshape(-1, ITEM_STRIDE)
        first_slot = dict(zip(items[:, ITEM["row"]].tolist(), items[:, ITEM["first_slot"]].tolist()))
        assert [first_slot[r] for r in range(layout.num_rows)] == want


def _masked_case(rng, rows, cols_per_row, num_cols):
    """A block-sparse layout with a random custom mask: ``rows`` block rows of 2 queries, blocks of 4 keys."""
    indices = [rng.choice(num_cols, size=n, replace=False) for n in cols_per_row[:rows]]
    indptr = np.concatenate([[0], np.cumsum([len(i) for i in indices])])
    mask = rng.random((int(indptr[-1]), 2, 4)) < 0.7
    return ba.layouts.block_sparse(indptr, np.concatenate(indices), M=2 * rows, N=4 * num_cols, R=2, C=4, mask=mask)


def test_a_refill_copies_only_the_bytes_the_plan_uses():
    """Host staging on the CPU: after a large plan, a smaller one is copied over it up to its own end and
    no further, and attention read from the device buffer alone is right, so the kernel needs no more."""
    rng = np.random.default_rng(1)
    big, small = _masked_case(rng, 4, [5, 6, 4, 6], 8), _masked_case(rng, 2, [3, 2], 8)
    spec_big, spec_small = (make_spec(lay, HQ, HKV, HEAD_DIM) for lay in (big, small))
    plans = [scheduler.plan(lay.qo_lens, lay.kv_lens, num_ctas=3, tile_q=2, fixed_split_size=5) for lay in (big, small)]
    runner = Runner(spec_big, plans[0], DEVICE)
    runner.buffers = buffers = PlanBuffers(runner.buffers.capacity, HQ, HKV, HEAD_DIM, DEVICE, host_staging=True)
    buffers.fill(plans[0], big)
    assert_packed(buffers, plans[0], big)

    plan_end, mask_end = buffers.used_bytes(small)
    mask_at = buffers.mask.data_ptr() - buffers.raw.data_ptr()
    assert plan_end < buffers.used_bytes(big)[0] and mask_end < big.custom_mask.size
    poison = 0xA5
    buffers.raw[plan_end:mask_at].fill_(poison)
    buffers.raw[mask_at + mask_end:].fill_(poison)
    buffers.staging.fill_(0x5A)  # stale staging beyond the small plan's end must not reach the device either
    refilled = Runner(spec_small, plans[1], DEVICE, previous=runner)
    assert refilled.buffers is buffers
    raw = buffers.raw.cpu().numpy()
    assert (raw[plan_end:mask_at] == poison).all() and (raw[mask_at + mask_end:] == poison).all()
    np.testing.assert_array_equal(raw[:plan_end], buffers.staging.numpy()[:plan_end])
    assert_packed(buffers, plans[1], small)

    q = rng.standard_normal((small.nnz_qo, HQ, HEAD_DIM)).astype(np.float32)
    k, v = (rng.standard_normal((small.num_blocks, small.block_size, HKV, HEAD_DIM)).astype(np.float32)
            for _ in range(2))
    got = refilled.run(*(torch.as_tensor(x, device=DEVICE) for x in (q, k, v)), return_lse=True)
    want = ba.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), small, return_lse=True)
    assert_close(got[0], want[0], "attention", "float32", name="out after a partial copy")
    assert_close(got[1], want[1], "lse", "float32", name="lse after a partial copy")


def test_a_prefill_past_int32_pairs_plans_without_a_mask():
    """qo_len * kv_len past int32 matters only to a custom mask's offsets; without one the plan goes ahead."""
    layout = ba.layouts.ragged([2**16], [2**16 + 1])
    assert layout.mask_indptr[-1] > np.iinfo(np.int32).max
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, 4, 2, 16)
    assert attn.work_plans[0].num_items > 0
