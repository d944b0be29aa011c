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
# # 13. Multi-head latent attention is one more BSR layout
#
# DeepSeek-V2 and V3 do not cache a key and a value per head. Multi-head latent attention (MLA) caches, per token,
# one **latent vector** $c_j$ (`ckv`, $D_c = 512$ wide) and one small **rotary key** $k^{pe}_j$ (`kpe`,
# $D_r = 64$), shared by all $H = 128$ query heads. Each head's key and value are up-projections of the latent,
# $k_{hj} = W^{UK}_h c_j$ and $v_{hj} = W^{UV}_h c_j$, and both projections can be **absorbed**: $W^{UK}_h$ into
# the query ($q^{nope}_h = W^{UK\top}_h q_h$), $W^{UV}_h$ into the output projection, applied after attention.
# What is left for the attention kernel is
#
# $$s_{hj} = \mathrm{sm\_scale}\,\big(q^{nope}_h \cdot c_j + q^{pe}_h \cdot k^{pe}_j\big), \qquad
#   o_h = \sum_j p_{hj}\, c_j, \qquad p_{hj} = \text{softmax}_j(s_{hj})$$
#
# and that is ordinary attention with **one KV head shared by every query head** — a GQA group of $G = H$ — whose
# key is the concatenation $c_j \oplus k^{pe}_j$ ($D_c + D_r$ wide: two dot products are one over the
# concatenation) and whose value is $c_j$, narrower than the key. The KV cache is a pool of such slots, so every
# layout of notebooks 1–6 serves MLA unchanged; only the microkernel must read a value narrower than its key.
# `ba.mla_attention` and `ba.BatchMLAAttention` take FlashInfer's MLA operands and run exactly that.

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
# ## The idea: absorb the up-projections, keep one latent head
#
# First the claim behind the cache, at small sizes: per-head keys and values expanded from the latent give the
# same output as the absorbed form, which never materialises them. (The rotary part is left out here: it is
# already one key shared by all heads, so there is nothing to absorb.)

# %%
rng = np.random.default_rng(0)
H, Dc, Dh, n = 4, 32, 8, 10                                 # heads, latent width, per-head width, tokens
c = rng.standard_normal((n, Dc))                            # [n, Dc]      the cache: one latent per token
W_uk, W_uv = rng.standard_normal((2, H, Dh, Dc)) / np.sqrt(Dc)  # [H, Dh, Dc] the up-projections
q = rng.standard_normal((H, Dh))                            # [H, Dh]      one query token's heads


def softmax(s):
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


k_heads = np.einsum("hdc,nc->hnd", W_uk, c)                 # [H, n, Dh]   per-head keys: what MHA would cache
v_heads = np.einsum("hdc,nc->hnd", W_uv, c)
expanded = np.einsum("hn,hnd->hd", softmax(np.einsum("hd,hnd->hn", q, k_heads) / np.sqrt(Dh)), v_heads)

q_nope = np.einsum("hdc,hd->hc", W_uk, q)                   # [H, Dc]      W_uk absorbed into the query
latent_out = softmax(q_nope @ c.T / np.sqrt(Dh)) @ c        # [H, Dc]      attention over the latents alone
absorbed = np.einsum("hdc,hc->hd", W_uv, latent_out)        # W_uv applied after attention
print("per-head K/V vs absorbed, max |diff|:", np.abs(expanded - absorbed).max())
print(f"cached per token: {2 * H * Dh} numbers as per-head K and V, {Dc} as the latent")

# %% [markdown]
# ## A picture
#
# A batch over a paged latent cache (pages of 8 slots): two decoding requests and one verifying three draft
# tokens at once. The picture is the one notebook 2 drew for ordinary attention — it is the same layout; what
# changes is what a slot holds (`ckv ⊕ kpe`, one latent head) and how many query heads read it. Every query
# row stands for all $H$ heads, which read the slot's one latent together: one load of a block serves them all.

# %%
page_size, num_pages = 8, 6
layout = ba.layouts.paged(qo_lens=[1, 1, 3], page_tables=[[4, 0, 2], [5], [1, 3]], kv_lens=[19, 6, 11],
                          page_size=page_size, num_pages=num_pages)
print(layout)
fig, ax = plt.subplots(figsize=(10, 2.4))
draw.layout(layout, variant=ba.Variant(causal=True), ax=ax,
            title=f"MLA over a paged cache: Bc = {page_size}, each slot ckv ⊕ kpe, one latent head for all H")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The reference: three ways to the same answer
