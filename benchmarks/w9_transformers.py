"""Workload 9: per-token decode time of a transformers model with bsrattn as its attention, against SDPA and eager.

A random-weight Llama of the 1B class (Llama 3.2 1B's shapes: 16 layers, hidden 2048, 32 query / 8 KV heads of
64, MLP 8192, vocabulary 128256; fp16), batch {1, 8, 32} x prompt {512, 4096}. The prompt is prefilled once
with HF's dynamic cache; each sample is then one decode step, ``model(next_token, past_key_values=cache)``
followed by a synchronize, timed by the host clock (what a token costs a user of ``generate``). The cache grows
by one token a sample, as in ``generate``, so every step plans anew and HF appends to its cache, as they do
there. Implementations, each HF's attention interface over the same weights and cache:

- ``bsrattn-torch``: ``bsrattn.integrations.transformers.register(backend="torch")``, ``attn_implementation
  ="bsrattn"`` (one plan per step, every layer reading HF's cache in place);
- ``sdpa``, ``eager``: transformers' own.

Correctness first: the first decode step's logits of every implementation are compared with SDPA's; the
tolerance is the larger of 2e-2 and twice HF's own eager-vs-SDPA difference on the same step (fp16 attention
orders its sums differently in each). HF's eager attention prefills by materialising ``[B, H, S, S]`` scores
several times over (fp16 scores, scaled and masked, their fp32 softmax, its fp16 copy: past the H200's 140 GB at
32 x 4096), so where its prefill runs out of GPU memory its row is recorded as unavailable, and HF's spread is
taken over the first requests of the batch that fit. Eager mode only: HF's dynamic cache grows every step,
which a CUDA graph cannot replay (the graph rows below use a static cache).

**As ``generate`` drives it** (the rows a user of transformers sees): the same prompts, left-padded as
``generate`` pads a batch (request ``b`` of ``B`` holds ``prompt - b * prompt // (2B)`` tokens), decoded
greedily by ``model.generate``; a step's time is the difference of two runs' wall times, one stopped after
:data:`NEW_TOKENS` ``[0]`` new tokens and one after ``[1]``, over the difference (prefill and set-up cancel;
median of :data:`REPEATS` such pairs):

- ``sdpa-generate``, ``eager-generate``, ``bsrattn-torch-generate``: HF's dynamic cache, each implementation;
- ``sdpa-graph``: ``cache_implementation="static"``, which ``generate`` compiles with ``torch.compile(mode=
  "reduce-overhead")``: every decode step one replayed CUDA graph, the path users pick for speed;
- ``bsrattn-torch-graph``: the same with bsrattn, its plans hoisted before the compiled forward
  (``bsrattn.integrations.transformers.hoist_plans``);
- ``bsrattn-paged-graph``: the project's paged serving loop (``examples/paged_generation.py``, page 16, the
  prompts unpadded), each decode step one CUDA graph of the whole forward, planned outside it, the host a step
  ahead of the tokens;
- ``bsrattn-paged-compiled``: the same loop with the forward its graphs record compiled first by
  ``torch.compile`` (``generate(..., compile=True)``), as transformers' static cache compiles its own.

Each such row records ``tokens_as_sdpa``: over the requests, the mean fraction of new tokens before the first
that differs from ``sdpa-generate``'s (1.0: every token SDPA's), and the dynamic- and static-cache rows check
the first decode step's logits against SDPA's (the tolerance above). **Throughput** (``--quick`` too): batch
:data:`THROUGHPUT` ``[0]`` x prompt ``[1]``, ``[2]`` new tokens, the whole ``generate`` (prefill included) in
tokens per second, for the graph rows.

Run: ``python3 -m benchmarks.w9_transformers [--quick]``.
"""

from __future__ import annotations

from functools import partial

from benchmarks import harness

