"""Deliberately wrong implementations that the checkers must reject (gpu-mode's habit, STYLE.md item 10).

Each test hands a broken implementation to the same check the real one passes (``helpers``' layout, split
and plan checks, driven by the same strategies and edge cases) and asserts that the check raises, for the
right reason. A checker that let one of these through would be a test that cannot fail. The sloppy float16
implementations are what the error budget of ``bsrattn.testing`` exists to reject: a budget loose enough to
let them through would pass anything.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import Phase, given, settings

import bsrattn as ba
from bsrattn import indexing, scheduler
from bsrattn.reference import kv_as_slots
from bsrattn.reference.microkernel import scores
from bsrattn.testing import assert_close
from bsrattn.validation import make_spec
from helpers import (call_inputs, check_layout_attention, check_plan_coverage, check_split_merge, naive_attention,
                     raw_tensors, reference_impl)
from strategies import EDGE_CASES, SPLIT_PROBLEMS, problems

# Rejection needs one failing draw, not the smallest one: no shrinking, one error reported.
HUNT = settings(max_examples=200, phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False, database=None)


def rejects_layout_impl(impl, dtype="float64"):
    """Run the layout check on ``impl`` in ``dtype``, on random problems and on the edge cases, each of which must
    reject it on its own; return the messages of the AssertionErrors raised."""
    @HUNT
    @given(problems())
    def check(problem):
        check_layout_attention(impl, problem, dtype)

    messages = []
    for run in (check, lambda: [check_layout_attention(impl, p, dtype) for p in EDGE_CASES.values()]):
        with pytest.raises(AssertionError) as caught:
            run()
        messages.append(str(caught.value))
    return " ".join(messages)


def rejects_merge_impl(merge_states_fn):
    """Run the split-and-merge check on ``merge_states_fn``; return the AssertionError raised."""
    @HUNT
    @given(SPLIT_PROBLEMS)
    def check(problem):
        check_split_merge(merge_states_fn, *problem)

    with pytest.raises(AssertionError) as caught:
        check()
    return str(caught.value)


def test_the_checks_pass_the_reference():
    """The control: the same checks, on the real implementations, raise nothing."""
    for problem in EDGE_CASES.values():
        for dtype in ("float64", "float16"):
            check_layout_attention(reference_impl, problem, dtype)
    check_plan_coverage(scheduler.plan([2, 1], [37, 5], num_ctas=4), [2, 1], [37, 5])


# ---- attention ----------------------------------------------------------------------------------------

def base2_lse_impl(q, k, v, layout, variant, kv_layout):
    """Returns log2(sum exp) where the contract says natural log (FlashInfer's internal convention leaking out)."""
    out, lse = reference_impl(q, k, v, layout, variant, kv_layout)
    return out, None if lse is None else lse / math.log(2.0)


def test_base2_lse_is_rejected():
    assert "lse" in rejects_layout_impl(base2_lse_impl)


def _off_by_one(layout):
    """Each row reads ``kv_indices[kv_indptr[r] + 1 + i // Bc]``: its blocks shifted by one (wrapping at the end)."""
    return replace(layout, kv_indices=np.roll(layout.kv_indices, -1)) if layout.kv_indices.size else layout


def off_by_one_indptr_impl(q, k, v, layout, variant, kv_layout):
    if isinstance(layout, ba.Cascade):
        layout = ba.Cascade(tuple(_off_by_one(level) for level in layout.levels))
    else:
        layout = _off_by_one(layout)
    return reference_impl(q, k, v, layout, variant, kv_layout)


def test_off_by_one_indptr_is_rejected():
    assert "out" in rejects_layout_impl(off_by_one_indptr_impl)


def gqa_modulo_impl(q, k, v, layout, variant, kv_layout):
    """Query head ``h`` reads KV head ``h % num_kv_heads`` instead of ``h // (num_qo_heads // num_kv_heads)``."""
    head_axis = 1 if (k.ndim == 3 or kv_layout == "HND") else 2
    hq, hkv = q.shape[1], k.shape[head_axis]
    outs, lses = [], []
    for h in range(hq):
        one = replace(variant, alibi_slopes=None if variant.alibi_slopes is None else (variant.alibi_slopes[h],))
        kh, vh = (np.take(x, [h % hkv], axis=head_axis) for x in (k, v))
        out, lse = reference_impl(q[:, h:h + 1], kh, vh, layout, one, kv_layout)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs, axis=1), None if lses[0] is None else np.concatenate(lses, axis=1)


