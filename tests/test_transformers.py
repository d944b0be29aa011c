"""bsrattn as a transformers model's attention: tiny random models against HF's own SDPA (or eager) attention.

Every model runs on the reference tier, float32: logits within 1e-5 of HF's for a teacher-forced prefill and
for decode steps through the cache, and greedy ``generate`` gives the same tokens, for full-length, left- and
right-padded batches and a static cache. Sliding windows (Mistral) and soft caps (Gemma 2, whose SDPA path
refuses a soft cap: it is checked against eager) run as models too; the registered function is also called
directly against an explicit float64 computation, and its refusals are checked by message.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import bsrattn as ba  # noqa: E402
import bsrattn.integrations.transformers as bsrattn_hf  # noqa: E402
from bsrattn import testing  # noqa: E402

LOGITS_ATOL = 1e-5
VOCAB = 128
# transformers 5.24 renames the argument to `cache`; 5.17 knows only `past_key_values`.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)


@pytest.fixture(autouse=True)
def registered():
    """A fresh registration (no plans kept from another test) on the reference tier."""
    return bsrattn_hf.register(backend="reference")


def _model(config_class, model_class, implementation="sdpa", **extra):
    torch.manual_seed(0)
    config = config_class(**SIZES, **extra, attn_implementation=implementation)
    return model_class(config).eval()


@pytest.fixture(scope="module")
def llama():
    return _model(transformers.LlamaConfig, transformers.LlamaForCausalLM)


def _ids(batch, length, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _forward(model, implementation, *args, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(*args, **kwargs)


def _generate(model, implementation, ids, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs)


def _assert_logits(ours, theirs, name="logits"):
    result = testing.compare(ours, theirs, atol=LOGITS_ATOL, rtol=0.0, name=name)
    assert result.ok, result.message


def test_prefill_logits_match_sdpa(llama, registered):
    ids = _ids(2, 12)
    _assert_logits(_forward(llama, registered, ids).logits, _forward(llama, "sdpa", ids).logits)


def test_decode_steps_through_the_cache_match_sdpa(llama, registered):
    ids = _ids(2, 7)
    steps = _ids(2, 4, seed=2)
    ours, theirs = _forward(llama, registered, ids), _forward(llama, "sdpa", ids)
    for t in range(steps.shape[1]):
        token = steps[:, t:t + 1]
        ours = _forward(llama, registered, token, past_key_values=ours.past_key_values)
        theirs = _forward(llama, "sdpa", token, past_key_values=theirs.past_key_values)
        _assert_logits(ours.logits, theirs.logits, f"logits of decode step {t}")


def test_a_chunk_of_several_queries_after_the_cache_matches_sdpa(llama, registered):
    """Queries 7..10 over keys 0..10: the causal mask is bottom-right aligned, as HF's mask says."""
    ids = _ids(1, 11)
    ours = _forward(llama, registered, ids[:, :7])
    theirs = _forward(llama, "sdpa", ids[:, :7])
    ours = _forward(llama, registered, ids[:, 7:], past_key_values=ours.past_key_values)
    theirs = _forward(llama, "sdpa", ids[:, 7:], past_key_values=theirs.past_key_values)
    _assert_logits(ours.logits, theirs.logits)


def test_greedy_generate_gives_sdpas_tokens(llama, registered):
    ids = _ids(2, 6)
    assert torch.equal(_generate(llama, registered, ids), _generate(llama, "sdpa", ids))


def test_greedy_generate_with_a_static_cache_gives_sdpas_tokens(llama, registered):
    """A static cache's prefill comes with no mask and keys past the prompt that hold nothing yet."""
    ids = _ids(2, 6, seed=3)
    ours = _generate(llama, registered, ids, cache_implementation="static")
    assert torch.equal(ours, _generate(llama, "sdpa", ids, cache_implementation="static"))


def _left_padded(lengths, seed=4):
    """Prompts of ``lengths`` left-padded to the longest, as ``generate`` pads a batch: ids and mask."""
    longest = max(lengths)
    ids = _ids(len(lengths), longest, seed)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :longest - n] = 0
        mask[b, longest - n:] = 1
    return ids, mask


