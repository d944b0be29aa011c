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
# # 12. Partition invariance: the same bits however the work is cut
#
# Notebook 7 showed that ⊕ is associative only to rounding: fold the same states in another order, or cut the
# keys at other points, and the last bits of the answer move. A plan fixes the order, so **the same plan** gives
# the same bits on every run. But a serving engine never runs the same plan twice: each step is planned for the
# whole batch (notebook 8), and the batch changes at every step. So a request's output can depend on who else
# happened to be in the batch — harmless numerically, fatal to a reproducible sample, a regression test that
# compares bits, or a cache keyed on outputs.
#
# `deterministic=True` (on `ba.attention` and `BatchAttention.plan`) makes a query row's `out` and `lse` a
# function of that row alone — its query, its keys, the variant — bitwise, whatever else the call holds and
# however the work is cut:
#
# - whatever the rest of the batch, and `num_ctas`;
# - paged or ragged storage of the same keys;
# - a decode step or the same query as the last row of a causal prefill;
# - a `Cascade` or the same keys in one flat layout;
# - one call, or KV pieces merged afterwards with `ba.merge_state`.
#
# `fixed_split_size` (notebook 7) fixes the chunk size of a normal plan; deterministic mode makes the whole list
# above a contract, on every tier. This notebook shows three of its cases — the batch, a decode step against a
# prefill, merged pieces — why normal mode cannot promise them, how deterministic mode does, and what it costs.

# %%
import os
import shutil
from pathlib import Path

# Without a GPU, the numba tier runs in Numba's CUDA simulator and the torch tier in Triton's interpreter.
# Both read these variables when they are first imported, so they are set before anything imports them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json

import matplotlib.pyplot as plt
import numpy as np

import bsrattn as ba
import tiers

names = tiers.available()

# %% [markdown]
# ## Why split-KV breaks batch invariance
#
# One decode request — 300 keys, 4 query heads over 2 KV heads, `head_dim` 16 — is batched twelve ways: alone
# or beside other decode requests of other lengths, first, second or third in the batch, with the tier's default
# `num_ctas` or another. Its query and its keys are the same every time; only the company changes.
#
# In normal mode the plan is Algorithm 1 (notebook 8): every row's KV is cut into chunks of
# $L_{kv} = \lceil \sum_r \lceil l_{qo,r}/T_q \rceil\, l_{kv,r} \,/\, \#\mathrm{CTA} \rceil$ slots (a tier may round it
# to its KV alignment and keep a minimum chunk), and $L_{kv}$ depends on **every** request in the batch and on the
# number of CTAs. Cut elsewhere, the same row is summed in another order.
#
# Each tier computes in its own precision: the reference here in float64 (from float64 inputs), the numba and
# torch tiers in float32. For each batching we keep the bytes of the watched row's `out` and `lse` and count the
# distinct ones.

# %%
HQ, HKV, D = 4, 2, 16
KV_LEN = 300
DTYPE = {"reference": np.float64, "numba": np.float32, "torch": np.float32}

rng = np.random.default_rng(0)
watched_q = rng.standard_normal((1, HQ, D))                      # [1, Hq, D]: the watched decode step's query
watched_k = rng.standard_normal((KV_LEN, HKV, D))                # [kv_len, Hkv, D]: its keys and values
watched_v = rng.standard_normal((KV_LEN, HKV, D))

# (other requests' KV lengths, num_ctas or None for the tier's default, the watched request's place in the batch)
BATCHINGS = [([], None, 0), ([], 3, 0), ([100], None, 1), ([200], 4, 0), ([40, 30], None, 1), ([200], None, 0),
             ([60, 30, 30], 4, 2), ([100], 7, 1), ([20], 2, 0), ([80, 20], 6, 1), ([64], 8, 0), ([100], None, 0)]


def batch(companions, place):
    """The watched request at ``place`` among decode requests of KV lengths ``companions``, as one ragged batch:
    ``(layout, q, k, v)`` in float64, the companions' queries and keys random."""
    other = np.random.default_rng(len(companions) + sum(companions))
    qs = [other.standard_normal((1, HQ, D)) for _ in companions]
    ks = [other.standard_normal((n, HKV, D)) for n in companions]
    vs = [other.standard_normal((n, HKV, D)) for n in companions]
    qs.insert(place, watched_q)
    ks.insert(place, watched_k)
    vs.insert(place, watched_v)
    lens = [len(x) for x in ks]
    return ba.layouts.ragged([1] * len(lens), lens), np.concatenate(qs), np.concatenate(ks), np.concatenate(vs)


