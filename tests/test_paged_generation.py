"""The paged KV cache and the serving loop of ``examples/paged_generation.py``, on a tiny random Llama (CPU).

The loop's greedy tokens must be ``model.generate``'s, request by request, with requests joining and leaving
between steps (prefill and decode rows in one plan) and with a shared system prompt stored once and served as a
two-level cascade; its logits must be HF's own forward's.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import bsrattn as ba  # noqa: E402
from bsrattn.integrations.paged import PagedKVCache  # noqa: E402

import paged_generation  # noqa: E402  (examples/, on pytest's pythonpath)
from helpers import generate_each  # noqa: E402

VOCAB = 128
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def _prompts(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]  # no special tokens (0-2)


# ---- the cache ---------------------------------------------------------------------------------------------

def test_pages_are_handed_out_in_order_and_taken_back():
    cache = PagedKVCache(num_layers=1, num_pages=3, page_size=4, num_kv_heads=1, head_dim=2)
    assert cache.extend("a", 5).tolist() == [0, 1, 2, 3, 4]  # pages 0 and 1
    assert cache.extend("b", 2).tolist() == [8, 9]  # page 2
    with pytest.raises(RuntimeError, match=r"request 'b' needs 1 more pages; the pool has 0 free"):
        cache.extend("b", 3)
    assert cache.length("b") == 2, "a refused extension takes nothing"
    cache.close("a")
    assert cache.free_pages == 2
    assert cache.extend("b", 6).tolist() == [10, 11, 0, 1, 2, 3]  # the rest of page 2, then a's first page
    lay = cache.layout(["b"], [1])
    assert lay.kv_lens.tolist() == [8] and lay.kv_indices.tolist() == [2, 0]


def test_the_layout_is_layouts_paged_of_the_books():
    """The cache builds a step's layout from its page tables at once; it must be what ``layouts.paged`` makes of
    the same tables and lengths, through requests that grow, keep a branch, close and leave pages reused."""
    rng = np.random.default_rng(3)
    cache = PagedKVCache(num_layers=1, num_pages=40, page_size=4, num_kv_heads=1, head_dim=2)
    for step in range(30):
        request = int(rng.integers(6))
        if request in cache and rng.random() < 0.15:
            cache.close(request)
            continue
        before = cache.length(request) if request in cache else 0
        cache.extend(request, int(rng.integers(0, 7)))
        if rng.random() < 0.2 and cache.length(request) > before + 1:
            cache.keep(request, before, [0, cache.length(request) - before - 1])
        open_ = [r for r in range(6) if r in cache]
        qo_lens = [int(rng.integers(0, 3)) for _ in open_]
        got = cache.layout(open_, qo_lens)
        want = ba.layouts.paged(qo_lens, [cache.pages(r) for r in open_], [cache.length(r) for r in open_], 4, 40)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (step, name)
    with pytest.raises(ValueError, match="qo_lens"):
        cache.layout(open_, [-1] * len(open_))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_written_keys_are_where_the_layout_reads_them(kv_layout, compiled):
    """Compiled, the write is the op ``bsrattn::paged_kv_write`` in place, not a store into the pool, which the
    compiled code would make a copy of the whole pool at every call."""
    rng = np.random.default_rng(0)
    cache = PagedKVCache(num_layers=2, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8, kv_layout=kv_layout)
    traced = []
    write = torch.compile(cache.write, fullgraph=True, backend=lambda gm, _: traced.append(gm) or gm.forward,
                          dynamic=False) if compiled else cache.write
    keys = {}
    for request, n in (("x", 7), ("y", 3), ("x", 2)):
        slots = cache.extend(request, n)
        k = torch.as_tensor(rng.standard_normal((n, 2, 8)), dtype=torch.float32)
        write(1, slots, k, -k)
        keys.setdefault(request, []).append(k)
    if compiled:
        calls = [str(node.target) for gm in traced for node in gm.graph.nodes if node.op == "call_function"]
        assert calls.count("bsrattn.paged_kv_write") == 2 * len(traced) and "<built-in function setitem>" not in calls
    lay = cache.layout(["x", "y"], [1, 1])
    pool = (cache.k[1] if kv_layout == "NHD" else cache.k[1].transpose(1, 2)).reshape(-1, 2, 8)
    for row, request in enumerate(("x", "y")):
        assert torch.equal(pool[torch.as_tensor(lay.kv_slots(row))], torch.cat(keys[request]))
    assert torch.equal(cache.v[1], -cache.k[1]) and not cache.k[0].any()


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_keep_moves_an_accepted_branch_into_place_and_frees_the_rest(kv_layout):
    cache = PagedKVCache(num_layers=2, num_pages=4, page_size=2, num_kv_heads=1, head_dim=1, kv_layout=kv_layout)
    slots = cache.extend("a", 7)
    for layer in (0, 1):
        values = torch.arange(7.0).view(7, 1, 1) + 10 * layer
        cache.write(layer, slots, values, -values)
    cache.keep("a", 2, [0, 2, 3])  # tokens 0, 1 stay; of the tree at 2.., nodes 0, 2 and 3
    assert cache.length("a") == 5 and cache.free_pages == 1
    for layer in (0, 1):
        got = cache.k[layer].reshape(-1)[cache.layout(["a"], [1]).kv_slots(0)]
        assert got.tolist() == [x + 10 * layer for x in (0.0, 1.0, 2.0, 4.0, 5.0)]
        assert torch.equal(cache.v[layer], -cache.k[layer])
    with pytest.raises(ValueError, match="must increase"):
        cache.keep("a", 1, [0, 0])


def test_a_shared_prefix_is_stored_once_and_refused_where_it_does_not_apply():
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    cache.extend("sys", 6)
    for r, n in (("a", 3), ("b", 5)):
        cache.open(r, prefix="sys")
        cache.extend(r, n)
    assert cache.length("a") == 9 and cache.free_pages == 8 - 2 - 1 - 2
    casc = cache.cascade("sys", ["a", "b"], [1, 1])
    assert [lvl.kv_lens.tolist() for lvl in casc.levels] == [[6], [3, 5]]
    with pytest.raises(ValueError, match="continues a shared prefix: use cascade"):
        cache.layout(["a"], [1])
    with pytest.raises(ValueError, match="shared prefix of open requests"):
        cache.close("sys")
    cache.open("c")
    cache.extend("c", 1)
    with pytest.raises(ValueError, match=r"request 'c' does not continue the prefix 'sys'"):
        cache.cascade("sys", ["a", "c"], [1, 1])
    with pytest.raises(ValueError, match="already in the cache"):
        cache.open("a")


# ---- the loop ----------------------------------------------------------------------------------------------

def test_a_step_gives_hf_forwards_logits(llama):
    prompts = _prompts((7, 4))
    engine = paged_generation.PagedModel(llama, num_pages=8, page_size=4, backend="reference")
    logits = engine.step(list(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            want = llama(prompt[None]).logits[0, -1]
        torch.testing.assert_close(logits[i], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_continuous_batching_gives_generates_tokens(llama, backend):
    """Requests join at steps 0, 1 and 7 and leave after 6, 4 and 5 tokens (or at the end-of-sequence token):
    the first two overlap, prefill beside decode; the pool (7 pages of 4) holds them both at most, so the last
    runs in pages the first two gave back."""
    prompts, counts = _prompts((5, 9, 3)), [6, 4, 5]
    got = paged_generation.generate(llama, prompts, counts, arrivals=[0, 1, 7], num_pages=7, page_size=4,
                                    backend=backend)
    assert got == generate_each(llama, prompts, counts)


def test_a_request_ending_at_its_end_of_sequence_token_drops_the_step_it_ran_past_it(llama, monkeypatch):
    """The host reads a step's tokens after it has launched the next, so a request that produced its
    end-of-sequence token has already been given one more step: that token is dropped, its pages go back once,
    and the requests beside it go on with generate's tokens."""
    prompts, counts = _prompts((5, 9, 3)), [9, 9, 9]
    monkeypatch.setattr(llama.generation_config, "eos_token_id", None)
    free = paged_generation.generate(llama, prompts, counts, arrivals=[0, 1, 1], num_pages=12, page_size=4,
                                     backend="reference")
    eos = free[0][3]
    monkeypatch.setattr(llama.generation_config, "eos_token_id", eos)
    closed = []
    close = PagedKVCache.close
    monkeypatch.setattr(PagedKVCache, "close", lambda self, request: closed.append(request) or close(self, request))
    got = paged_generation.generate(llama, prompts, counts, arrivals=[0, 1, 1], num_pages=12, page_size=4,
                                    backend="reference")
    assert got[0] == free[0][:free[0].index(eos) + 1]
    assert got == generate_each(llama, prompts, counts)
    assert sorted(closed) == [0, 1, 2]


