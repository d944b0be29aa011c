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
# # 7. The attention state and ⊕: merging is exact, fold order is not free
#
# Attention of a query over a set of keys $I$ can be carried as a **state**: the output and its log-sum-exp,
#
# $$\mathrm{lse}(I) = \log \sum_{j \in I} e^{s_j}, \qquad o(I) = \sum_{j \in I} e^{s_j - \mathrm{lse}(I)}\, v_j .$$
#
# For disjoint $I = A \cup B$, $e^{\mathrm{lse}(I)} = e^{\mathrm{lse}(A)} + e^{\mathrm{lse}(B)}$, and
# $o(I)$ is the average of $o(A)$ and $o(B)$ weighted by those two sums. Shifting by $m = \max(\mathrm{lse}(A),
# \mathrm{lse}(B))$ keeps the exponentials in range:
#
# $$w_A = e^{\mathrm{lse}(A) - m},\quad w_B = e^{\mathrm{lse}(B) - m},\qquad
#   o = \frac{w_A\, o(A) + w_B\, o(B)}{w_A + w_B},\qquad \mathrm{lse} = m + \log(w_A + w_B).$$
#
# That is the merge operator ⊕. It is associative and commutative — in exact arithmetic — so attention over
# any split of the keys, merged, is attention over all of them. Every composition in this project rests on it:
# cascades (notebook 4), split-KV work items (notebook 8), and the levels of the API. A state with no keys has
# $\mathrm{lse} = -\infty$, weight 0, and is ⊕'s identity.

# %%
import os
import re
import shutil

# Without a GPU, the numba tier runs in Numba's CUDA simulator and the torch tier in Triton's interpreter.
# Both read these variables when they are first imported, so they are set before anything imports them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import numpy as np

import bsrattn as ba
import sm90
import tiers

# %% [markdown]
# ## The idea: 4096 keys in seven uneven chunks
#
# One query head over 4096 keys, split at six random points. Each chunk's state comes from an ordinary
# attention call with `return_lse=True`.

# %%
rng = np.random.default_rng(0)
n_keys, head_dim = 4096, 16
q = rng.standard_normal((1, 1, head_dim))                   # [nnz_qo=1, Hq=1, D]
k = rng.standard_normal((n_keys, 1, head_dim))              # [N, Hkv=1, D]
v = rng.standard_normal((n_keys, 1, head_dim))
cuts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n_keys), 6, replace=False)), [n_keys]])
chunks = list(zip(cuts[:-1], cuts[1:]))
print("chunk sizes:", np.diff(cuts))

o_parts, lse_parts = [], []
for a, b in chunks:
    o_c, lse_c = ba.attention(q, k[a:b], v[a:b], ba.layouts.dense(1, b - a), return_lse=True)
    o_parts.append(o_c)
    lse_parts.append(lse_c)
o_parts = np.stack(o_parts, axis=1)                          # [n=1, S=7, H=1, D]
lse_parts = np.stack(lse_parts, axis=1)                      # [n=1, S=7, H=1]
o_full, lse_full = ba.attention(q, k, v, ba.layouts.dense(1, n_keys), return_lse=True)

# %% [markdown]
# ## A picture
#
# Each chunk's share of the final softmax mass is $e^{\mathrm{lse}_c - \mathrm{lse}}$: the merge weights. They
# sum to one, and the merged output is exactly that mixture of the chunks' outputs.

# %%
share = np.exp(lse_parts[0, :, 0] - lse_full[0, 0])
fig, axes = plt.subplots(1, 2, figsize=(12, 3))
axes[0].bar(range(7), share, color="C0")
axes[0].set_xticks(range(7), [f"{a}:{b}" for a, b in chunks], rotation=30)
axes[0].set_ylabel("exp(lse_c - lse)")
axes[0].set_title(f"merge weights (sum = {share.sum():.15f})")
axes[1].plot(o_parts[0, :, 0].T, color="0.75", linewidth=1)
axes[1].plot((share[:, None] * o_parts[0, :, 0]).sum(axis=0), color="C3", linewidth=2, label="weighted mixture")
axes[1].plot(o_full[0, 0], "k:", linewidth=2, label="attention over all keys")
axes[1].set_xlabel("channel")
axes[1].set_title("chunk outputs (grey) and their mixture")
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# `ba.merge_states` folds the seven states in index order, $((s_0 \oplus s_1) \oplus s_2) \oplus \dots$; in float64
# the result is the monolithic attention to the last bit or two.

# %%
o_merged, lse_merged = ba.merge_states(o_parts, lse_parts)
print("max |o_merged - o_full|    :", np.abs(o_merged - o_full).max())
print("max |lse_merged - lse_full|:", np.abs(lse_merged - lse_full).max())
empty_o, empty_lse = np.zeros_like(o_full), np.full_like(lse_full, -np.inf)
o_id, lse_id = ba.merge_state(o_full, lse_full, empty_o, empty_lse)
print("merging with an empty state is the identity:", np.array_equal(o_id, o_full), np.array_equal(lse_id, lse_full))

