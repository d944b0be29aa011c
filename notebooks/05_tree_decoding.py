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
# # 5. Tree decoding: a tree mask is block occupancy
#
# Speculative decoding drafts several continuations at once and verifies them in one forward pass. Drafts that
# share a beginning share a branch, so the candidates form a **tree** (Medusa, SpecInfer, EAGLE). All its nodes
# go through the target model together, as one request's queries, and each node must see exactly the committed
# tokens, its ancestors and itself — nothing from sibling branches.
#
# That visibility is an arbitrary mask, so it is data, not a function of positions: the layout carries it as
# a **custom mask**, per request a `[qo_len, kv_len]` boolean block. In BSR terms the tree's keys live in pages
# like any other tokens, and the mask says which elements of the occupied blocks count. A tile with no visible
# pair need not be computed at all.

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
# ## The idea: a draft tree of eight nodes behind twelve committed tokens
#
# `parents[i]` is node $i$'s parent (`-1` for the root). The tree's nodes are stored as the last eight KV slots
# of the request, in node order, and they are also its eight query rows.

# %%
parents = [-1, 0, 0, 1, 1, 2, 3, 5]
committed, page_size = 12, 4
kv_len = committed + len(parents)
layout = ba.layouts.tree([parents], page_tables=[[2, 0, 4, 1, 3]], kv_lens=[kv_len], page_size=page_size,
                         num_pages=5)
print(layout)
mask = layout.row_mask(0)                                              # [qo_len, kv_len]
print("tree part of the mask (rows = nodes, columns = tree slots):")
print(mask[:, committed:].astype(int))

# %% [markdown]
# ## A picture
#
# Left: the draft tree. Middle: the request's mask in logical key order — committed tokens are visible to every
# node, the tree part is each node's ancestry. Right: the same mask in the pool, with the $(4, 4)$ tiles that
# hold a visible pair; the others hold no work at all.

# %%
def tree_coordinates(parents):
    """(x, depth) of each node: leaves spread left to right, a parent above the middle of its children."""
    children = {i: [c for c, p in enumerate(parents) if p == i] for i in range(len(parents))}
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    x, next_leaf = {}, [0]

    def place(i):
        for c in children[i]:
            place(c)
        if children[i]:
            x[i] = float(np.mean([x[c] for c in children[i]]))
        else:
            x[i], next_leaf[0] = float(next_leaf[0]), next_leaf[0] + 1

    for root in (i for i, p in enumerate(parents) if p < 0):
        place(root)
    return [x[i] for i in range(len(parents))], depth


fig, axes = plt.subplots(1, 3, figsize=(15, 3.2), gridspec_kw={"width_ratios": [1, 1.4, 1.6]})
xs, depths = tree_coordinates(parents)
for i, p in enumerate(parents):
    if p >= 0:
        axes[0].plot([xs[p], xs[i]], [depths[p], depths[i]], color="0.5", zorder=1)
axes[0].scatter(xs, depths, s=420, color="C0", zorder=2)
for i in range(len(parents)):
    axes[0].annotate(str(i), (xs[i], depths[i]), ha="center", va="center", color="white", weight="bold")
axes[0].margins(0.15)
axes[0].invert_yaxis()
axes[0].set_axis_off()
axes[0].set_title("draft tree")
axes[1].imshow(mask, cmap="Blues", vmin=0, vmax=1.4, interpolation="nearest", aspect="auto")
axes[1].axvline(committed - 0.5, color="C3", linestyle="--")
axes[1].set_xlabel("logical key (committed | tree)")
axes[1].set_ylabel("tree node (query)")
axes[1].set_title("custom mask, logical order")
draw.layout(layout, tiles=(4, 4), tile_grid="pool", ax=axes[2], title="in the pool, (4, 4) tiles with a visible pair")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# The same attention, written another way: each node as its own decode query over exactly the slots on its
# path (committed tokens, ancestors, itself) — a vector-sparse layout with $B_c = 1$ and no mask at all. The
# tree mask and the explicit slot lists give the same answer.

