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
# # 11. Inside a real model: a transformers Llama on bsrattn
#
# The earlier notebooks call attention on made-up tensors. This one puts bsrattn where the tensors come from: a
# Hugging Face `transformers` Llama, small and random so it runs on a laptop, first with bsrattn as its attention
# function (HF keeps its own cache), then in a serving loop of our own over a paged KV cache, where every layout
# of the course appears in one decoding loop: paged rows for continuous batching, a cascade for a shared system
# prompt, a tree mask for speculative decoding.
#
# The claim to check, each time: the tokens are the model's own greedy tokens, `model.generate`'s.

# %%
import importlib.util
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers

import bsrattn as ba
import bsrattn.integrations.transformers as bsrattn_hf
from bsrattn.draw import layout as draw_layout

# The serving loop, examples/paged_generation.py: a script of the repository, imported from there by its path.
ROOT = Path.cwd() if (Path.cwd() / "examples").exists() else Path.cwd().parent
spec = importlib.util.spec_from_file_location("paged_generation", ROOT / "examples" / "paged_generation.py")
paged_generation = sys.modules["paged_generation"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paged_generation)

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=128, attn_implementation="sdpa")
model = transformers.LlamaForCausalLM(config).eval()
print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {config.num_hidden_layers} layers, "
      f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads of {config.head_dim}")

# %% [markdown]
# ## 1. bsrattn as the model's attention
#
# `register()` adds an attention function named `"bsrattn"` to transformers; `set_attn_implementation` switches
# every layer to it. HF's cache tensor `[B, Hkv, S, D]` is already a layout — one block of `S` slots per request,
# stored HND — so bsrattn reads it where it lies, with no copy, and plans once per step for all the layers.
# Teacher-forced logits against HF's SDPA, then greedy generation:

# %%
bsrattn_hf.register(backend="reference")
ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
logits = {}
for implementation in ("sdpa", "bsrattn"):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        logits[implementation] = model(ids).logits
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)[:, ids.shape[1]:]
    print(f"{implementation:8s} tokens {generated.tolist()}")
print("largest logit difference:", float((logits["sdpa"] - logits["bsrattn"]).abs().max()))
model.set_attn_implementation("sdpa")

# %% [markdown]
# What the attention function saw at a decode step: two requests, one query row each, over the cache's two
# blocks. The layout (`step_layout`) is the picture of notebook 2 with a page as long as the cache:

# %%
step, variant = bsrattn_hf.step_layout(None, batch_size=2, qo_len=1, kv_len=17, variant=ba.Variant(causal=True))
fig, ax = plt.subplots(figsize=(7, 1.8))
draw_layout(step, ax=ax)
ax.set_title("an HF decode step as a BSR layout: request b reads block b of the cache")
plt.show()

# %% [markdown]
# ## 2. A serving loop over a paged cache
#
# HF's cache gives every request its own contiguous block. A serving engine keeps one pool of fixed-size pages
# instead, hands pages out as requests grow and takes them back when requests leave, so requests of any length
# share the memory: `bsrattn.integrations.paged.PagedKVCache`. `examples/paged_generation.py` runs the model's
# own modules (embeddings, norms, projections, rotary embedding, MLP, head) around it and does the attention with
# one `BatchAttention` plan per step.
#
# **Continuous batching.** Requests join and leave between steps. A step's query rows are the whole prompt of
# each request that joins (its prefill) and one token of each running request (its decode): one paged layout,
# causal and bottom-right aligned, so for a request with $q$ query rows over $k$ keys, row $i$ sees the keys up
# to position $k - q + i$ — the whole prompt up to itself for a prefill, everything for a decode.

# %%
prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(10 + n)) for n in (5, 9, 3)]
counts, arrivals = [6, 4, 5], [0, 1, 7]
planned = []
original_plan = ba.BatchAttention.plan


def recording_plan(self, layout, *args, **kwargs):
    planned.append(layout)
    return original_plan(self, layout, *args, **kwargs)


ba.BatchAttention.plan = recording_plan
try:
    got = paged_generation.generate(model, prompts, counts, arrivals=arrivals, num_pages=7, page_size=4,
                                    backend="reference")