WORKLOAD = "w9_transformers"
TITLE = "W9: per-token decode of a 1B-class Llama (fp16, 32/8 heads, d64): bsrattn vs SDPA vs eager"
GPU_MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192)
DRY_MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
CONFIGS = [(b, p) for b in (1, 8, 32) for p in (512, 4096)]
QUICK = [(1, 512), (8, 4096), (32, 512)]
DRY_CONFIGS = [(1, 8), (2, 16)]
IMPLEMENTATIONS = {"bsrattn-torch": "bsrattn", "sdpa": "sdpa", "eager": "eager"}
GENERATE = {"sdpa-generate": "sdpa", "eager-generate": "eager", "bsrattn-torch-generate": "bsrattn"}
GRAPHS = {"sdpa-graph": "sdpa", "bsrattn-torch-graph": "bsrattn"}
PAGED = {"bsrattn-paged-graph": False, "bsrattn-paged-compiled": True}  # row -> compile
NEW_TOKENS = (16, 48)
DRY_NEW_TOKENS = (2, 4)
REPEATS = 3
THROUGHPUT = (64, 2048, 256)


def make_model(suite):
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = DRY_MODEL if suite.dry_run else GPU_MODEL
    config = transformers.LlamaConfig(**sizes, attn_implementation="sdpa")
    dtype = torch.float32 if suite.dry_run else torch.float16
    with torch.device(suite.device):  # the random weights drawn where they will live: seconds, not a minute
        model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None  # random weights: every run decodes as many tokens as asked
    model.generation_config.pad_token_id = 0
    return model.to(dtype=dtype).eval()


def prefill(model, implementation, prompt):
    """HF's dynamic cache after ``prompt`` under ``implementation``, and the next token."""
    import torch

    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


def decode_logits(model, implementation, prompt):
    """The first decode step's logits ``[B, vocab]`` under ``implementation``, from its own prefill."""
    import torch

    cache, token = prefill(model, implementation, prompt)
    with torch.no_grad():
        return model(token, past_key_values=cache, use_cache=True).logits[:, -1].float()


def hf_spread(model, prompt) -> float:
    """HF's own eager-vs-SDPA difference in the first decode step's logits, over as many of the batch's first
    requests as eager attention's prefill fits in GPU memory (halved until it does; at least one)."""
    import torch

    rows = prompt.shape[0]
    while True:
        head = prompt[:rows]
        try:
            return float((decode_logits(model, "eager", head) - decode_logits(model, "sdpa", head)).abs().max())
        except torch.OutOfMemoryError:
            if rows == 1:
                raise
        rows //= 2
        torch.cuda.empty_cache()  # after the handler: its frames' tensors are freed by then


def unless_out_of_memory(what, fn):
    """``fn()``, or :class:`harness.Unavailable` naming ``what`` when it runs out of GPU memory."""
    import torch

    try:
        return fn()
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0]
    torch.cuda.empty_cache()  # after the handler: its frames' tensors are freed by then
    raise harness.Unavailable(f"{what} does not fit in GPU memory ({oom})")


def build(model, implementation, prompt, tolerance):
    """One timed decode step, the cache one token longer after each, once checked against SDPA's."""
    import torch

    got = unless_out_of_memory(f"{implementation} attention's prefill at {tuple(prompt.shape)}",
                               partial(decode_logits, model, implementation, prompt))
    want = decode_logits(model, "sdpa", prompt)
    err = float((got - want).abs().max())
    if not err <= tolerance:
        raise AssertionError(f"first decode step's logits {err:.3g} from SDPA's, beyond {tolerance:.3g}")
    cache, token = prefill(model, implementation, prompt)

    def step():
        with torch.no_grad():
            model(token, past_key_values=cache, use_cache=True)

    return step


# ---- as generate drives it ----

def left_padded(prompt):
    """``prompt [B, L]`` left-padded as ``generate`` pads a batch: request ``b`` keeps its last ``L - b * L //
    (2B)`` tokens. Returns the ids (pads 0), the mask, and each request's own tokens."""
    batch, length = prompt.shape
    ids, mask = prompt.clone(), prompt.new_ones(prompt.shape)
    for b in range(batch):
        pad = b * length // (2 * batch)
        ids[b, :pad], mask[b, :pad] = 0, 0
    return ids, mask, [ids[b][mask[b].bool()] for b in range(batch)]