def test_left_padded_batch_matches_sdpa_on_its_tokens(llama, registered):
    lengths = (5, 9)
    ids, mask = _left_padded(lengths)
    ours = _forward(llama, registered, ids, attention_mask=mask).logits
    theirs = _forward(llama, "sdpa", ids, attention_mask=mask).logits
    for b, n in enumerate(lengths):
        _assert_logits(ours[b, -n:], theirs[b, -n:], f"logits of request {b}")
        _assert_logits(ours[b, -n:], _forward(llama, registered, ids[b:b + 1, -n:]).logits[0],
                       f"request {b} padded against alone")


def test_left_padded_greedy_generate_gives_sdpas_tokens(llama, registered):
    ids, mask = _left_padded((3, 8))
    ours = _generate(llama, registered, ids, attention_mask=mask)
    assert torch.equal(ours, _generate(llama, "sdpa", ids, attention_mask=mask))


def test_right_padded_batch_matches_sdpa_on_its_tokens(llama, registered):
    lengths = (4, 10)
    ids = _ids(2, max(lengths), seed=5)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    ours = _forward(llama, registered, ids, attention_mask=mask).logits
    theirs = _forward(llama, "sdpa", ids, attention_mask=mask).logits
    for b, n in enumerate(lengths):
        _assert_logits(ours[b, :n], theirs[b, :n], f"logits of request {b}")


def test_every_layer_of_a_step_runs_the_steps_one_plan(llama, registered, monkeypatch):
    plans = []
    plan = ba.BatchAttention.plan

    def counted(self, layout, *args, **kwargs):
        plans.append(layout)
        return plan(self, layout, *args, **kwargs)

    monkeypatch.setattr(ba.BatchAttention, "plan", counted)
    ids, mask = _left_padded((3, 8))
    _forward(llama, registered, ids)
    _forward(llama, registered, ids, attention_mask=mask)
    assert len(plans) == 2, f"{len(plans)} plans for 2 steps of {llama.config.num_hidden_layers} layers"
    assert plans[0].custom_mask is None and plans[1].custom_mask is not None


def test_a_sliding_window_model_matches_sdpa_in_prefill_and_decode(registered):
    model = _model(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=4)
    ids = _ids(2, 10, seed=6)
    ours, theirs = _forward(model, registered, ids), _forward(model, "sdpa", ids)
    _assert_logits(ours.logits, theirs.logits)
    for t, token in enumerate(_ids(2, 3, seed=7).T):
        ours = _forward(model, registered, token[:, None], past_key_values=ours.past_key_values)
        theirs = _forward(model, "sdpa", token[:, None], past_key_values=theirs.past_key_values)
        _assert_logits(ours.logits, theirs.logits, f"logits of decode step {t}")


def test_a_soft_capped_model_with_alternating_windows_matches_eager(registered):
    """Gemma 2: a soft cap, its own scale, and sliding and full layers, each kind with its own mask."""
    model = _model(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, "eager", sliding_window=4,
                   attn_logit_softcapping=0.05, query_pre_attn_scalar=8)
    ids, mask = _left_padded((7, 10), seed=8)
    ours = _forward(model, registered, ids, attention_mask=mask).logits
    theirs = _forward(model, "eager", ids, attention_mask=mask).logits
    for b, n in enumerate((7, 10)):
        _assert_logits(ours[b, -n:], theirs[b, -n:], f"logits of request {b}")
    assert torch.equal(_generate(model, registered, ids, attention_mask=mask),
                       _generate(model, "eager", ids, attention_mask=mask))


# The registered function called directly, against attention written out in float64.

class _Module(torch.nn.Module):
    is_causal = True


