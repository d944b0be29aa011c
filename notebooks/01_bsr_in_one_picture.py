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
# # 1. BSR in one picture
#
# Attention over a batch of requests is a matrix: one row per query, one column per slot of the KV pool,
# and a non-zero where a query attends a key. Group the non-zeros into $(B_r, B_c)$ tiles and store only the
# tiles that hold one — a row pointer `indptr`, the column-block ids `indices`, and the block size. That is a
# **block-sparse-row (BSR)** matrix, and FlashInfer's point is that every KV-cache layout a serving engine
# uses is one, with a different block size:
#
# | layout | $B_c$ | what `indices` is |
# |---|---|---|
# | paged KV cache | page size | the page table |
# | ragged batch | 1 | consecutive slots (dense within a request) |
# | shared prefix | page size, with a large $B_r$ | the prefix's pages, shared by every query |
# | tree decoding | page size | the page table, plus a tree mask |
# | KV pruning (Quest, H2O) | 1 or the page | the slots (pages) kept |
#
# One kernel serves them all: it gathers each row's KV blocks from wherever they sit in the pool into fast
# memory, then runs the same dense FlashAttention microkernel. Only the address computation differs.
#
# Every notebook here follows one arc: **the idea → a picture → the reference → the tiers agree → what it
# costs.**

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
# ## The idea: three requests in a paged cache
#
# A pool of 10 pages of 4 slots. Request 0 has 10 tokens in pages 7, 2, 4; request 1 has 7 tokens in pages
# 0, 9; request 2 has 12 tokens in pages 5, 1, 8. The layout is FlashInfer's plan input in BSR words:

# %%
layout = ba.layouts.paged(qo_lens=[2, 1, 3], page_tables=[[7, 2, 4], [0, 9], [5, 1, 8]],
                          kv_lens=[10, 7, 12], page_size=4, num_pages=10)
print(layout)
print("qo_indptr   ", layout.qo_indptr, "  query rows of each request")
print("kv_indptr   ", layout.kv_indptr, "  where each request's pages start in kv_indices")
print("kv_indices  ", layout.kv_indices, "  the page tables, concatenated")
print("kv_last_len ", layout.kv_last_len, "  valid slots of each last page")

# %% [markdown]
# A kernel finds the pool slot of a request's logical key $i$ in one of two ways. The **sparse path** goes
# through the indices array; the **affine path**, for KV stored contiguously from `offset`, is affine:
#
# ```
# j = indices[(offset + i) / Bc] * Bc + (offset + i) % Bc     // sparse
# j = offset + i                                              // dense
# ```
#
# Both are written once, in `bsrattn.indexing`, and every tier uses them.

# %%
i = np.arange(layout.kv_lens[0])
sparse = ba.indexing.sparse_slot(layout.kv_indices, layout.kv_indptr[0], layout.block_size, i)
print("request 0, sparse path:", sparse)
print("same as kv_slots(0):   ", layout.kv_slots(0))
print("affine path from slot 0:", ba.indexing.affine_slot(0, i))

# %% [markdown]
# ## A picture
#
# The matrix itself (`bsrattn.draw.layout`): rows are the six query rows, coloured by request, columns the 40
# pool slots, under a causal mask. Left, the blocks as stored: one per page of each request, $B_c = 4$ slots
# wide and as tall as the request's queries; every slot a block holds is needed, bar the tail of a last page.
# Right, what a kernel that reads aligned 16-slot tiles straight from the pool must load — $B_c = 16$ is a tile
# width a tensor core likes — whole tiles around a few keys each.

# %%
variant = ba.Variant(causal=True)
fig, axes = plt.subplots(1, 2, figsize=(12, 2.8))
draw.layout(layout, variant=variant, ax=axes[0], title="stored as BSR: a block per page, Bc = 4")
draw.layout(layout, variant=variant, tiles=(1, 16), tile_grid="pool", ax=axes[1],
            title="read in aligned (1, 16) tiles from the pool")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# The reference tier (`bsrattn/reference`, NumPy in float64) is the spec. Here is the claim the whole
# project rests on, checked: attention over the BSR layout equals one dense masked softmax over the pool,
# with the layout's dense mask.

# %%
rng = np.random.default_rng(0)
num_qo_heads, num_kv_heads, head_dim = 4, 2, 16
q = rng.standard_normal((layout.nnz_qo, num_qo_heads, head_dim))                       # [nnz_qo, Hq, D]
k = rng.standard_normal((layout.num_blocks, layout.block_size, num_kv_heads, head_dim))  # [pages, Bc, Hkv, D]
v = rng.standard_normal(k.shape)

out, lse = ba.attention(q, k, v, layout, variant=variant, return_lse=True)

