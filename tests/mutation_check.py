"""Deliberate faults in the library, each of which some test must catch (STYLE.md item 10).

Every entry of :data:`MUTANTS` is applied on its own to a fresh copy of the repository's ``bsrattn/`` and
``tests/`` (with ``examples/``, which tests import, ``conftest.py`` and ``pyproject.toml``) in a temporary
directory; the tests it names are run there with ``python -m pytest``, the copy first on the path (its
``pyproject.toml``'s pytest ``pythonpath``, and ``PYTHONPATH`` for what its tests start) so that it, not the
installed package, is what gets imported (checked once before any mutant runs). A mutant is *killed* when
those tests fail; one that passes them *survives*, and a test suite that lets a fault survive guards nothing.
The working tree is only read.

An entry is one line::

    Mutant(name, file, snippet, replacement, tests)

``name`` says what the fault is; ``file`` is a path from the repository root; ``snippet`` is exact source
text that must occur in ``file`` exactly once (a snippet that no longer occurs, or occurs twice, is an
error: the list must follow the code); ``replacement`` is what it becomes (a fault in two places of one
file: a tuple of snippets and a tuple of their replacements); ``tests`` are pytest node ids (from the
repository root) that must fail on the mutant, chosen fast. Before the mutants, the union of all
named tests runs once on the unmutated copy and must pass, so a kill always means the fault was caught (the
test suite's own run, ``tests/test_mutations.py``, leaves this to the suite, which runs those tests anyway).

Each job slot keeps a server process that has imported what every run imports (numpy, torch, triton, numba,
pytest, hypothesis; 3-4 s on two cores), with the environment the repository's ``conftest.py`` sets; each
pytest run is a child forked from it, so a mutant pays for its own tests only. The child checks that
``bsrattn`` resolves to its copy before the first test runs.

Run ``python tests/mutation_check.py [--jobs N] [NAME ...]``: it prints each mutant's outcome, the kill rate
and the survivors, and exits non-zero unless every mutant is killed. ``tests/test_mutations.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import py_compile
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("bsrattn", "tests", "examples", "conftest.py", "pyproject.toml")
TIMEOUT_S = 240  # per pytest run; a mutant that hangs its tests this long counts as caught


@dataclass(frozen=True)
class Mutant:
    """One deliberate fault (see the module docstring for the fields)."""

    name: str
    file: str
    snippet: str | tuple
    replacement: str | tuple
    tests: tuple

    @property
    def edits(self) -> list:
        """``[(snippet, replacement)]``."""
        if isinstance(self.snippet, str):
            return [(self.snippet, self.replacement)]
        return list(zip(self.snippet, self.replacement, strict=True))


# The tests the entries run, by what they exercise.
REFERENCE = ("tests/test_wrong_implementations.py::test_the_checks_pass_the_reference",)
FORMULA = ("tests/test_reference_formula.py::test_the_fast_path_matches_the_formula",)
NUMBA = ("tests/test_numba_tier.py::test_every_layout_kind", "tests/test_numba_tier.py::test_gqa_ratios_and_storage")
TORCH = ("tests/test_torch_tier.py::test_variants_with_split_plans",)
CUDA_GRAPH = ("tests/test_transformers_hoisted.py::"
              "test_a_cuda_graph_plan_keeps_its_kernel_and_key_across_re_plans_that_fit",)
FLOAT16_BUDGET = ("tests/test_wrong_implementations.py::test_one_percent_noise_in_float16_is_rejected",
                  "tests/test_wrong_implementations.py::test_a_float16_accumulator_is_rejected")
COVERAGE = ("tests/test_scheduler.py::test_plan_covers_every_row_and_kv_slot_exactly_once[python]",)
AFTER_A_GOOD_CALL = ("tests/test_bad_inputs.py::test_run_checks_again_whatever_differs_from_the_last_call_that_passed",)


def plan_order(tier):
    return (f"tests/test_merge_order.py::test_split_rows_fold_their_chunks_in_the_plan_order[{tier}]",)


def index_order(tier):
    return (f"tests/test_merge_order.py::test_merge_states_folds_in_index_order[{tier}]",)


def special(test):
    return (f"tests/test_special_values.py::{test}",)


def large_lse(tier):
    return (f"tests/test_tiers.py::test_merge_of_large_lses_does_not_overflow[{tier}]",)


MUTANTS = (
    # merge order
    Mutant("fold order reversed: reference executor", "bsrattn/reference/executor.py",
           "merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]",
           "merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]][::-1]", plan_order("reference")),
    Mutant("fold order reversed: reference merge_states", "bsrattn/reference/merge.py",
           "acc_o, acc_lse = o[:, 0], lse[:, 0]\n    for s in range(1, o.shape[1]):",
           "acc_o, acc_lse = o[:, -1], lse[:, -1]\n    for s in range(o.shape[1] - 2, -1, -1):", index_order("reference")),
    Mutant("fold order reversed: numba plan merge kernel", "bsrattn/numba_cuda/merge.py",
           "p = merge_partials[first] + i\n            o = part_o[p, head, d]\n            s = zero if sigmoid else "
           "part_lse[p, head]\n            for n in range(first + 1, last):",
           "p = merge_partials[last - 1] + i\n            o = part_o[p, head, d]\n            s = zero if sigmoid else "
           "part_lse[p, head]\n            for n in range(last - 2, first - 1, -1):", plan_order("numba")),
    Mutant("fold order reversed: numba merge_states", "bsrattn/numba_cuda/merge.py",
           "value, s = dec_o(o[b, 0, h, d]), dec_lse(lse[b, 0, h])\n            for state in range(1, o.shape[1]):",
           "value, s = dec_o(o[b, -1, h, d]), dec_lse(lse[b, -1, h])\n            "
           "for state in range(o.shape[1] - 2, -1, -1):", index_order("numba")),
    Mutant("fold order reversed: torch fold_partials", "bsrattn/torch_cuda/merge.py",
           ("tl.load(merge_partials + lo), row", "tl.load(merge_partials + j), row"),
           ("tl.load(merge_partials + hi - 1), row", "tl.load(merge_partials + lo + hi - 1 - j), row"),
           plan_order("torch")),
    Mutant("fold order reversed: torch merge_states", "bsrattn/torch_cuda/merge.py",
           "    for s in range(1, num_states):\n        row_s = base + s * num_heads",
           "    last = base + (num_states - 1) * num_heads\n    o = tl.load(o_ptr + last[:, None] * HEAD_DIM + d[None, :], "
           "mask=valid[:, None] & cols, other=0.0).to(tl.float32)\n    lse = tl.load(lse_ptr + last, mask=valid, "
           "other=float(\"-inf\")).to(tl.float32)\n    for s in range(num_states - 2, -1, -1):\n"
           "        row_s = base + s * num_heads", index_order("torch")),
    # the formulas
    Mutant("base-2 LSE: reference microkernel", "bsrattn/reference/microkernel.py",
           "lse = m_safe.T + np.log(denom)", "lse = (m_safe.T + np.log(denom)) / np.log(2.0)", REFERENCE),
    Mutant("base-2 LSE: reference formula", "bsrattn/reference/microkernel.py",
           "lse = m + np.log(total)", "lse = (m + np.log(total)) / np.log(2.0)", FORMULA),
    Mutant("an empty row shifted by -inf: reference formula", "bsrattn/reference/microkernel.py",
           "m = np.where(m == -np.inf, 0, m)", "m = m", FORMULA),
    Mutant("a tile's span one key short: reference fast path", "bsrattn/reference/microkernel.py",
           "span = slice(seen[0], seen[-1] + 1)", "span = slice(seen[0], seen[-1])", FORMULA),
    Mutant("base-2 LSE: numba microkernel", "bsrattn/numba_cuda/microkernel.py",
           "s = m_run[i] + math.log(l_run[i])", "s = m_run[i] + math.log2(l_run[i])", NUMBA),
    Mutant("base-2 LSE: torch microkernel", "bsrattn/torch_cuda/microkernel.py",
           "(m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2", "(m_i + tl.log2(tl.where(has_keys, l_i, 1.0)))",
           TORCH),
    Mutant("default scale 1/head_dim, not 1/sqrt(head_dim)", "bsrattn/variant.py",
           "1.0 / math.sqrt(head_dim)", "1.0 / head_dim", REFERENCE),
    Mutant("soft cap without the division: cap * tanh(s)", "bsrattn/reference/microkernel.py",
           "s = cap * np.tanh(s / cap)", "s = cap * np.tanh(s)", REFERENCE),
    Mutant("ALiBi bias of the wrong sign", "bsrattn/reference/microkernel.py",
           "(k_pos[None, None, :] - q_pos[None, :, None])", "(q_pos[None, :, None] - k_pos[None, None, :])",
           REFERENCE),
    Mutant("fused RoPE turned the wrong way: reference", "bsrattn/reference/microkernel.py",
           "[lo * cos - hi * sin, hi * cos + lo * sin]", "[lo * cos + hi * sin, hi * cos - lo * sin]",
           ("tests/test_tiers.py::test_fused_rope[reference-rope-decode and append]",)),
    Mutant("fused RoPE keys turned one position late: torch", "bsrattn/torch_cuda/microkernel.py",
           "            k_pos + row.rope_offset, row.rope_freq, q.dtype)",
           "            k_pos + row.rope_offset + 1, row.rope_freq, q.dtype)",
           ("tests/test_torch_tier.py::test_variants_with_split_plans[fused RoPE, window]",)),
    Mutant("fused RoPE on a cascade: queries at their level's positions, reference", "bsrattn/reference/microkernel.py",
           "q_rot, k_offset = spec.rope_positions[0][qo_start:qo_end], int(spec.rope_positions[1][r])",
           "q_rot, k_offset = q_pos, int(spec.rope_positions[1][r])",
           ("tests/test_tiers.py::test_fused_rope_on_a_cascade[reference-rope]",)),
    Mutant("fused RoPE on a cascade: keys at their level's positions, torch", "bsrattn/torch_cuda/executor.py",
           "rope_offset = tl.load(item + _ROPE_OFFSET)", "rope_offset = 0",
           ("tests/test_tiers.py::test_fused_rope_on_a_cascade[torch-rope]",)),
    Mutant("fused RoPE on a cascade: keys at their level's positions, numba", "bsrattn/numba_cuda/microkernel.py",
           "angle = compute(rope_offset + kv0 + j)", "angle = compute(kv0 + j)",
           ("tests/test_tiers.py::test_fused_rope_on_a_cascade[numba-rope]",)),
    Mutant("context parallel: fused RoPE at a shard's local positions", "bsrattn/distributed.py",
           "rope_positions=shard.rope_positions() if local_variant.use_rope else None)", "rope_positions=None)",
           ("tests/test_distributed.py::test_sharded_equals_unsharded_to_rounding[2 ranks]",)),
    Mutant("a caller's fused-RoPE positions ignored", "bsrattn/api.py",
           "    return replace(spec, rope_positions=check_rope_positions(layout, spec.variant, rope_positions))",
           "    return replace(spec, rope_positions=None)",
           ("tests/test_tiers.py::test_fused_rope_at_given_positions[reference]",)),
    Mutant("the kernel without merges for a plan that splits rows", "bsrattn/torch_cuda/runner.py",
           "merges=self.work_plan.num_merges > 0 or", "merges=False and", TORCH),
    Mutant("no warning when a graph's merge-free kernel meets a plan that splits", "bsrattn/torch_cuda/runner.py",
           "if buffers.captured_without_merges and work_plan.num_merges:", "if False:",
           ("tests/test_torch_tier.py::test_a_prefill_plan_that_splits_no_row_runs_the_kernel_without_merges",)),
    Mutant("a small decode batch balanced over every CTA", "bsrattn/torch_cuda/config.py",
           "busy_ctas=max(1, min(ctas, sms // programs)) if few_pairs else ctas,", "busy_ctas=ctas,",
           ("tests/test_torch_tier.py::test_a_decode_batch_of_few_pairs_runs_on_one_8_warp_cta_per_sm",)),
    Mutant("a decode batch of tall tiles balanced over one CTA per SM", "bsrattn/torch_cuda/config.py",
           "few_pairs = m <= DECODE_FEW_ROWS and ", "few_pairs = ",
           ("tests/test_torch_tier.py::test_a_decode_batch_of_few_pairs_runs_on_one_8_warp_cta_per_sm",)),
    Mutant("a split prefill tile's row cut into chunks lighter than their partial states",
           "bsrattn/torch_cuda/config.py", "else split_keys(spec, tile_q)", "else 1",
           ("tests/test_torch_tier.py::test_a_split_prefill_tile_reads_more_kv_than_its_partial_states",)),
    Mutant("a decode's chains of short items left on the persistent kernel", "bsrattn/torch_cuda/config.py",
           "return kv.size >= DECODE_CHAIN_ITEMS * work_plan.num_ctas and", "return False and",
           ("tests/test_torch_tier.py::test_a_split_decode_runs_the_item_kernel_with_its_merges",)),
    Mutant("kept kernels shared by buffers of another item capacity", "bsrattn/torch_cuda/launch.py",
           "item_grid = self.item_capacity if config.item_kernel else 0", "item_grid = 0",
           ("tests/test_torch_tier.py::test_a_launch_over_buffers_of_another_item_capacity_keeps_its_own_kernels",)),
    Mutant("a kept one-shot runner reused for another spec of the same layout", "bsrattn/torch_cuda/one_shot.py",
           "return a == b and a.rope_positions is b.rope_positions", "return a.layout is b.layout",
           ("tests/test_torch_tier.py::test_one_shot_calls_of_one_spec_plan_once",)),
    Mutant("a one-shot call's checks skipped for another layout object", "bsrattn/api.py",
           "return isinstance(other, _Identity) and other.obj is self.obj", "return isinstance(other, _Identity)",
           ("tests/test_bad_inputs.py::test_a_one_shot_call_like_the_last_that_passed_skips_only_its_checks",)),
    Mutant("kept kernels launched past a launch hook chain that calls something", "bsrattn/torch_cuda/launch.py",
           'return hook is not None and bool(getattr(hook, "calls", True))', "return hook is not None",
           ("tests/test_torch_tier.py::test_kept_kernels_go_through_triton_while_a_launch_hook_is_set",)),
    Mutant("a cascade's prior state left out of a whole row, persistent kernel", "bsrattn/torch_cuda/executor.py",
           "                             valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)",
           "                             valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, False)",
           ("tests/test_torch_tier.py::"
            "test_a_cascades_last_level_folds_the_levels_before_it[whole rows-persistent]",)),
    Mutant("a cascade's prior state left out of a merged row, persistent kernel", "bsrattn/torch_cuda/executor.py",
           "head, valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)",
           "head, valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, False)",
           ("tests/test_torch_tier.py::"
            "test_a_cascades_last_level_folds_the_levels_before_it[split rows-persistent]",)),
    Mutant("a cascade's prior state left out of a whole row, item kernel", "bsrattn/torch_cuda/item_kernel.py",
           "                         valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)",
           "                         valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, False)",
           ("tests/test_torch_tier.py::"
            "test_a_cascades_last_level_folds_the_levels_before_it[whole rows-items]",)),
    Mutant("a cascade's prior state left out of a merged row, item kernel", "bsrattn/torch_cuda/item_kernel.py",
           "head, valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, PRIOR)",
           "head, valid_m, dv, o, lse, head_programs * GROUP_SIZE, HEAD_DIM_VO, STORE_LSE, False)",
           ("tests/test_torch_tier.py::"
            "test_a_cascades_last_level_folds_the_levels_before_it[split rows-items]",)),
    Mutant("a cascade's last level run without the levels before it", "bsrattn/api.py",
           "return run_level(num_levels - 1, out=out, lse=lse, return_lse=return_lse, prior=prior)",
           "return run_level(num_levels - 1, out=out, lse=lse, return_lse=return_lse)",
           ("tests/test_tiers.py::test_batch_attention_cascade[torch]",)),
    Mutant("the idle CTAs handed the first items", "bsrattn/scheduler.py",
           "np.full(all_ctas - num_ctas, indptr[-1], dtype=indptr.dtype)",
           "np.full(all_ctas - num_ctas, 0, dtype=indptr.dtype)",
           ("tests/test_scheduler.py::"
            "test_busy_ctas_balances_over_the_first_ctas_and_leaves_the_rest_empty[python]",)),
    Mutant("deterministic mode's chunks computed as a normal item's (BLAS over the item's shapes)",
           "bsrattn/reference/executor.py",
           "state_of = attend_range if spec.split_size is None else grid_state", "state_of = attend_range",
           ("tests/test_partition_invariance.py::test_rows_agree_however_the_batch_is_cut[reference]",)),
    Mutant("a deterministic plan cut by L_kv, off the grid", "bsrattn/api.py",
           "fixed_split_size=fixed_split_size if split is None else split,", "fixed_split_size=fixed_split_size,",
           ("tests/test_partition_invariance.py::test_one_shot_attention_is_the_planned_call",)),
    Mutant("a window's KV tiles starting at the window, off the tile grid", "bsrattn/torch_cuda/executor.py",
           "lo = lo + (first_key - lo) // BLOCK_N * BLOCK_N", "lo = first_key",
           ("tests/test_partition_invariance.py::test_a_window_cuts_its_keys_into_the_same_tiles_in_a_decode_step_and_a_"
            "prefill[torch]",)),
    Mutant("a deterministic cascade's HND pool viewed per slot as if NHD", "bsrattn/api.py",
           "        x = x.swapaxes(1, 2)\n", "        pass\n",
           ("tests/test_partition_invariance.py::test_a_cascade_over_an_hnd_pool_is_its_nhd_pool_viewed_per_slot",)),
    Mutant("a whole row in one pass, its chunks of the grid not folded one by one",
           "bsrattn/torch_cuda/deterministic.py", "    return first, SPLIT_SIZE, ceil_div(hi - first, SPLIT_SIZE)",
           "    return first, hi - first, 1",
           ("tests/test_partition_invariance.py::"
            "test_items_of_several_chunks_fold_as_a_plan_cut_at_every_grid_point[causal-torch]",)),
    Mutant("a deterministic plan's first items at L_kv, off the grid", "bsrattn/scheduler.py",
           "lead = ceil_div(_chunk_size(qo, kv, num_ctas, tile_q, 0, min_split_size, kv_align), split) * split",
           "lead = _chunk_size(qo, kv, num_ctas, tile_q, 0, min_split_size, kv_align)",
           ("tests/test_scheduler.py::"
            "test_lead_items_gives_a_row_one_first_item_of_l_kv_on_the_grid_then_single_chunks[python]",)),
    Mutant("a deterministic row cut into items of several chunks each (their folds regrouped)", "bsrattn/scheduler.py",
           ("chunks[r] = 1 + ceil_div(max(0, kv[r] - lead), chunk)",
            "ks[w] = 0 if c == 0 else lead + (c - 1) * chunk", "min(lead + c * chunk, kv[r])"),
           ("chunks[r] = max(1, ceil_div(kv[r], lead))", "ks[w] = c * lead", "min((c + 1) * lead, kv[r])"),
           ("tests/test_partition_invariance.py::"
            "test_items_of_several_chunks_fold_as_a_plan_cut_at_every_grid_point[causal-reference]",)),
    Mutant("a deterministic kernel without merges for a plan that splits nothing", "bsrattn/torch_cuda/runner.py",
           "merges=self.work_plan.num_merges > 0 or spec.split_size is not None or spec.cuda_graph,",
           "merges=self.work_plan.num_merges > 0 or spec.cuda_graph,",
           ("tests/test_partition_invariance.py::"
            "test_a_deterministic_kernel_keeps_its_merges_for_a_plan_that_splits_nothing",)),
    Mutant("a cuda_graph plan that splits nothing launched without merges", "bsrattn/torch_cuda/runner.py",
           "spec.split_size is not None or spec.cuda_graph,", "spec.split_size is not None,", CUDA_GRAPH),
    Mutant("a cuda_graph plan launched on the item kernel", "bsrattn/torch_cuda/runner.py",
           "item_kernel=0 if spec.cuda_graph or value_in_key else", "item_kernel=0 if value_in_key else", CUDA_GRAPH),
    Mutant("a workspace as wide as k, not v (head_dim_vo): torch", "bsrattn/torch_cuda/runner.py",
           "buffers = PlanBuffers(capacity, *shape, head_dim_vo=spec.head_dim_vo)",
           "buffers = PlanBuffers(capacity, *shape)",
           ("tests/test_torch_mla.py::test_v_in_k_read_from_the_key_v_apart_by_its_strides_and_the_workspace_as_wide_"
            "as_v",)),
    Mutant("MLA's ckv and kpe joined in place wherever they share a buffer, in either order", "bsrattn/mla.py",
           "            or b.ctypes.data != a.ctypes.data + a.shape[-1] * a.itemsize):", "            ):",
           ("tests/test_mla.py::test_one_latent_cache_array_is_read_in_place[reference]",)),
    Mutant("v read from the key's tile whatever v is (value_in_key)", "bsrattn/torch_cuda/runner.py",
           "    return (config.value_may_be_in_key(spec) and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()",
           "    return (config.value_may_be_in_key(spec)",
           ("tests/test_torch_mla.py::test_v_in_k_read_from_the_key_v_apart_by_its_strides_and_the_workspace_as_wide_"
            "as_v",)),
    Mutant("a decode graph captured with the garbage collector on", "examples/paged_generation.py",
           "            gc.disable()\n", "",
           ("tests/test_paged_generation.py::test_a_decode_graph_is_captured_with_the_garbage_collector_off",)),
    Mutant("MLA decode chunks aligned to the tile of a value apart from its key", "bsrattn/torch_cuda/config.py",
           "                        value_in_key=value_may_be_in_key(spec)).block_n",
           "                        value_in_key=False).block_n",
           ("tests/test_torch_tier.py::test_an_mla_decode_plan_cuts_its_rows_into_whole_tiles_of_its_launch[32]",)),
    Mutant("MLA's kpe_scale left out of q_pe", "bsrattn/mla.py",
           "    if kpe_scale != ckv_scale:  # the product in float64, then rounded once to q_pe's dtype", "    if False:",
           ("tests/test_mla.py::test_an_fp8_cache_with_its_scales[reference]",)),
    Mutant("a split_size off the tiles accepted", "bsrattn/validation.py", "    if size % SPLIT_ALIGN:", "    if False:",
           ("tests/test_partition_invariance.py::test_bad_deterministic_arguments_are_refused",)),
    Mutant("a row that starts off the chunk grid accepted", "bsrattn/validation.py",
           "off = np.flatnonzero(offsets % split_size)", "off = np.flatnonzero(offsets % 1)",
           ("tests/test_partition_invariance.py::test_a_row_that_rope_positions_start_off_the_grid_is_refused",)),
    Mutant("fused RoPE on a cascade: item rows without the levels' offsets", "bsrattn/items.py",
           "items[w, _ROPE_OFFSET] = rope_offsets[r] if rope_offsets.size else 0", "items[w, _ROPE_OFFSET] = 0",
           ("tests/test_plan_buffers.py::test_packed_sections_equal_a_plain_construction",)),
    Mutant("fused RoPE query's second half not turned: numba", "bsrattn/numba_cuda/microkernel.py",
           "q_tile[i, d + half] = hi * math.cos(angle) + lo * math.sin(angle)", "q_tile[i, d + half] = hi",
           ("tests/test_numba_tier.py::test_every_variant_field[rope]",)),
    Mutant("a call's strides packed out of the declared order", "bsrattn/torch_cuda/kernel_args.py",
           "kv_strides(v, config.kv_view), out.stride(), lse.stride()",
           "kv_strides(v, config.kv_view), lse.stride(), out.stride()",
           ("tests/test_torch_tier.py::test_the_packers_give_the_declared_arguments_in_order",)),
    Mutant("a kept kernel handed the plan's arguments before the call's", "bsrattn/torch_cuda/launch.py",
           "args = (*ptrs, *call[_TENSORS:], *self._plan_ptrs)", "args = (*ptrs, *self._plan_ptrs, *call[_TENSORS:])",
           ("tests/test_torch_tier.py::test_a_launch_of_a_kept_kernel_hands_it_the_declared_arguments",)),
    Mutant("every block size compile-time: a kernel compiled per transformers step", "bsrattn/torch_cuda/gather.py",
           "return block_size if block_size & (block_size - 1) == 0 else 0", "return block_size",
           ("tests/test_torch_tier.py::test_block_sizes_that_are_not_powers_of_two_share_one_kernel",)),
    Mutant("online softmax without the rescale: numba accumulator", "bsrattn/numba_cuda/microkernel.py",
           "a, j = (acc[n] if sigmoid else acc[n] * alpha[i]), 0", "a, j = acc[n], 0", NUMBA),
    Mutant("online softmax without the rescale: torch accumulator", "bsrattn/torch_cuda/microkernel.py",
           "acc = acc * alpha[:, None] + dot(", "acc = acc + dot(", TORCH),
    # masks and positions
    Mutant("causal off by one: k_pos < q_pos", "bsrattn/indexing.py",
           "((k_pos <= q_pos) | (not causal))", "((k_pos < q_pos) | (not causal))", REFERENCE),
    Mutant("sliding window exclusive", "bsrattn/indexing.py",
           "(q_pos - k_pos <= window_left))", "(q_pos - k_pos < window_left))", REFERENCE),
    Mutant("queries top-left aligned", "bsrattn/indexing.py", "return kv_len - qo_len + i", "return i", REFERENCE),
    # indexing and layouts
    Mutant("GQA head mapping h % num_kv_heads: reference microkernel", "bsrattn/reference/microkernel.py",
           "return x.reshape(num_kv_heads, x.shape[0] // num_kv_heads * x.shape[1], x.shape[2])",
           "return x.reshape(x.shape[0] // num_kv_heads, num_kv_heads, x.shape[1], x.shape[2]).swapaxes(0, 1)"
           ".reshape(num_kv_heads, x.shape[0] // num_kv_heads * x.shape[1], x.shape[2])", REFERENCE),
    Mutant("GQA head mapping h % num_kv_heads: numba queries", "bsrattn/numba_cuda/microkernel.py",
           "q[q_row0 + tile_query(i, group_size), tile_head(head_group, group_size, i), d]",
           "q[q_row0 + tile_query(i, group_size), head_group + i % group_size * (q.shape[1] // group_size), d]",
           NUMBA),
    Mutant("GQA head mapping h % num_kv_heads: torch kernel", "bsrattn/torch_cuda/executor.py",
           "head = tile_head(head_group, GROUP_SIZE, m)\n            q_local",
           "head = head_group + m % GROUP_SIZE * head_programs\n            q_local", TORCH),
    Mutant("block slot without the block size", "bsrattn/indexing.py",
           "kv_indices[row_block_start + i // block_size] * block_size + i % block_size",
           "kv_indices[row_block_start + i // block_size] + i % block_size", REFERENCE),
    Mutant("HND storage read as NHD: reference gather", "bsrattn/reference/gather.py",
           "x = x.transpose(0, 2, 1, 3)", "x = x", REFERENCE),
    Mutant("last partial page dropped from kv_len", "bsrattn/layout.py",
           "(nblocks.astype(np.int64) - 1) * self.block_size + self.kv_last_len",
           "(nblocks.astype(np.int64) - (self.kv_last_len < self.block_size)) * self.block_size", REFERENCE),
    Mutant("kv_len computed in int32", "bsrattn/layout.py",
           "(nblocks.astype(np.int64) - 1)", "(nblocks.astype(np.int32) - 1)",
           ("tests/test_bad_inputs.py::test_a_row_longer_than_int32_is_refused_not_wrapped",)),
    Mutant("float ids truncated, not refused", "bsrattn/coerce.py",
           'if arr.dtype.kind not in "iu" and arr.size:', 'if arr.dtype.kind not in "iuf" and arr.size:',
           ("tests/test_bad_inputs.py::test_floats_are_refused_where_integers_go",)),
    # merge
    Mutant("merge without the max shift: reference", "bsrattn/reference/merge.py",
           "m_safe = np.where(m == -np.inf, dt.type(0), m)", "m_safe = np.zeros_like(m)", large_lse("reference")),
    Mutant("merge without the max shift: numba", "bsrattn/numba_cuda/merge.py",
           "w_a, w_b = math.exp(s_a - m), math.exp(s_b - m)", "m = zero\n        w_a, w_b = math.exp(s_a), math.exp(s_b)",
           large_lse("numba")),
    Mutant("merge without the max shift: torch", "bsrattn/torch_cuda/merge.py",
           'm_safe = tl.where(m == float("-inf"), 0.0, m)\n    w_a', 'm_safe = tl.zeros_like(m)\n    w_a',
           large_lse("torch")),
    Mutant("cascade levels not merged: the last level's state alone", "bsrattn/api.py",
           "o, s = backend.merge_state(o, s, o_b, s_b)", "o, s = o_b, s_b", REFERENCE),
    Mutant("cascade prefix level causal", "bsrattn/cascade.py",
           "return variant if level == len(self.levels) - 1 else replace(variant, causal=False)", "return variant",
           REFERENCE),
    # numbers that are not numbers, and launches that share buffers
    Mutant("a merge's counter not set back to zero by the program that merges", "bsrattn/torch_cuda/merge.py",
           "tl.store(counter, 0)", "pass", special("test_no_launch_depends_on_what_an_earlier_one_left[torch]")),
    Mutant("item flags not cleared by the second launch", "bsrattn/torch_cuda/executor.py",
           "tl.store(item_flags + w * head_programs + head_group, 0)", "pass",
           special("test_no_launch_depends_on_what_an_earlier_one_left[torch]")),
    Mutant("flags left set when a call stops between its launches", "bsrattn/torch_cuda/launch.py",
           "            self.sync.zero_()\n", "            pass\n",
           special("test_a_call_stopped_between_its_launches_leaves_nothing_behind")),
    Mutant("NaN swallowed: numba finish decides empty from l > 0", "bsrattn/numba_cuda/microkernel.py",
           ("elif l_run[i] == zero:", "if l_run[i] != zero else neg_inf"),
           ("elif not l_run[i] > zero:", "if l_run[i] > zero else neg_inf"),
           special("test_poisoned_inputs_follow_the_rules[numba-NaN k of a visible key-split plan]")),
    Mutant("NaN swallowed: torch finish decides empty from l > 0", "bsrattn/torch_cuda/microkernel.py",
           "has_keys = l_i != 0.0", "has_keys = l_i > 0.0",
           special("test_poisoned_inputs_follow_the_rules[torch-NaN k of a visible key-one-shot]")),
    Mutant("NaN swallowed: reference merge decides empty from total > 0", "bsrattn/reference/merge.py",
           "lse = m_safe + np.log(total)", "lse = np.where(total > 0, m_safe + np.log(total), -np.inf)",
           special("test_merge_special_states[reference]")),
    Mutant("a hidden key's v used: reference", "bsrattn/reference/microkernel.py",
           "o = weighted_sum(w, np.where(finite, v, 0))", "o = weighted_sum(w, v)",
           special("test_hidden_keys_leave_the_bits_unchanged[reference-NaN v of a causally hidden key]")),
    Mutant("a hidden key's v used: numba", "bsrattn/numba_cuda/microkernel.py",
           "if not hidden_keys or seen[i, j]:", "if True:",
           special("test_hidden_keys_leave_the_bits_unchanged[numba-NaN v of a causally hidden key]")),
    Mutant("a hidden key's v used: torch (no second launch)", "bsrattn/torch_cuda/executor.py",
           "if config.hidden_keys else []", "if False else []",
           special("test_hidden_keys_leave_the_bits_unchanged[torch-NaN v of a causally hidden key]")),
    Mutant("a hidden key's v used: torch item kernel (its non-finite items not flagged)",
           "bsrattn/torch_cuda/item_kernel.py",
           "redo |= tl.sum(tl.sum(o * 0.0, 1), 0) != 0.0", "redo |= False",
           ("tests/test_torch_tier.py::test_a_hidden_keys_nan_does_not_reach_the_item_kernels_rows[gathered]",)),
    Mutant("rows that are not affine read through tensor descriptors", "bsrattn/torch_cuda/item_kernel.py",
           "if first_slot >= 0:", "if first_slot >= -1:",
           ("tests/test_torch_tier.py::test_prefill_plans_that_split_no_row_run_the_item_kernel"
            "[paged, the last rows on scattered pages-causal]",)),
    Mutant("an empty state's o read: numba merge", "bsrattn/numba_cuda/merge.py",
           "weighted = t_b if s_a == neg_inf else ops.fma(w_a, o_a, t_b)", "weighted = ops.fma(w_a, o_a, t_b)",
           special("test_merge_special_states[numba]")),
    # run's checks, skipped for the arguments of the last call that passed
    Mutant("run's checks skipped once any call passed", "bsrattn/passed.py",
           "if key is None or key != self.key:", "if self.value is None:", AFTER_A_GOOD_CALL),
    Mutant("run's key without the dtypes", "bsrattn/passed.py",
           "type(x), x.shape, x.dtype, getattr(", "type(x), x.shape, getattr(", AFTER_A_GOOD_CALL),
    Mutant("run's key without a buffer's writability", "bsrattn/passed.py",
           'getattr(x, "flags", _WRITABLE).writeable\n', "True\n", AFTER_A_GOOD_CALL),
    Mutant("run's key without the scales' types", "bsrattn/passed.py",
           "type(k_scale), k_scale, type(v_scale), v_scale)", "k_scale, v_scale)", AFTER_A_GOOD_CALL),
    # plans
    Mutant("plan covers a slot twice: chunk ends one past the next start", "bsrattn/scheduler.py",
           "min(lead + c * chunk, kv[r])", "min(lead + c * chunk + 1, kv[r])", COVERAGE),
    # tolerances
    Mutant("float16 budget factor loosened 100x", "bsrattn/testing.py",
           '("attention", "float16"): Budget(2.0, 1e-3)', '("attention", "float16"): Budget(200.0, 1e-3)',
           FLOAT16_BUDGET),
    Mutant("float16 budget atol loosened 100x", "bsrattn/testing.py",
           '("attention", "float16"): Budget(2.0, 1e-3)', '("attention", "float16"): Budget(2.0, 1e-1)',
           FLOAT16_BUDGET),
    Mutant("float16 table tolerance loosened to 1", "bsrattn/testing.py",
           '("attention", "float16"): (4e-3, 4e-3)', '("attention", "float16"): (1.0, 1.0)',
           ("tests/test_wrong_implementations.py::test_the_float16_table_rejects_one_percent_noise",)),
    # checks that name the argument
    Mutant("infinite KV scales accepted", "bsrattn/validation.py",
           "if not (value > 0 and math.isfinite(value)):", "if not value > 0:",
           ("tests/test_bad_inputs.py::test_non_finite_kv_scales_are_refused_at_every_entry_point"
            "[reference-k_scale-inf]",)),
    Mutant("a causal Cascade row past its keys accepted", "bsrattn/cascade.py",
           "over = np.flatnonzero(last.qo_lens > last.kv_lens + 1)", "over = np.flatnonzero(last.qo_lens < 0)",
           ("tests/test_bad_inputs.py::test_a_causal_cascade_row_that_no_flat_layout_expresses_is_refused_in_every_mode"
            "[reference]",)),
    Mutant("a causal Cascade row one query past its keys refused", "bsrattn/cascade.py",
           "over = np.flatnonzero(last.qo_lens > last.kv_lens + 1)",
           "over = np.flatnonzero(last.qo_lens > last.kv_lens)",
           ("tests/test_bad_inputs.py::test_a_causal_cascade_row_with_one_query_past_its_keys_is_one_attention_in_every"
            "_mode[reference]",)),
    Mutant("no storage-order hint", "bsrattn/validation.py",
           "    _check_kv_order(shape_of(q)[1], shape_of(k), view, layout.block_size)\n", "",
           ("tests/test_bad_inputs.py::test_kv_in_the_other_storage_order_names_the_kv_layout_that_fits[reference]",)),
    Mutant("lengths of different counts blame one", "bsrattn/coerce.py",
           '{of} has {size}: they need one entry per request each',
           'expected {size}',
           ("tests/test_bad_inputs.py::test_errors_name_the_argument_that_is_wrong",)),
    Mutant("an empty qo_indptr reported as kv_last_len", "bsrattn/layout.py",
           "if self.qo_indptr.size == 0:", "if False:",
           ("tests/test_bad_inputs.py::test_errors_name_the_argument_that_is_wrong",)),
    Mutant("per_head_views takes any num_kv_heads", "bsrattn/layouts.py",
           'num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)\n    if len(q.shape) != 3:',
           'if len(q.shape) != 3:',
           ("tests/test_bad_inputs.py::test_errors_name_the_argument_that_is_wrong",)),
    Mutant("the numba tier loads where its kernels cannot run", "bsrattn/numba_cuda/launch.py",
           "    if cuda.is_available():\n        return \"gpu\"", "    if True:\n        return \"gpu\"",
           ("tests/test_bad_inputs.py::test_the_numba_tier_without_a_gpu_or_the_simulator_names_the_variable[load]",)),
    Mutant("a late TRITON_INTERPRET not told apart", "bsrattn/torch_cuda/arrays.py",
           'elif device.type in ("cpu", "cuda") and interpreter_changed():', 'elif False:',
           ("tests/test_bad_inputs.py::test_the_interpreter_switched_on_after_the_torch_tier_loaded_says_to_restart",)),
    Mutant("an additive NaN mask read as masked", "bsrattn/integrations/transformers.py",
           "bias = ~(seen | (mask == -torch.inf) | (mask == torch.finfo(mask.dtype).min))",
           "bias = ~seen & (mask > torch.finfo(mask.dtype).min / 2)",
           ("tests/test_transformers.py::test_a_mask_bsrattn_cannot_read_is_refused",)),
    Mutant("a two-dimensional page table read one page past each row's", "bsrattn/layouts.py",
           "return tables[np.arange(tables.shape[1]) < n_pages[:, None]]",
           "return tables[np.arange(tables.shape[1]) <= n_pages[:, None]]",
           ("tests/test_layouts.py::test_a_two_dimensional_page_table_gives_the_layout_of_its_rows",)),
    Mutant("a step's position masks reaching past its requests' keys", "bsrattn/integrations/transformers.py",
           "positions = in_row & indexing.key_visible", "positions = indexing.key_visible",
           ("tests/test_transformers.py::test_a_mask_of_whole_key_prefixes_needs_no_custom_mask_without_causality",)),
    Mutant("a padded step's mask kept within causality it does not keep", "bsrattn/integrations/transformers.py",
           "within = not (seen & ~positions).any()", "within = True",
           ("tests/test_transformers.py::test_a_mask_past_the_position_masks_drops_them",)),
    Mutant("a compiled cache write traced as a store into the pool", "bsrattn/integrations/paged.py",
           "store = torch.ops.bsrattn.paged_kv_write if torch.compiler.is_compiling() else _store", "store = _store",
           ("tests/test_paged_generation.py::test_written_keys_are_where_the_layout_reads_them",)),
    Mutant("a block of a shared group reading another KV head's tiles", "bsrattn/numba_cuda/executor.py",
           "kv_head = head_group // head_groups", "kv_head = head_group % num_kv_heads",
           ("tests/test_numba_tier.py::test_a_group_too_large_for_one_block_is_shared_among_blocks_of_its_kv_head",)),
    Mutant("a head group reading another KV head's tiles: torch kernel", "bsrattn/torch_cuda/executor.py",
           "k_head = k_ptr + head_group // HEAD_GROUPS * k_strides[2]",
           "k_head = k_ptr + head_group % HEAD_GROUPS * k_strides[2]",
           ("tests/test_torch_tier.py::test_a_gqa_group_too_tall_for_a_decode_tile_runs_in_head_groups",)),
    Mutant("a head group reading another KV head's tiles: item kernel", "bsrattn/torch_cuda/item_kernel.py",
           "k_head = k_ptr + head_group // HEAD_GROUPS * k_strides[2]",
           "k_head = k_ptr + head_group % HEAD_GROUPS * k_strides[2]",
           ("tests/test_torch_tier.py::test_a_gqa_group_too_tall_for_a_decode_tile_runs_in_head_groups",)),
    Mutant("a paged cache's requests read as filling their last pages", "bsrattn/integrations/paged.py",
           "lengths = np.fromiter((self._lengths[r] for r in requests), np.int64, len(requests))",
           "lengths = np.fromiter((len(self._pages[r]) * self.page_size for r in requests), np.int64, len(requests))",
           ("tests/test_paged_generation.py::test_the_layout_is_layouts_paged_of_the_books",)),
    Mutant("kernel='core' with deterministic mode accepted", "bsrattn/api.py",
           "if split is not None and backend.kernel == \"core\":", "if False:",
           ("tests/test_cores.py::test_the_core_refuses_deterministic_mode_by_name",)),
    Mutant("an unknown kernel accepted as the shipped one", "bsrattn/backends.py",
           'if not isinstance(kernel, str) or kernel not in KERNELS:', 'if False:',
           ("tests/test_backends.py::test_a_kernel_the_tier_does_not_run_is_refused_by_name",)),
)


@dataclass
class Outcome:
    """What running one mutant's tests showed."""

    mutant: Mutant
    status: str  # "killed", "survived" or "error"
    detail: str
    seconds: float


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


