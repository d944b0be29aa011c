"""Hugging Face ``transformers`` models with bsrattn as their attention: ``register()``, then ``"bsrattn"``.

:func:`register` adds an attention function named ``"bsrattn"`` to ``transformers.AttentionInterface`` (and
SDPA's mask builder under the same name to ``transformers.AttentionMaskInterface``, without which HF builds
no padding mask for an attention it does not know). A model then runs every layer through bsrattn with
``model.set_attn_implementation("bsrattn")``, ``from_pretrained(..., attn_implementation="bsrattn")`` or a
config built with ``attn_implementation="bsrattn"``. Needs ``pip install 'bsrattn[transformers]'``
(transformers 4.53 or newer); ``import bsrattn`` does not import transformers or torch, this module does.

**HF's cache is a layout, read where it lies.** Each layer hands its attention function ``query [B, Hq, S_q,
D]`` and the cache after this step's update, ``key``, ``value [B, Hkv, S_kv, D]``. That tensor already is an
HND KV pool of ``B`` blocks of ``S_kv`` slots: request ``b`` owns block ``b`` (a paged layout with one page
per request, ``page_size = S_kv``), passed as it is, with no copy and no ``repeat_kv`` (GQA is the kernel's
head mapping): the torch tier reads it in place through its strides (the reference tier, NumPy, brings every
input to the host, as it always does). Only the new tokens' queries are rearranged, to ``[B * S_q,
Hq, D]`` (``query.transpose(1, 2)``: a view when it undoes the transpose HF's projections made, a copy of the
queries otherwise), and the output is returned as HF's attention functions return it, ``[B, S_q, Hq, D]``.

**Masks** (see :func:`step_layout`). With no mask (HF leaves it out where SDPA's ``is_causal`` would do) a
causal prefill sees its first ``S_q`` keys and a decode step all of them. A mask, boolean or additive (0 and
-inf or the dtype's minimum; other biases are refused), is read on the host once per step: each request's
row ends at its last visible key (right padding and a static cache's empty tail are never read), and what
the causal mask and sliding window of the variant do not already say becomes the layout's custom mask.
Padded batches, left-padded as ``generate`` pads them or right-padded, are thereby exact; their padded slots
before a request's first token are read and masked, not skipped, and the custom mask costs ``S_q x kv_len``
host bools per request and step (a decode step's: ``kv_len``). A query row that sees no key (a left pad's own
row) gets 0. Masks that differ between heads are refused.

**Variants.** ``scaling`` is ``sm_scale``; the model's causality (the ``is_causal`` argument, else the
module's attribute), ``sliding_window`` (the argument, else the module's attribute; HF's window of ``w``
keys is ``window_left = w - 1``), ``softcap`` (Gemma 2's ``attn_logit_softcapping``) and attention sinks
(gpt-oss's ``s_aux``, read to the host once per layer's tensor) become the :class:`~bsrattn.Variant`. Refused
with a ``ValueError``: ``dropout`` other than 0 (train with another implementation, or call ``model.eval()``)
and additive position biases (``position_bias``). Attention weights are never returned (``None``, as SDPA returns them).

**One plan per step.** HF calls the attention function once per layer with the same shapes and the same mask
object, so the :class:`~bsrattn.BatchAttention` plan (the inspector, host work) is computed on a step's first
layer and run by every other one (the executor). Plans are keyed on the step's signature: backend, device,
batch, heads, ``S_q``, ``S_kv``, ``head_dim``, dtypes, variant, and the mask tensor itself (held by a weak
reference, so a mask that is freed matches nothing; a mask is read once, so do not change one in place
between calls). Without a mask the plan depends on the shapes alone and is reused across steps of equal
shapes. The latest :data:`PLANS_KEPT` plans are kept, enough for models that alternate sliding and full
layers, each with its own mask. ``S_kv`` grows every step: the torch tier reads a block size that is not a power
of two at run time, so the steps share one compiled kernel.

**Compiled forwards and CUDA graphs** (:func:`hoist_plans`). A forward that ``torch.compile`` traces, or that
a CUDA graph replays, runs no Python: a plan made inside it would be made once, at tracing, and never again.
``hoist_plans(model)`` moves the plan out: a hook before the model's forward, left out of what is compiled,
plans the step (from the 4D mask ``generate`` builds ahead of each call when the cache is compilable, such as
``cache_implementation="static"``) into buffers that stay where they are, and every layer's attention inside
the compiled forward is one opaque op that runs the current plan (``bsrattn::hf_attention``). A re-plan that
fits the buffers refills them in place, so the captured graph replays it: the buffers are sized for a decode
step over the whole cache at its first, and every launch is one that runs any plan of them
(``BatchAttention(cuda_graph=True)``). What would make a captured graph stale (new buffers, a custom mask that
comes or goes, a new layer kind) changes the string the hook passes down (``bsrattn_step``), which the compiled
forward is guarded on: it is compiled again, never replayed wrong. Each step reads its mask to the host (one
synchronisation), as the eager path does.

**Paged caches.** transformers' own continuous batching (``generate_batch``) accepts only ``"paged|eager"``,
``"sdpa"`` and flash implementations (transformers 5.24, whose other ``paged|`` names are deprecated), so it
cannot call a registered attention function. bsrattn's paged path is its own: :class:`bsrattn.integrations.paged.PagedKVCache`
and the serving loop of ``examples/paged_generation.py``, driving a transformers model's weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections import OrderedDict
from functools import partial

import numpy as np

try:
    import torch
    import transformers
    from transformers.masking_utils import sdpa_mask
except ImportError as err:
    raise ImportError("bsrattn.integrations.transformers needs transformers (4.53 or newer) and torch: "
                      "pip install 'bsrattn[transformers]'") from err

from bsrattn import indexing, layouts
from bsrattn.api import BatchAttention
from bsrattn.backends import get_backend
from bsrattn.layout import BSRLayout
from bsrattn.variant import Variant

__all__ = ["NAME", "PLANS_KEPT", "STEP_KWARG", "hoist_plans", "register", "step_layout"]

NAME = "bsrattn"
"""The name ``register`` gives the attention in ``transformers.AttentionInterface``."""

PLANS_KEPT = 8
"""Plans each registered attention keeps, the most recently used."""

STEP_KWARG = "bsrattn_step"
"""The keyword :func:`hoist_plans`'s hook adds to a model call; HF passes it on to every attention function."""