def test_the_decode_graphs_forward_compiles_whole_with_the_attention_one_op(llama, monkeypatch):
    """The GPU captures it in a CUDA graph; here ``torch.compile`` traces it (``fullgraph``: a break fails) with
    the attention as the op ``attend``, and gives the eager forward's logits, for a second engine without
    compiling again."""
    from functools import partial

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="aot_eager"))
    prompts, logits = _prompts((5, 9)), []
    for _ in range(2):
        engine = paged_generation.PagedModel(llama, num_pages=8, page_size=4, backend="reference")
        engine.step(list(enumerate(prompts)))
        graphs = paged_generation.DecodeGraphs(engine, compile=True)
        positions = torch.tensor([engine.cache.length(i) for i in range(2)])
        slots = torch.cat([engine.cache.extend(i, 1) for i in range(2)])
        engine._plan(engine.cache.layout([0, 1], [1, 1]), graphs.attention)
        monkeypatch.setattr(paged_generation, "_recording", graphs)
        compiled_before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            logits.append(graphs.forward(torch.tensor([7, 9]), positions, slots, torch.arange(2)))
        engine._plan(engine.cache.layout([0, 1], [1, 1]))
        with torch.no_grad():
            eager = engine._forward(torch.tensor([7, 9]), positions, slots, torch.arange(2), engine._attend)
        torch.testing.assert_close(logits[-1], eager, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == compiled_before, "a second engine must reuse the compiled forward"
    monkeypatch.setattr(paged_generation, "_recording", None)
    with pytest.raises(RuntimeError, match="no DecodeGraphs is recording one"):
        torch.ops.paged_generation.attend(torch.zeros(1, 4, 16), engine.cache.k[0], engine.cache.v[0])


def test_a_decode_graph_is_captured_with_the_garbage_collector_off(llama, monkeypatch):
    """Dead reference cycles are collected before the capture and the collector is off during it (on a GPU, a
    collection inside the capture made it fail), then on again. The CUDA calls are stood in for here: the capture
    records what the forward saw."""
    import contextlib
    import gc

    engine = paged_generation.PagedModel(llama, num_pages=8, page_size=4, backend="reference")
    engine.step(list(enumerate(_prompts((5, 9)))))
    graphs = paged_generation.DecodeGraphs(engine)
    seen, collected = [], []
    monkeypatch.setattr(graphs, "forward", lambda *args: seen.append(gc.isenabled()) or torch.zeros(2, 4))
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(len(seen)) or 0)
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    slots = torch.cat([engine.cache.extend(i, 1) for i in range(2)])
    graphs._capture(torch.tensor([7, 9]), torch.tensor([5, 9]), slots)
    assert seen == [True, False], "the warm-up with the collector on, the capture with it off"
    assert collected == [1], "collected between the warm-up and the capture"
    assert gc.isenabled()