# %% [markdown]
# ## The tiers agree
#
# Every tier implements ⊕ (`merge_state`) and the ordered fold (`merge_states`), here on float32 states.

# %%
o32, lse32 = o_parts.astype(np.float32), lse_parts.astype(np.float32)
for name in tiers.available():
    o_t, lse_t = ba.merge_states(o32, lse32, backend=name)
    tiers.check(f"{name} merge_states", o_t, o_merged, op="merge")
    tiers.check(f"{name} lse", lse_t, lse_merged, op="merge")
    o_t, lse_t = ba.merge_state(o32[:, 0], lse32[:, 0], o32[:, 1], lse32[:, 1], backend=name)
    o_ref, lse_ref = ba.merge_state(o_parts[:, 0], lse_parts[:, 0], o_parts[:, 1], lse_parts[:, 1])
    tiers.check(f"{name} merge_state", o_t, o_ref, op="merge")

# %% [markdown]
# ## The determinism lesson
#
# Floating-point addition is not associative, so ⊕ is only associative to rounding. Fold the seven **float32**
# states in 200 random orders, and count the distinct results, bit for bit:

# %%
shuffle_rng = np.random.default_rng(1)
results = {}
for _ in range(200):
    order = shuffle_rng.permutation(7)
    o_s, lse_s = ba.merge_states(o32[:, order], lse32[:, order])
    results.setdefault(o_s.tobytes() + lse_s.tobytes(), o_s)
fixed = {ba.merge_states(o32, lse32)[0].tobytes() for _ in range(200)}
print(f"200 shuffled fold orders: {len(results)} distinct results")
print(f"200 folds in the plan's fixed order: {len(fixed)} distinct result")

ulp = np.spacing(np.abs(o_full).max().astype(np.float32))             # float32 ulp of the largest output
deviation = np.stack([(r - o_full) / ulp for r in results.values()])   # [distinct, 1, 1, D]
fig, ax = plt.subplots(figsize=(8, 3))
ax.hist(deviation.reshape(len(results), -1).ravel(), bins=40, color="C1")
ax.set_xlabel("error against float64, in float32 ulps of the largest output (every channel, every result)")
ax.set_ylabel("count")
ax.set_title(f"{len(results)} distinct float32 results from 200 fold orders of the same seven states")
fig.tight_layout()
plt.show()

# %% [markdown]
# The differences are a few ulps — numerically irrelevant, and fatal to a cache key, a regression test or a
# reproducible sample. This is why FlashInfer's scheduler departs from Stream-K, which it otherwise follows:
# Stream-K aggregates partial results with atomics, whose completion order changes run to run. bsrattn uses no
# floating-point atomics: a `WorkPlan` lists each split tile's partial states **in a fixed order**, and every
# tier folds them in that order. Same inputs, same plan, same bits:

# %%
lens = [60, 10, 90, 25]
starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
pool_k = rng.standard_normal((sum(lens), 1, head_dim)).astype(np.float32)   # [N, Hkv, D]
pool_v = rng.standard_normal((sum(lens), 1, head_dim)).astype(np.float32)
queries = rng.standard_normal((4, 2, head_dim)).astype(np.float32)          # [requests, Hq, D]


def batched_run(rows, backend, dtype=np.float32, **plan_options):
    """Requests ``rows`` as one batch, planned over 8 CTAs; returns each request's output row."""
    layout = ba.layouts.vector_sparse([np.arange(starts[r], starts[r] + lens[r]) for r in rows], [1] * len(rows),
                                      num_slots=sum(lens))
    attn = ba.BatchAttention(backend=backend)
    attn.plan(layout, num_qo_heads=2, num_kv_heads=1, head_dim=head_dim, num_ctas=8, **plan_options)
    return attn.run(queries[rows].astype(dtype), pool_k.astype(dtype), pool_v.astype(dtype))


for name in tiers.available():
    runs = {batched_run([0, 1, 2, 3], name, fixed_split_size=16).tobytes() for _ in range(3)}
    print(f"{name:>9}: 3 runs of a split plan -> {len(runs)} distinct result")

# %% [markdown]
# ### No floating-point atomics, read in the compiled kernel
#
# "No floating-point atomics" is a property of the code a GPU runs, so read that code. The torch tier's persistent
# kernel, compiled for the H200 (sm_90) right here — Triton needs no GPU to compile, only to run (`sm90.py` beside
# this notebook does it in a subprocess, since the interpreter is on here) — for a decode and for a causal
# prefill. Every atomic instruction in its PTX, and every atomic read-modify-write in its TTGIR (Triton's GPU-level
# IR, which names the operand types):

