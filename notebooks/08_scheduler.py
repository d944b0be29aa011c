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
# # 8. The scheduler: plan once per step, run once per layer
#
# Sequence lengths change at every generation step, but a CUDA graph wants one launch configuration forever.
# FlashInfer resolves this with an **inspector–executor** split:
#
# - `plan` runs on the host once per step. It sees the lengths and computes a `WorkPlan`: which CTA does which
#   piece of work, in which order, where each partial result goes, and how partial results are merged.
# - `run` executes the plan once per layer, with a fixed grid (a persistent kernel of `num_ctas` CTAs per KV
#   head) and fixed workspace offsets, so it can be captured in a CUDA graph and replayed while the plan's
#   buffers are refilled in place.
#
# The plan is **Algorithm 1** of the paper — longest-processing-time-first with KV chunking:
#
# 1. cut every request's queries into tiles of $T_q$ rows;
# 2. chunk each tile's KV into pieces of $L_{kv} = \left\lceil \sum_r \lceil l_{qo,r} / T_q \rceil \, l_{kv,r} \,/\, \#\mathrm{CTA} \right\rceil$
#    slots (or a `fixed_split_size`);
# 3. sort the pieces by cost (query rows + KV slots), longest first;
# 4. give each to the least-loaded CTA (a min-heap);
# 5. every tile that was split gets partial-state slots and a merge list, **in chunk order** (notebook 7).
#
# The plan is a pure function of the lengths: the same lengths give the same plan, bit for bit.

# %%
import os
import shutil

# Without a GPU, the numba tier runs in Numba's CUDA simulator and the torch tier in Triton's interpreter.
# Both read these variables when they are first imported, so they are set before anything imports them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import numpy as np

import bsrattn as ba
import tiers
from bsrattn import draw

# %% [markdown]
# ## The idea: six decode requests on eight CTAs
#
# The baseline gives each request one CTA (round robin). Two long requests then decide when the step ends,
# while most CTAs idle. Algorithm 1 cuts the long ones into chunks of $L_{kv}$ and balances them.

# %%
qo_lens = np.ones(6, dtype=int)
kv_lens = np.array([1900, 240, 410, 1250, 90, 600])
num_ctas = 8
baseline = ba.scheduler.round_robin(qo_lens, kv_lens, num_ctas=num_ctas)
planned = ba.scheduler.plan(qo_lens, kv_lens, num_ctas=num_ctas)
print(f"L_kv = ceil({kv_lens.sum()} / {num_ctas}) = {planned.kv_chunk_size}")
print(f"items: {baseline.num_items} round robin, {planned.num_items} planned; merges: {planned.num_merges}")
for w in range(planned.cta_indptr[0], planned.cta_indptr[1]):
    print(f"CTA 0 item {w}: request {planned.item_row[w]}, KV {planned.item_kv_start[w]}:{planned.item_kv_end[w]}, "
          f"partial row {planned.item_partial[w]}")
m = 0
parts = planned.merge_partials[planned.merge_indptr[m]:planned.merge_indptr[m + 1]]
print(f"merge {m}: query row {planned.merge_qo_start[m]} folds partial rows {parts.tolist()} in that order")

# %% [markdown]
# ## A picture
#
# Gantt charts under the plan's cost model (query rows + KV slots per item), coloured by request
# (`bsrattn.draw.plan`). Hatched items are chunks of a split request: each writes a partial state, and a diamond
# marks each merge, when the last of its chunks is done. The dashed line is the makespan, when the busiest CTA
# finishes.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.2), sharex=True)
draw.plan(baseline, ax=axes[0], title="round robin, one CTA per request:")
draw.plan(planned, ax=axes[1], title="Algorithm 1:")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# `ba.BatchAttention` is plan/run. Its reference tier executes the `WorkPlan` the way a GPU would — CTA by CTA,
# item by item, partial states into the workspace, then each merge list in its fixed order — and gets the
# same answer as plain attention. The plan also covers every (request, KV slot) exactly once.

# %%
rng = np.random.default_rng(0)
small_kv = np.array([95, 12, 20, 62, 5, 30])
layout = ba.layouts.ragged(qo_lens, small_kv)
num_qo_heads, num_kv_heads, head_dim = 4, 2, 16
q = rng.standard_normal((layout.nnz_qo, num_qo_heads, head_dim))       # [nnz_qo, Hq, D]
k = rng.standard_normal((layout.num_slots, num_kv_heads, head_dim))    # [N, Hkv, D]
v = rng.standard_normal(k.shape)

