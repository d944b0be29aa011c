# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 9. Backends: one flag, three tiers, the same answers
#
# bsrattn runs the same API on three tiers:
#
# | tier | package | what it is |
# |---|---|---|
# | `reference` | `bsrattn/reference` | NumPy, float64: the spec |
# | `numba` | `bsrattn/numba_cuda` | Numba CUDA kernels — the paper's kernel in Python syntax; on a CPU, Numba's CUDA simulator |
# | `torch` | `bsrattn/torch_cuda` | Triton kernels on PyTorch tensors, custom ops, CUDA graphs; on a CPU, Triton's interpreter |
#
# One flag picks the tier, and the tiers are checked against each other. This notebook shows the flag, the
# three tiers agreeing across variants, and then opens the numba tier's kernel and runs it one stage at a time
# in the simulator — gather, microkernel, merge — comparing each stage with the reference function it must match.

# %%
import os
import shutil

# Without a GPU, the numba tier runs in Numba's CUDA simulator and the torch tier in Triton's interpreter.
# Both read these variables when they are first imported, so they are set before anything imports them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import time

import matplotlib.pyplot as plt
import numpy as np

import bsrattn as ba
import bsrattn.testing
import tiers
from bsrattn import draw
from bsrattn.validation import spec_from_inputs

# %% [markdown]
# ## The idea: one flag
#
# Which tier a call uses, first match wins: its `backend=` argument; the innermost `with ba.use_backend(name):`;
# `ba.set_backend(name)`; the environment variable `BSRATTN_BACKEND`; else `"reference"`. `"auto"` means the
# torch tier when a CUDA GPU and Triton are present. Importing `bsrattn` imports no tier: each is imported the
# first time a call asks for it.

# %%
print("default:                  ", ba.backends.current_backend_name())
os.environ["BSRATTN_BACKEND"] = "numba"
print("BSRATTN_BACKEND=numba:    ", ba.backends.current_backend_name())
ba.set_backend("torch")
print("set_backend('torch'):     ", ba.backends.current_backend_name())
with ba.use_backend("reference"):
    print("inside use_backend(...):  ", ba.backends.current_backend_name())
ba.set_backend(None)
del os.environ["BSRATTN_BACKEND"]
print("'auto' resolves here to:  ", ba.get_backend("auto").name)
try:
    ba.get_backend("cuda")
except ValueError as err:
    print("an unknown name:          ", err)

# %% [markdown]
# ## The tiers agree, across variants
#
# A small paged batch with grouped-query attention (4 query heads over 2 KV heads), under five variants. Every
# tier gets float32 inputs and is compared with the float64 reference, within the tolerance table.

# %%
rng = np.random.default_rng(0)
layout = ba.layouts.paged(qo_lens=[2, 1], page_tables=[[3, 0, 5, 1, 4], [2, 6]], kv_lens=[19, 7], page_size=4,
                          num_pages=7)