def test_a_shared_system_prompt_gives_generates_tokens(llama):
    system = _prompts((21,), seed=2)[0]
    prompts, counts = _prompts((5, 9, 3)), [6, 4, 5]
    got = paged_generation.generate(llama, prompts, counts, arrivals=[0, 1, 1], system_prompt=system,
                                    num_pages=16, page_size=4, backend="reference")
    assert got == generate_each(llama, prompts, counts, system)


def test_speculative_tree_decoding_gives_generates_tokens_in_fewer_steps(llama):
    """Draft trees by prompt lookup, verified in one forward each over ``layouts.tree``: the accepted tokens are
    exactly greedy decoding's, requests joining and leaving, in fewer steps than tokens."""
    prompts, counts = _prompts((5, 9, 3)), [12, 10, 12]
    got, steps = paged_generation.generate_speculative(llama, prompts, counts, arrivals=[0, 2, 3], num_pages=16,
                                                       page_size=4, backend="reference")
    assert got == generate_each(llama, prompts, counts)
    assert steps < sum(map(len, got)) - len(got), "no draft token was ever accepted: the trees went unused"


def test_drafts_right_wrong_and_half_right_are_accepted_exactly_as_far_as_they_are_right(llama):
    """An adversarial drafter that knows the answer: at every step one branch is right for one token and then
    wrong, one is wrong from the start, and every other step one is right three tokens deep. The verifier
    must accept exactly the right part, whatever the depth of the mistake."""
    prompts, counts = _prompts((4, 7)), [9, 9]
    want = generate_each(llama, prompts, counts)

    def drafter(request, history):
        done = len(history) - len(prompts[request])  # tokens generated so far
        future = want[request][done:]
        wrong = [(t + 1) % VOCAB for t in future]
        branches = [future[:1] + wrong[1:3], wrong[:2]] + ([future[:3]] if done % 2 else [])
        return paged_generation.draft_tree(history[-1], branches)

    got, steps = paged_generation.generate_speculative(llama, prompts, counts, arrivals=[0, 1], proposer=drafter,
                                                       num_pages=16, page_size=4, backend="reference")
    assert got == want
    assert steps < sum(map(len, got)) - len(got)