mask = layout.to_dense_mask(variant)                                            # [nnz_qo, num_slots]
group = num_qo_heads // num_kv_heads                                            # query heads per KV head
k_pool = np.repeat(k.reshape(layout.num_slots, num_kv_heads, head_dim), group, axis=1)
v_pool = np.repeat(v.reshape(layout.num_slots, num_kv_heads, head_dim), group, axis=1)
scores = np.where(mask, np.einsum("nhd,mhd->hnm", q, k_pool) / np.sqrt(head_dim), -np.inf)
lse_dense = np.logaddexp.reduce(scores, axis=2)                                 # [Hq, nnz_qo]
out_dense = np.einsum("hnm,mhd->nhd", np.exp(scores - lse_dense[..., None]), v_pool)
print("max |out - dense|:", np.abs(out - out_dense).max(), "  max |lse - dense|:", np.abs(lse - lse_dense.T).max())

# %% [markdown]
# ## The tiers agree
#
# The same call on every tier, in float32, against the float64 reference, within the project's tolerance
# table (`bsrattn.testing`). Without a GPU the numba and torch tiers run in the simulator and the interpreter,
# so the sizes stay tiny.

# %%
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
for name in tiers.available():
    tiers.check(name, ba.attention(q32, k32, v32, layout, variant=variant, backend=name), out)

# %% [markdown]
# ## What it costs: read amplification
#
# Quest-style decode picks a budget of scattered 16-slot pages out of a long cache. A kernel that loads
# aligned blocks of $B$ slots must read every block that holds a needed slot. With $B = 16$ it reads exactly
# what it needs; with $B = 128$ each 16-slot page drags in a whole 128-slot block — eight times the bytes,
# before any fixed overhead. The gather into fast memory is what lets FlashInfer keep $B_c = 16$ in storage
# and still feed 64- or 128-wide tiles to the tensor cores.

# %%
def quest_row(seq_len, budget, page_size=16, seed=0):
    """One decode query attending ``budget`` distinct random pages of a ``seq_len``-slot cache."""
    pages = np.sort(np.random.default_rng(seed).choice(seq_len // page_size, budget, replace=False))
    return ba.layouts.paged([1], [pages], [budget * page_size], page_size, seq_len // page_size)


print(f"{'seq_len':>8} {'budget':>7} {'block':>6} {'needed':>7} {'read':>7} {'amplification':>14}")
for seq_len, budget in [(4096, 64), (32768, 64), (32768, 512)]:
    row = quest_row(seq_len, budget)
    for block in (16, 128):
        amp = row.read_amplification(block)
        print(f"{seq_len:8d} {budget:7d} {block:6d} {amp.needed:7d} {amp.read:7d} {amp.ratio:13.1f}x")

# %% [markdown]
# Left, the ratio against the kernel's block size for four budgets (`bsrattn.draw.read_amplification`; the dotted
# line is the page, where a gather reads exactly what is needed). Right, one small decode row: its six pages in
# colour, the 128-slot blocks an aligned kernel reads around them in grey.

# %%
blocks = 2 ** np.arange(0, 10)
fig, axes = plt.subplots(1, 2, figsize=(12, 3.2))
for budget in (64, 128, 256, 512):
    draw.read_amplification(quest_row(32768, budget), blocks, ax=axes[0], label=f"budget {budget}")
axes[0].set_title("read amplification, seq_len 32768, pages of 16")
draw.layout(quest_row(2048, 6), tiles=(1, 128), tile_grid="pool", ax=axes[1],
            title="6 pages of 16 needed, the 128-slot blocks read")
fig.tight_layout()
plt.show()

# %% [markdown]
# In bytes, for one KV head with `head_dim = 128` in fp16 (K and V): a budget of 64 pages needs
# $64 \cdot 16 \cdot 128 \cdot 2 \cdot 2 = 512$ KiB; read in 128-slot blocks it costs up to 4 MiB (8x, when no two
# selected pages share a block; random pages sometimes do, hence the 7.6x above). That is why, in
# the paper's Appendix G.5, FlashInfer's latency is affine in the pages it retrieves while FlexAttention's
# 128-wide template stays flat and slow. Notebook 6 builds the Quest layout itself, and notebook 10 shows the
# H200 measurements.

# %%
bytes_per_slot = 128 * 2 * 2  # head_dim x fp16 x (K and V)
for block in (16, 128):
    amp = quest_row(32768, 64).read_amplification(block)
    print(f"block {block:3d}: needs {amp.needed * bytes_per_slot / 2**10:6.0f} KiB, reads {amp.read * bytes_per_slot / 2**10:6.0f} KiB")

# %% [markdown]
# ## Exercises
#
# The exercises of the course that go with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 5, **pool-slot** (`python -m bsrattn.exercises check 5`): Logical slot -> pool slot: where key i of block
#   row r lives in the KV pool.
# - Exercise 11, **gather** (`python -m bsrattn.exercises check 11`): A BSR gather: one block row's keys (or values), in
#   logical order, copied out of the pool.
# - Exercise 24, **dense-mask** (`python -m bsrattn.exercises check 24`): A layout as the dense mask it stands for:
#   which pool slot each query row attends.