PRELOADED = ("numpy", "torch", "triton", "numba", "numba.cuda", "pytest", "hypothesis")
REPLY = "mutant-server: "  # marks the server's answers on its stdout
NOT_THE_COPY = 99  # a child's exit code when ``import bsrattn`` would not find the copy it was sent to test
CHILD_FAILED = 98  # a child's exit code when it failed before pytest could run (the traceback is in its output)


@dataclass
class Run:
    """One pytest run in a copy: its exit code (``None``: killed after ``TIMEOUT_S``) and what it printed."""

    returncode: int | None
    output: str


class _ImportsTheCopy:
    """A pytest plugin: the session stops with :data:`NOT_THE_COPY` before its first test unless ``bsrattn``
    resolves to the copy at ``workdir`` (which pytest's ``pythonpath`` option, from the copy's own
    ``pyproject.toml``, puts first on the path)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def pytest_sessionstart(self, session):
        import pytest

        origin = Path(importlib.util.find_spec("bsrattn").origin).resolve()
        if not origin.is_relative_to(self.workdir.resolve()):
            pytest.exit(f"the copy in {self.workdir} does not shadow the installed package: bsrattn is {origin}",
                        returncode=NOT_THE_COPY)


def _pytest_child(workdir: Path, tests, log: Path):
    """In a child forked from the server: run ``tests`` in the copy at ``workdir``, output to ``log``; never
    returns."""
    code = CHILD_FAILED
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(workdir)
        # what the tests start in subprocesses imports the copy too
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir), os.environ.get("PYTHONPATH")]))
        os.environ["HYPOTHESIS_PROFILE"] = "mutants"  # conftest.py's: no shrinking of a failing example
        import pytest
        code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests], plugins=[_ImportsTheCopy(workdir)]))
    except BaseException:  # noqa: BLE001 - whatever it was, the output says it and the run counts as an error
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    """The exit code of child ``pid``, or ``None`` after killing it at ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def serve():
    """The server's loop: preload, then one forked pytest run per request line, one at a time."""
    here = Path(__file__).resolve().parent  # the copies' tests, not these, are the ones to import
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    os.nice(10)  # beside the rest of the suite (pytest -n), its tests come first: some of them time calls
    setup = importlib.util.spec_from_file_location("_suite_setup", ROOT / "conftest.py")
    setup.loader.exec_module(importlib.util.module_from_spec(setup))  # the simulators' environment, as in pytest
    for name in PRELOADED:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        workdir, log = Path(request["workdir"]), Path(request["log"])
        pid = os.fork()
        if pid == 0:
            _pytest_child(workdir, request["tests"], log)
        print(REPLY + json.dumps(_wait(pid, TIMEOUT_S)), flush=True)


