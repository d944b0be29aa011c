"""Greedy generation with a transformers Llama-family model whose attention runs on bsrattn over a paged KV cache.

The model's own modules (embeddings, norms, projections, rotary embedding, MLP, head) do everything but the
attention and the cache: the keys and values go into a :class:`~bsrattn.integrations.paged.PagedKVCache`, and
each layer attends through one :class:`~bsrattn.BatchAttention` plan per step, over that step's layout.

**Continuous batching.** Requests join and leave between steps. A step's queries are the whole prompt of every
request that joins (its prefill) and the last token of every running one (its decode), all in one ragged batch
of query rows over one paged layout, causal (bottom-right aligned, so a prefill row sees its own prompt up to
itself and a decode row everything): prefill and decode in one plan, one launch per layer.

**A shared system prompt** is prefilled once, alone; every request then continues it, and a step's layout is a
two-level :class:`~bsrattn.Cascade`: the prompt's pages once for every query of the step, then each request's
own pages, the two states merged with ⊕.

**Quest page selection** (``generate(..., quest_budget=B)``): each decode step, layer by layer, each KV head
reads only the ``B`` pages whose keys could score highest against its queries (:func:`select_pages`, the bound of
Quest from each page's key minimum and maximum) through a :func:`bsrattn.layouts.quest` layout over the pool
stored HND and viewed per head; prefills attend in full. Exact when ``B`` covers a request's pages.

**Decode steps as CUDA graphs** (``generate(..., graphs=True)``, on a GPU): a step whose every request adds one
token runs the whole forward, every layer's projections, cache writes and attention, as one replayed CUDA graph
(:class:`DecodeGraphs`, one per batch size). The step's plan is made before the replay, outside the graph, into
buffers sized once for the whole pool (``BatchAttention(cuda_graph=True)``), so a re-plan refills them and the
graph replays it; the graph is captured again only when the plan's ``graph_key`` says it must. With
``compile=True`` the captured forward is first compiled by ``torch.compile``: the norms, rotary embedding, cache
writes and MLP fused into fewer kernels, each layer's attention one op the compiler leaves whole.

**The host runs a step ahead of its tokens.** A step's next tokens stay on the device, where the next step reads
them, and reach the host while that step runs: the host books, plans and launches step ``t + 1`` while the GPU
computes step ``t``, instead of waiting for step ``t``'s tokens first. What the host learns late is an
end-of-sequence token: a request that produced one has already been given one more step, whose token is dropped.

**Speculative tree decoding** (:func:`generate_speculative`): each running request's step is a draft tree
(prompt lookup by default, :func:`propose`) under a tree mask (:func:`bsrattn.layouts.tree`; a joining
request's prompt is a chain), verified in one forward; the longest branch the model itself would have chosen
is accepted, plus its next token, and its keys are moved into place in the cache
(:meth:`~bsrattn.integrations.paged.PagedKVCache.keep`). The tokens are greedy decoding's, in fewer steps.

Run it on a random tiny Llama (the tokens are compared with ``model.generate``'s)::

    python examples/paged_generation.py [--backend reference|torch]
"""

from __future__ import annotations

import argparse
import gc
from functools import partial

import numpy as np
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import bsrattn as ba
from bsrattn.integrations.paged import PagedKVCache

SYSTEM = "system"
"""The request name of the shared system prompt."""


