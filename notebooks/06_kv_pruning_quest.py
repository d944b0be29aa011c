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
# # 6. KV pruning: vector-sparse rows and Quest's per-head pages
#
# Long contexts make decode memory-bound on the KV cache, and most keys barely matter to a given query. KV
# pruning reads only some of them:
#
# - **token level** (H2O, StreamingLLM and friends): each request keeps a scattered list of token slots. In BSR
#   words, $B_c = 1$ and `kv_indices` is the kept slots — `ba.layouts.vector_sparse`.
# - **page level** (Quest): for each query, every KV head estimates an upper bound of the scores on each page
#   from the page's per-channel min and max keys, and keeps its top `budget` pages. The selection differs per
#   head, so the layout has **one block row per (request, KV head)** over a cache stored head-major (HND),
#   where page $p$ of head $h$ is the block $p \cdot H_{kv} + h$ — `ba.layouts.quest`.
#
# Either way the kernel is the same: gather the selected rows into fast memory, run the dense microkernel. The
# work is proportional to the budget, not to the sequence length.

# %%
import json
import os
import shutil
from pathlib import Path

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
# ## The idea: Quest's page selection, written out
#
# One decode query, 4 query heads over 2 KV heads, a 200-token context in 13 pages of 16, a budget of 4 pages
# per KV head. For a query $q$ and a page whose keys have per-channel minimum $m$ and maximum $M$, no key on the
# page can score above $\sum_d \max(q_d m_d,\; q_d M_d)$; Quest keeps the pages with the highest bound (summed
# over the query heads that share the KV head). The last, partly filled page holds the newest tokens and is
# always kept.

# %%
rng = np.random.default_rng(0)
num_qo_heads, num_kv_heads, head_dim, page_size = 4, 2, 16, 16
kv_len, budget = 200, 4
num_pages = -(-kv_len // page_size)
page_table = rng.permutation(num_pages)                                    # where the pages sit in the pool
q = rng.standard_normal((1, num_qo_heads, head_dim))                       # [B=1, Hq, D]
k = rng.standard_normal((num_pages, num_kv_heads, page_size, head_dim))    # HND: [pages, Hkv, page, D]
v = rng.standard_normal(k.shape)
k[:, 0, :, :] += 1.5 * rng.standard_normal((num_pages, 1, head_dim))       # make some pages stand out
k[:, 1, :, :] += 1.5 * rng.standard_normal((num_pages, 1, head_dim))

group = num_qo_heads // num_kv_heads
valid = (np.arange(num_pages * page_size) < kv_len).reshape(num_pages, page_size)   # [logical page, slot]
bound = np.zeros((num_kv_heads, num_pages))
for h in range(num_kv_heads):
    keys = k[page_table, h]                                                # [logical page, page, D]
    lo = np.where(valid[..., None], keys, np.inf).min(axis=1)              # [logical page, D]
    hi = np.where(valid[..., None], keys, -np.inf).max(axis=1)
    for g in range(group):
        qh = q[0, h * group + g]
        bound[h] += np.maximum(qh * lo, qh * hi).sum(axis=1)
selected = []
for h in range(num_kv_heads):
    top = np.argsort(-bound[h, :-1])[:budget - 1]                          # the last page is always kept
    selected.append(np.sort(np.append(top, num_pages - 1)))
print("selected logical pages per KV head:", [s.tolist() for s in selected])

layout = ba.layouts.quest([page_table], [kv_len], [selected], page_size, num_pages, num_kv_heads)
print(layout)
print("kv_indices:", layout.kv_indices, " (= pool page * Hkv + head)")

# %% [markdown]
# ## A picture
#
# Left: Quest's score bound per (KV head, logical page), the kept pages outlined. Right: the layout — one row per
# KV head over the head-major pool, each picking its own pages.

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 2.6), gridspec_kw={"width_ratios": [1, 2.2]})
axes[0].imshow(bound, cmap="viridis", aspect="auto")
for h, pages in enumerate(selected):
    for p in pages:
        axes[0].add_patch(plt.Rectangle((p - 0.5, h - 0.5), 1, 1, fill=False, edgecolor="white", linewidth=2))
axes[0].set_xlabel("logical page")
axes[0].set_ylabel("KV head")
axes[0].set_yticks(range(num_kv_heads))
axes[0].set_title("upper bound of q.k per page (kept: outlined)")
draw.layout(layout, ax=axes[1], title="quest layout: row = KV head, pool in (page, head) blocks")
axes[1].set_ylabel("KV head")
axes[1].set_yticks(range(num_kv_heads))
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference
#
# `ba.layouts.per_head_views` reshapes the query to one row per KV head (its `group` query heads side by side)
# and the HND cache to one block per (page, head), without copying. The answer equals attention of each query
# head over exactly its KV head's selected slots, computed by hand.

# %%
qv, kv, vv = ba.layouts.per_head_views(q, k, v, num_kv_heads)      # [B*Hkv, G, D], [P*Hkv, page, 1, D] x2
out = ba.attention(qv, kv, vv, layout).reshape(1, num_qo_heads, head_dim)

worst = 0.0
for hq in range(num_qo_heads):
    h = hq // group
    keys = k[page_table[selected[h]], h].reshape(-1, head_dim)      # [budget * page, D]
    vals = v[page_table[selected[h]], h].reshape(-1, head_dim)
    keep = valid[selected[h]].reshape(-1)                           # the last page is partly filled
    s = np.where(keep, keys @ q[0, hq] / np.sqrt(head_dim), -np.inf)
    p = np.exp(s - s.max())
    worst = max(worst, np.abs(out[0, hq] - (p / p.sum()) @ vals).max())
