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
from bsrattn import draw

# %% [markdown]
# ## The idea: a prefill, an append and a decode in one batch

# %%
qo_lens, kv_lens = [7, 3, 1], [7, 10, 6]
layout = ba.layouts.ragged(qo_lens, kv_lens)
print(layout)
print("qo_indptr (cu_seqlens_q):", layout.qo_indptr)
print("kv_indptr (cu_seqlens_k):", layout.kv_indptr)
print("kv_indices:              ", layout.kv_indices, " <- consecutive: the affine path")
for r in range(layout.num_rows):
    pos = ba.indexing.query_position(qo_lens[r], kv_lens[r], np.arange(qo_lens[r]))
    print(f"request {r}: query positions {pos}")

# %% [markdown]
# ## A picture
#
# Left: the causal mask element by element, over the stored blocks — one slot wide ($B_c = 1$), as tall as the
# request. Right: tiles of 4 queries by 4 keys, each starting at its own request's first query and key, as a
# kernel tiles a request. Tiles on a diagonal are partly masked; the one above it holds no visible pair, and a
# causal kernel never loads it (counted at full size at the end of this notebook).

# %%
causal = ba.Variant(causal=True)
fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
draw.layout(layout, variant=causal, ax=axes[0], title="causal, element by element, Bc = 1")
draw.layout(layout, variant=causal, tiles=(4, 4), ax=axes[1], title="4 queries x 4 keys tiles with a visible pair")
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

