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
# # 4. Shared prefix: composable formats, merged with ⊕
#
# Many requests often share a long prefix (a system prompt, few-shot examples, a document) and differ only in
# a short suffix. A paged cache already stores the prefix once — every page table lists the same prefix pages —
# but a plain paged kernel still *loads* it once per request.
#
# One block size cannot fix that: the prefix wants a large $B_r$ (all requests' queries in one block row, so
# one load into fast memory serves them all), the suffixes want $B_r = 1$. So FlashInfer **composes formats**:
# two BSR matrices over the same KV pool — the prefix level and the suffix level — each run separately, and
# their attention states merged with the operator ⊕ (notebook 7 derives it):
#
# $$\text{attn}(q, \text{prefix} \cup \text{suffix}) = \text{attn}(q, \text{prefix}) \oplus \text{attn}(q, \text{suffix})$$
#
# No data moves; only the index arrays differ. `ba.layouts.shared_prefix` builds the two levels as a
# `ba.Cascade`, and every entry point accepts one.

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
# ## The idea: four decoding requests behind one 24-token prefix
#
# Pages of 8 slots. The prefix sits in pages 0–2; each request's own suffix in its own pages.

# %%
page_size, num_pages = 8, 12
cascade = ba.layouts.shared_prefix(qo_lens=[1, 1, 1, 1], prefix_pages=[0, 1, 2], prefix_len=24,
                                   suffix_page_tables=[[5], [7, 3], [9], [4, 11]], suffix_lens=[6, 13, 3, 10],
                                   page_size=page_size, num_pages=num_pages)
prefix_level, suffix_level = cascade.levels
print("prefix level:", prefix_level, " qo_lens", prefix_level.qo_lens, "-> one block row, Br = 4")
print("suffix level:", suffix_level, " qo_lens", suffix_level.qo_lens, "-> Br = 1 per request")
flat = cascade.flatten()
print("flattened:   ", flat, " (each request: prefix slots, then suffix slots)")

# %% [markdown]
# ## A picture
#
# The prefix level is one block row four queries tall over the three prefix pages: one tile load serves all
# four requests. The suffix level is four rows of height one. The flattened layout on the right is the same
# attention as one matrix — correct, but every request reads the prefix again.

# %%
fig, axes = plt.subplots(1, 3, figsize=(14, 2.6))
draw.layout(cascade, ax=axes[:2], title=["level 0: prefix, (Br, Bc) = (4, 8)", "level 1: suffixes, (Br, Bc) = (1, 8)"])
draw.layout(flat, ax=axes[2], title="flattened (Bc = 1): prefix read per request")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# Run each level on its own with `return_lse=True`, merge the two states with `ba.merge_state`, and compare
# with the cascade call and with the flattened single layout.

# %%
rng = np.random.default_rng(0)
num_qo_heads, num_kv_heads, head_dim = 4, 2, 16
q = rng.standard_normal((cascade.nnz_qo, num_qo_heads, head_dim))             # [nnz_qo, Hq, D]
k = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim))       # [pages, page_size, Hkv, D]
v = rng.standard_normal(k.shape)

o_prefix, lse_prefix = ba.attention(q, k, v, prefix_level, return_lse=True)
o_suffix, lse_suffix = ba.attention(q, k, v, suffix_level, return_lse=True)
o_merged, lse_merged = ba.merge_state(o_prefix, lse_prefix, o_suffix, lse_suffix)

out, lse = ba.attention(q, k, v, cascade, return_lse=True)
k_slots, v_slots = (x.reshape(-1, num_kv_heads, head_dim) for x in (k, v))    # flat is block_size 1
out_flat = ba.attention(q, k_slots, v_slots, flat)
print("cascade vs levels merged by hand:", np.abs(out - o_merged).max(), np.abs(lse - lse_merged).max())
print("cascade vs flattened layout:     ", np.abs(out - out_flat).max())

# %% [markdown]
# ## The tiers agree
#
# The cascade on every tier: each tier runs both levels and merges them with its own `merge_state`.

# %%
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
for name in tiers.available():
    o32, lse32 = ba.attention(q32, k32, v32, cascade, return_lse=True, backend=name)
    tiers.check(f"{name} out", o32, out)
    tiers.check(f"{name} lse", lse32, lse, op="lse")

# %% [markdown]
# ## Positions across levels: fused RoPE
#
# A level's rows do not hold a query's position: the prefix level packs all four requests' queries into one
# row, and a suffix's slot 0 sits right after the prefix. Fused RoPE (`Variant(rope_theta=...)`) must turn each
# query and key at its position in the whole sequence, so each level gets them from the cascade:
# `Cascade.rope_positions(level)` gives every query's position and each level row's first-slot offset. With
# them the cascade gives the flattened layout's answer. (ALiBi and sliding windows stay refused: they would
# bias or mask the one prefix row differently for each of its queries.)

# %%
rope = ba.Variant(causal=True, rope_theta=1e4)
q_pos, prefix_offsets = cascade.rope_positions(0)
print("query positions:        ", q_pos.tolist())
print("prefix / suffix offsets:", prefix_offsets.tolist(), cascade.rope_positions(1)[1].tolist())
out_rope = ba.attention(q, k, v, cascade, variant=rope)
out_rope_flat = ba.attention(q, k_slots, v_slots, flat, variant=rope)
print("cascade vs flattened, fused RoPE:", np.abs(out_rope - out_rope_flat).max())
for name in tiers.available():
    tiers.check(f"{name} fused RoPE", ba.attention(q32, k32, v32, cascade, variant=rope, backend=name), out_rope)

# %% [markdown]
# ## What it costs: the bytes the cascade saves
#
# A decode step is memory-bound, so its floor is the KV bytes it must read. Plain paged decode reads
# `batch x (prefix + suffix)` slots; the cascade reads the prefix once plus every suffix. Below, the ratio for
# the paper's Table 5 shapes (suffix 256). It is an upper bound on the speedup: the paper measures 1.03x at
# 1k / batch 16 (fixed costs dominate there) up to 16.1x at 32k / batch 64; workload 5 of the benchmark suite
# measures the H200's (notebook 10).

# %%
suffix = 256
configs = [(p, b) for p in (1024, 8192, 32768) for b in (16, 64)]
ratios = []
print(f"{'prefix':>7} {'batch':>6} {'plain (slots)':>14} {'cascade (slots)':>16} {'bytes saved':>12}")
for prefix, batch in configs:
    plain, composed = batch * (prefix + suffix), prefix + batch * suffix
    ratios.append(plain / composed)
    print(f"{prefix:7d} {batch:6d} {plain:14d} {composed:16d} {ratios[-1]:11.1f}x")

fig, ax = plt.subplots(figsize=(8, 3))
bars = ax.bar([f"{p // 1024}k / {b}" for p, b in configs], ratios, color="C2")
ax.bar_label(bars, fmt="%.1fx")
ax.set_xlabel("prefix / batch (suffix 256)")
ax.set_ylabel("plain bytes / cascade bytes")
ax.set_title("KV bytes a decode step must read")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 8, **cascade** (`python -m bsrattn.exercises check 8`): A cascade: a shared prefix as one block row of
#   every request's queries, then each request's suffix.