# Arguments some models pass that change the attention's result in ways bsrattn does not compute.
_REFUSED = {"position_bias": "an additive position bias"}


def register(backend=None) -> str:
    """Register bsrattn as the attention implementation ``"bsrattn"`` of every transformers model.

    Parameters
    ----------
    backend : str or Backend, optional
        The tier every layer runs on: ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"``. ``None``
        follows bsrattn's backend flag at each call, so ``with ba.use_backend("torch"): model.generate(...)``
        works.

    Returns
    -------
    str
        ``"bsrattn"``, to pass as ``attn_implementation``. Registering again replaces the earlier function
        (and its plans).

    Examples
    --------
    >>> import torch, transformers
    >>> import bsrattn.integrations.transformers as bsrattn_hf
    >>> name = bsrattn_hf.register(backend="reference")
    >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation=name)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> ids = torch.tensor([[5, 9, 2, 7, 1]])
    >>> with torch.no_grad():
    ...     ours = model(ids).logits
    ...     model.set_attn_implementation("sdpa")
    ...     theirs = model(ids).logits
    >>> bool(torch.allclose(ours, theirs, atol=1e-5))
    True
    """
    global _registered
    get_backend(backend)  # an unknown name or a missing tier fails here, not in a model's first layer
    _registered = _Attention(backend)
    transformers.AttentionInterface.register(NAME, _registered)
    transformers.AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def hoist_plans(model) -> torch.utils.hooks.RemovableHandle:
    """Plan every step of ``model`` before its forward, outside what ``torch.compile`` traces or a CUDA graph replays.

    With it, a model running ``"bsrattn"`` (:func:`register`, on the backend given there) works under transformers'
    static cache and ``torch.compile``, ``mode="reduce-overhead"`` (CUDA graphs) included: each call's hook reads the
    step's 4D mask (a dict of them, per layer type, for models of sliding and full layers), plans every layer kind
    seen so far into its persistent buffers, and passes the layers a guard string (:data:`STEP_KWARG`). A call
    without a 4D mask (a dynamic cache, whose masks the model builds inside) is left to the per-step plans of the
    eager path, which a compiled forward refuses.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder whose forward passes its keyword arguments on to the attention functions (every decoder of
        transformers 5 does), with ``attn_implementation="bsrattn"``.

    Returns
    -------
    torch.utils.hooks.RemovableHandle
        ``.remove()`` takes the hook away again.

    Raises
    ------
    RuntimeError
        :func:`register` was not called first.

    Examples
    --------
    >>> import torch, transformers
    >>> import bsrattn.integrations.transformers as bsrattn_hf
    >>> name = bsrattn_hf.register(backend="reference")
    >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation=name)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> handle = bsrattn_hf.hoist_plans(model)
    >>> ids = torch.tensor([[5, 9, 2, 7, 1]])
    >>> ours = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    >>> handle.remove()
    >>> model.set_attn_implementation("sdpa")
    >>> bool((ours == model.generate(ids, max_new_tokens=4, do_sample=False)).all())
    True
    """
    if _registered is None:
        raise RuntimeError("hoist_plans needs bsrattn's attention registered first: call register()")
    hoisted = _Hoisted(_registered)
    return model.register_forward_pre_hook(torch.compiler.disable(hoisted.before_forward), with_kwargs=True)