class Server:
    """A client of one :func:`serve` process: one job slot, sent one run at a time (:class:`Servers`)."""

    def __init__(self):
        self._process = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def pytest(self, workdir: Path, tests) -> Run:
        log = workdir.with_name(workdir.name + ".log")
        self._process.stdin.write(json.dumps(dict(workdir=str(workdir), tests=list(tests), log=str(log))) + "\n")
        self._process.stdin.flush()
        for line in self._process.stdout:
            if line.startswith(REPLY):
                break
        else:
            raise RuntimeError(f"the mutant server exited (code {self._process.wait()})")
        code = json.loads(line[len(REPLY):])
        output = log.read_text(errors="replace") if log.exists() else ""
        log.unlink(missing_ok=True)
        if code == NOT_THE_COPY:
            raise RuntimeError(output)
        return Run(code, output)

    def close(self):
        self._process.stdin.close()
        self._process.wait()


def copy_repository(target: Path) -> Path:
    """``bsrattn/``, ``tests/``, ``conftest.py`` and ``pyproject.toml`` of the working tree, copied to ``target``."""
    target.mkdir(parents=True)
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=shutil.ignore_patterns(".hypothesis"))
        else:
            shutil.copy2(source, target / name)
    return target


def mutate(mutant: Mutant, workdir: Path):
    """Apply ``mutant`` to the copy in ``workdir``; raise ValueError unless each snippet occurs exactly once."""
    path = workdir / mutant.file
    source = path.read_text()
    for snippet, replacement in mutant.edits:
        count = source.count(snippet)
        if count != 1:
            raise ValueError(f"{mutant.file}: the snippet occurs {count} times (must be exactly once): {snippet!r}")
        source = source.replace(snippet, replacement)
    path.write_text(source)
    py_compile.compile(str(path), doraise=True)