fig, ax = plt.subplots(figsize=(8, 3))
bars = ax.bar(names, np.array(padded) / np.array(packed), color="C1", width=0.5)
ax.bar_label(bars, fmt="%.2fx")
ax.axhline(1.0, color="black", linewidth=0.8, label="ragged (packed) = 1")
ax.set_ylabel("padded pairs / packed pairs")
ax.set_title("16-request causal prefill: the work padding adds")
ax.legend(loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What it costs: the tiles a causal kernel never loads
#
# A masked tile still costs its loads and its arithmetic; a tile outside the mask need not be touched at all. The
# torch tier's kernel bounds each query tile's KV loop by the variant (block skipping, in
# `bsrattn/torch_cuda/executor.py`): causal masking ends it after the tile's last query position, and a sliding
# window starts it at the tile's first query position minus `window_left`. Here is that rule applied to the
# plan of a prefill of three requests (2048, 1024 and 512 tokens), with the torch tier's prefill tiles: `BLOCK_M`
# rows of (query row, query head) pairs — 128, that is 32 query rows of a 4-head GQA group — by `BLOCK_N` = 64
# keys.

# %%
group = 4              # 32 query heads over 8 KV heads
block_m = 128          # (query row, head) rows of a prefill tile: PREFILL_BLOCK_M in bsrattn/torch_cuda/config.py
block_n = 64           # keys of a tile, for head_dim 128 in bfloat16: config.tiles(...).block_n
ctas_per_sm = 4        # a prefill launch's CTAs per SM: config.CTAS_PER_SM["prefill"]
if tiers.torch_extra_installed():  # checked against the tier itself
    from bsrattn.torch_cuda import config as torch_config

    tier = (torch_config.PREFILL_BLOCK_M, torch_config.tiles(block_m, 128, "bfloat16").block_n,
            torch_config.CTAS_PER_SM["prefill"])
    assert (block_m, block_n, ctas_per_sm) == tier, tier
prefill = ba.layouts.ragged([2048, 1024, 512], [2048, 1024, 512])


def kv_loops(work_plan, layout, variant):
    """The KV loop of every query tile of every item: ``(block row, first query, lo, hi, kv_start, kv_end)``.

    ``lo:hi`` is the range the kernel walks, ``BLOCK_N`` keys at a time from ``lo``; ``kv_start:kv_end`` the item's.
    """
    loops = []
    for w in range(work_plan.num_items):
        r = int(work_plan.item_row[w])
        qo_first, qo_len, kv_len = int(layout.qo_indptr[r]), int(layout.qo_lens[r]), int(layout.kv_lens[r])
        qo_start, qo_end = int(work_plan.item_qo_start[w]), int(work_plan.item_qo_end[w])
        kv_start, kv_end = int(work_plan.item_kv_start[w]), int(work_plan.item_kv_end[w])
        n_rows = (qo_end - qo_start) * group
        for m0 in range(0, n_rows, block_m):
            lo, hi = kv_start, kv_end
            if variant.causal:
                last = qo_start - qo_first + (min(m0 + block_m, n_rows) - 1) // group
                hi = min(hi, ba.indexing.query_position(qo_len, kv_len, last) + 1)
            if variant.window_left >= 0:
                first = qo_start - qo_first + m0 // group
                lo = max(lo, ba.indexing.query_position(qo_len, kv_len, first) - variant.window_left)
            loops.append((r, qo_start - qo_first + m0 // group, lo, max(lo, hi), kv_start, kv_end))
    return loops


skipping = {"causal": ba.Variant(causal=True), "causal, window 256": ba.Variant(causal=True, window_left=256)}
work_plan = ba.scheduler.plan(prefill.qo_lens, prefill.kv_lens, tile_q=block_m // group,
                              num_ctas=132 * ctas_per_sm // 8)
loops = {}
for label, variant in skipping.items():
    loops[label] = kv_loops(work_plan, prefill, variant)
    loaded = sum(ba.indexing.ceil_div(hi - lo, block_n) for _, _, lo, hi, _, _ in loops[label])
    full = sum(ba.indexing.ceil_div(end - start, block_n) for *_, start, end in loops[label])
    # The skip is exact: no query of a tile sees any key outside the range its loop walks.
    mask = prefill.to_dense_mask(variant)
    for r, q0, lo, hi, start, end in loops[label]:
        rows = mask[prefill.qo_indptr[r] + q0:prefill.qo_indptr[r] + q0 + block_m // group]
        keys = prefill.kv_slots(r)
        assert not rows[:, keys[start:lo]].any() and not rows[:, keys[hi:end]].any()
    print(f"{label:>19}: {loaded:5d} of {full:5d} KV tile loads ({loaded / full:.0%}), "
          f"over {len(loops[label])} query tiles")

# %% [markdown]
# Each query tile of the 2048-token request as a row, the KV tiles its loop loads as boxes: the causal triangle,
# and the window's band. Everything white is never read.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, (label, request_loops) in zip(axes, loops.items()):
    rows = [(q0, lo, hi) for r, q0, lo, hi, _, _ in request_loops if r == 0]
    for q0, lo, hi in rows:
        starts = np.arange(lo, hi, block_n)
        ax.broken_barh([(x, block_n) for x in starts], (q0, block_m // group), facecolors="C0", edgecolors="white",
                       linewidth=0.3)
    loaded = sum(ba.indexing.ceil_div(hi - lo, block_n) for _, lo, hi in rows)
    ax.set_xlim(0, int(prefill.kv_lens[0]))
    ax.set_ylim(int(prefill.qo_lens[0]), 0)
    ax.set_xlabel("key position")
    ax.set_title(f"{label}: {loaded} of {len(rows) * int(prefill.kv_lens[0]) // block_n} tiles loaded")
axes[0].set_ylabel(f"query position ({block_m // group} per tile)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Exercises
#
# The exercises of the course that go with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 4, **ragged** (`python -m bsrattn.exercises check 4`): A ragged batch as BSR with Bc = 1: its `qo_indptr`,
#   `kv_indptr`, `kv_indices` and `kv_last_len`.
# - Exercise 6, **causal-mask** (`python -m bsrattn.exercises check 6`): The bottom-right causal mask of a block row:
#   which keys each query sees.
# - Exercise 7, **sliding-window** (`python -m bsrattn.exercises check 7`): A sliding window: the keys a query sees when
#   it looks back at most `window_left` positions.