def step_layout(attention_mask, batch_size: int, qo_len: int, kv_len: int, variant: Variant):
    """The layout and variant of one step: ``batch_size`` requests of ``qo_len`` queries over HF's cache.

    The cache ``[batch_size, Hkv, kv_len, D]`` is the pool (HND), request ``b`` block ``b`` of ``kv_len``
    slots; the queries are ``[batch_size * qo_len, Hq, D]``, request by request.

    Parameters
    ----------
    attention_mask : torch.Tensor or None
        HF's mask ``[batch_size or 1, 1, qo_len, >= kv_len]`` (its first ``kv_len`` columns are used): bool,
        True where a query attends, or additive float, 0 where it attends and -inf or the dtype's minimum
        where it does not. ``None``: causal from the first key (top-left, SDPA's ``is_causal``) when
        ``variant.causal`` and ``qo_len > 1``, else every key.
    batch_size, qo_len, kv_len : int
    variant : Variant
        The model's scale, soft cap, causality and window.

    Returns
    -------
    layout : BSRLayout
        One block of ``kv_len`` slots per request; row ``b`` stops at request ``b``'s last visible key, and
        carries a custom mask of what ``variant``'s position masks do not say.
    variant : Variant
        ``variant``, without its causal mask and window where the mask lets a query see past them.

    Raises
    ------
    TypeError
        A mask that is not a tensor, or neither bool nor float.
    ValueError
        A mask of another shape, or additive values besides 0, -inf and the dtype's minimum.

    Examples
    --------
    >>> import torch, bsrattn as ba
    >>> from bsrattn.integrations.transformers import step_layout
    >>> causal = ba.Variant(causal=True)
    >>> step_layout(None, 2, 3, 8, causal)[0].kv_lens.tolist()       # a prefill into an empty static cache
    [3, 3]
    >>> pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)   # request 0 is left-padded
    >>> mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)) & pad[:, None, None, :]
    >>> layout, variant = step_layout(mask, 2, 4, 4, causal)
    >>> layout.row_mask(0).astype(int).tolist(), variant.causal
    ([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], True)
    """
    if attention_mask is None:
        length = qo_len if variant.causal and qo_len > 1 else kv_len
        return _one_block_per_request(batch_size, qo_len, np.full(batch_size, length), kv_len), variant
    return _layout_of(_visible(attention_mask, batch_size, qo_len, kv_len), qo_len, kv_len, variant)


