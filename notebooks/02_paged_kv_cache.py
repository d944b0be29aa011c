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
# # 2. The paged KV cache is BSR with $B_c$ = page size
#
# A serving engine cannot know how long a request will grow, so it does not reserve one contiguous buffer per
# request. It hands out fixed-size **pages** from a pool as tokens arrive (vLLM's PagedAttention), and keeps a
# **page table** per request. In BSR words:
#
# - a block row is a request (or a tile of its queries), a column block is a page: $B_c$ = page size;
# - `kv_indices` *is* the page table, the requests' tables concatenated, with `kv_indptr` saying where each
#   starts;
# - `kv_last_len` says how many slots of each request's last page hold tokens (1 … page size).
#
# PagedAttention is not a separate abstraction: it is the sparse load path with $B_c = 16$.

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
# ## The idea: a decode step over four requests
#
# Pages of 8 slots, a pool of 16 pages. Request 3 was forked from request 0 (think parallel sampling) and
# still shares its first two pages: a page used by two requests is just the same id in two page tables.

# %%
page_size, num_pages = 8, 16
page_tables = [[11, 3, 6], [0, 14], [9, 1, 12, 5], [11, 3, 15]]
kv_lens = [21, 9, 30, 19]
layout = ba.layouts.paged(qo_lens=[1, 1, 1, 1], page_tables=page_tables, kv_lens=kv_lens,
                          page_size=page_size, num_pages=num_pages)
print(layout)
print("kv_indptr  ", layout.kv_indptr)
print("kv_indices ", layout.kv_indices, "  <- the page table")
print("kv_last_len", layout.kv_last_len, "  <- kv_len - (pages - 1) * page_size")
for r in range(layout.num_rows):
    print(f"request {r}: logical slots 0..{layout.kv_lens[r] - 1} live at pool slots {layout.kv_slots(r)[[0, -1]]} (first, last)")

# %% [markdown]
# ## A picture
#
# Left: the decode step as a BSR matrix — one query row per request, the pool's 128 slots as columns, shaded
# pages where a request has keys. The shared pages 11 and 3 appear in rows 0 and 3. Right: the same four
# requests after copying each one's keys into one contiguous buffer — the **ragged** layout of notebook 3,
# where the load path is affine. Attention cannot tell the two apart.

# %%
contiguous = ba.layouts.ragged([1, 1, 1, 1], kv_lens)
fig, axes = plt.subplots(1, 2, figsize=(12, 2.4), gridspec_kw={"width_ratios": [128, 79]})
draw.layout(layout, ax=axes[0], title=f"paged: Bc = {page_size}, scattered pages")
draw.layout(contiguous, ax=axes[1], title="ragged: the same keys, contiguous, Bc = 1")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# Gather each request's keys out of the pages into a contiguous buffer by hand, then run the ragged layout on
# it: the answer is the paged answer. The same cache stored head-major (`kv_layout="HND"`,
# `[num_pages, num_kv_heads, page_size, head_dim]`, each (page, head) contiguous) gives it too.

# %%
rng = np.random.default_rng(0)
num_qo_heads, num_kv_heads, head_dim = 4, 2, 16
q = rng.standard_normal((layout.nnz_qo, num_qo_heads, head_dim))            # [nnz_qo, Hq, D]
k = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim))     # [num_pages, page_size, Hkv, D]
v = rng.standard_normal(k.shape)
out_paged = ba.attention(q, k, v, layout)

slots = np.concatenate([layout.kv_slots(r) for r in range(layout.num_rows)])
k_flat, v_flat = (x.reshape(-1, num_kv_heads, head_dim)[slots] for x in (k, v))  # [sum(kv_lens), Hkv, D]
out_ragged = ba.attention(q, k_flat, v_flat, contiguous)

k_hnd, v_hnd = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))  # [pages, Hkv, page, D]
out_hnd = ba.attention(q, k_hnd, v_hnd, layout, kv_layout="HND")
print("paged vs ragged:", np.abs(out_paged - out_ragged).max())
print("NHD vs HND:     ", np.abs(out_paged - out_hnd).max())

# %% [markdown]
# ## The tiers agree
#
# The paged decode on every tier (float32 against the float64 reference), in both storage orders.

# %%
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
k32_hnd, v32_hnd = (x.astype(np.float32) for x in (k_hnd, v_hnd))
for name in tiers.available():
    tiers.check(f"{name} NHD", ba.attention(q32, k32, v32, layout, backend=name), out_paged)
    tiers.check(f"{name} HND", ba.attention(q32, k32_hnd, v32_hnd, layout, kv_layout="HND", backend=name), out_paged)

# %% [markdown]
# ## What it costs
#
# The page size is a trade. Small pages waste little memory — only the unused tail of each request's last page,
# on average half a page — but a kernel that loads fixed 128-slot blocks straight from the pool reads whole
# blocks around every scattered page. Gathering pages into fast memory first decouples the two: storage keeps
# a small $B_c$, the microkernel still gets dense tiles, and the bytes read are the bytes needed.
#
# Below, 64 requests with lengths drawn from U(100, 2000) and pages placed at random in a pool twice the
# needed size.

# %%
lengths = np.random.default_rng(1).integers(100, 2001, size=64)
sizes = [1, 2, 4, 8, 16, 32, 64, 128]
waste, amplification = [], []
for size in sizes:
    pages_needed = -(-lengths // size)
    pool = 2 * int(pages_needed.sum())
    perm = np.random.default_rng(2).permutation(pool)
    tables = np.split(perm[:pages_needed.sum()], np.cumsum(pages_needed)[:-1])
    batch = ba.layouts.paged(np.ones(64, dtype=int), tables, lengths, size, pool)
    waste.append((pages_needed * size - lengths).sum() / lengths.sum())
    amplification.append(batch.read_amplification(128).ratio)
    print(f"page {size:3d}: {waste[-1]:6.1%} of the cache is last-page padding; "
          f"an aligned 128-slot kernel reads {amplification[-1]:5.2f}x the needed bytes")

fig, axes = plt.subplots(1, 2, figsize=(12, 3))
axes[0].plot(sizes, waste, marker="o")
axes[0].set_xscale("log", base=2)
axes[0].set_xlabel("page size")
axes[0].set_ylabel("memory wasted")
axes[0].set_title("internal fragmentation grows with the page")
axes[1].plot(sizes, amplification, marker="o", color="C3", label="aligned 128-slot blocks from the pool")
axes[1].axhline(1.0, color="C2", label="gather pages first (bsrattn, FlashInfer)")
axes[1].set_xscale("log", base=2)
axes[1].set_xlabel("page size")
axes[1].set_ylabel("slots read / slots needed")
axes[1].set_title("read amplification shrinks with the page")
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 3, **page-table** (`python -m bsrattn.exercises check 3`): A page table as BSR: the `kv_indptr`,
#   `kv_indices` and `kv_last_len` of a paged KV cache.