print("quest layout vs per-head attention by hand:", worst)

# %% [markdown]
# Token-level pruning is the same call with $B_c = 1$: keep 40 scattered tokens of the 200 (here, every head
# shares the selection) and compare with attention over just those tokens, gathered first.

# %%
kept = np.sort(rng.choice(kv_len, 40, replace=False))
k_nhd, v_nhd = (x.transpose(0, 2, 1, 3)[page_table].reshape(-1, num_kv_heads, head_dim)[:kv_len] for x in (k, v))
tokens = ba.layouts.vector_sparse([kept], qo_lens=[1], num_slots=kv_len)
out_tokens = ba.attention(q, k_nhd, v_nhd, tokens)                   # k_nhd: [kv_len, Hkv, D], logical order
gathered = ba.attention(q, k_nhd[kept], v_nhd[kept], ba.layouts.dense(1, kept.size))
print("vector-sparse vs gather-then-dense:", np.abs(out_tokens - gathered).max())

# %% [markdown]
# ## The tiers agree

# %%
qv32, kv32, vv32, q32, k32, v32 = (x.astype(np.float32) for x in (qv, kv, vv, q, k_nhd, v_nhd))
for name in tiers.available():
    quest_out = ba.attention(qv32, kv32, vv32, layout, backend=name).reshape(1, num_qo_heads, head_dim)
    tiers.check(f"{name} quest", quest_out, out)
    tiers.check(f"{name} tokens", ba.attention(q32, k32, v32, tokens, backend=name), out_tokens)

# %% [markdown]
# ## What it costs: bytes that follow the budget, not the context
#
# Per KV head, with `head_dim = 128` in fp16 (K and V), bytes a decode step reads as the context grows: attention
# over the whole cache with a mask (SDPA's approach) scales with the context; a kernel that reads aligned
# 128-slot blocks (FlexAttention's default template) scales with the budget but pays up to 8x; gathering the
# 16-slot pages (Quest in bsrattn and FlashInfer) reads exactly what was selected. The H200's times for the same
# pattern follow below the picture.

# %%
def quest_pages(seq_len, budget, seed):
    """``budget`` distinct random 16-slot pages of a ``seq_len`` cache (all of them if the budget exceeds it)."""
    return np.sort(np.random.default_rng(seed).permutation(seq_len // 16)[:budget])


bytes_per_slot = 128 * 2 * 2
seq_lens = [4096, 8192, 16384, 32768]
fig, ax = plt.subplots(figsize=(8, 3.4))
for budget_pages, style in ((64, "-"), (512, "--")):
    gathered_bytes, blocks_128 = [], []
    for seq_len in seq_lens:
        pages = quest_pages(seq_len, budget_pages, seq_len)
        row = ba.layouts.paged([1], [pages], [pages.size * 16], 16, seq_len // 16)
        gathered_bytes.append(row.read_amplification(16).read * bytes_per_slot)
        blocks_128.append(row.read_amplification(128).read * bytes_per_slot)
    ax.plot(seq_lens, np.array(gathered_bytes) / 2**20, style, color="C2", marker="o",
            label=f"gather 16-slot pages, budget {budget_pages}")
    ax.plot(seq_lens, np.array(blocks_128) / 2**20, style, color="C1", marker="o",
            label=f"aligned 128-slot blocks, budget {budget_pages}")
ax.plot(seq_lens, np.array(seq_lens) * bytes_per_slot / 2**20, color="C3", marker="o", label="whole cache + mask")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("MiB read per KV head")
ax.set_title("Quest decode: bytes per step")
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# On the H200, workload 1 of the benchmark suite times this decode (32 query heads over 32 KV heads, `head_dim`
# 128, fp16, a 32k context, one query), in graph mode: the committed results in `benchmarks/results/`, read here.
# The whole-cache kernel stays where it is whatever the budget; the gathering ones follow the budget.

# %%
here = Path.cwd()
root = next((p for p in (here, *here.parents) if (p / "benchmarks" / "results").is_dir()), None)
if root is None:
    raise FileNotFoundError(f"no benchmarks/results above {here}: run this notebook inside the repository")
w1_path = root / "benchmarks" / "results" / "w1_quest_decode.json"
w1 = json.loads(w1_path.read_text()) if w1_path.is_file() else {"records": []}
measured = {(r["config"]["budget"], r["impl"]): r for r in w1["records"]
            if r["status"] == "ok" and r["config"].get("seq_len") == 32768}
names = {"sdpa-mask": "SDPA + mask (whole cache)", "flex-b128": "FlexAttention, 128-slot blocks",
         "flashinfer-cuda-core": "FlashInfer (gather)", "bsrattn-torch": "bsrattn torch tier (gather)"}
if not measured:
    print(f"no workload 1 results in {w1_path.relative_to(root)}")
for budget in sorted({b for b, _ in measured}):
    cells = [f"{label} {measured[budget, impl]['time_us']:.1f}" for impl, label in names.items()
             if (budget, impl) in measured and measured[budget, impl].get("time_mode") == "graph"]
    print(f"budget {budget:3d} pages, µs: " + ", ".join(cells))

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 9, **quest** (`python -m bsrattn.exercises check 9`): Quest's page selection: keep the pages whose keys
#   could score highest, by an upper bound of `q . k`.