def _explicit(query, key, value, visible, scale, softcap=0.0):
    """``[B, S_q, Hq, D]`` float64 attention: each query head reads KV head ``h // (Hq / Hkv)``."""
    q, k, v = (x.double() for x in (query, key, value))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = scale * q @ k.transpose(-1, -2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, -torch.inf)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def _qkv(batch=2, num_qo_heads=8, num_kv_heads=2, qo_len=5, kv_len=9, head_dim=16):
    g = torch.Generator().manual_seed(9)
    return (torch.randn(batch, num_qo_heads, qo_len, head_dim, generator=g),
            torch.randn(batch, num_kv_heads, kv_len, head_dim, generator=g),
            torch.randn(batch, num_kv_heads, kv_len, head_dim, generator=g))


def _bottom_right(qo_len, kv_len, window=None):
    q_pos = torch.arange(qo_len)[:, None] + kv_len - qo_len
    k_pos = torch.arange(kv_len)[None, :]
    visible = k_pos <= q_pos
    return visible & (k_pos > q_pos - window) if window else visible


@pytest.mark.parametrize("kwargs", [dict(), dict(sliding_window=3), dict(softcap=0.5), dict(scaling=0.7),
                                    dict(sliding_window=2, softcap=1.0, scaling=0.3)], ids=str)
def test_the_function_computes_the_models_variant(kwargs):
    query, key, value = _qkv()
    visible = _bottom_right(5, 9, kwargs.get("sliding_window"))
    mask = visible[None, None].expand(2, 1, 5, 9)
    function = transformers.AttentionInterface()[bsrattn_hf.NAME]
    out, weights = function(_Module(), query, key, value, mask, **kwargs)
    expected = _explicit(query, key, value, visible, kwargs.get("scaling", 16 ** -0.5), kwargs.get("softcap", 0.0))
    testing.assert_close(out, expected, "attention", "float32")
    assert weights is None


def test_the_function_reads_a_sliding_window_from_the_module():
    query, key, value = _qkv(qo_len=1)
    module = _Module()
    module.sliding_window = 4
    out, _ = transformers.AttentionInterface()[bsrattn_hf.NAME](module, query, key, value, None)
    testing.assert_close(out, _explicit(query, key, value, _bottom_right(1, 9, 4), 0.25), "attention", "float32")


def test_a_mask_past_the_position_masks_drops_them():
    """A query that may see a later key (a bidirectional block) needs the mask alone, not causality on top."""
    query, key, value = _qkv(batch=1, qo_len=4, kv_len=4)
    visible = _bottom_right(4, 4)
    visible[0, 1] = True
    out, _ = transformers.AttentionInterface()[bsrattn_hf.NAME](_Module(), query, key, value, visible[None, None])
    testing.assert_close(out, _explicit(query, key, value, visible, 0.25), "attention", "float32")


def test_an_additive_float_mask_is_read_as_a_mask():
    query, key, value = _qkv()
    visible = _bottom_right(5, 9) & (torch.arange(9) >= 2)
    additive = torch.zeros(2, 1, 5, 9).masked_fill(~visible, torch.finfo(torch.float32).min)
    out, _ = transformers.AttentionInterface()[bsrattn_hf.NAME](_Module(), query, key, value, additive)
    testing.assert_close(out, _explicit(query, key, value, visible, 0.25), "attention", "float32")


@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout=0.1), r"dropout=0\.1: bsrattn's attention has no dropout"),
    (dict(position_bias=torch.zeros(1, 8, 5, 9)), r"position_bias is given"),
], ids=["dropout", "position_bias"])
def test_what_bsrattn_does_not_compute_is_refused(kwargs, message):
    query, key, value = _qkv()
    with pytest.raises(ValueError, match=message):
        transformers.AttentionInterface()[bsrattn_hf.NAME](_Module(), query, key, value, None, **kwargs)