def _layout_of(seen, qo_len, kv_len, variant):
    """:func:`step_layout` of a mask read to the host: ``seen [batch, qo_len, kv_len]`` bools.

    Every request at once (this runs before each step, on the host): a request's keys end after the last one
    any of its queries sees, and its position masks over them are the variant's ``position_mask``."""
    keys_seen = seen.any(axis=1)  # [B, kv_len]
    kv_lens = np.where(keys_seen.any(axis=1), kv_len - np.argmax(keys_seen[:, ::-1], axis=1), 0)
    in_row = np.arange(kv_len) < kv_lens[:, None, None]  # [B, 1, kv_len]: a request's keys
    q_pos = indexing.query_position(qo_len, kv_lens[:, None, None], np.arange(qo_len)[None, :, None])
    positions = in_row & indexing.key_visible(q_pos, np.arange(kv_len), variant.causal, variant.window_left)
    if np.array_equal(seen, positions):  # seen is False past a request's keys, as positions are
        return _one_block_per_request(seen.shape[0], qo_len, kv_lens, kv_len), variant
    # Where the mask lies within the variant's position masks, keep them too: a kernel skips whole tiles of
    # keys they hide, which a custom mask alone would have it read.
    within = not (seen & ~positions).any()
    custom = seen[np.broadcast_to(in_row, seen.shape)]  # each request's [qo_len, kv_lens[b]] in turn
    layout = _one_block_per_request(seen.shape[0], qo_len, kv_lens, kv_len, custom)
    return layout, variant if within else dataclasses.replace(variant, causal=False, window_left=-1)


def _one_block_per_request(batch_size, qo_len, kv_lens, block_size, custom_mask=None) -> BSRLayout:
    """Request ``b``: ``qo_len`` queries over the first ``kv_lens[b] <= block_size`` slots of block ``b`` (a
    request of no keys has no block), built from arrays rather than page tables: a step's host work."""
    kv_lens = np.asarray(kv_lens)
    return layouts._paged_layout(np.full(batch_size, qo_len), kv_lens, np.flatnonzero(kv_lens > 0), block_size,
                                 batch_size, custom_mask)


def _visible(attention_mask, batch_size, qo_len, kv_len) -> np.ndarray:
    """HF's mask as ``[batch_size, qo_len, kv_len]`` host bools, True where a query attends."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch tensor or None, got {type(attention_mask).__name__}")
    shape = tuple(attention_mask.shape)
    if len(shape) != 4 or shape[0] not in (1, batch_size) or shape[1] != 1 or shape[2] != qo_len or shape[3] < kv_len:
        raise ValueError(f"attention_mask has shape {shape}; expected [batch, 1, query_len, >= key_len] = "
                         f"[{batch_size} (or 1), 1, {qo_len}, >= {kv_len}], one mask for every head")
    mask = attention_mask.detach()[:, 0, :, :kv_len]
    if mask.dtype == torch.bool:
        seen = mask
    elif mask.is_floating_point():
        seen = mask == 0
        bias = ~(seen | (mask == -torch.inf) | (mask == torch.finfo(mask.dtype).min))  # NaN included
        if bias.any():
            raise ValueError(f"attention_mask holds the additive value {mask[bias][0].item()!r}; bsrattn takes "
                             f"masks (0 attends, -inf or the dtype's minimum does not), not biases")
    else:
        raise TypeError(f"attention_mask has dtype {mask.dtype}; expected bool (True attends) or an additive "
                        f"float mask")
    return np.broadcast_to(seen.cpu().numpy(), (batch_size, qo_len, kv_len))


class _Plans:
    """The most recently used plans, keyed on a step's signature and its mask (see the module docstring)."""

    def __init__(self, size: int):
        self._size = size
        self._entries: OrderedDict = OrderedDict()  # key -> (weak reference to the mask or None, BatchAttention)

    @staticmethod
    def _key(signature, mask):
        return signature + (None if mask is None else id(mask),)

    def get(self, signature, mask):
        key = self._key(signature, mask)
        entry = self._entries.get(key)
        # A freed mask's id may be another tensor's now; its dead reference tells them apart.
        if entry is None or (mask is not None and entry[0]() is not mask):
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, signature, mask, attn):
        self._entries[self._key(signature, mask)] = (None if mask is None else weakref.ref(mask), attn)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)