class PagedModel:
    """A Llama-family ``transformers`` causal LM run step by step over a paged KV cache."""

    def __init__(self, model, num_pages: int, page_size: int = 16, backend=None, kv_layout: str = "NHD",
                 graphs: bool = False, compile: bool = False):
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.cache = PagedKVCache(config.num_hidden_layers, num_pages, page_size, self.kv_heads, self.head_dim,
                                  dtype=model.dtype, device=model.device, kv_layout=kv_layout)
        self.attention = ba.BatchAttention(backend=backend)
        self.quest_attention = ba.BatchAttention(backend=backend)
        self.variant = ba.Variant(sm_scale=model.model.layers[0].self_attn.scaling, causal=True)
        self.dtype = str(model.dtype).removeprefix("torch.")
        if compile and not graphs:
            raise ValueError("compile=True compiles the decode steps' CUDA graphs: pass graphs=True too")
        self.graphs = DecodeGraphs(self, compile) if graphs else None

    @torch.no_grad()
    def step(self, chunks, prefix=None, quest_budget=None) -> torch.Tensor:
        """Feed each ``(request, token ids [n])`` of ``chunks`` its new tokens; the logits at each one's last.

        ``prefix`` names the request every one of them continues (the cache's shared prefix), or None. With a
        ``quest_budget`` (a cache made with ``kv_layout="HND"``), each one-token chunk of a request already in
        the cache is a decode whose KV heads each read only the ``quest_budget`` pages :func:`select_pages`
        picks for them, layer by layer; the other chunks attend as before.
        """
        if quest_budget is not None and prefix is not None:
            raise ValueError("Quest selection over a shared prefix is not supported")
        requests = [r for r, _ in chunks]
        qo_lens = [len(ids) for _, ids in chunks]
        for r in requests:
            if r not in self.cache:
                self.cache.open(r)
        positions = torch.from_numpy(np.concatenate([np.arange(self.cache.length(r), self.cache.length(r) + n)
                                                     for r, n in zip(requests, qo_lens)]))
        decoding = [quest_budget is not None and n == 1 and self.cache.length(r) > 0
                    for r, n in zip(requests, qo_lens)]
        slots = torch.cat([self.cache.extend(r, n) for r, n in zip(requests, qo_lens)])
        rows = torch.as_tensor(qo_lens).cumsum(0) - 1
        ids = torch.cat([ids.to(self.model.device) for _, ids in chunks])
        if self.graphs is not None and prefix is None and quest_budget is None and max(qo_lens) == 1:
            return self.graphs.run(ids, positions, slots, self.cache.layout(requests, qo_lens))
        if any(decoding):
            decode = [(r, int(row)) for r, row, d in zip(requests, rows, decoding) if d]
            rest = [(r, n) for r, n, d in zip(requests, qo_lens, decoding) if not d]
            if rest:
                self._plan(self.cache.layout([r for r, _ in rest], [n for _, n in rest]))
            rest_rows = [int(i) for row, n, d in zip(rows, qo_lens, decoding) if not d
                         for i in range(row - n + 1, row + 1)]
            attend = partial(self._attend_with_quest, rest_rows, decode, quest_budget)
        else:
            self._plan(self.cache.layout(requests, qo_lens) if prefix is None
                       else self.cache.cascade(prefix, requests, qo_lens))
            attend = self._attend
        return self._forward(ids, positions, slots, rows, attend)

    @torch.no_grad()
    def step_trees(self, trees) -> torch.Tensor:
        """Feed each ``(request, token ids [n], parents [n])`` of ``trees`` its draft tree (a prompt is a chain,
        parents ``[-1, 0, 1, ...]``); the logits at every node, ``[sum n, vocab]``.

        Node ``i`` sits at position ``length + depth(i)`` and attends the request's tokens, its ancestors and
        itself (:func:`bsrattn.layouts.tree`): one forward verifies every branch.
        """
        positions, slots = [], []
        for request, ids, parents in trees:
            if request not in self.cache:
                self.cache.open(request)
            depth = []
            for p in parents:
                depth.append(0 if p < 0 else depth[p] + 1)
            positions.append(self.cache.length(request) + torch.as_tensor(depth))
            slots.append(self.cache.extend(request, len(ids)))
        layout = self.cache.tree([r for r, _, _ in trees], [p for _, _, p in trees])
        self._plan(layout)
        ids = torch.cat([ids.to(self.model.device) for _, ids, _ in trees])
        return self._forward(ids, torch.cat(positions), torch.cat(slots), torch.arange(ids.numel()), self._attend)

    def _plan(self, layout, attention=None):
        attention = attention or self.attention
        attention.plan(layout, self.heads, self.kv_heads, self.head_dim, variant=self.variant,
                       q_dtype=self.dtype, kv_dtype=self.dtype, kv_layout=self.cache.kv_layout)  # for every layer

    def _attend(self, layer, q):
        """``q [n, Hq, D]`` through the step's plan over layer ``layer``'s pool."""
        return self.attention.run(q, self.cache.k[layer], self.cache.v[layer])

    def _attend_with_quest(self, rest_rows, decode, budget, layer, q):
        """The step's plan for ``rest_rows`` of ``q``, Quest for the ``decode`` ``(request, row)`` pairs."""
        out = torch.empty_like(q)
        if rest_rows:
            out[rest_rows] = self._attend(layer, q[rest_rows].contiguous())
        decode_rows = [row for _, row in decode]
        out[decode_rows] = quest_attention(self.quest_attention, self.cache, layer, [r for r, _ in decode],
                                           q[decode_rows], budget, self.variant.sm_scale)
        return out

    def _forward(self, ids, positions, slots, last_rows, attend):
        inner = self.model.model
        nnz = ids.numel()
        h = inner.embed_tokens(ids)  # [nnz, hidden]: the step's tokens, request after request
        cos, sin = (x[0] for x in inner.rotary_emb(h[None], positions[None].to(h.device)))
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(nnz, self.heads, self.head_dim)
            k = attn.k_proj(x).view(nnz, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(nnz, self.kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # at each token's absolute position
            self.cache.write(i, slots, k, v)
            o = attend(i, q.contiguous())
            h = h + attn.o_proj(o.reshape(nnz, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h[last_rows]))


class DecodeGraphs:
    """An engine's decode steps (one new token per request) replayed as CUDA graphs, one per batch size.

    A graph records the forward over fixed input tensors (token ids, positions, cache slots) and over the plan
    buffers of its own :class:`~bsrattn.BatchAttention` (``cuda_graph=True``): each step copies its inputs in,
    plans outside the graph (the buffers are refilled in place) and replays. Before its first capture the plan is
    sized for a step over every page of the pool, so later steps fit; a graph is captured again only when the
    plan's :attr:`~bsrattn.BatchAttention.graph_key` changes. With ``compile``, the forward a graph records is
    ``torch.compile``'s (each layer's attention the op :func:`attend`, which the compiler leaves whole).
    """

    def __init__(self, engine: PagedModel, compile: bool = False):
        self.engine = engine
        self.attention = ba.BatchAttention(backend=engine.attention.backend, cuda_graph=True)
        self.graphs: dict = {}  # batch size -> (graph, graph key, ids, positions, slots, logits, rows)
        self.captures = 0  # graphs captured so far
        self.forward = torch.compile(self._forward, dynamic=False, fullgraph=True) if compile else self._forward

    def run(self, ids, positions, slots, layout) -> torch.Tensor:
        """The step's logits ``[batch, vocab]`` (the graph's output tensor, overwritten by the next replay)."""
        batch = ids.numel()
        if batch not in self.graphs:  # buffers for any step of this batch over the pool, before a graph holds them
            pages = self.engine.cache.num_pages
            tables = np.array_split(np.arange(pages), batch)
            full = ba.layouts.paged([1] * batch, tables, [len(t) * self.engine.cache.page_size for t in tables],
                                    self.engine.cache.page_size, pages)
            self.engine._plan(full, self.attention)
        self.engine._plan(layout, self.attention)
        entry = self.graphs.get(batch)
        if entry is None or entry[1] != self.attention.graph_key:
            entry = self.graphs[batch] = self._capture(ids, positions, slots)
        for static, given in zip(entry[2:5], (ids, positions, slots)):
            # From pinned host memory, a copy that does not wait for the GPU: the host stays a step ahead.
            static.copy_(given.pin_memory() if given.device.type == "cpu" else given, non_blocking=True)
        entry[0].replay()
        return entry[5]

    def _capture(self, ids, positions, slots):
        device = self.engine.model.device
        static = [x.to(device, copy=True) for x in (ids, positions, slots)]
        rows = torch.arange(ids.numel(), device=device)
        global _recording
        _recording = self  # whose plan the op ``attend`` runs (only here: a replay runs no Python)
        try:
            side = torch.cuda.Stream()  # one eager run first (kernels compiled, workspaces made), as capture needs
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(*static, rows)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # Dead reference cycles are freed before the capture, and none inside it. With Python's collector on
            # during the capture, in a process that had run transformers' generate first, the capture failed (it
            # passed with the collector off, and in relaxed mode): some object it freed made a CUDA call that a
            # capture forbids. torch.cuda.graph collects first only when torch.compiler's config forces it.
            gc.collect()
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph):
                    logits = self.forward(*static, rows)
            finally:
                if collecting:
                    gc.enable()
        finally:
            _recording = None
        self.captures += 1
        return graph, self.attention.graph_key, *static, logits, rows  # the graph reads every input it was given

    def _forward(self, ids, positions, slots, rows):
        return self.engine._forward(ids, positions, slots, rows, self._attend)

    def _attend(self, layer, q):
        return torch.ops.paged_generation.attend(q, self.engine.cache.k[layer], self.engine.cache.v[layer])


_recording: DecodeGraphs | None = None  # the DecodeGraphs recording a graph


@torch.library.custom_op("paged_generation::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q [n, Hq, D]`` over one layer's pool ``k``, ``v`` through the plan of the :class:`DecodeGraphs` recording
    a graph: an op of its own, which ``torch.compile`` calls as it is instead of tracing bsrattn."""
    if _recording is None:
        raise RuntimeError("paged_generation::attend runs a DecodeGraphs' plan while it records a graph; no "
                           "DecodeGraphs is recording one")
    return _recording.attention.run(q, k, v)


@attend.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def select_pages(cache, layer, request, q, budget) -> list:
    """Quest's choice for one decode query ``q [Hq, D]``: for each KV head, the ``budget`` pages of ``request``
    whose keys could score highest, by the bound ``sum_d max(q_d min_d, q_d max_d)`` over each page's
    elementwise key minimum and maximum (the largest over the head's query heads), the last page always kept;
    positions in the request's page table, increasing, ``[num_kv_heads][<= budget]``."""
    pages = cache.pages(request)
    if len(pages) <= budget:
        return [list(range(len(pages)))] * cache.num_kv_heads
    k = cache.k[layer][pages]  # HND: [n, Hkv, page_size, D]
    valid = (torch.arange(len(pages) * cache.page_size) < cache.length(request)).view(len(pages), 1, -1, 1)
    big = torch.finfo(k.dtype).max
    low, high = torch.where(valid, k, big).amin(2), torch.where(valid, k, -big).amax(2)  # [n, Hkv, D]
    q = q.view(cache.num_kv_heads, -1, q.shape[-1]).to(k.dtype)  # [Hkv, G, D]
    bound = torch.maximum(q[None] * low[:, :, None], q[None] * high[:, :, None]).sum(-1).amax(-1)  # [n, Hkv]
    bound[-1] = float("inf")  # the page of the newest tokens
    return [sorted(bound[:, h].topk(budget).indices.tolist()) for h in range(cache.num_kv_heads)]


def quest_attention(attention, cache, layer, requests, q, budget, sm_scale):
    """Decode ``q [B, Hq, D]`` (one row per request) over the pages :func:`select_pages` keeps, each KV head its
    own: one :func:`bsrattn.layouts.quest` layout over the HND pool viewed per head, planned and run here."""
    selected = [select_pages(cache, layer, r, q[b], budget) for b, r in enumerate(requests)]
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // cache.num_kv_heads
    qh, kh, vh = ba.layouts.per_head_views(q.contiguous(), cache.k[layer], cache.v[layer], cache.num_kv_heads)
    dtype = str(q.dtype).removeprefix("torch.")
    attention.plan(cache.quest(requests, selected), group, 1, head_dim, variant=ba.Variant(sm_scale=sm_scale),
                   q_dtype=dtype, kv_dtype=dtype)
    return attention.run(qh, kh, vh).reshape(len(requests), heads, head_dim)


def _eos_tokens(model) -> set:
    """The end-of-sequence tokens ``model.generate`` stops at (its ``generation_config``)."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


class _NextTokens:
    """A step's greedy tokens, one per request of ``requests``: on the device, where the next step reads them, and
    on their way to the host, which reads them (:meth:`read`) once it has launched that next step."""

    def __init__(self, requests, logits):
        self.requests = requests
        self.device = logits.argmax(-1)
        self.host, self.ready = self.device, None
        if self.device.is_cuda:
            self.host = torch.empty(self.device.shape, dtype=self.device.dtype, pin_memory=True)
            self.host.copy_(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def read(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def generate(model, prompts, max_new_tokens, *, arrivals=None, system_prompt=None, quest_budget=None,
             num_pages=64, page_size=16, backend=None, graphs=False, compile=False) -> list:
    """Greedy continuous batching: request ``i`` joins at step ``arrivals[i]`` with ``prompts[i]`` (token ids),
    continuing ``system_prompt`` when given, and leaves once it has ``max_new_tokens[i]`` new tokens or has
    produced an end-of-sequence token (the model's ``generation_config``), as ``model.generate`` stops; returns
    each request's new tokens. With a ``quest_budget``, decode steps read only that many pages per KV head and
    layer (:func:`select_pages`), an approximation that is exact once the budget covers a request's pages. With
    ``graphs`` (a CUDA device), steps of one new token per request replay a CUDA graph (:class:`DecodeGraphs`),
    compiled first with ``compile``. Each step is launched before the last one's tokens are read (the module's
    docstring): a request stopped by an end-of-sequence token has run one step more, its token dropped."""
    engine = PagedModel(model, num_pages, page_size, backend, kv_layout="NHD" if quest_budget is None else "HND",
                        graphs=graphs, compile=compile)
    eos = _eos_tokens(model)
    arrivals = [0] * len(prompts) if arrivals is None else list(arrivals)
    prefix = None
    if system_prompt is not None:
        engine.step([(SYSTEM, torch.as_tensor(system_prompt))])  # stored once; its logits are not needed
        prefix = SYSTEM
    tokens = [[] for _ in prompts]
    ended = set()  # requests whose tokens reached an end-of-sequence token
    running, step, last = [], 0, None  # last: the step before, its tokens not yet read
    while running or last is not None or any(not t and arrivals[i] >= step for i, t in enumerate(tokens)):
        # Every running request is in the last step; its token there, unread, counts against its budget.
        at = {} if last is None else {r: j for j, r in enumerate(last.requests)}
        done = {i for i in running if len(tokens[i]) + 1 >= max_new_tokens[i]}
        for i in done:  # its pages go back to the pool; the GPU reuses them only after its last step
            engine.cache.close(i)
        chunks = [(i, last.device[at[i]:at[i] + 1]) for i in running if i not in done]
        for i in range(len(prompts)):
            if arrivals[i] == step:
                engine.cache.open(i, prefix)
                chunks.append((i, torch.as_tensor(prompts[i])))
        launched = _NextTokens([i for i, _ in chunks], engine.step(chunks, prefix, quest_budget)) if chunks else None
        if last is not None:
            for i, token in zip(last.requests, last.read()):  # the host's one wait a step
                if i not in ended:  # else a token past its end-of-sequence token, dropped
                    tokens[i].append(token)
                    if token in eos:
                        ended.add(i)
            for i in last.requests:
                if i not in running:  # it ended a step before, and has run its one step more
                    engine.cache.close(i)
        running = [] if launched is None else [i for i in launched.requests if i not in ended]
        last = launched
        step += 1
    return tokens


def draft_tree(root: int, branches):
    """``branches`` (token sequences after ``root``) merged into a trie under it: ``(tokens, parents)``, node 0
    the root, each node after its parent."""
    tokens, parents, children = [root], [-1], {}
    for branch in branches:
        node = 0
        for t in branch:
            if (node, t) not in children:
                children[node, t] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = children[node, t]
    return tokens, parents


def propose(history, depth: int = 3, branches: int = 2):
    """A draft tree by prompt lookup: after each of the last ``branches`` earlier occurrences of the last token,
    the ``depth`` tokens that followed it, merged into a trie under the root (the last token itself)."""
    last = history[-1]
    starts = [i + 1 for i in range(len(history) - 2, -1, -1) if history[i] == last][:branches]
    return draft_tree(last, [history[s:s + depth] for s in starts])


def generate_speculative(model, prompts, max_new_tokens, *, arrivals=None, proposer=None, num_pages=64,
                         page_size=16, backend=None):
    """:func:`generate` with speculative tree decoding: each running request's step is a draft tree verified in
    one forward; the longest branch whose every token is the model's own greedy choice is accepted, plus the
    token the model picks after it. The tokens are greedy decoding's, in fewer steps when drafts are right.
    ``proposer(request, history) -> (tokens, parents)`` drafts a tree rooted at ``history[-1]`` (default:
    :func:`propose`'s prompt lookup). Returns ``(tokens, steps)``."""
    proposer = proposer or (lambda request, history: propose(history))
    engine = PagedModel(model, num_pages, page_size, backend)
    eos = _eos_tokens(model)
    arrivals = [0] * len(prompts) if arrivals is None else list(arrivals)
    history = [list(map(int, p)) for p in prompts]
    tokens = [[] for _ in prompts]
    running, step, steps = [], 0, 0
    while len(running) or any(not t and arrivals[i] >= step for i, t in enumerate(tokens)):
        trees, drafts = [], {}
        for i in running:
            drafts[i] = proposer(i, history[i] + tokens[i])
            trees.append((i, torch.tensor(drafts[i][0]), drafts[i][1]))
        for i in range(len(prompts)):
            if arrivals[i] == step:
                engine.cache.open(i)
                trees.append((i, torch.as_tensor(prompts[i]), list(range(-1, len(prompts[i]) - 1))))
        if trees:
            base = {i: engine.cache.length(i) for i, _, _ in trees}
            logits = engine.step_trees(trees)
            steps += 1
            at = 0
            for i, ids, parents in trees:
                rows = logits[at:at + len(ids)]
                at += len(ids)
                if i not in drafts:  # a prompt: its last row picks the first token
                    tokens[i].append(int(rows[-1].argmax()))
                    continue
                children = {(p, int(t)): c for c, (p, t) in enumerate(zip(parents, ids)) if p >= 0}
                path, node = [0], 0
                while True:  # follow the model's greedy choice down the tree
                    choice = int(rows[node].argmax())
                    tokens[i].append(choice)
                    node = children.get((node, choice))
                    if node is None or len(tokens[i]) >= max_new_tokens[i] or choice in eos:
                        break
                    path.append(node)
                engine.cache.keep(i, base[i], path)  # the accepted branch's keys become the request's next ones
                del tokens[i][max_new_tokens[i]:]
            running = [i for i, _, _ in trees if len(tokens[i]) < max_new_tokens[i] and not eos & set(tokens[i])]
            for i, _, _ in trees:
                if i not in running:
                    engine.cache.close(i)
        step += 1
    for t in tokens:  # stop at the first end-of-sequence token, as generate does
        cut = next((j + 1 for j, x in enumerate(t) if x in eos), len(t))
        del t[cut:]
    return tokens, steps


def main(argv=None):
    import transformers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="reference")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).eval()
    prompts = [torch.randint(1, 128, (n,)) for n in (5, 9, 3)]
    system = torch.randint(1, 128, (20,))
    for shared in (None, system):
        got = generate(model, prompts, [6, 4, 5], arrivals=[0, 2, 3], system_prompt=shared, backend=args.backend)
        for i, prompt in enumerate(prompts):
            full = prompt if shared is None else torch.cat([shared, prompt])
            want = model.generate(full[None], max_new_tokens=len(got[i]), do_sample=False)[0, full.numel():]
            print(f"{'shared prompt, ' if shared is not None else ''}request {i}: {got[i]} "
                  f"{'==' if got[i] == want.tolist() else '!='} generate's")
    got, steps = generate_speculative(model, prompts, [12, 10, 12], arrivals=[0, 2, 3], backend=args.backend)
    for i, prompt in enumerate(prompts):
        want = model.generate(prompt[None], max_new_tokens=len(got[i]), do_sample=False)[0, prompt.numel():]
        print(f"speculative, request {i}: {got[i]} {'==' if got[i] == want.tolist() else '!='} generate's")
    print(f"speculative: {sum(map(len, got))} tokens in {steps} steps")


if __name__ == "__main__":
    main()