def _stop_after(limit):
    import torch
    import transformers

    class StopAfter(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= limit, dtype=torch.bool,
                              device=input_ids.device)

    return transformers.StoppingCriteriaList([StopAfter()])


def generate_with(model, implementation, ids, mask, new_tokens, stop, static):
    """``generate``'s greedy sequences and logits, stopped after ``stop`` new tokens of a run sized for
    ``new_tokens`` (so a static cache, and its compiled graph, is the same for every ``stop``)."""
    import torch

    model.set_attn_implementation(implementation)
    extra = dict(cache_implementation="static") if static else dict(disable_compile=True)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              stopping_criteria=_stop_after(ids.shape[1] + stop), output_logits=True,
                              return_dict_in_generate=True, **extra)


def step_times(run, counts, sync):
    """µs a decode step, from the wall times of ``run(n)`` for the two ``counts`` of new tokens: one sample per
    pair of runs, :data:`REPEATS` pairs."""
    import time

    samples = []
    for _ in range(REPEATS):
        walls = []
        for n in counts:
            sync()
            t0 = time.perf_counter()
            run(n)
            sync()
            walls.append(time.perf_counter() - t0)
        samples.append((walls[1] - walls[0]) / (counts[1] - counts[0]) * 1e6)
    return samples


def as_sdpa(new, want) -> float:
    """The mean, over requests, of the fraction of ``new [B, n]`` tokens before the first unlike ``want``'s."""
    import torch

    differs = (new != want).int()
    first = torch.where(differs.any(1), differs.argmax(1), torch.full_like(differs[:, 0], new.shape[1]))
    return float(first.float().mean() / new.shape[1])