class _Attention:
    """The function registered as ``"bsrattn"``: HF's attention-function signature over bsrattn's plan and run."""

    def __init__(self, backend):
        self.backend = backend
        self.plans = _Plans(PLANS_KEPT)
        self._sinks: dict = {}  # id of a layer's sinks tensor -> (a weak reference to it, its version, its values)

    def sinks(self, s_aux) -> tuple:
        """The values of a layer's attention sinks (``s_aux``, ``[num_qo_heads]``), read to the host once per
        tensor and again only when it changes in place (a training step)."""
        held = self._sinks.get(id(s_aux))
        # A freed tensor's id may be another's now; its dead reference tells them apart.
        if held is None or held[0]() is not s_aux or held[1] != s_aux._version:
            held = self._sinks[id(s_aux)] = (weakref.ref(s_aux), s_aux._version,
                                             tuple(s_aux.detach().float().cpu().tolist()))
        return held[2]

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                 softcap=None, is_causal=None, **kwargs):
        if dropout:
            raise ValueError(f"dropout={dropout}: bsrattn's attention has no dropout; call model.eval() (HF passes "
                             f"the config's attention_dropout while training) or train with another "
                             f"attn_implementation")
        for name, what in _REFUSED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} is given: bsrattn does not compute {what}; run this model with another "
                                 f"attn_implementation")
        batch, num_qo_heads, qo_len, head_dim = query.shape
        if key.ndim != 4 or key.shape[0] != batch or key.shape[3] != head_dim or value.shape != key.shape:
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                             f"expected query [B, Hq, S_q, D] and key, value [B, Hkv, S_kv, D]")
        num_kv_heads, kv_len = key.shape[1], key.shape[2]
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        window_left = window - 1 if window else -1
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        s_aux = kwargs.get("s_aux")
        step = kwargs.get(STEP_KWARG)
        if step is not None and ":" in step:  # the plan was made before the forward (hoist_plans)
            args = (query, key, value, step, scaling, window_left, float(softcap or 0.0), causal, s_aux)
            if torch.compiler.is_compiling():
                return torch.ops.bsrattn.hf_attention(*args), None
            return _hoisted_attention(*args), None
        if torch.compiler.is_compiling():
            raise RuntimeError("bsrattn's attention plans each step on the host, which a compiled forward cannot: "
                               "call bsrattn.integrations.transformers.hoist_plans(model) first, and give the "
                               "model its 4D mask (generate does with a static cache)")
        variant = Variant(sm_scale=scaling, causal=causal, window_left=window_left, logits_soft_cap=softcap or 0.0,
                          sinks=None if s_aux is None else self.sinks(s_aux))
        backend = get_backend(self.backend)
        if step is not None:  # a model with hoisted plans, called without a 4D mask: learn the layer's kind
            _hoisted_state(step).kind(variant, query, key)
        signature = (backend.name, query.device, batch, num_qo_heads, num_kv_heads, qo_len, kv_len, head_dim,
                     query.dtype, key.dtype, variant)
        attn = self.plans.get(signature, attention_mask)
        if attn is None:
            layout, step_variant = step_layout(attention_mask, batch, qo_len, kv_len, variant)
            attn = BatchAttention(backend=backend)
            attn.plan(layout, num_qo_heads, num_kv_heads, head_dim, variant=step_variant, q_dtype=query.dtype,
                      kv_dtype=key.dtype, kv_layout="HND")
            self.plans.put(signature, attention_mask, attn)
        out = attn.run(query.transpose(1, 2).reshape(batch * qo_len, num_qo_heads, head_dim), key, value)
        return out.reshape(batch, qo_len, num_qo_heads, head_dim), None


# ---- Plans made before the forward (hoist_plans): one slot per layer kind, refilled in place every step ----

_registered: _Attention | None = None  # the attention register() put in transformers' interface
_hoisted: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # serial -> _Hoisted
_serials = itertools.count()


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """One model call's queries and masks, read to the host: ``masks[name] [batch, qo_len, kv_len]`` bools, by
    HF's layer type (``None`` for a model with one mask)."""

    batch: int
    qo_len: int
    masks: dict