# %%
rng = np.random.default_rng(0)
num_qo_heads, num_kv_heads, head_dim = 4, 2, 16
q = rng.standard_normal((layout.nnz_qo, num_qo_heads, head_dim))                        # [nodes, Hq, D]
k = rng.standard_normal((layout.num_blocks, page_size, num_kv_heads, head_dim))         # [pages, page, Hkv, D]
v = rng.standard_normal(k.shape)
out = ba.attention(q, k, v, layout)

slots = layout.kv_slots(0)
paths = [slots[mask[i]] for i in range(len(parents))]
per_node = ba.layouts.vector_sparse(paths, qo_lens=[1] * len(parents), num_slots=layout.num_slots)
k_slots, v_slots = (x.reshape(-1, num_kv_heads, head_dim) for x in (k, v))              # [slots, Hkv, D]
print("tree mask vs per-node slot lists:", np.abs(out - ba.attention(q, k_slots, v_slots, per_node)).max())

# %% [markdown]
# ## The tiers agree

# %%
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
for name in tiers.available():
    tiers.check(name, ba.attention(q32, k32, v32, layout, backend=name), out)

# %% [markdown]
# ## What it costs
#
# Verifying $n$ draft nodes one by one would read the committed cache $n$ times. The tree call reads it once for
# all nodes (they are one block row, $B_r = n$), plus the tree's own $n$ slots. Below, for a 4096-token
# context, KV slots read against the number of nodes of a random tree, and the share of $(16, 16)$ tiles of the
# tree part that hold any visible pair (the rest hold none: a kernel that read the mask a tile at a time could
# skip them; bsrattn's kernels bound their KV loops by position only, as notebook 3 counts).

# %%
def random_tree(n, seed):
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


context = 4096
sizes = [4, 8, 16, 32, 64, 128]
one_by_one, together, tile_share = [], [], []
for n in sizes:
    tree_n = ba.layouts.tree([random_tree(n, n)], [np.arange(-(-(context + n) // 16))], [context + n], 16,
                             -(-(context + n) // 16))
    tree_mask = tree_n.row_mask(0)[:, context:]
    one_by_one.append(int(tree_n.row_mask(0).sum()))     # each node alone reads its own path
    together.append(context + n)
    t = -(-n // 16)                                       # tiles per side of the tree part
    padded = np.zeros((t * 16, t * 16), dtype=bool)
    padded[:n, :n] = tree_mask
    tile_share.append(padded.reshape(t, 16, t, 16).any(axis=(1, 3)).mean())
    print(f"{n:4d} nodes: {one_by_one[-1]:7d} slots one by one, {together[-1]:5d} as one tree call "
          f"({one_by_one[-1] / together[-1]:5.1f}x); {tile_share[-1]:.0%} of tree tiles computed")

fig, axes = plt.subplots(1, 2, figsize=(12, 3))
axes[0].plot(sizes, one_by_one, marker="o", label="each node separately")
axes[0].plot(sizes, together, marker="o", label="one tree call")
axes[0].set_xscale("log", base=2)
axes[0].set_yscale("log")
axes[0].set_xlabel("draft nodes")
axes[0].set_ylabel("KV slots read")
axes[0].set_title(f"verifying a draft tree, {context}-token context")
axes[0].legend()
axes[1].plot(sizes, tile_share, marker="o", color="C2")
axes[1].set_xscale("log", base=2)
axes[1].set_ylim(0, 1.05)
axes[1].set_xlabel("draft nodes")
axes[1].set_ylabel("tree tiles with a visible pair")
axes[1].set_title("the tree part on (16, 16) tiles")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 21, **tree-mask** (`python -m bsrattn.exercises check 21`): A draft tree as a custom mask: each node sees
#   the committed tokens, its ancestors and itself.