finally:
    ba.BatchAttention.plan = original_plan
with torch.no_grad():
    want = [model.generate(p[None], max_new_tokens=n, do_sample=False)[0, p.numel():].tolist()
            for p, n in zip(prompts, counts)]
for i, (g, w) in enumerate(zip(got, want)):
    print(f"request {i}: {g} {'==' if g == w else '!='} generate's")

# %% [markdown]
# Each step's layout, as the plan saw it: rows are query rows (a prefill is a tall block), columns the pool's
# 7 pages of 4 slots. The third request runs in pages the first two gave back.

# %%
fig, axes = plt.subplots(1, len(planned), figsize=(2.2 * len(planned), 2.6), sharey=False)
for s, (ax, lay) in enumerate(zip(axes, planned)):
    draw_layout(lay, ax=ax)
    ax.set_title(f"step {s}: kv {lay.kv_lens.tolist()}", fontsize=8)
    ax.set_xlabel("")
fig.suptitle("continuous batching: one paged layout per step over one pool of pages", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. A shared system prompt, stored once: a cascade
#
# When every request starts with the same system prompt, its keys are computed once and stored in pages of their
# own. A step's layout then has two levels (notebook 4): every query of the step over the prompt's pages — read
# once for all of them — and each request over its own pages; the two states merge with ⊕.

# %%
system = torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(3))
got = paged_generation.generate(model, prompts, counts, arrivals=[0, 1, 1], system_prompt=system, num_pages=16,
                                page_size=4, backend="reference")
with torch.no_grad():
    want = [model.generate(torch.cat([system, p])[None], max_new_tokens=n, do_sample=False)[0, 21 + p.numel():]
            .tolist() for p, n in zip(prompts, counts)]
print("tokens behind the shared prompt equal generate's:", got == want)

# %% [markdown]
# ## 4. Speculative decoding: draft trees verified in one forward
#
# A drafter guesses what comes next as a tree of candidate tokens under the last one; the model scores every
# node in one forward, each node seeing the request's tokens, its ancestors and itself — a tree mask, the layout
# of notebook 5. The longest branch the model would have chosen itself is accepted, plus the token it picks
# after it, and the accepted keys are moved into place in the cache. The drafter here is prompt lookup: after
# each earlier occurrence of the last token, the tokens that followed it. Whatever the drafts, the tokens are
# greedy decoding's; only the number of steps changes.

# %%
long_counts = [12, 10, 12]
got, steps = paged_generation.generate_speculative(model, prompts, long_counts, arrivals=[0, 2, 3], num_pages=16,
                                                   page_size=4, backend="reference")
with torch.no_grad():
    want = [model.generate(p[None], max_new_tokens=n, do_sample=False)[0, p.numel():].tolist()
            for p, n in zip(prompts, long_counts)]
print("speculative tokens equal generate's:", got == want)
print(f"{sum(map(len, got))} tokens in {steps} steps (one token per request per step without drafts)")

tokens, parents = paged_generation.propose(prompts[1].tolist() + got[1][:4])
tree = ba.layouts.tree([parents], [[0]], [len(tokens) + 4], page_size=16, num_pages=1)
fig, ax = plt.subplots(figsize=(5, 2.2))
ax.imshow(tree.row_mask(0), cmap="Greys", aspect="auto", vmin=0, vmax=1)
ax.set_xlabel("key slot (4 committed tokens, then the tree's nodes)")
ax.set_ylabel("tree node")
ax.set_yticks(range(len(tokens)), [f"{t} ← {p}" for t, p in zip(tokens, parents)], fontsize=7)
ax.set_title("a draft tree's mask: each node sees the committed tokens, its ancestors and itself", fontsize=8)
plt.show()

# %% [markdown]
# The same loop runs on the torch tier (`backend="torch"`), on a GPU or here in Triton's interpreter, with the
# same tokens (`tests/test_paged_generation.py` checks both tiers).

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 23, **gqa** (`python -m bsrattn.exercises check 23`): Grouped-query attention: G query heads share one KV
#   head, and a kernel reads it once for all of them.