class _Slot:
    """The plan of one layer kind (variant, heads, cache length, dtypes) for the current step."""

    def __init__(self, backend, variant, num_qo_heads, num_kv_heads, head_dim, kv_len, q_dtype, kv_dtype):
        self.attn = BatchAttention(backend=backend, cuda_graph=True)
        self.variant, self.kv_len = variant, kv_len
        self.shape = (num_qo_heads, num_kv_heads, head_dim)
        self.dtypes = (q_dtype, kv_dtype)
        self.step = None

    def fits(self, step: _Step) -> bool:
        """Whether ``step``'s mask for this slot covers its cache's keys."""
        return step.masks[_mask_name(step.masks, self.variant)].shape[2] >= self.kv_len

    def plan(self, step: _Step) -> None:
        seen = step.masks[_mask_name(step.masks, self.variant)]
        if seen.shape[2] < self.kv_len:
            raise ValueError(f"attention_mask covers {seen.shape[2]} keys; the layer's cache holds {self.kv_len}")
        layout, variant = _layout_of(seen[:, :, :self.kv_len], step.qo_len, self.kv_len, self.variant)
        if self.step is None and step.qo_len == 1:
            # Buffers for a decode step over the whole cache, so that every later decode step fits them.
            whole = _one_block_per_request(step.batch, 1, np.full(step.batch, self.kv_len), self.kv_len)
            if layout.custom_mask is not None:
                whole = dataclasses.replace(whole, custom_mask=np.ones(step.batch * self.kv_len, dtype=bool))
            self._plan(whole, variant)
        self._plan(layout, variant)
        self.step = step

    def _plan(self, layout, variant):
        self.attn.plan(layout, *self.shape, variant=variant, q_dtype=self.dtypes[0], kv_dtype=self.dtypes[1],
                       kv_layout="HND")


def _mask_name(masks: dict, variant: Variant):
    """Which of a step's masks a layer of ``variant`` reads: the only one, or HF's layer type's."""
    if None in masks:
        return None
    name = "sliding_attention" if variant.window_left >= 0 else "full_attention"
    if name not in masks:
        raise ValueError(f"attention_mask holds masks for the layer types {sorted(masks)}; a layer with "
                         f"window_left={variant.window_left} reads the {name!r} one")
    return name