def watched_row(name, batching, dtype=None, **options):
    """Run ``batching`` on tier ``name``; the watched row's ``out`` and ``lse`` bytes, and the plan's chunk size."""
    companions, num_ctas, place = batching
    layout, q, k, v = batch(companions, place)
    dtype = DTYPE[name] if dtype is None else dtype
    attn = ba.BatchAttention(backend=name)
    attn.plan(layout, HQ, HKV, D, num_ctas=num_ctas, **options)
    o, lse = attn.run(q.astype(dtype), k.astype(dtype), v.astype(dtype), return_lse=True)
    o, lse = np.asarray(o), np.asarray(lse)
    return o[place].tobytes() + lse[place].tobytes(), attn.work_plans[0].kv_chunk_size


def show(runs, title):
    """Print each batching's chunk size and result label per tier, then the distinct counts."""
    print(title)
    print(f"{'':3} {'other KV lengths':>17} {'num_ctas':>9} {'place':>5} " +
          " ".join(f"{name + ' L_kv, result':>22}" for name in runs))
    labels = {name: {} for name in runs}
    for i, (companions, num_ctas, place) in enumerate(BATCHINGS):
        cells = []
        for name, results in runs.items():
            bits, chunk = results[i]
            label = labels[name].setdefault(bits, "ABCDEFGHIJKLMNOP"[len(labels[name])])
            cells.append(f"{chunk:>16}, {label:>4}")
        ctas = "default" if num_ctas is None else num_ctas
        print(f"{i:3d} {str(companions):>17} {ctas:>9} {place:>5} " + " ".join(f"{c:>22}" for c in cells))
    for name, results in runs.items():
        chunks = {chunk for _, chunk in results}
        count = len(labels[name])
        print(f"{name:>9}: {count} distinct result{'s' * (count > 1)} from {len(BATCHINGS)} batchings "
              f"({len(chunks)} distinct chunk size{'s' * (len(chunks) > 1)})")


normal = {name: [watched_row(name, b) for b in BATCHINGS] for name in names}
show(normal, "normal mode: the watched row's chunk size L_kv and its result (same letter = same bits)")

# %% [markdown]
# On every tier the watched row's bits move with its company. Here the batchings that give the same $L_{kv}$
# give the same bits, whatever the place in the batch or the number of CTAs: what moves the row is where its
# keys are cut. (With its default `num_ctas` the torch tier's decode chunks are at least 256 slots, its
# `min_split_size`, so those batchings share one size.) The differences are in the last bits only.
#
# That last point is also why the reference is fed float64 here. Given float32 inputs, it still computes in
# float64 and rounds the answer to float32 — and the float64 differences, far below half a float32 ulp, vanish in
# that rounding:

# %%
rounded = [watched_row("reference", b, dtype=np.float32) for b in BATCHINGS]
print(f"reference, float32 inputs (computed in float64, rounded): {len({bits for bits, _ in rounded})} distinct "
      f"result from {len(BATCHINGS)} batchings")

# %% [markdown]
# ## The invariant fold
#
# Deterministic mode removes every dependence on the batch, in three rules:
#
# 1. **A grid at absolute positions.** Each row's KV is cut every `split_size` slots (default 1024, a multiple of
#    64), counted from the row's first key: chunk $c$ is positions $[c\,S, (c+1)\,S)$, the last one shorter. The
#    cut depends on the row's own length only — not on $L_{kv}$, the batch or `num_ctas`.
# 2. **Each chunk's state is computed alone**, with arithmetic that does not depend on the tile it sits in: the
#    reference row by row; the numba tier with explicit FMAs and one KV tile for the whole call; the torch tier
#    with its row sums on the tensor cores (`p @ 1`) and no FMA fusion by the compiler.
# 3. **Chunk states are folded left to right** with ⊕: $s = (\dots((s_0 \oplus s_1) \oplus s_2) \dots) \oplus
#    s_{n-1}$.
#
# The plan still balances the chunks over the CTAs as Algorithm 1 does; only where the cuts fall, and how each
# piece is summed, no longer depend on it. A picture of the watched row's 300 keys in two batchings of the table
# (rows 3 and 7), as the reference tier plans them, in normal mode and with `split_size=64`:

# %%
SPLIT = 64