class Servers:
    """``jobs`` servers; :meth:`pytest` runs on whichever is free."""

    def __init__(self, jobs: int):
        self._free = queue.Queue()
        for _ in range(jobs):
            self._free.put(Server())

    def pytest(self, workdir: Path, tests) -> Run:
        server = self._free.get()
        try:
            return server.pytest(workdir, tests)
        finally:
            self._free.put(server)

    def close(self):
        while not self._free.empty():
            self._free.get().close()


def run_mutant(mutant: Mutant, base: Path, scratch: Path, servers: Servers) -> Outcome:
    start = time.perf_counter()
    workdir = scratch / mutant.name.replace(" ", "_").replace(":", "").replace("/", "_")
    shutil.copytree(base, workdir)
    try:
        mutate(mutant, workdir)
    except (ValueError, py_compile.PyCompileError) as err:
        return Outcome(mutant, "error", str(err), time.perf_counter() - start)
    try:
        result = servers.pytest(workdir, mutant.tests)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.perf_counter() - start
    if result.returncode is None:
        return Outcome(mutant, "killed", f"its tests ran past {TIMEOUT_S} s", seconds)
    # 1: a test failed; 2: collecting the tests failed, which the control run shows only the fault can cause.
    if result.returncode in (1, 2):
        failed = [line for line in result.output.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return Outcome(mutant, "killed", failed[0] if failed else _tail(result.output, 3), seconds)
    if result.returncode == 0:
        return Outcome(mutant, "survived", f"passed: {' '.join(mutant.tests)}", seconds)
    return Outcome(mutant, "error", f"pytest exit code {result.returncode}:\n{_tail(result.output)}", seconds)


WARM_UP = ("tests/test_plan_buffers.py::test_decode_batch_without_merges",)
"""A test whose run compiles every host loop (``bsrattn.compiled``) into the base copy's Numba disk cache: what
:func:`run` runs first instead of the control, when told the named tests passed elsewhere."""


def run(names=(), jobs: int = 2, out=sys.stdout, control: bool = True) -> list:
    """Run the control and the mutants (all, or those named), ``jobs`` at a time; return their outcomes.

    ``control=False`` is for a caller that runs every named test on the unmutated tree itself (the test suite,
    whose run fails where they do): then only :data:`WARM_UP` runs first."""
    chosen = [m for m in MUTANTS if not names or m.name in names]
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        raise ValueError(f"no mutants named {sorted(unknown)}")
    servers = Servers(jobs)
    try:
        with tempfile.TemporaryDirectory(prefix="bsrattn-mutants-") as scratch:
            scratch = Path(scratch)
            base = copy_repository(scratch / "base")
            # The control first, its tests shared out over the job slots: it also leaves Numba's disk cache of the
            # host loops (bsrattn.compiled) in the base copy, which each mutant's copy reuses for every file it
            # does not mutate (WARM_UP does only that).
            named = sorted({t for m in chosen for t in m.tests}) if control else list(WARM_UP)
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                parts = [part for part in (named[i::jobs] for i in range(jobs)) if part]
                for result in pool.map(lambda part: servers.pytest(base, part), parts):
                    if result.returncode != 0:
                        raise RuntimeError(f"the named tests fail without any mutation (exit code "
                                           f"{result.returncode}):\n{_tail(result.output)}")
            outcomes = []
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                for outcome in pool.map(lambda m: run_mutant(m, base, scratch, servers), chosen):
                    print(f"{outcome.status:>8}  {outcome.mutant.name}  ({outcome.seconds:.0f} s)  "
                          f"{outcome.detail}", file=out, flush=True)
                    outcomes.append(outcome)
    finally:
        servers.close()
    return outcomes


def report(outcomes, seconds: float, out=sys.stdout) -> bool:
    """Print the kill rate, the survivors and the broken entries; whether every mutant was killed."""
    killed = sum(o.status == "killed" for o in outcomes)
    print(f"\nkilled {killed} of {len(outcomes)} mutants ({100 * killed / max(1, len(outcomes)):.0f}%) "
          f"in {seconds:.0f} s", file=out)
    for status in ("survived", "error"):
        for o in outcomes:
            if o.status == status:
                print(f"{status.upper()}: {o.mutant.name} ({o.mutant.file})\n    {o.detail}", file=out)
    return killed == len(outcomes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these mutants (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default: 2)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    start = time.perf_counter()
    outcomes = run(args.names, args.jobs)
    return 0 if report(outcomes, time.perf_counter() - start) else 1


if __name__ == "__main__":
    sys.exit(main())