num_qo_heads, num_kv_heads, head_dim = 4, 2, 8
q = rng.standard_normal((layout.nnz_qo, num_qo_heads, head_dim))                       # [nnz_qo, Hq, D]
k = rng.standard_normal((layout.num_blocks, layout.block_size, num_kv_heads, head_dim))  # [pages, Bc, Hkv, D]
v = rng.standard_normal(k.shape)
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
variants = {
    "no mask": ba.Variant(),
    "causal": ba.Variant(causal=True),
    "window 4 + soft cap": ba.Variant(causal=True, window_left=4, logits_soft_cap=3.0),
    "ALiBi": ba.Variant(causal=True, alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "FlashSigmoid": ba.Variant(sigmoid_bias=-1.0),
}
errors = {}
for name in tiers.available():
    for label, variant in variants.items():
        expected = ba.attention(q, k, v, layout, variant=variant)
        result = tiers.check(f"{name} {label}", ba.attention(q32, k32, v32, layout, variant=variant, backend=name),
                             expected)
        errors[name, label] = result.max_abs

# %% [markdown]
# ## A picture
#
# The worst error of each tier against the float64 reference, with the float32 tolerance. The reference's own
# float32 error is the rounding of its inputs and output; the kernels add the rounding of their float32
# accumulation in a different order.

# %%
atol, rtol = bsrattn.testing.tolerance("attention", "float32")
names = tiers.available()
fig, ax = plt.subplots(figsize=(9, 3))
width = 0.8 / len(names)
for i, name in enumerate(names):
    ax.bar(np.arange(len(variants)) + i * width, [errors[name, label] for label in variants], width, label=name)
ax.axhline(atol, color="C3", linestyle="--", label="float32 atol")
ax.set_yscale("log")
ax.set_xticks(np.arange(len(variants)) + width * (len(names) - 1) / 2, list(variants))
ax.set_ylabel("max |out - float64 reference|")
ax.set_title("float32 on every tier, against the float64 spec")
ax.legend(fontsize=8, ncol=4)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference, and the numba kernel stepped through
#
# The numba tier's files mirror the reference's, so each stage can be checked against the function it must
# match:
#
# | stage | reference | numba tier |
# |---|---|---|
# | the load module | `reference/gather.py`: `row_slots`, `gather` | `numba_cuda/gather.py`: `resolve_rows`, `copy_rows` |
# | the microkernel | `reference/microkernel.py`: `attend_range` | `numba_cuda/microkernel.py`: online softmax per tile |
# | the plan, CTA by CTA | `reference/executor.py`: `execute` | `numba_cuda/executor.py`: the persistent kernel |
# | ⊕ in plan order | `reference/merge.py`: `merge_state` | `numba_cuda/merge.py`: the merge kernel |
#
# In the simulator a kernel is ordinary Python run by one thread per CUDA thread, so it can be launched piece by
# piece and its shared and device memory read back. First, the spec of the call — the shapes a plan fixes — and
# the tier's plan for it: a grid of `num_ctas` CTAs per KV head.

# %%
numba_tier = ba.get_backend("numba")
variant = variants["causal"]
spec = spec_from_inputs(q32, k32, v32, layout, variant)
options = numba_tier.plan_options(spec)
work_plan = ba.scheduler.plan(layout.qo_lens, layout.kv_lens, **options)
runner = numba_tier.make_runner(spec, work_plan)
print("plan options:", options)
for w in range(work_plan.num_items):
    cta = int(np.searchsorted(work_plan.cta_indptr, w, side="right")) - 1
    print(f"item {w}: CTA {cta}, request {work_plan.item_row[w]}, queries {work_plan.item_qo_start[w]}:"
          f"{work_plan.item_qo_end[w]}, KV {work_plan.item_kv_start[w]}:{work_plan.item_kv_end[w]}, "
          f"partial row {work_plan.item_partial[w]}")
fig, ax = plt.subplots(figsize=(8, 1.8))
draw.plan(work_plan, ax=ax, title=f"numba tier's plan, grid ({work_plan.num_ctas} CTAs x {num_kv_heads} KV heads):")
fig.tight_layout()
plt.show()

# %% [markdown]
# **Stage 1, the gather.** One block gathers the first KV tile of request 0 for KV head 1: `resolve_rows` turns
# logical slots into storage rows through the page table (the sparse path), `load_rows` brings each thread's
# share of those rows into its registers (the executor issues these loads a tile ahead, so they travel while the
# previous tile is computed), and `store_rows` writes them into shared memory. A tiny kernel written here runs
# just those three device functions and copies the shared tile out.

# %%
from numba import cuda

from bsrattn.numba_cuda.gather import make_gather, rows_view
from bsrattn.reference.gather import gather, kv_as_slots

cfg = runner.config("float32", "float32", "NHD", word_size=4)
resolve_rows, load_rows, store_rows = make_gather(cfg)
TILE, STRIDE, ROW_WORDS, WORD, STAGED = cfg.tile_kv, cfg.row_stride, cfg.row_words, cfg.word, cfg.words_per_thread


@cuda.jit
def gather_one_tile(k_words, v_words, kv_indices, row_block_start, block_size, kv_head, kv0, kv_end, rows_out,
                    k_out):
    """rows_out [TILE]: storage row of each slot of the tile; k_out [TILE, ROW_WORDS]: the K tile as gathered."""
    t = cuda.threadIdx.x
    kv_rows = cuda.shared.array(TILE, np.int64)
    k_tile = cuda.shared.array((TILE, STRIDE), WORD)
    v_tile = cuda.shared.array((TILE, STRIDE), WORD)
    k_staged = cuda.local.array(STAGED, WORD)
    v_staged = cuda.local.array(STAGED, WORD)
    # -1: the row has no first slot of a contiguous run, so its slots go through the page table (sparse path).
    resolve_rows(t, kv_rows, kv_indices, row_block_start, -1, block_size, num_kv_heads, kv_head, kv0, kv_end)
    cuda.syncthreads()
    load_rows(t, k_staged, v_staged, k_words, v_words, kv_rows)
    store_rows(t, k_staged, v_staged, k_tile, v_tile)
    cuda.syncthreads()
    for e in range(t, TILE * ROW_WORDS, cuda.blockDim.x):
        k_out[e // ROW_WORDS, e % ROW_WORDS] = k_tile[e // ROW_WORDS, e % ROW_WORDS]
    for j in range(t, TILE, cuda.blockDim.x):
        rows_out[j] = kv_rows[j]


kv_head, kv_end = 1, int(layout.kv_lens[0])
k_dev, v_dev = cuda.to_device(k32), cuda.to_device(v32)
rows_out = cuda.device_array(TILE, np.int64)
k_out = cuda.device_array((TILE, ROW_WORDS), WORD)
gather_one_tile[1, cfg.num_threads](rows_view(k_dev, head_dim, WORD), rows_view(v_dev, head_dim, WORD),
                                    cuda.to_device(layout.kv_indices), int(layout.kv_indptr[0]), layout.block_size,
                                    kv_head, 0, kv_end, rows_out, k_out)
k_tile = k_out.copy_to_host().view(np.float32)                            # [TILE, head_dim]
expected_tile = gather(kv_as_slots(k32, spec), layout, 0, 0, TILE)[:, kv_head]
print("storage rows:", rows_out.copy_to_host(), " (pool slot * Hkv + head)")
print("pool slots:  ", layout.kv_slots(0)[:TILE])
same = np.array_equal(k_tile, expected_tile.astype(np.float32))
print("gathered K tile == reference gather:", same)
assert same, "the numba gather and the reference disagree"

# %% [markdown]
# **Stages 2 and 3, the microkernel and the executor.** `runner.run` launches the persistent kernel on the grid
# above: each block walks its CTA's items, gathers tile after tile and folds them into a running softmax state.
# Items of a split request write a partial `(o, lse)` into their workspace rows; the merge kernel then folds
# them in the plan's order. Read the workspace back and compare every partial state with the reference
# microkernel over the same queries and KV range.

# %%
from bsrattn.numba_cuda.config import shared_bytes
from bsrattn.reference.microkernel import attend_range

out, lse = runner.run(q32, k32, v32, return_lse=True)
part_o, part_lse = (x.copy_to_host() for x in runner.workspace(cfg.compute_name))
k_slots, v_slots = kv_as_slots(k32, spec), kv_as_slots(v32, spec)
for w in range(work_plan.num_items):
    p = int(work_plan.item_partial[w])
    if p < 0:
        continue
    qs, qe = int(work_plan.item_qo_start[w]), int(work_plan.item_qo_end[w])
    o_ref, lse_ref = attend_range(spec, q32, k_slots, v_slots, int(work_plan.item_row[w]), qs, qe,
                                  int(work_plan.item_kv_start[w]), int(work_plan.item_kv_end[w]))
    print(f"item {w} (KV {work_plan.item_kv_start[w]}:{work_plan.item_kv_end[w]}): partial state vs attend_range "
          f"max |err| o {np.abs(part_o[p:p + qe - qs] - o_ref).max():.1e}, "
          f"lse {np.abs(part_lse[p:p + qe - qs] - lse_ref).max():.1e}")

# %% [markdown]
# **Stage 4, the merge.** The final output equals the reference fold of those partial states in the plan's
# order — and the plain attention.

# %%
for m in range(work_plan.num_merges):
    qs, qe = int(work_plan.merge_qo_start[m]), int(work_plan.merge_qo_end[m])
    rows = work_plan.merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]
    o_parts = np.stack([part_o[p:p + qe - qs] for p in rows], axis=1)      # [n, S, Hq, D]
    lse_parts = np.stack([part_lse[p:p + qe - qs] for p in rows], axis=1)  # [n, S, Hq]
    o_ref, _ = ba.merge_states(o_parts, lse_parts)
    print(f"merge {m}: output rows {qs}:{qe} vs reference fold of partial rows {rows.tolist()}: "
          f"max |err| {np.abs(out[qs:qe] - o_ref).max():.1e}")
_ = tiers.check("numba run", out, ba.attention(q, k, v, layout, variant=variant))

# %% [markdown]
# ## The cores: the paper's kernel at teaching size
#
# The shipped kernels carry a serving engine's machinery — a persistent grid, loads a tile ahead, the affine load
# path, deterministic mode's chunk grid, a Cascade's earlier levels folded in. Under all of it is one idea, and
# each GPU tier states it once more, at teaching size, in a file of its own: `numba_cuda/core.py` and
# `torch_cuda/core.py`, about 200 lines each. `kernel="core"` selects it on any call:
#
# | idea | reference | numba core | torch core |
# |---|---|---|---|
# | the gather through the BSR indices | `gather.row_slots`, `gather` | `gather`, into shared memory | `gather_offsets`, one `tl.load` per tile |
# | scores and masks, one function | `microkernel.scores`, `transform` | `score` | `score` |
# | the online softmax | `microkernel.attend` (all keys at once) | `accumulate`, key by key | the tile loop on `tl.dot` |
# | LSE out, empty and poisoned rows | `attend`'s tail | `finish` | `finish` |
# | split rows, ⊕ in plan order | `executor.execute` | the tier's plan merge kernel | `merge_kernel` |
#
# Both run the same `WorkPlan` as the shipped kernels and the reference, and are held to the same cross-tier tests.

# %%
for name in (n for n in tiers.available() if n != "reference"):
    for label, variant in variants.items():
        expected = ba.attention(q, k, v, layout, variant=variant)
        _ = tiers.check(f"{name} core {label}", ba.attention(q32, k32, v32, layout, variant=variant, backend=name,
                                                              kernel="core"), expected)

# %% [markdown]
# On the H200 the core is the first rung of the benchmark ladder (`bsrattn-torch-core` in W1-W3, beside the
# shipped `bsrattn-torch`): what the serving machinery buys over the idea itself.

# %%
import json
from pathlib import Path

results = Path("..") / "benchmarks" / "results"
rows = []
for workload in ("w1_quest_decode", "w2_paged_decode", "w3_prefill"):
    path = results / f"{workload}.json"
    if not path.exists():
        continue
    records = json.loads(path.read_text())["records"]
    timed = {(json.dumps(r["config"], sort_keys=True), r["impl"]): r["time_us"] for r in records
             if r.get("status") == "ok" and r.get("time_mode") == "graph"}
    for (config, impl), core_us in timed.items():
        shipped_us = timed.get((config, "bsrattn-torch"))
        if impl == "bsrattn-torch-core" and shipped_us is not None:
            rows.append((workload, json.loads(config), core_us, shipped_us))
if rows:
    print(f"{'workload':<16} {'configuration':<58} {'core us':>9} {'shipped us':>11} {'core / shipped':>15}")
    for workload, config, core_us, shipped_us in rows:
        label = ", ".join(f"{k}={v}" for k, v in config.items())
        print(f"{workload:<16} {label[:58]:<58} {core_us:9.1f} {shipped_us:11.1f} {core_us / shipped_us:14.2f}x")
else:
    print("no committed H200 run with the core's row yet: python3 -m benchmarks.run_all --quick --only w1,w2,w3")

# %% [markdown]
# In the committed run the core takes 1.6-3x the shipped call's time at decode and 5-11x at prefill. The
# difference is the serving layer, rung by rung in `benchmarks/NOTES.md`:
# - KV tiles that every query of a tile sees run without a mask.
# - The check for non-finite values leaves the tile loop, for a second launch over the items that need it.
# - Prefill tiles are 128 rows, with the scale folded into `exp2`.
# - Block ids and tiles are loaded a stage ahead.
# - Merges are folded into the attention launch, and small decode batches are balanced over the SMs.

# %% [markdown]
# ## What it costs
#
# Here, on a CPU, the simulator and the interpreter are teaching tools: they run every CUDA thread as a Python
# thread, or every Triton program as NumPy, so their times below say nothing about a GPU (notebook 10 has the
# H200's). What carries over is the launch geometry and the memory each block declares.

# %%
for name in tiers.available():
    ba.attention(q32, k32, v32, layout, variant=variant, backend=name)
    start = time.perf_counter()
    ba.attention(q32, k32, v32, layout, variant=variant, backend=name)
    print(f"{name:>9}: {(time.perf_counter() - start) * 1e3:8.1f} ms for {layout.nnz_qo} queries x "
          f"{int(layout.kv_lens.sum())} keys here")
shared = shared_bytes(head_dim, cfg.group_size, cfg.tile_rows, cfg.tile_kv, head_dim * 4, cfg.word_size, 4)
print(f"numba tier here: grid ({work_plan.num_ctas}, {num_kv_heads}) x {cfg.num_threads} threads, "
      f"{cfg.tile_kv}-key tiles, {cfg.max_nq} (query, head) pairs per block, {shared} bytes of shared memory")

# %% [markdown]
# ## Exercises
#
# The exercises of the course that go with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 12, **block-row** (`python -m bsrattn.exercises check 12`): Attention of one block row: the gather
#   (exercise 11), then the online softmax (exercise 10), tile by tile.
# - Exercise 19, **numba-tile** (`python -m bsrattn.exercises check 19`): One tile of a CUDA kernel, in Numba: each
#   query's online-softmax update over one gathered KV tile.
# - Exercise 20, **triton-tile** (`python -m bsrattn.exercises check 20`): One tile of a Triton kernel: K/V rows
#   gathered through slot indices, `tl.dot`, the online softmax.
# - Exercise 22, **score-transform** (`python -m bsrattn.exercises check 22`): Score transforms: the scale, the logits
#   soft cap and ALiBi, in FlashInfer's order.