def row_chunks(batching, **options):
    """The watched row's KV chunks ``[(start, end), ...]`` in the reference tier's plan of ``batching``."""
    companions, num_ctas, place = batching
    layout, *_ = batch(companions, place)
    attn = ba.BatchAttention(backend="reference")
    attn.plan(layout, HQ, HKV, D, num_ctas=num_ctas, **options)
    (work_plan,) = attn.work_plans
    items = np.flatnonzero(work_plan.item_row == place)
    return sorted(zip(work_plan.item_kv_start[items].tolist(), work_plan.item_kv_end[items].tolist()))


bars = []
for mode, options in (("normal", {}), ("deterministic", dict(deterministic=True, split_size=SPLIT))):
    for i in (3, 7):
        bars.append((f"{mode}, batching {i}", row_chunks(BATCHINGS[i], **options)))

fig, ax = plt.subplots(figsize=(11, 2.6))
for y, (label, chunks) in enumerate(bars):
    spans = [(a, b - a) for a, b in chunks]
    ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=[("C0", "C1")[j % 2] for j in range(len(spans))],
                   edgecolor="white")
    ax.text(KV_LEN + 5, y, f"{len(chunks)} chunks", va="center", fontsize=8)
for x in range(SPLIT, KV_LEN, SPLIT):
    ax.axvline(x, color="black", linestyle=":", linewidth=0.8)
ax.set_yticks(range(len(bars)), [label for label, _ in bars])
ax.invert_yaxis()
ax.set_xlim(0, KV_LEN + 60)
ax.set_xlabel(f"KV position in the watched row (dotted: the grid, every {SPLIT} slots)")
ax.set_title("one row's keys in two batchings: chunks of L_kv in normal mode, the grid in deterministic mode")
fig.tight_layout()
plt.show()

# %% [markdown]
# The same twelve batchings in deterministic mode, on every tier:

# %%
deterministic = {name: [watched_row(name, b, deterministic=True, split_size=SPLIT) for b in BATCHINGS]
                 for name in names}
show(deterministic, f"deterministic mode, split_size={SPLIT}: the chunk size is the grid's")

# %% [markdown]
# One result per tier. (Bits agree *within* a tier: each tier has its own arithmetic, and the tiers agree with
# one another only to rounding, as always — notebook 9.)

# %% [markdown]
# ## A decode step and the last row of a causal prefill
#
# The same query, over the same keys, can reach attention two ways: as a decode step (one query row), or as the
# last row of a causal prefill — a chunked prefill that ends where decoding starts, or a speculative
# verification. In normal mode the two are planned apart: a prefill of 40 rows is several query tiles, so
# Algorithm 1 gives it another $L_{kv}$, and the row sits in a tile of many queries instead of one. In
# deterministic mode the row is cut on the same grid and each chunk summed the same way.

# %%
causal = ba.Variant(causal=True)
N, PREFILL = 170, 40
seq_q = rng.standard_normal((N, HQ, D))                          # a request's queries at every position
seq_k = rng.standard_normal((N, HKV, D))
seq_v = rng.standard_normal((N, HKV, D))


def last_row(name, rows, **options):
    """The last of the request's final ``rows`` query rows, causal over its ``N`` keys: ``(out, lse)`` and the
    plan's chunk size."""
    dtype = DTYPE[name]
    attn = ba.BatchAttention(backend=name)
    attn.plan(ba.layouts.ragged([rows], [N]), HQ, HKV, D, variant=causal, **options)
    o, lse = attn.run(seq_q[N - rows:].astype(dtype), seq_k.astype(dtype), seq_v.astype(dtype), return_lse=True)
    return np.asarray(o)[-1], np.asarray(lse)[-1], attn.work_plans[0].kv_chunk_size


for name in names:
    for mode, options in (("normal", {}), ("deterministic", dict(deterministic=True, split_size=64))):
        (o1, s1, c1), (o2, s2, c2) = last_row(name, 1, **options), last_row(name, PREFILL, **options)
        same = np.array_equal(o1, o2) and np.array_equal(s1, s2)
        print(f"{name:>9} {mode:>13}: L_kv {c1:3d} and {c2:3d}; decode step == last row of a {PREFILL}-row "
              f"prefill? {str(same):5} (max |out diff| {np.abs(o1 - o2).max():.1e})")