@pytest.mark.parametrize("mask, error, message", [
    (torch.zeros(2, 8, 5, 9, dtype=torch.bool), ValueError, r"attention_mask has shape \(2, 8, 5, 9\)"),
    (torch.full((2, 1, 5, 9), 0.5), ValueError, r"attention_mask holds the additive value 0\.5"),
    (torch.ones(2, 1, 5, 9, dtype=torch.int64), TypeError, r"attention_mask has dtype torch\.int64"),
    (torch.zeros(2, 1, 5, 9).index_fill(3, torch.tensor([4]), float("nan")), ValueError,
     r"attention_mask holds the additive value nan"),
    (torch.zeros(2, 1, 5, 9).index_fill(3, torch.tensor([4]), -2e38), ValueError,
     r"attention_mask holds the additive value -1\.99\d*e\+38"),
], ids=["per-head", "bias", "integer", "NaN", "a large negative bias"])
def test_a_mask_bsrattn_cannot_read_is_refused(mask, error, message):
    query, key, value = _qkv()
    with pytest.raises(error, match=message):
        transformers.AttentionInterface()[bsrattn_hf.NAME](_Module(), query, key, value, mask)


def test_a_training_model_is_refused_for_its_dropout(registered):
    model = _model(transformers.LlamaConfig, transformers.LlamaForCausalLM, attention_dropout=0.1).train()
    model.set_attn_implementation(registered)
    with pytest.raises(ValueError, match=r"dropout=0\.1"):
        model(_ids(1, 4))


def test_a_plan_is_not_reused_for_another_mask_at_a_freed_masks_address(monkeypatch):
    """CPython gives a freed mask's address, its id, to the next tensor: every mask here gets the same id."""
    monkeypatch.setattr(bsrattn_hf, "id", lambda obj: 0, raising=False)
    query, key, value = _qkv(batch=1, qo_len=1, kv_len=9)
    function = transformers.AttentionInterface()[bsrattn_hf.NAME]
    for start in range(3):
        visible = torch.arange(9)[None, None, None, :] >= start
        out, _ = function(_Module(), query, key, value, visible)
        testing.assert_close(out, _explicit(query, key, value, visible[0, 0], 0.25), "attention", "float32",
                             name=f"keys from {start}")


def test_keys_past_the_last_visible_one_are_not_in_the_layout():
    """A static cache's decode step: the empty tail is cut off, and causality then needs no custom mask."""
    lengths = torch.tensor([3, 6])
    mask = (torch.arange(16)[None, :] < lengths[:, None])[:, None, None, :]
    layout, variant = bsrattn_hf.step_layout(mask, 2, 1, 16, ba.Variant(causal=True))
    assert layout.kv_lens.tolist() == [3, 6] and layout.custom_mask is None and variant.causal


def test_a_mask_of_whole_key_prefixes_needs_no_custom_mask_without_causality():
    """A bidirectional model's step whose queries each see their request's first keys: the layout's lengths say it
    all, for any number of queries, and a request that sees no key has none."""
    lengths = torch.tensor([3, 0, 9])
    mask = (torch.arange(12)[None, :] < lengths[:, None])[:, None, None, :].expand(3, 1, 5, 12)
    layout, variant = bsrattn_hf.step_layout(mask, 3, 5, 12, ba.Variant())
    assert layout.kv_lens.tolist() == [3, 0, 9] and layout.custom_mask is None and not variant.causal


def test_import_bsrattn_imports_neither_transformers_nor_torch():
    import subprocess
    import sys

    code = ("import sys, bsrattn, bsrattn.integrations; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


# ---- attention sinks (gpt-oss) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_oss():
    """A tiny random gpt-oss: attention sinks in every layer, sliding-window and full layers alternating."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss (it arrived in 4.55)")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
                                       attn_implementation="eager")
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # zero at init: make them matter
    return model


def test_gpt_oss_sinks_give_hf_eager_attentions_logits_and_tokens(gpt_oss):
    """HF's eager attention is the only one of its own that computes gpt-oss's sinks: bsrattn's must agree, for
    teacher-forced logits over sliding and full layers and for greedy generation."""
    ids = _ids(2, 20)
    want, got = (_forward(gpt_oss, impl, ids).logits for impl in ("eager", bsrattn_hf.NAME))
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)
    want, got = (_generate(gpt_oss, impl, ids[:1]) for impl in ("eager", bsrattn_hf.NAME))
    assert torch.equal(got, want)
