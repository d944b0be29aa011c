"""Plans made before the forward (``hoist_plans``): a transformers model under a static cache and ``torch.compile``.

On the reference tier, float32: greedy ``generate`` with a static cache gives SDPA's tokens through the hoisted
plans, eagerly and with the forward compiled (``aot_eager``: the CPU has no CUDA graphs; the H200 runs
``reduce-overhead`` in ``test_transformers_gpu.py``), left-padded batches included, with one compiled graph for
every decode step. On the torch tier (the Triton interpreter), what a captured graph depends on: a
``cuda_graph=True`` plan keeps its kernel and its :attr:`~bsrattn.BatchAttention.graph_key` across re-plans that
fit its buffers, and the guard string the hook passes down changes with it.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import bsrattn as ba  # noqa: E402
import bsrattn.integrations.transformers as bsrattn_hf  # noqa: E402

VOCAB = 128
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def _llama(name):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, pad_token_id=0, attn_implementation=name)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def hoisted(request):
    """A model with its plans hoisted, on the reference tier (or the parameter's), and the hook's state."""
    backend = getattr(request, "param", "reference")
    if backend == "torch":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the torch tier plans on the GPU here, and this model is on the CPU: "
                        "test_transformers_gpu.py runs it there, in CUDA graphs")
    name = bsrattn_hf.register(backend=backend)
    model = _llama(name)
    before = set(bsrattn_hf._hoisted)
    handle = bsrattn_hf.hoist_plans(model)
    (serial,) = set(bsrattn_hf._hoisted) - before
    yield model, bsrattn_hf._hoisted[serial]
    handle.remove()


def _padded(lengths, seed=4):
    """Prompts of ``lengths``, left-padded to the longest as ``generate`` pads a batch: ids and mask."""
    longest = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), longest), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :longest - n] = 0
        mask[b, :longest - n] = 0
    return ids, mask


def _generate(model, implementation, ids, mask, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              cache_implementation="static", **kwargs)


def _compiled():
    config = transformers.CompileConfig(backend="aot_eager")
    config._compile_all_devices = True  # generate compiles only on accelerators otherwise
    return dict(compile_config=config)


@pytest.mark.parametrize("lengths", [(7, 7), (7, 4)], ids=["full batch", "left-padded"])
def test_a_static_cache_generate_through_hoisted_plans_gives_sdpas_tokens(hoisted, lengths):
    model, state = hoisted
    ids, mask = _padded(lengths)
    ours = _generate(model, bsrattn_hf.NAME, ids, mask)
    assert len({key[:-1] for key in state.slots}) == 1, "both layers share one kind: one plan a step"
    assert torch.equal(ours, _generate(model, "sdpa", ids, mask))


@pytest.mark.parametrize("hoisted", ["reference", "torch"], indirect=True)
def test_a_compiled_static_cache_generate_gives_sdpas_tokens_in_one_graph(hoisted):
    """On the torch tier the guard carries the plan's graph key: the buffers sized at the first decode step keep
    it for every later one, the left pad's custom mask growing with the cache included."""
    from torch._dynamo.utils import counters

    model, state = hoisted
    ids, mask = _padded((9, 5), seed=6)
    torch._dynamo.reset()
    counters.clear()
    ours = _generate(model, bsrattn_hf.NAME, ids, mask, **_compiled())
    # Again: the prefill's plan, which needs more room than a decode step's, must leave the decode steps' alone.
    assert torch.equal(_generate(model, bsrattn_hf.NAME, ids, mask, **_compiled()), ours)
    assert counters["stats"]["unique_graphs"] == 1, "every decode step of both runs must run one compiled graph"
    assert state.step.qo_len == 1, "the decode steps were planned by the hook"
    assert torch.equal(ours, _generate(model, "sdpa", ids, mask))


def test_a_call_without_a_4d_mask_is_left_to_the_per_step_plans(hoisted):
    """A dynamic cache: the model builds its masks inside, so the hook plans nothing and passes no guard."""
    model, state = hoisted
    ids, mask = _padded((6, 3), seed=8)
    model.set_attn_implementation(bsrattn_hf.NAME)
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert state.step is None and not state.slots
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        theirs = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_the_layers_of_an_unplanned_call_have_their_plans_before_the_next_planned_one(hoisted):
    """A compiled forward's first call must find its layers planned: transformers may prefill a static cache
    eagerly with a 2D mask, then compile the decode steps, which bring 4D masks."""
    model, state = hoisted
    ids, mask = _padded((7, 7))
    model.set_attn_implementation(bsrattn_hf.NAME)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert not state.slots and len(state.kinds) == 1
    decode = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    _, kwargs = state.before_forward(model, (), {"input_ids": ids[:, -1:], "attention_mask": decode})
    assert list(state.slots) == [kind + (True,) for kind in state.kinds]
    assert state.slots[next(iter(state.slots))].step is state.step
    assert kwargs[bsrattn_hf.STEP_KWARG] == state.guard


@pytest.mark.parametrize("hoisted", ["torch"], indirect=True)
def test_a_prefill_between_decode_steps_leaves_their_plan_and_graph_key_alone(hoisted):
    """A new prompt's prefill needs more room (its custom mask) than the decode steps' buffers hold: it is planned
    into buffers of its own, and the decode steps' graph (captured on theirs) still replays."""
    model, state = hoisted
    ids, mask = _padded((7, 4))
    model.set_attn_implementation(bsrattn_hf.NAME)
    with torch.no_grad():
        model(ids, attention_mask=mask)  # learns the layers' kind
    pads = mask[:, None, None, :].bool()
    decode = {"input_ids": ids[:, -1:], "attention_mask": pads}
    prefill = {"input_ids": ids, "attention_mask": pads & torch.tril(torch.ones(7, 7, dtype=torch.bool))}
    guards = [state.before_forward(model, (), kwargs)[1][bsrattn_hf.STEP_KWARG] for kwargs in (decode, prefill, decode)]
    assert guards[0] == guards[2] != guards[1]


def test_an_attention_call_with_a_stale_guard_is_refused(hoisted):
    model, state = hoisted
    ids, mask = _padded((5, 5))
    _generate(model, bsrattn_hf.NAME, ids, mask)
    q, k = torch.zeros(2, 4, 1, 16), torch.zeros(2, 2, 11, 16)
    with pytest.raises(RuntimeError, match="not the step the hook"):
        bsrattn_hf._hoisted_attention(q, k, k, f"{state.serial}:stale", None, -1, 0.0, True, None)


def test_a_removed_hooks_guard_names_no_plans():
    bsrattn_hf.register(backend="reference")
    model = _llama(bsrattn_hf.NAME)
    handle = bsrattn_hf.hoist_plans(model)
    serial = max(bsrattn_hf._hoisted)
    handle.remove()
    del handle
    gc.collect()
    assert serial not in bsrattn_hf._hoisted, "the model keeps no hook, so nothing keeps its plans"
    with pytest.raises(RuntimeError, match="names no model's hoisted plans"):
        bsrattn_hf._hoisted_attention(torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16),
                                      f"{serial}:", None, -1, 0.0, True, None)


