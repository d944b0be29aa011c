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
# # 3. Ragged batches are BSR with $B_c = 1$
#
# Prefill batches requests of different lengths. Padding them to the longest wastes work; packing them
# end to end in one `[sum(len), heads, head_dim]` buffer does not. That packed form is FlashAttention's
# "varlen" API (`cu_seqlens`), and in BSR words it is the simplest layout of all:
#
# - $B_c = 1$: every key is its own block, and request $r$'s blocks are consecutive, so `kv_indices` is just
#   `0, 1, 2, …` and the load path is the affine one;
# - `qo_indptr` and `kv_indptr` are the prefix sums of the query and key lengths (`cu_seqlens_q`,
#   `cu_seqlens_k`).
#
# Causal masks are **bottom-right aligned**: query $i$ of a request with `qo_len` queries and `kv_len` keys
# sits at position `kv_len - qo_len + i`. A prefill (`qo_len == kv_len`) gets the usual triangle, an append
# (chunked prefill, `qo_len < kv_len`) sees the whole cached part plus its own triangle, a decode sees all.

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
from pictures import draw_layout, draw_row_tiles

# %% [markdown]
# ## The idea: a prefill, an append and a decode in one batch

# %%
qo_lens, kv_lens = [7, 3, 1], [7, 10, 6]
layout = ba.layouts.ragged(qo_lens, kv_lens)
print(layout)
print("qo_indptr (cu_seqlens_q):", layout.qo_indptr)
print("kv_indptr (cu_seqlens_k):", layout.kv_indptr)
print("kv_indices:              ", layout.kv_indices, " <- consecutive: the dense path")
for r in range(layout.num_rows):
    pos = ba.indexing.query_position(qo_lens[r], kv_lens[r], np.arange(qo_lens[r]))
    print(f"request {r}: query positions {pos}")

# %% [markdown]
# ## A picture
#
# Left: the causal mask element by element. Right: the tiles a kernel computes, 4 queries by 4 keys, each
# starting at its own request's first query and key. Tiles on a diagonal are partly masked; tiles above it
# hold no visible pair and are skipped.

# %%
causal = ba.Variant(causal=True)
fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
draw_layout(axes[0], layout, 1, 1, causal, "causal, element by element")
draw_row_tiles(axes[1], layout, 4, 4, causal, "the (4 queries x 4 keys) tiles computed")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# The ragged call equals a loop over requests, each a plain causal softmax over its own keys — written here
# from scratch, with the bottom-right alignment spelled out.

# %%
rng = np.random.default_rng(0)
num_qo_heads, num_kv_heads, head_dim = 4, 1, 16
q = rng.standard_normal((layout.nnz_qo, num_qo_heads, head_dim))      # [sum(qo_lens), Hq, D]
k = rng.standard_normal((layout.num_slots, num_kv_heads, head_dim))   # [sum(kv_lens), Hkv, D]
v = rng.standard_normal(k.shape)
out = ba.attention(q, k, v, layout, variant=causal)

worst = 0.0
for r in range(layout.num_rows):
    qs, ks = layout.qo_indptr[r], layout.kv_indptr[r]
    qr, kr, vr = q[qs:qs + qo_lens[r]], k[ks:ks + kv_lens[r], 0], v[ks:ks + kv_lens[r], 0]
    scores = np.einsum("nhd,md->hnm", qr, kr) / np.sqrt(head_dim)
    q_pos = kv_lens[r] - qo_lens[r] + np.arange(qo_lens[r])
    scores = np.where(np.arange(kv_lens[r])[None, :] <= q_pos[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    expected = np.einsum("hnm,md->nhd", p / p.sum(axis=2, keepdims=True), vr)
    worst = max(worst, np.abs(out[qs:qs + qo_lens[r]] - expected).max())
print("max |ragged - per-request loop|:", worst)

# %% [markdown]
# ## The tiers agree
#
# The causal batch, and the same batch under a sliding window of 3 keys with a logit soft cap, on every tier.

# %%
windowed = ba.Variant(causal=True, window_left=3, logits_soft_cap=5.0)
out_windowed = ba.attention(q, k, v, layout, variant=windowed)
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
for name in tiers.available():
    tiers.check(f"{name} causal", ba.attention(q32, k32, v32, layout, variant=causal, backend=name), out)
    tiers.check(f"{name} window", ba.attention(q32, k32, v32, layout, variant=windowed, backend=name), out_windowed)

# %% [markdown]
# ## What it costs: padding against packing
#
# Score pairs a kernel computes for a causal prefill of 16 requests (each pair counted once), packed versus
# padded to the longest request. With equal lengths they tie; the more the lengths spread, the more of a
# padded batch is padding.

# %%
def causal_pairs(n):
    return n * (n + 1) // 2


rng = np.random.default_rng(3)
batches = {
    "constant 1024": np.full(16, 1024),
    "U(256, 1792)": rng.integers(256, 1793, size=16),
    "lognormal, mean ~1024": np.clip(rng.lognormal(6.6, 0.8, size=16), 16, 8192).astype(int),
}
names, packed, padded = list(batches), [], []
for name, lens in batches.items():
    packed.append(causal_pairs(lens).sum())
    padded.append(len(lens) * causal_pairs(lens.max()))
    print(f"{name:>22}: packed {packed[-1] / 1e6:6.1f} M pairs, padded {padded[-1] / 1e6:6.1f} M "
          f"({padded[-1] / packed[-1]:.2f}x)")

x = np.arange(len(names))
fig, ax = plt.subplots(figsize=(8, 3))
ax.bar(x - 0.2, np.array(packed) / 1e6, width=0.4, label="ragged (packed)")
ax.bar(x + 0.2, np.array(padded) / 1e6, width=0.4, label="padded to the longest")
ax.set_xticks(x, names)
ax.set_ylabel("causal score pairs (millions)")
ax.set_title("16-request causal prefill")
ax.legend()
fig.tight_layout()
plt.show()