def paged_loop():
    """``examples/paged_generation.py``, the project's serving loop, as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    module = sys.modules.get("paged_generation")
    if module is None:
        path = Path(__file__).resolve().parent.parent / "examples" / "paged_generation.py"
        spec = importlib.util.spec_from_file_location("paged_generation", path)
        module = sys.modules["paged_generation"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def sdpa_reference(model, prompt, counts) -> dict:
    """``sdpa-generate``'s new tokens and first decode step's logits, which the generate-driven rows are held to."""
    ids, mask, _ = left_padded(prompt)
    out = generate_with(model, "sdpa", ids, mask, counts[1], counts[1], False)
    return {"sequences": out.sequences[:, ids.shape[1]:], "logits": out.logits[1].float()}


def build_generate(model, implementation, prompt, counts, tolerance, reference, sync, static=False, hoist=None):
    """A generate-driven row: checked (first decode step's logits, tokens against SDPA's), then timed."""
    import torch

    ids, mask, _ = left_padded(prompt)
    handle = hoist(model) if hoist else None
    try:
        out = unless_out_of_memory(f"{implementation} at {tuple(ids.shape)}", partial(
            generate_with, model, implementation, ids, mask, counts[1], counts[1], static))
    except BaseException:
        if handle is not None:
            handle.remove()
        raise
    err = float((out.logits[1].float() - reference["logits"]).abs().max())
    fields = {"tokens_as_sdpa": as_sdpa(out.sequences[:, ids.shape[1]:], reference["sequences"]),
              "logits_vs_sdpa": err}

    def timed():
        try:
            if not err <= tolerance:
                raise AssertionError(f"first decode step's logits {err:.3g} from SDPA's, beyond {tolerance:.3g}")
            times = step_times(lambda n: generate_with(model, implementation, ids, mask, counts[1], n, static),
                               counts, sync)
        finally:
            if handle is not None:
                handle.remove()
        return times, fields

    return timed


def build_paged(model, prompt, counts, reference, sync, compile=False):
    """The paged loop with its decode steps as CUDA graphs, compiled first with ``compile``, on the unpadded
    prompts."""
    paged_generation = paged_loop()
    _, _, prompts = left_padded(prompt)
    pages = sum(-(-(len(p) + counts[1]) // 16) for p in prompts)

    def run(n):
        return paged_generation.generate(model, prompts, [n] * len(prompts), num_pages=pages, page_size=16,
                                         backend="torch", graphs=True, compile=compile)

    import torch

    new = torch.tensor(run(counts[1]), device=prompt.device)

    def timed():
        return step_times(run, counts, sync), {"tokens_as_sdpa": as_sdpa(new, reference["sequences"])}

    return timed


def build_throughput(model, implementation, batch, length, new_tokens, sync, hoist=None, paged=None):
    """Tokens per second of a whole greedy run (prefill included): ``generate`` with a static cache, compiled,
    or the paged loop with decode graphs (``paged``: whether they are compiled)."""
    import time

    import torch

    gen = torch.Generator(device="cpu").manual_seed(7)
    prompt = torch.randint(3, model.config.vocab_size, (batch, length), generator=gen).to(model.device)
    mask = torch.ones_like(prompt)
    if paged is not None:
        paged_generation = paged_loop()
        pages = batch * -(-(length + new_tokens) // 16)

        def run():
            paged_generation.generate(model, list(prompt), [new_tokens] * batch, num_pages=pages, page_size=16,
                                      backend="torch", graphs=True, compile=paged)
    else:
        def run():
            generate_with(model, implementation, prompt, mask, new_tokens, new_tokens, True)

    handle = hoist(model) if hoist else None

    def timed():
        try:
            run()  # compiles and captures
            walls = []
            for _ in range(2):
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                walls.append((time.perf_counter() - t0) * 1e6)
        finally:
            if handle is not None:
                handle.remove()
        return walls, {"tokens_per_s": batch * new_tokens / (min(walls) / 1e6)}

    return timed


def run(suite) -> None:
    import torch

    from bsrattn.integrations import transformers as bsrattn_hf

    bsrattn_hf.register(backend="reference" if suite.dry_run else "torch")
    model = make_model(suite)
    items = DRY_CONFIGS if suite.dry_run else (QUICK if suite.quick else CONFIGS)
    counts = DRY_NEW_TOKENS if suite.dry_run else NEW_TOKENS
    sync = torch.cuda.synchronize if suite.gpu else (lambda: None)
    vocab = model.config.vocab_size
    for (batch, length), config in suite.configs(items, lambda c: {"batch": c[0], "prompt": c[1]}):
        gen = torch.Generator(device="cpu").manual_seed(batch * 10007 + length)
        prompt = torch.randint(3, vocab, (batch, length), generator=gen).to(suite.device)
        tolerance = max(2e-2 if not suite.dry_run else 1e-4, 2 * hf_spread(model, prompt))
        for name, implementation in IMPLEMENTATIONS.items():
            impl = "bsrattn-reference" if suite.dry_run and name == "bsrattn-torch" else name
            suite.measure_host(config, impl, partial(build, model, implementation, prompt, tolerance))
        reference = sdpa_reference(model, prompt, counts)
        for name, implementation in GENERATE.items():
            impl = name.replace("torch", "reference") if suite.dry_run else name
            suite.measure_timed(config, impl, partial(build_generate, model, implementation, prompt, counts,
                                                      tolerance, reference, sync))
        for name, implementation in GRAPHS.items():
            hoist = bsrattn_hf.hoist_plans if implementation == "bsrattn" else None
            suite.measure_timed(config, name, partial(build_generate, model, implementation, prompt, counts,
                                                      tolerance, reference, sync, static=True, hoist=hoist),
                                needs_cuda=True)
        for name, compile in PAGED.items():
            suite.measure_timed(config, name, partial(build_paged, model, prompt, counts, reference, sync, compile),
                                needs_cuda=True)
        suite.release(collect=True)
    throughput = lambda c: {"batch": c[0], "prompt": c[1], "new_tokens": c[2]}  # noqa: E731
    for (batch, length, new_tokens), config in suite.configs([THROUGHPUT], throughput):
        for name, implementation in GRAPHS.items():
            hoist = bsrattn_hf.hoist_plans if implementation == "bsrattn" else None
            suite.measure_timed(config, name, partial(build_throughput, model, implementation, batch, length,
                                                      new_tokens, sync, hoist=hoist), needs_cuda=True)
        for name, compile in PAGED.items():
            suite.measure_timed(config, name, partial(build_throughput, model, None, batch, length, new_tokens,
                                                      sync, paged=compile), needs_cuda=True)


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