def test_a_layer_type_without_its_mask_is_refused():
    masks = {"full_attention": np.ones((1, 1, 4), dtype=bool)}
    with pytest.raises(ValueError, match="'sliding_attention'"):
        bsrattn_hf._mask_name(masks, ba.Variant(window_left=3))
    assert bsrattn_hf._mask_name(masks, ba.Variant()) == "full_attention"


# ---- what a captured graph depends on (the torch tier, plans only: nothing is launched) ----

HQ, HKV, D = 4, 2, 16


def _decode(lens, block):
    return ba.layouts.paged([1] * len(lens), np.arange(len(lens))[:, None], lens, page_size=block,
                            num_pages=len(lens))


def test_a_cuda_graph_plan_keeps_its_kernel_and_key_across_re_plans_that_fit():
    pytest.importorskip("triton")
    attn = ba.BatchAttention(backend="torch", cuda_graph=True)
    attn.plan(_decode([4096] * 4, 4096), HQ, HKV, D, q_dtype="float16", kv_dtype="float16", kv_layout="HND")
    key = attn.graph_key
    for lens in ([3, 9, 1, 4], [4096, 1, 2, 3000]):  # a plan that splits nothing, then one that splits
        attn.plan(_decode(lens, 4096), HQ, HKV, D, q_dtype="float16", kv_dtype="float16", kv_layout="HND")
        config = attn._runners[0].launch_config("float16", "HND", False)
        assert config.merges and config.item_kernel == 0, config
        assert attn.graph_key == key
    plain = ba.BatchAttention(backend="torch")
    plain.plan(_decode([3, 9, 1, 4], 4096), HQ, HKV, D, q_dtype="float16", kv_dtype="float16", kv_layout="HND")
    assert not plain._runners[0].launch_config("float16", "HND", False).merges, "the lighter kernel, by default"
    prefill = ba.layouts.ragged([64, 64], [64, 64])
    for graphed in (plain, attn):  # a prefill that splits nothing: the item kernel, unless a graph replays it
        graphed.plan(prefill, HQ, HKV, D, variant=ba.Variant(causal=True), q_dtype="float16", kv_dtype="float16",
                     disable_split_kv=True)
        item_kernel = graphed._runners[0].launch_config("float16", "NHD3", False).item_kernel
        assert (item_kernel == 0) == graphed.cuda_graph, item_kernel
    masked = _with_mask(_decode([3, 9, 1, 4], 4096))
    attn.plan(masked, HQ, HKV, D, q_dtype="float16", kv_dtype="float16", kv_layout="HND")
    assert attn.graph_key != key, "a custom mask that comes is recorded by a graph"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn.plan(_decode([4096] * 64, 4096), HQ, HKV, D, q_dtype="float16", kv_dtype="float16", kv_layout="HND")
    assert attn.graph_key[0][0] != key[0][0], "new buffers, a new key"


def _with_mask(layout):
    """``layout`` with a custom mask that hides nothing."""
    return dataclasses.replace(layout, custom_mask=np.ones(int(layout.kv_lens.sum()), dtype=bool))


def test_graph_key_is_none_where_no_graph_replays_a_run():
    attn = ba.BatchAttention(backend="reference", cuda_graph=True)
    attn.plan(_decode([5, 2], 8), HQ, HKV, D)
    assert attn.graph_key is None


def test_cuda_graph_must_be_a_bool():
    with pytest.raises(TypeError, match="cuda_graph must be a bool, got 1"):
        ba.BatchAttention(backend="reference", cuda_graph=1)


def test_a_layer_kind_first_met_at_a_decode_step_keeps_its_buffers_to_the_end_of_the_cache():
    """Its buffers are sized for a decode step over the whole cache, the left pad's custom mask included."""
    pytest.importorskip("triton")
    from bsrattn.backends import get_backend

    slot = bsrattn_hf._Slot(get_backend("torch"), ba.Variant(causal=True), HQ, HKV, D, 300, torch.float16,
                            torch.float16)
    keys = set()
    for n in (5, 40, 140, 300):
        seen = np.zeros((3, 1, 300), dtype=bool)
        seen[:, :, 2:n] = True  # two pads, then the cache up to this step's token
        slot.plan(bsrattn_hf._Step(3, 1, {None: seen}))
        assert slot.attn._specs[0].layout.custom_mask is not None
        keys.add(slot.attn.graph_key)
    assert len(keys) == 1, keys
