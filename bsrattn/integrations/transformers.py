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

**Paged caches.** transformers' own continuous batching (``generate_batch``) accepts only ``"paged|eager"``,
``"sdpa"`` and flash implementations (transformers 5.24, whose other ``paged|`` names are deprecated), so it
cannot call a registered attention function. bsrattn's paged path is its own: :class:`bsrattn.integrations.paged.PagedKVCache`
and the serving loop of ``examples/paged_generation.py``, driving a transformers model's weights.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict

import numpy as np

try:
    import torch
    import transformers
    from transformers.masking_utils import sdpa_mask
except ImportError as err:
    raise ImportError("bsrattn.integrations.transformers needs transformers (4.53 or newer) and torch: "
                      "pip install 'bsrattn[transformers]'") from err

from bsrattn import layouts
from bsrattn.api import BatchAttention
from bsrattn.backends import get_backend
from bsrattn.layout import BSRLayout
from bsrattn.variant import Variant

__all__ = ["NAME", "PLANS_KEPT", "register", "step_layout"]

NAME = "bsrattn"
"""The name ``register`` gives the attention in ``transformers.AttentionInterface``."""

PLANS_KEPT = 8
"""Plans each registered attention keeps, the most recently used."""

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
    get_backend(backend)  # an unknown name or a missing tier fails here, not in a model's first layer
    transformers.AttentionInterface.register(NAME, _Attention(backend))
    transformers.AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


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
    seen = _visible(attention_mask, batch_size, qo_len, kv_len)
    keys_seen = seen.any(axis=1)  # [B, kv_len]
    kv_lens = np.where(keys_seen.any(axis=1), kv_len - np.argmax(keys_seen[:, ::-1], axis=1), 0)
    rows = [seen[b, :, :n] for b, n in enumerate(kv_lens)]
    positions = [variant.position_mask(qo_len, int(n)) for n in kv_lens]
    base = _one_block_per_request(batch_size, qo_len, kv_lens, kv_len)
    if all(np.array_equal(row, pos) for row, pos in zip(rows, positions)):
        return base, variant
    # Where the mask lies within the variant's position masks, keep them too: a kernel skips whole tiles of
    # keys they hide, which a custom mask alone would have it read.
    within = all(not (row & ~pos).any() for row, pos in zip(rows, positions))
    custom = np.concatenate([row.reshape(-1) for row in rows])
    layout = BSRLayout(base.qo_indptr, base.kv_indptr, base.kv_indices, base.kv_last_len, base.block_size,
                       base.num_blocks, custom)
    return layout, variant if within else dataclasses.replace(variant, causal=False, window_left=-1)


def _one_block_per_request(batch_size, qo_len, kv_lens, block_size) -> BSRLayout:
    """Request ``b``: ``qo_len`` queries over the first ``kv_lens[b]`` slots of block ``b``."""
    return layouts.paged(np.full(batch_size, qo_len), np.arange(batch_size)[:, None], kv_lens, page_size=block_size,
                         num_pages=batch_size)


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
        s_aux = kwargs.get("s_aux")
        variant = Variant(sm_scale=scaling,
                          causal=bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)),
                          window_left=window - 1 if window else -1, logits_soft_cap=softcap or 0.0,
                          sinks=None if s_aux is None else self.sinks(s_aux))
        backend = get_backend(self.backend)
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