#
# Small sizes ($H = 8$, $D_c = 32$, $D_r = 8$). `ba.mla_attention` takes MLA's operands as FlashInfer names them;
# `ba.attention` takes the one-KV-head reading of them — `q = q_nope ⊕ q_pe`, `k = ckv ⊕ kpe` with a KV-head axis
# of 1, `v` the key's first $D_c$ columns (a view, so the cache is read once); and a direct NumPy formula walks
# each query's slots with no concatenation at all. The default scale is $1/\sqrt{D_c + D_r}$, the key's width; a
# model whose scale is that of its unabsorbed heads (DeepSeek's is $1/\sqrt{128 + 64}$, times a YaRN factor) passes
# it as `ba.Variant(sm_scale=...)`.

# %%
H, Dc, Dr = 8, 32, 8
causal = ba.Variant(causal=True)
q_nope = rng.standard_normal((layout.nnz_qo, H, Dc))      # [nnz_qo, H, Dc]
q_pe = rng.standard_normal((layout.nnz_qo, H, Dr))        # [nnz_qo, H, Dr]
ckv = rng.standard_normal((num_pages, page_size, Dc))     # [num_pages, page_size, Dc]
kpe = rng.standard_normal((num_pages, page_size, Dr))     # [num_pages, page_size, Dr]

out, lse = ba.mla_attention(q_nope, q_pe, ckv, kpe, layout, variant=causal, return_lse=True)

q_cat = np.concatenate([q_nope, q_pe], axis=-1)            # [nnz_qo, H, Dc + Dr]
k_cat = np.concatenate([ckv, kpe], axis=-1)[:, :, None]    # [num_pages, page_size, 1, Dc + Dr]: one KV head
v_view = k_cat[..., :Dc]                                   # [num_pages, page_size, 1, Dc]: ckv, a view of the key
out_attn = ba.attention(q_cat, k_cat, v_view, layout, variant=causal)


def mla_formula(q_nope, q_pe, ckv, kpe, layout):
    """MLA row by row: each query's visible slots, scored by both dot products, weighting ckv itself."""
    ckv, kpe = ckv.reshape(-1, ckv.shape[-1]), kpe.reshape(-1, kpe.shape[-1])
    scale = 1 / np.sqrt(ckv.shape[-1] + kpe.shape[-1])
    o = np.zeros(q_nope.shape)
    for r in range(layout.num_rows):
        slots, qo_len, kv_len = layout.kv_slots(r), int(layout.qo_lens[r]), int(layout.kv_lens[r])
        for i in range(qo_len):
            row, seen = int(layout.qo_indptr[r]) + i, slots[: kv_len - qo_len + i + 1]   # causal, bottom-right
            s = scale * (q_nope[row] @ ckv[seen].T + q_pe[row] @ kpe[seen].T)          # [H, visible]
            o[row] = softmax(s) @ ckv[seen]
    return o


out_formula = mla_formula(q_nope, q_pe, ckv, kpe, layout)
print("out:", out.shape, " lse:", lse.shape)
print("mla_attention vs attention, one KV head:", np.abs(out - out_attn).max())
print("mla_attention vs the formula:           ", np.abs(out - out_formula).max())
print("v is a view of k, no copy:              ", np.shares_memory(v_view, k_cat))

# %% [markdown]
# ## Plan and run: the scheduler and ⊕ are unchanged
#
# `ba.BatchMLAAttention` is `ba.BatchAttention` with `num_heads` query heads over one KV head of width
# $D_c + D_r$ and values of $D_c$. On three CTAs, with chunks of 8 slots, the scheduler splits the two longer
# requests; each chunk writes a partial state, and the plan's merges fold them with ⊕ in a fixed order — the same
# plan, the same merge, as for any other attention. The merged answer is the one-shot answer, to rounding.

# %%
attn = ba.BatchMLAAttention(backend="reference")
attn.plan(layout, num_heads=H, head_dim_ckv=Dc, head_dim_kpe=Dr, variant=causal, num_ctas=3, fixed_split_size=8)
work_plan = attn.work_plans[0]
print(f"{work_plan.num_items} work items on {work_plan.num_ctas} CTAs, {work_plan.num_merges} merges of split rows")
out_planned, lse_planned = attn.run(q_nope, q_pe, ckv, kpe, return_lse=True)
print("planned and merged vs one-shot: out", np.abs(out_planned - out).max(), " lse", np.abs(lse_planned - lse).max())

