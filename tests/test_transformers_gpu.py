"""bsrattn's torch tier as the attention of transformers models on the H200: a 1B-class Llama in fp16, and the
paged serving loop of ``examples/paged_generation.py``.

The 1B-class model (Llama 3.2 1B's shapes, random weights, fp16) is compared with HF's own SDPA attention:
teacher-forced logits of a prefill and of decode steps through HF's cache must lie within HF's own discrepancy
(twice eager-vs-SDPA on the same inputs, at least 2e-2: fp16 attention orders its sums differently in each), and
greedy ``generate`` must give SDPA's tokens up to the first step where SDPA's own two best logits are closer
than that tolerance (a near-tie either side may break). The paged loop runs a small fp32 model on the GPU
through the torch tier: its greedy tokens must be ``model.generate``'s, requests joining and leaving, with a
shared system prompt as a cascade. Run on the H200 with ``python3 -m pytest -m gpu tests/test_transformers_gpu.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import bsrattn.integrations.transformers as bsrattn_hf  # noqa: E402

import paged_generation  # noqa: E402  (examples/, on pytest's pythonpath)
from helpers import generate_each  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: none here (run on the H200 through the device tool)")]

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192)
MIN_TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def llama_1b():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_1B, attn_implementation="sdpa")
    with torch.device("cuda"):  # the random weights drawn on the GPU: seconds, not a minute
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype=torch.float16).eval()


def _run(model, implementation, *args, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(*args, **kwargs)


def _rel(a, b) -> float:
    """Largest difference relative to the largest logit."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_a_1b_llama_in_fp16_gives_sdpas_logits_within_hfs_own_spread(llama_1b):
    name = bsrattn_hf.register(backend="torch")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, LLAMA_1B["vocab_size"], (4, 384), generator=gen).cuda()
    steps = torch.randint(3, LLAMA_1B["vocab_size"], (4, 6), generator=gen).cuda()
    runs = {impl: _run(llama_1b, impl, ids) for impl in ("sdpa", "eager", name)}
    tolerance = max(MIN_TOLERANCE, 2 * _rel(runs["eager"].logits, runs["sdpa"].logits))
    assert _rel(runs[name].logits, runs["sdpa"].logits) <= tolerance, "prefill logits"
    ours, theirs = runs[name], runs["sdpa"]
    for t in range(steps.shape[1]):
        token = steps[:, t:t + 1]
        ours = _run(llama_1b, name, token, past_key_values=ours.past_key_values)
        theirs = _run(llama_1b, "sdpa", token, past_key_values=theirs.past_key_values)
        assert _rel(ours.logits, theirs.logits) <= tolerance, f"decode step {t}"


def test_a_1b_llama_greedy_generate_gives_sdpas_tokens_up_to_a_near_tie(llama_1b):
    name = bsrattn_hf.register(backend="torch")
    ids = torch.randint(3, LLAMA_1B["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(2)).cuda()
    runs = {}
    for impl in ("sdpa", "eager", name):
        llama_1b.set_attn_implementation(impl)
        with torch.no_grad():
            runs[impl] = llama_1b.generate(ids, max_new_tokens=16, do_sample=False, output_logits=True,
                                           return_dict_in_generate=True, pad_token_id=0)
    sdpa = runs["sdpa"]
    first = torch.stack(runs["eager"].logits[:1]), torch.stack(sdpa.logits[:1])
    tolerance = max(MIN_TOLERANCE, 2 * _rel(*first)) * float(first[1].float().abs().max())  # in logits
    new = slice(ids.shape[1], None)
    for row in range(ids.shape[0]):
        for step, (ours, want) in enumerate(zip(runs[name].sequences[row, new], sdpa.sequences[row, new])):
            if ours == want:
                continue
            logits = sdpa.logits[step][row].float()
            gap = float(logits[want] - logits[ours])
            assert gap <= tolerance, (f"row {row} step {step}: token {int(ours)} for SDPA's {int(want)}, whose "
                                      f"logit leads by {gap:.3g} (tolerance {tolerance:.3g})")
            break  # past a near-tie the continuations differ


@pytest.fixture(scope="module")
def small_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).cuda().eval()


def _prompts(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).cuda() for n in lengths]


@pytest.mark.parametrize("system_len", [0, 37], ids=["no system prompt", "shared system prompt"])
def test_the_paged_loop_on_the_gpu_gives_generates_tokens(small_llama, system_len):
    small_llama.set_attn_implementation("sdpa")
    prompts, counts = _prompts((50, 130, 9, 70)), [12, 9, 14, 6]
    system = _prompts((system_len,), seed=3)[0] if system_len else None
    got = paged_generation.generate(small_llama, prompts, counts, arrivals=[0, 1, 3, 8], system_prompt=system,
                                    num_pages=64, page_size=16, backend="torch")
    assert got == generate_each(small_llama, prompts, counts, system)


# ---- CUDA graphs: transformers' static cache compiled with reduce-overhead, and the paged loop's decode graphs ----

def _left_padded(lengths, seed=5):
    longest = max(lengths)
    ids = torch.randint(3, 256, (len(lengths), longest), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :longest - n], mask[b, :longest - n] = 0, 0
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("lengths", [(60, 60, 60), (60, 33, 12)], ids=["full batch", "left-padded"])
def test_a_static_cache_generate_in_cuda_graphs_replays_its_plans_and_gives_generates_tokens(small_llama, lengths):
    """``generate`` compiles a static cache's decode step with ``mode="reduce-overhead"``: one graph, captured once
    and replayed at every later step while the hook re-plans into the same buffers."""
    from torch._dynamo.utils import counters

    name = bsrattn_hf.register(backend="torch")
    before = set(bsrattn_hf._hoisted)
    handle = bsrattn_hf.hoist_plans(small_llama)
    (state,) = (bsrattn_hf._hoisted[s] for s in set(bsrattn_hf._hoisted) - before)
    ids, mask = _left_padded(lengths)
    try:
        torch._dynamo.reset()
        counters.clear()
        small_llama.set_attn_implementation(name)
        with torch.no_grad():
            ours = small_llama.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                                        cache_implementation="static")
        graphs = counters["stats"]["unique_graphs"]
        buffers = [slot.attn._runners[0].buffers for key, slot in state.slots.items() if key[-1]]  # decode slots
    finally:
        handle.remove()
    small_llama.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = small_llama.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, want)
    assert buffers and all(b.captured for b in buffers), "the decode steps must run inside a captured CUDA graph"
    assert graphs == 1, f"{graphs} graphs compiled: every decode step must replay the first"


@pytest.mark.parametrize("compile", [False, True], ids=["eager forward", "compiled forward"])
def test_the_paged_loop_with_decode_graphs_gives_generates_tokens(small_llama, monkeypatch, compile):
    """Requests join and leave, so decode batches of several sizes each get a graph, replayed across re-plans."""
    captures = []
    capture = paged_generation.DecodeGraphs._capture

    def counted(self, *args):
        captures.append(args[0].numel())
        return capture(self, *args)

    monkeypatch.setattr(paged_generation.DecodeGraphs, "_capture", counted)
    small_llama.set_attn_implementation("sdpa")
    prompts, counts = _prompts((50, 130, 9, 70)), [12, 9, 14, 6]
    got = paged_generation.generate(small_llama, prompts, counts, arrivals=[0, 1, 3, 8], num_pages=64,
                                    page_size=16, backend="torch", graphs=True, compile=compile)
    assert got == generate_each(small_llama, prompts, counts)
    assert captures and len(captures) == len(set(captures)), f"one capture per batch size: {captures}"
