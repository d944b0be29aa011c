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
which a CUDA graph cannot replay.

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


def make_model(suite):
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = DRY_MODEL if suite.dry_run else GPU_MODEL
    config = transformers.LlamaConfig(**sizes, attn_implementation="sdpa")
    dtype = torch.float32 if suite.dry_run else torch.float16
    with torch.device(suite.device):  # the random weights drawn where they will live: seconds, not a minute
        model = transformers.LlamaForCausalLM(config)
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


def build(model, implementation, prompt, tolerance):
    """One timed decode step, the cache one token longer after each, once checked against SDPA's."""
    import torch

    try:
        got = decode_logits(model, implementation, prompt)
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0]
    else:
        oom = None
    if oom is not None:
        torch.cuda.empty_cache()  # after the handler: its frames' tensors are freed by then
        raise harness.Unavailable(f"{implementation} attention's prefill at {tuple(prompt.shape)} does not fit in "
                                  f"GPU memory ({oom})")
    want = decode_logits(model, "sdpa", prompt)
    err = float((got - want).abs().max())
    if not err <= tolerance:
        raise AssertionError(f"first decode step's logits {err:.3g} from SDPA's, beyond {tolerance:.3g}")
    cache, token = prefill(model, implementation, prompt)

    def step():
        with torch.no_grad():
            model(token, past_key_values=cache, use_cache=True)

    return step


def run(suite) -> None:
    import torch

    from bsrattn.integrations import transformers as bsrattn_hf

    bsrattn_hf.register(backend="reference" if suite.dry_run else "torch")
    model = make_model(suite)
    items = DRY_CONFIGS if suite.dry_run else (QUICK if suite.quick else CONFIGS)
    vocab = model.config.vocab_size
    for (batch, length), config in suite.configs(items, lambda c: {"batch": c[0], "prompt": c[1]}):
        gen = torch.Generator(device="cpu").manual_seed(batch * 10007 + length)
        prompt = torch.randint(3, vocab, (batch, length), generator=gen).to(suite.device)
        tolerance = max(2e-2 if not suite.dry_run else 1e-4, 2 * hf_spread(model, prompt))
        for name, implementation in IMPLEMENTATIONS.items():
            impl = "bsrattn-reference" if suite.dry_run and name == "bsrattn-torch" else name
            suite.measure_host(config, impl, partial(build, model, implementation, prompt, tolerance))
        suite.release(collect=True)


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