fig, ax = plt.subplots(figsize=(9, 2))
draw.plan(work_plan, ax=ax, title=f"the MLA plan on {work_plan.num_ctas} CTAs, chunks of 8 slots:")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What it costs: one latent head makes decode compute-bound
#
# A decode step reads every KV slot of every request once, and each slot's bytes feed every query head that reads
# it. Its **arithmetic intensity** — FLOPs per byte read from HBM — is therefore set per slot by the shapes alone
# (queries and outputs are a few rows per request, negligible against the cache, and left out):
#
# | model | bytes per slot | FLOPs per slot |
# |---|---|---|
# | MLA | $(D_c + D_r) \times 2$: latent and rotary key, once for all heads | $H\,(2(D_c + D_r) + 2D_c)$: scores, $p \cdot c$ |
# | GQA / MHA | $H_{kv} \times 2 \times D \times 2$: K and V of every KV head | $H\,(2D + 2D)$: scores, $p \cdot v$ |
#
# In GQA each KV head serves $G = H / H_{kv}$ query heads, so the intensity is about $G$ flop/byte whatever $H$; in
# MLA one slot serves all $H$ heads, so the intensity grows with $H$. The numbers below are in code: change them.
#
# The machine's **ridge point** — where a kernel stops being limited by bandwidth and starts being limited by
# arithmetic — is its peak compute over its peak bandwidth. These are the public spec figures of the H200 SXM from
# NVIDIA's H200 datasheet: 1,979 TFLOP/s of FP16/BF16 tensor throughput *with 2:4 sparsity*, so 989 TFLOP/s dense,
# and 4.8 TB/s of HBM3e bandwidth. They are peaks, not measurements (notebook 10 shows what the benchmarks
# measured); the ridge point sits near 206 flop/byte.

# %%
BYTES = 2                           # 16-bit cache
H200_DENSE_FLOPS = 989e12           # FP16/BF16 tensor, dense (the datasheet's 1,979 TFLOP/s is with sparsity)
H200_HBM_BYTES = 4.8e12             # HBM3e, bytes/s
ridge = H200_DENSE_FLOPS / H200_HBM_BYTES


def mla_intensity(num_heads, dc=512, dr=64, nbytes=BYTES):
    """FLOPs per byte of a decode step over one MLA slot: every head scores it and reads its latent."""
    flops = num_heads * (2 * (dc + dr) + 2 * dc)
    return flops / ((dc + dr) * nbytes)


def gqa_intensity(num_qo_heads, num_kv_heads, head_dim, nbytes=BYTES):
    """FLOPs per byte of a decode step over one slot of a K and V cache of ``num_kv_heads`` heads."""
    flops = num_qo_heads * (2 * head_dim + 2 * head_dim)
    return flops / (num_kv_heads * 2 * head_dim * nbytes)


models = {"MLA, DeepSeek-V3 (H 128, Dc 512, Dr 64)": mla_intensity(128),
          "GQA, Llama-3-8B (32 / 8 heads of 128)": gqa_intensity(32, 8, 128),
          "MHA (32 / 32 heads of 128)": gqa_intensity(32, 32, 128)}
print(f"H200 ridge point: {H200_DENSE_FLOPS / 1e12:.0f} TFLOP/s / {H200_HBM_BYTES / 1e12:.1f} TB/s = "
      f"{ridge:.0f} flop/byte")
for name, intensity in models.items():
    bound = "compute-bound" if intensity > ridge else "memory-bound"
    print(f"{name:>40}: {intensity:6.1f} flop/byte  ({bound})")
crossing = ridge / mla_intensity(1)
print(f"MLA decode crosses the ridge at H = {crossing:.0f} query heads")

heads = np.arange(1, 257)
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.plot(heads, mla_intensity(heads), label="MLA decode (Dc 512, Dr 64)", color="C0")
ax.axhline(ridge, color="k", linestyle="--", label=f"H200 ridge point, {ridge:.0f} flop/byte")
ax.axvline(crossing, color="C0", linestyle=":", linewidth=1)
ax.plot([128], [mla_intensity(128)], "o", color="C0")
ax.annotate(f"DeepSeek-V3, H = 128: {mla_intensity(128):.0f}", (128, mla_intensity(128)), textcoords="offset points",
            xytext=(8, -14))
ax.annotate(f"crosses at H ≈ {crossing:.0f}", (crossing, ridge), textcoords="offset points", xytext=(-95, 8))
for (name, intensity), color in zip(list(models.items())[1:], ("C1", "C2")):
    ax.plot([32], [intensity], "s", color=color, label=f"{name}: {intensity:.0f}")
ax.set_yscale("log")
ax.set_xlabel("query heads H")
ax.set_ylabel("flop / byte of KV read")
ax.set_title("Decode arithmetic intensity per KV slot, 16-bit cache")
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# Below the ridge a decode kernel's floor is the cache's bytes over the bandwidth, and its tensor cores mostly wait;
# above it the floor is the FLOPs. That is why an MLA decode kernel is built like a prefill kernel: the $H$ heads
# of one query become the $H$ rows of the tile (the GQA row mapping of exercise 23, with $G = H$), so one load of a
# latent block feeds a matrix multiply $H$ rows tall.