def test_gqa_head_mapping_by_modulo_is_rejected():
    assert "out" in rejects_layout_impl(gqa_modulo_impl)


# ---- sloppy float16 -------------------------------------------------------------------------------------

def one_percent_noise_impl(q, k, v, layout, variant, kv_layout):
    """The reference's answer, each output element 1% too large or too small (a fixed pattern)."""
    out, lse = reference_impl(q, k, v, layout, variant, kv_layout)
    sign = np.where(np.arange(out.size).reshape(out.shape) % 3 == 0, -1.0, 1.0)
    return (out * (1 + 0.01 * sign)).astype(out.dtype), lse


def float16_accumulator_impl(q, k, v, layout, variant, kv_layout):
    """Online softmax one key at a time whose running sum and output accumulator are stored in float16 after
    every key, where a kernel keeps them in float32 (scores, max and exponentials are exact enough: float64)."""
    layout = layout.flatten() if isinstance(layout, ba.Cascade) else layout
    half = np.float16
    kv_view = "NHD3" if k.ndim == 3 else kv_layout
    spec = make_spec(layout, q.shape[1], k.shape[1 if kv_view != "NHD" else 2], q.shape[2], variant, kv_view=kv_view)
    k_slots, v_slots = kv_as_slots(k, spec), kv_as_slots(v, spec)
    group = spec.group_size
    out = np.zeros(q.shape, half)
    lse = np.full(q.shape[:2], np.nan if variant.use_sigmoid else -np.inf)
    for r in range(layout.num_rows):
        qs, qe = int(layout.qo_indptr[r]), int(layout.qo_indptr[r + 1])
        qo_len, kv_len = qe - qs, int(layout.kv_lens[r])
        q_pos, k_pos = indexing.query_position(qo_len, kv_len, np.arange(qo_len)), np.arange(kv_len)
        slots = layout.kv_slots(r)
        s = scores(np.asarray(q[qs:qe], np.float64), k_slots[slots], q_pos, k_pos, variant, spec.sm_scale)
        seen = indexing.key_visible(q_pos[:, None], k_pos[None, :], variant.causal, variant.window_left)
        if layout.row_mask(r) is not None:
            seen = seen & layout.row_mask(r)
        for i in range(qo_len):
            for h in range(q.shape[1]):
                m, total, acc = -np.inf, half(0), np.zeros(q.shape[2], half)
                for j in np.flatnonzero(seen[i]):
                    value = v_slots[slots[j], h // group]
                    if variant.use_sigmoid:
                        acc = (acc + value / (1 + np.exp(-(s[h, i, j] + variant.sigmoid_bias)))).astype(half)
                        continue
                    m_new = max(m, s[h, i, j])
                    alpha, p = np.exp(m - m_new), np.exp(s[h, i, j] - m_new)
                    total, acc, m = half(total * alpha + p), (acc * alpha + p * value).astype(half), m_new
                out[qs + i, h] = acc if variant.use_sigmoid or total == 0 else acc / total
                if not variant.use_sigmoid and total > 0:
                    lse[qs + i, h] = m + np.log(total)
    return out, None if variant.use_sigmoid else lse


def test_one_percent_noise_in_float16_is_rejected():
    """Everywhere: 1% is at least 12 times the naive float16 error of every edge case, so a budget whose factor
    let it through on any of them would be that much too loose."""
    assert "budget" in rejects_layout_impl(one_percent_noise_impl, "float16")
    for name, problem in EDGE_CASES.items():
        with pytest.raises(AssertionError, match="budget"):
            check_layout_attention(one_percent_noise_impl, problem, "float16")


def test_a_float16_accumulator_is_rejected():
    assert "budget" in rejects_layout_impl(float16_accumulator_impl, "float16")


def test_the_float16_table_rejects_one_percent_noise():
    """The table's fixed tolerances serve comparisons with no naive counterpart (GPU scripts, benchmarks):
    they too must reject what no float16 kernel should do."""
    problem = EDGE_CASES["page shared by two requests, ALiBi"]
    q, k, v = raw_tensors(problem, "float16")
    want_o, _ = naive_attention(problem, q, k, v)
    q_c, k_c, v_c, kv_layout = call_inputs(problem.case, q, k, v)
    got_o, _ = one_percent_noise_impl(*(x.astype(np.float16) for x in (q_c, k_c, v_c)), problem.case.layout,
                                      problem.variant, kv_layout)
    with pytest.raises(AssertionError, match="atol 0.004, rtol 0.004"):
        assert_close(got_o, want_o, "attention", "float16")


# ---- merge --------------------------------------------------------------------------------------------

def _fold(merge_two):
    def merge_states(o, lse):
        acc_o, acc_lse = o[:, 0], lse[:, 0]
        for s in range(1, o.shape[1]):
            acc_o, acc_lse = merge_two(acc_o, acc_lse, o[:, s], lse[:, s])
        return acc_o, acc_lse
    return merge_states


def merge_without_max_shift(o_a, lse_a, o_b, lse_b):
    """exp(lse) straight away: overflows to inf once lse passes ~709, and inf/inf is NaN."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        wa, wb = np.exp(lse_a), np.exp(lse_b)
        total = wa + wb
        o = (wa[..., None] * o_a + wb[..., None] * o_b) / np.where(total > 0, total, 1.0)[..., None]
        return o, np.log(total)


def merge_in_base2(o_a, lse_a, o_b, lse_b):
    """The max-shifted merge, but with exp2/log2 applied to natural-log LSEs."""
    m = np.maximum(lse_a, lse_b)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp2(lse_a - m_safe), np.exp2(lse_b - m_safe)
    total = wa + wb
    o = (wa[..., None] * o_a + wb[..., None] * o_b) / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        return o, np.where(total > 0, m_safe + np.log2(np.where(total > 0, total, 1.0)), -np.inf)


def test_merge_without_max_shift_is_rejected():
    message = rejects_merge_impl(_fold(merge_without_max_shift))
    assert "NaN mismatches" in message and "NaN mismatches 0," not in message


def test_merge_in_base2_is_rejected():
    rejects_merge_impl(_fold(merge_in_base2))


# ---- plans --------------------------------------------------------------------------------------------

LENS = ([2, 1], [37, 5])


def _split_plan():
    work_plan = scheduler.plan(*LENS, num_ctas=4)
    assert work_plan.num_merges > 0
    return work_plan


def test_plan_with_overlapping_chunks_is_rejected():
    """Chunk ends one past the next chunk's start: a KV slot covered twice."""
    wp = _split_plan()
    kv_lens = np.asarray(LENS[1])[wp.item_row]
    bad = replace(wp, item_kv_end=np.minimum(wp.item_kv_end + 1, kv_lens).astype(np.int32))
    with pytest.raises(AssertionError, match="covered .* times, want exactly once"):
        check_plan_coverage(bad, *LENS)


def test_plan_missing_a_chunk_is_rejected():
    wp = _split_plan()
    last = int(np.argmax(wp.item_kv_end))
    bad = replace(wp, item_kv_end=wp.item_kv_end.copy())
    bad.item_kv_end[last] -= 1
    with pytest.raises(AssertionError, match="want exactly once"):
        check_plan_coverage(bad, *LENS)


def test_plan_merging_out_of_kv_order_is_rejected():
    """Folding a tile's partials in another order than its chunks is what makes results depend on timing."""
    wp = _split_plan()
    partials = wp.merge_partials.copy()
    lo, hi = wp.merge_indptr[0], wp.merge_indptr[1]
    partials[lo:hi] = partials[lo:hi][::-1]
    with pytest.raises(AssertionError, match="out of KV order"):
        check_plan_coverage(replace(wp, merge_partials=partials), *LENS)