def test_quest_with_a_budget_over_every_page_gives_generates_tokens(llama):
    """Quest's path (an HND cache, prefill through the step's plan, each decode per layer through a Quest layout
    over the pool viewed per head) is exact when the budget covers every page."""
    prompts, counts = _prompts((5, 9, 3)), [6, 4, 5]
    got = paged_generation.generate(llama, prompts, counts, arrivals=[0, 1, 2], quest_budget=64, num_pages=16,
                                    page_size=4, backend="reference")
    assert got == generate_each(llama, prompts, counts)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_quest_attention_reads_exactly_the_pages_it_selects(seed):
    """Two requests of 12 and 5 pages, budget 3: each KV head keeps the last page and the two pages of the
    largest bound (the largest over its query heads), and its query heads attend over exactly those keys."""
    rng = np.random.default_rng(seed)
    hkv, group, d, page = 2, 4, 8, 4
    cache = PagedKVCache(num_layers=1, num_pages=17, page_size=page, num_kv_heads=hkv, head_dim=d, kv_layout="HND")
    for request, n in (("a", 46), ("b", 19)):
        cache.write(0, cache.extend(request, n), *(torch.as_tensor(rng.standard_normal((n, hkv, d)),
                                                                   dtype=torch.float32) for _ in range(2)))
    q = torch.as_tensor(rng.standard_normal((2, hkv * group, d)), dtype=torch.float32)
    got = paged_generation.quest_attention(ba.BatchAttention(backend="reference"), cache, 0, ["a", "b"], q, 3,
                                           d ** -0.5)
    for b, request in enumerate(("a", "b")):
        pages, length = cache.pages(request), cache.length(request)
        keys = cache.k[0][pages].transpose(1, 2).reshape(-1, hkv, d)[:length].double().numpy()  # [length, Hkv, D]
        values = cache.v[0][pages].transpose(1, 2).reshape(-1, hkv, d)[:length].double().numpy()
        selected = paged_generation.select_pages(cache, 0, request, q[b], 3)
        for h in range(hkv):
            qh = q[b, h * group:(h + 1) * group].double().numpy()
            page_of = np.arange(length) // page
            bounds = [max(np.maximum(qh[g] * keys[page_of == p, h].min(0), qh[g] * keys[page_of == p, h].max(0))
                          .sum() for g in range(group)) for p in range(len(pages))]
            bounds[-1] = np.inf
            assert selected[h] == sorted(np.argsort(bounds)[-3:].tolist())
            seen = np.isin(page_of, selected[h])
            scores = qh @ keys[seen, h].T * d ** -0.5
            weights = np.exp(scores - scores.max(1, keepdims=True))
            want = weights @ values[seen, h] / weights.sum(1, keepdims=True)
            np.testing.assert_allclose(got[b, h * group:(h + 1) * group].numpy(), want, atol=2e-6)


def test_propose_merges_lookups_into_a_tree():
    tokens, parents = paged_generation.propose([5, 1, 2, 3, 5, 1, 4, 9, 5], depth=2, branches=3)
    # after the second 5: 1, 4; after the first 5: 1, 2 (sharing the node 1)
    assert tokens == [5, 1, 4, 2] and parents == [-1, 0, 1, 1]
    assert paged_generation.propose([7, 8], depth=2) == ([8], [-1])


def test_the_example_runs(capsys):
    paged_generation.main(["--backend", "reference"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and all("== generate's" in line for line in lines[:9]), lines


def test_the_step_plan_is_a_cascade_over_the_system_prompt(llama, monkeypatch):
    """Every step after the prompt's own plans a two-level cascade whose first level is the prompt's pages."""
    planned = []
    real = ba.BatchAttention.plan
    monkeypatch.setattr(ba.BatchAttention, "plan", lambda self, layout, *a, **kw: planned.append(layout) or
                        real(self, layout, *a, **kw))
    system = _prompts((9,), seed=3)[0]
    paged_generation.generate(llama, _prompts((3, 2)), [2, 2], system_prompt=system, num_pages=12, page_size=4,
                              backend="reference")
    assert isinstance(planned[0], ba.BSRLayout) and planned[0].kv_lens.tolist() == [9]
    assert all(isinstance(p, ba.Cascade) and p.levels[0].kv_lens.tolist() == [9] for p in planned[1:])
    assert len(planned) == 3  # the prompt, then the two requests' prefill, then their one decode step