# %% [markdown]
# ### What a GPU measured
#
# The intensity says where the floor is; a kernel still has to reach it. Benchmark W11 times MLA decode at
# DeepSeek-V3's shapes on one GPU, bsrattn's torch tier beside FlashInfer's MLA kernels in the same process, each
# checked against a float64 reference first; `benchmarks/NOTES.md` says where the time goes. The cell reads the
# committed results, if there are any: the time of a call, the TFLOP/s it reaches, and the bound — the larger of
# the cache's bytes over the measured copy rate and the FLOPs over the measured matrix-multiply rate.

# %%
import json
from pathlib import Path

W11 = next((p / "benchmarks" / "results" / "w11_mla_decode.json" for p in (Path.cwd(), *Path.cwd().parents)
            if (p / "benchmarks" / "results").is_dir()), None)
if W11 is None or not W11.is_file():
    print("No W11 results are committed: `python3 -m benchmarks.w11_mla_decode` measures them on a GPU.")
else:
    payload = json.loads(W11.read_text())
    print(f"measured on {payload['environment']['gpu']['name']}, {payload['environment']['time_utc'][:10]}")
    shown = ("bsrattn-torch", "flashinfer-mla-fa3")
    rows = {}
    for rec in payload["records"]:
        if rec["status"] == "ok" and rec["impl"] in shown:
            c = rec["config"]
            rows.setdefault((c["dtype"], c["page_size"], c["batch"], c["kv_len"]), {})[rec["impl"]] = rec
    print(f"{'batch x kv, page':>18} {'bound us':>9}" + "".join(f"{name:>30}" for name in shown))
    for (dtype, page, batch, kv), recs in sorted(rows.items(), key=lambda item: (item[0][1], item[0][2:])):
        bound = next(iter(recs.values()))["bound_us"]
        cells = "".join(f"{recs[name]['time_us']:>12.1f} us {recs[name]['tflop_per_s']:>6.0f} TFLOP/s"
                        if name in recs else f"{'-':>30}" for name in shown)
        print(f"{f'{batch} x {kv}, {page}':>18} {bound:>9.1f}{cells}")

# %% [markdown]
# From batch 32 up the work is past the ridge and the bound is the FLOPs: FlashInfer's kernel runs at several
# hundred TFLOP/s, a large fraction of the matrix-multiply rate, while bsrattn's torch tier runs at a fraction of
# that. Its tile is 64 heads x 64 keys on Hopper's warpgroup matrix multiply (`wgmma`), as FlashInfer's kernel uses,
# but written in Triton's tile dialect: every wait there drains all the products in flight, so a tile's softmax
# cannot overlap the next tile's products, and beside a 512-wide float32 accumulator the tile spills registers.
# FlashInfer's kernel splits the accumulator between two warpgroups and overlaps their work by hand
# (`benchmarks/NOTES.md` has the figures, and a plan fix at batch 32 timed in a sweep but not yet in this run). The
# layout, the plan and the merge are the same for both; what separates them is the microkernel, the one part of the
# design that is specific to the hardware.

# %% [markdown]
# ## One flag picks the tier
#
# `backend=` switches the tier with nothing else changed: the reference in NumPy, the numba tier (here in Numba's
# CUDA simulator), the torch tier (here in Triton's interpreter). A tier runs MLA where its kernel reads a value
# narrower than its key — `ba.get_backend(name).head_dim_vo` says so — and otherwise refuses by name, before
# launching anything, rather than answer wrong. The sizes are tiny, for the simulators.

# %%
small = ba.layouts.paged(qo_lens=[1, 2], page_tables=[[2, 0], [1]], kv_lens=[7, 4], page_size=4, num_pages=3)
Hs, Dcs, Drs = 4, 16, 8
operands = [rng.standard_normal(shape).astype(np.float32)
            for shape in ((small.nnz_qo, Hs, Dcs), (small.nnz_qo, Hs, Drs), (3, 4, Dcs), (3, 4, Drs))]
expected = ba.mla_attention(*[x.astype(np.float64) for x in operands], small)
for name in tiers.available():
    if ba.get_backend(name).head_dim_vo:
        print(f"{name:>9}: head_dim_vo is True here, its kernel reads ckv as the value; it runs")
        tiers.check(name, ba.mla_attention(*operands, small, backend=name), expected)
        continue
    print(f"{name:>9}: head_dim_vo is False here, its kernel takes v as wide as k; it refuses by name:")
    try:
        ba.mla_attention(*operands, small, backend=name)
    except ValueError as err:
        print(f"{'':11}{err}")

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 25, **mla-as-attention** (`python -m bsrattn.exercises check 25`): Multi-head latent attention as
#   attention: MLA's operands as q, k and v of one KV head read by every head.