class _Hoisted:
    """One model's plans, made by the hook before each forward (:func:`hoist_plans`)."""

    def __init__(self, attention: _Attention):
        self.attention = attention
        self.serial = next(_serials)
        _hoisted[self.serial] = self
        self.step: _Step | None = None
        self.slots: dict = {}  # a layer kind (see ``kind``) and whether the step decodes -> _Slot
        self.kinds: dict = {}  # a layer kind -> a function making its slot
        self.guard = ""
        self._side = None  # the CUDA stream a slot first met inside a forward is made on (attend)

    def kind(self, variant, query, key):
        """The kind of a layer of ``variant`` called with ``query`` and ``key`` (variant, heads, head_dim, cache
        length, dtypes, device); remembered, with how to make its slot, for the hook to make one before the next
        step it plans."""
        num_qo_heads, head_dim, num_kv_heads, kv_len = query.shape[1], query.shape[3], key.shape[1], key.shape[2]
        kind = (variant, num_qo_heads, num_kv_heads, head_dim, kv_len, query.dtype, key.dtype, query.device)
        if kind not in self.kinds:
            self.kinds[kind] = partial(_Slot, get_backend(self.attention.backend), variant, num_qo_heads,
                                       num_kv_heads, head_dim, kv_len, query.dtype, key.dtype)
        return kind

    def before_forward(self, module, args, kwargs):
        kwargs = {name: value for name, value in kwargs.items() if name != STEP_KWARG}
        mask = kwargs.get("attention_mask")
        masks = mask if isinstance(mask, dict) else {None: mask}
        if not all(isinstance(m, torch.Tensor) and m.ndim == 4 for m in masks.values()):
            # The model builds its masks inside: the eager path plans each step, and tells this hook the layers'
            # kinds, so that their slots exist before a compiled call (``kind``).
            self.step, self.kinds = None, {}
            kwargs[STEP_KWARG] = str(self.serial)
            return args, kwargs
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        batch, qo_len = tokens.shape[:2]
        self.step = _Step(batch, qo_len, {name: _visible(m, batch, qo_len, m.shape[-1]) for name, m in masks.items()})
        decode = qo_len == 1  # decode steps and prefills plan slots of their own: a graph holds the first only
        for kind, make in self.kinds.items():
            if kind + (decode,) not in self.slots:
                self.slots[kind + (decode,)] = make()
        # A slot over more keys than its mask covers is an earlier cache's (another generate's): dropped.
        self.slots = {key: slot for key, slot in self.slots.items() if slot.fits(self.step)}
        planned = [slot for key, slot in self.slots.items() if key[-1] == decode]
        for slot in planned:
            slot.plan(self.step)
        # What a graph captured on the slots' buffers recorded: a change compiles the forward again.
        self.guard = f"{self.serial}:" + ";".join(repr(slot.attn.graph_key) for slot in planned)
        kwargs[STEP_KWARG] = self.guard
        return args, kwargs

    def attend(self, query, key, value, guard, scaling, window_left, soft_cap, causal, s_aux):
        if guard != self.guard or self.step is None:
            raise RuntimeError(f"the attention was called with {STEP_KWARG}={guard!r}, not the step the hook "
                               f"before the forward planned last ({self.guard!r})")
        batch, num_qo_heads, qo_len, head_dim = query.shape
        if (batch, qo_len) != (self.step.batch, self.step.qo_len):
            raise ValueError(f"query has batch {batch} and {qo_len} tokens; the step was planned for "
                             f"{self.step.batch} and {self.step.qo_len}")
        variant = Variant(sm_scale=scaling, causal=causal, window_left=window_left, logits_soft_cap=soft_cap,
                          sinks=None if s_aux is None else self.attention.sinks(s_aux))
        kind = self.kind(variant, query, key)
        slot_key = kind + (qo_len == 1,)
        slot = self.slots.get(slot_key)
        if slot is None or slot.step is not self.step:
            if query.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a CUDA graph capture reached a layer the hook before the forward has not "
                                   "planned; run the model once without capturing first")
            with self._outside_graph_pools(query.device):
                if slot is None:
                    slot = self.slots[slot_key] = self.kinds[kind]()
                slot.plan(self.step)
        out = slot.attn.run(query.transpose(1, 2).reshape(batch * qo_len, num_qo_heads, head_dim), key, value)
        return out.reshape(batch, qo_len, num_qo_heads, head_dim)

    @contextlib.contextmanager
    def _outside_graph_pools(self, device):
        """Where a slot first met inside a forward gets its buffers: on a CUDA stream of its own, so that they do
        not come from the memory pool of a CUDA graph being recorded (``torch.compile``'s warm-up run allocates
        on its stream from the pool it later captures into, and refuses buffers that outlive the run)."""
        if device.type != "cuda":
            yield
            return
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            yield
        torch.cuda.current_stream(device).wait_stream(self._side)


@torch.library.custom_op("bsrattn::hf_attention", mutates_args=())
def _hf_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: str, scaling: float | None,
                  window_left: int, soft_cap: float, causal: bool, s_aux: torch.Tensor | None) -> torch.Tensor:
    """A layer's attention over the plan the hook made for this step: ``[B, S_q, Hq, D]`` from HF's ``query [B,
    Hq, S_q, D]`` and cache ``key``, ``value [B, Hkv, S_kv, D]``."""
    return _hoisted_attention(query, key, value, step, scaling, window_left, soft_cap, causal, s_aux)


@_hf_attention.register_fake
def _(query, key, value, step, scaling, window_left, soft_cap, causal, s_aux):
    batch, num_qo_heads, qo_len, head_dim = query.shape
    return query.new_empty((batch, qo_len, num_qo_heads, head_dim))


def _hoisted_attention(query, key, value, step, scaling, window_left, soft_cap, causal, s_aux):
    return _hoisted_state(step).attend(query, key, value, step, scaling, window_left, soft_cap, causal, s_aux)


def _hoisted_state(step: str) -> _Hoisted:
    """The hook's state that passed ``step`` (its serial, then ``:`` and the guard where it planned the step)."""
    hoisted = _hoisted.get(int(step.split(":", 1)[0]))
    if hoisted is None:
        raise RuntimeError(f"{STEP_KWARG}={step!r} names no model's hoisted plans (its hook was removed)")
    return hoisted