# %% [markdown]
# ## Two KV pieces merged, or one call
#
# An engine may also attend over a request's keys in pieces and merge the states itself: a prefix from one call,
# the newest keys from another, joined with `ba.merge_state`. In deterministic mode that equals one call bit for
# bit when the pieces follow the fold: the first piece ends on a grid point, and the second lies within one grid
# chunk. One call computes $(s_0 \oplus s_1) \oplus s_2$ for the 170 keys below on a 64-slot grid (chunks 0:64,
# 64:128 and 128:170); the first piece (keys 0:128) computes $s_0 \oplus s_1$, the second (128:170) computes
# $s_2$, and one more ⊕ completes the same fold. (The states are float32 on the compiled tiers, float64 on the
# reference.)
#
# Cut elsewhere, the chunks or the parentheses move: a cut at 100 is off the grid, so each piece's own grid
# (counted from the piece's first key) cuts other chunks; a cut at 64 leaves two chunks in the second piece,
# which folds them before the merge: $s_0 \oplus (s_1 \oplus s_2)$. Both are correct attention, and both may
# round differently.

# %%
def state(name, lo, hi):
    """Deterministic attention of the request's last query over its keys ``lo:hi`` (all visible), on the 64-slot
    grid, on tier ``name``: ``(out, lse)``."""
    q, k, v = (x.astype(DTYPE[name]) for x in (seq_q[-1:], seq_k[lo:hi], seq_v[lo:hi]))
    o, lse = ba.attention(q, k, v, ba.layouts.ragged([1], [hi - lo]), backend=name, return_lse=True,
                          deterministic=True, split_size=64)
    return np.asarray(o), np.asarray(lse)


for name in names:
    whole = state(name, 0, N)
    for cut, why in ((128, "on the grid, one chunk after it"), (100, "off the grid"), (64, "two chunks after it")):
        o, lse = ba.merge_state(*state(name, 0, cut), *state(name, cut, N), backend=name)
        o, lse = np.asarray(o), np.asarray(lse)
        same = np.array_equal(o, whole[0]) and np.array_equal(lse, whole[1])
        print(f"{name:>9}: keys {f'0:{cut}':>5} ⊕ {f'{cut}:{N}':<7} ({why:>31}) == one call? {str(same):5} "
              f"(max |out diff| {np.abs(o - whole[0]).max():.1e})")

# %% [markdown]
# ## What it costs
#
# Deterministic mode gives up two things: the cuts no longer follow the batch freely (Algorithm 1 picks
# $L_{kv}$ to balance the CTAs; deterministic plans cut only on the grid — on the torch tier a row's first item
# covers $L_{kv}$ rounded up to the grid and folds its chunks in registers, and the rest of a long row is one
# chunk per item), and each chunk's arithmetic is pinned (on the torch tier, no FMA fusion and the row sums on
# the tensor cores). The benchmark suite's workload 4 (split-KV decode, KV lengths drawn from U(4096, 16384))
# times the torch tier both ways on the H200, in graph mode, with the default grid of 1024 slots. The measured
# results are committed under `benchmarks/results/`; this cell reads them, and the commit they measured, if they
# are there.

# %%
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks").is_dir()), Path.cwd())
path = ROOT / "benchmarks" / "results" / "w4_split_kv.json"
payload = json.loads(path.read_text()) if path.is_file() else None
times = {}
if payload is not None and not payload.get("dry_run"):
    for record in payload["records"]:
        if record["status"] == "ok" and record["impl"] in ("bsrattn-torch", "bsrattn-torch-deterministic"):
            times[record["config"]["batch"], record["impl"]] = record["time_us"]
batches = sorted({b for b, _ in times})
if batches:
    print(f"measured at commit {payload['environment'].get('git_commit', '?')[:7]}")
    print(f"{'batch':>6} {'normal (µs)':>12} {'deterministic (µs)':>19} {'ratio':>7}")
    for b in batches:
        fast, fixed = times.get((b, "bsrattn-torch")), times.get((b, "bsrattn-torch-deterministic"))
        if fast is None or fixed is None:
            continue
        print(f"{b:6d} {fast:12.1f} {fixed:19.1f} {fixed / fast:6.2f}x")
else:
    print("No measured results for workload 4 in benchmarks/results/ yet: they come from "
          "`python3 -m benchmarks.run_all --only w4` on the H200. Nothing measured, nothing shown.")

# %% [markdown]
# The ratio column is the price on the H200 at the commit named above (`benchmarks/NOTES.md` keeps the ladder of
# versions, with what each measured). What that buys is a contract a test can check bit for
# bit: the same request gives the same bytes whatever it is batched with, however it is stored, and however its
# keys are split. Use it where reproducibility matters (evaluation, debugging, output caches, comparing a serving
# stack against offline runs) and leave it off where only throughput does.

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 18, **chunk-grid** (`python -m bsrattn.exercises check 18`): The deterministic chunk grid: KV cut at
#   absolute multiples of `split_size`, whatever else is in the batch.