attn = ba.BatchAttention(backend="reference")
attn.plan(layout, num_qo_heads, num_kv_heads, head_dim, num_ctas=num_ctas)
(work_plan,) = attn.work_plans
expected = ba.attention(q, k, v, layout)
print("plan/run vs attention:", np.abs(attn.run(q, k, v) - expected).max())

covered = np.zeros(layout.num_slots, dtype=int)
for w in range(work_plan.num_items):
    start = layout.kv_indptr[work_plan.item_row[w]]
    covered[start + work_plan.item_kv_start[w]:start + work_plan.item_kv_end[w]] += 1
print("every KV slot covered exactly once:", bool((covered == 1).all()),
      f"({work_plan.num_items} items over {num_ctas} CTAs, chunk {work_plan.kv_chunk_size})")

# %% [markdown]
# ## The tiers agree
#
# The same plan/run on every tier (float32), and one plan run twice to show it is reusable.

# %%
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
for name in tiers.available():
    tier_attn = ba.BatchAttention(backend=name)
    tier_attn.plan(layout, num_qo_heads, num_kv_heads, head_dim, num_ctas=num_ctas)
    tiers.check(f"{name} run 1", tier_attn.run(q32, k32, v32), expected)
    tiers.check(f"{name} run 2", tier_attn.run(q32, k32, v32), expected)

# %% [markdown]
# ## What it costs: the makespan table
#
# `ba.scheduler.simulate` draws decode batches from a length distribution and compares makespans on 132 CTAs
# (one H200 wave): round robin over Algorithm 1, 50 random batches per row. Uniform lengths with one request per
# CTA or more gain nothing — there is nothing to balance; variable lengths and small batches, where a few long
# requests cannot fill the GPU, gain the most. This is the tail-latency regime, and it is where the paper's
# end-to-end gain appears (1.61x ITL at U(4096, 16384), request rate 1).

# %%
print(f"{'distribution':>18} {'batch':>6} {'median':>8} {'min':>7} {'max':>7}")
table = {}
for batch in (256, 32):
    for distribution in ba.scheduler.DISTRIBUTIONS:
        result = ba.scheduler.simulate(distribution, batch, num_ctas=132, trials=50)
        table[distribution, batch] = result
        print(f"{distribution:>18} {batch:6d} {result.median:7.2f}x {result.min:6.2f}x {result.max:6.2f}x")

# %%
fig, ax = plt.subplots(figsize=(9, 3.2))
names = list(ba.scheduler.DISTRIBUTIONS)
for offset, batch in ((-0.2, 256), (0.2, 32)):
    med = np.array([table[d, batch].median for d in names])
    low = med - np.array([table[d, batch].min for d in names])
    high = np.array([table[d, batch].max for d in names]) - med
    ax.bar(np.arange(len(names)) + offset, med, width=0.4, yerr=[low, high], capsize=3, label=f"batch {batch}")
ax.axhline(1.0, color="black", linewidth=0.8)
ax.set_xticks(range(len(names)), names)
ax.set_ylabel("round-robin / planned makespan")
ax.set_title("Algorithm 1 on 132 CTAs (median, min-max over 50 batches)")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The host pays for this: `plan` walks every work item. Its time, for decode batches of growing size (the
# benchmark suite's workload 6 measures it on the H200's host, beside FlashInfer's: notebook 10):

# %%
import time

for batch in (1, 64, 256, 1024):
    lens = np.random.default_rng(batch).integers(4096, 16385, size=batch)
    ones = np.ones(batch, dtype=int)
    ba.scheduler.plan(ones, lens, num_ctas=132)
    start = time.perf_counter()
    for _ in range(20):
        ba.scheduler.plan(ones, lens, num_ctas=132)
    print(f"batch {batch:5d}: plan() {(time.perf_counter() - start) / 20 * 1e6:8.1f} µs here")

# %% [markdown]
# ## Exercises
#
# The exercises of the course that go with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 14, **plan-merges** (`python -m bsrattn.exercises check 14`): The merges of a WorkPlan: fold each split
#   query tile's partial states, in the order the plan lists them.
# - Exercise 15, **lpt-plan** (`python -m bsrattn.exercises check 15`): Algorithm 1, FlashInfer's scheduler: KV chunks
#   of `L_kv`, longest first, each onto the least-loaded CTA.
# - Exercise 16, **makespan** (`python -m bsrattn.exercises check 16`): The makespan of a plan: when its busiest CTA
#   finishes, under the cost model; and how early it could.