# %%
launches = {"fp16 decode": {}, "bf16 causal prefill": dict(q_dtype="bfloat16", tile_q=32, causal=True)}
if not tiers.torch_extra_installed():
    launches = {}
    print("Compiling the kernel takes torch and Triton: install the torch extra (pip install -e '.[torch]') "
          "to read its PTX.")
for label, kwargs in launches.items():
    asm = sm90.compile_attention(**kwargs)
    ptx_atomics = re.findall(r"\b(?:atom|red)\.[\w.]+", asm["ptx"])
    ttgir_atomics = [" ".join(line.split()) for line in asm["ttgir"].splitlines() if "tt.atomic_" in line]
    print(f"{label}: {len(asm['ptx'].splitlines())} lines of PTX")
    print("  PTX atomics:  ", sorted(set(ptx_atomics)), f"x{len(ptx_atomics)}")
    for line in ttgir_atomics:
        print("  TTGIR:        ", re.sub(r"\s*loc\(.*\)$", "", line))
    assert ptx_atomics and all(re.search(r"\.[us]32$", op) for op in ptx_atomics), ptx_atomics
    assert all(": (!tt.ptr<i32>, i32, i1) -> i32" in line for line in ttgir_atomics), ttgir_atomics

# %% [markdown]
# One atomic, and it is an integer: the counter each split tile's items bump (`atom.add.u32`, acquire-release at
# GPU scope) so that the last one to finish knows it is last. That item then folds the tile's partial states
# itself — with ordinary loads and adds, in the order the plan lists them. The partial states never meet in an
# atomic, so which item happens to merge changes nothing in the result. (The numba tier has no atomics at all: it
# merges in a second launch.)

# %% [markdown]
# ### Batch invariance
#
# A plan's default chunk size $L_{kv}$ depends on the whole batch, so a request's KV is split differently
# when it is batched with others — and its output changes in the last bits (shown in float64 on the reference,
# where it is visible). With `fixed_split_size`, a request's chunks depend only on its own length, so its
# output is bitwise the same whatever it is batched with.

# %%
alone = batched_run([2], "reference", np.float64)[0]
batched = batched_run([0, 1, 2, 3], "reference", np.float64)[2]
print("default L_kv   : alone == batched?", np.array_equal(alone, batched), f"(max diff {np.abs(alone - batched).max():.1e})")
for name in tiers.available():
    alone = batched_run([2], name, fixed_split_size=16)[0]
    batched = batched_run([0, 1, 2, 3], name, fixed_split_size=16)[2]
    print(f"fixed split 16 : alone == batched on {name}?", np.array_equal(alone, batched))

# %% [markdown]
# ## What it costs
#
# Splitting is not free: each split tile writes one partial state per chunk (`head_dim` outputs plus one lse,
# in float32) to a workspace, and the merge reads them back. The plan says how much. For a batch of 8 long
# decode requests spread over 132 CTAs:

# %%
kv_lens = np.random.default_rng(2).integers(4096, 16385, size=8)
num_qo_heads, head_dim_big = 32, 128
for label, kwargs in [("no split", dict(disable_split_kv=True)), ("Algorithm 1", {})]:
    work_plan = ba.scheduler.plan(np.ones(8, dtype=int), kv_lens, num_ctas=132, **kwargs)
    workspace = work_plan.num_partial_rows * num_qo_heads * (head_dim_big + 1) * 4
    kv_bytes = int(kv_lens.sum()) * 8 * head_dim_big * 2 * 2               # 8 KV heads, fp16, K and V
    print(f"{label:>12}: {work_plan.num_items:4d} items, {work_plan.num_merges} merges, "
          f"{work_plan.num_partial_rows:4d} partial rows = {workspace / 2**10:6.0f} KiB of workspace "
          f"({workspace / kv_bytes:.2%} of the KV bytes read), makespan {ba.scheduler.makespan(work_plan):.0f}")

# %% [markdown]
# ## Exercises
#
# The exercises of the course that go with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 1, **lse** (`python -m bsrattn.exercises check 1`): The LSE of a row of scores: log(sum(exp(s))) in natural
#   log, without overflow; -inf for an empty row.
# - Exercise 2, **merge** (`python -m bsrattn.exercises check 2`): ⊕, the merge of two attention states, and its
#   identity, the empty state (lse = -inf).
# - Exercise 10, **online-softmax** (`python -m bsrattn.exercises check 10`): The online softmax: attention over keys
#   that arrive one tile at a time, in a single pass.
# - Exercise 13, **split-merge** (`python -m bsrattn.exercises check 13`): Split a row's KV into chunks, attend to each
#   on its own, and merge the states in order.
