"""Attention variants: functions of positions and scores, with FlashInfer's semantics.

For a query at position ``q_pos`` and a key at ``k_pos`` (logical positions, see :mod:`bsrattn.layout`):

0. fused RoPE (``rope_theta``), FlashInfer's ``ROPE_LLAMA`` (Llama's rotate-half form): ``q`` and ``k`` are
   rotated at their positions, each pair of dimensions ``(i, i + D/2)`` by the angle ``pos * f_i``::

       f_i = rope_theta ** (-2 i / D) / rope_scale,                 i = 0 .. D/2 - 1
       x'_i       = x_i cos(pos f_i) - x_{i+D/2} sin(pos f_i)
       x'_{i+D/2} = x_{i+D/2} cos(pos f_i) + x_i sin(pos f_i)

   so a cache may hold un-rotated keys. The positions are the logical ones (a key at its slot of the row, a
   query at ``kv_len - qo_len + i``): a layout whose slots are a request's positions (dense, ragged, paged)
   rotates at the request's positions; one whose slots skip positions (Quest's selected pages, a pruned or
   tree layout) rotates at the slots, so rotate such keys before they are cached instead. A ``Cascade``'s
   levels rotate at positions in the whole sequence (``Cascade.rope_positions``).
1. ``s = sm_scale * (q . k)``
2. soft cap: ``s = cap * tanh(s / cap)`` when ``logits_soft_cap > 0``
3. ALiBi: ``s = s + slope[h] * (k_pos - q_pos)`` when ``alibi_slopes`` is given
4. masks: the key is dropped unless it is causal-visible (``k_pos <= q_pos``), inside the window
   (``q_pos - k_pos <= window_left``) and set in the layout's custom mask
5. softmax over the visible keys, or FlashSigmoid: weights ``sigmoid(s + sigmoid_bias)``, not normalised;
6. attention sinks (``sinks``, softmax only): head ``h``'s learned logit ``sink[h]`` joins the softmax's
   denominator and receives no value::

       out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink[h])),  lse = log(sum_j exp(s_j) + exp(sink[h]))

   That is the state ``(o = 0, lse = sink[h])`` merged with ⊕ into the row's state once, after every split
   chunk and cascade level has been merged (:mod:`bsrattn.api`): a row with no visible key gets ``out = 0``,
   ``lse = sink[h]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bsrattn import indexing
from bsrattn.coerce import as_int, as_real


def _per_head(name: str, values) -> tuple:
    """``values`` as a tuple of finite floats, one per query head; ``TypeError`` or ``ValueError`` naming ``name``."""
    try:
        arr = np.asarray(values)
    except ValueError:  # a ragged nested sequence
        arr = None
    if arr is None or arr.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be a sequence of real numbers, got {values!r}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D finite [num_qo_heads] sequence, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        at = int(np.argmax(~np.isfinite(arr)))
        raise ValueError(f"{name} must be a 1-D finite [num_qo_heads] sequence, got {name}[{at}]={arr[at]}")
    return tuple(float(x) for x in arr)


@dataclass(frozen=True)
class Variant:
    """How scores become weights.

    Numbers may be Python or NumPy scalars; anything else (a string, a list, ``None`` where a number is
    required, a bool) raises ``TypeError`` naming the field, and a value out of range ``ValueError``.

    Parameters
    ----------
    sm_scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(head_dim)``.
    causal : bool
        Bottom-right aligned causal mask: query ``i`` of a row sits at ``kv_len - qo_len + i``.
    window_left : int
        Inclusive sliding window: keys with ``q_pos - k_pos <= window_left``; ``-1`` disables it.
    logits_soft_cap : float
        ``cap * tanh(score / cap)`` when positive; 0 disables it.
    alibi_slopes : sequence of float, optional
        ``[num_qo_heads]`` slopes; bias ``slope * (k_pos - q_pos)``.
    sigmoid_bias : float, optional
        FlashSigmoid: weights ``sigmoid(score + bias)`` with no normalisation; ``lse`` is then undefined.
    sinks : sequence of float, optional
        ``[num_qo_heads]`` attention-sink logits (gpt-oss, StreamingLLM): each joins its head's softmax
        denominator and receives no value (step 6 above). Not with ``sigmoid_bias``.
    rope_theta : float, optional
        Fused RoPE's base (step 0 above; Llama: 1e4, Llama 3: 5e5); None disables it. ``head_dim`` must then
        be even.
    rope_scale : float
        Fused RoPE's position interpolation factor: positions are divided by it. Only with ``rope_theta``.

    Examples
    --------
    >>> import bsrattn as ba
    >>> v = ba.Variant(causal=True, logits_soft_cap=30.0)
    >>> v.scale(64)
    0.125
    """

    sm_scale: float | None = None
    causal: bool = False
    window_left: int = -1
    logits_soft_cap: float = 0.0
    alibi_slopes: tuple | None = None
    sigmoid_bias: float | None = None
    sinks: tuple | None = None
    rope_theta: float | None = None
    rope_scale: float = 1.0

    def __post_init__(self):
        set_ = object.__setattr__
        if self.sm_scale is not None:
            scale = as_real("sm_scale", self.sm_scale)
            if not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"sm_scale must be a positive finite float, got {self.sm_scale}")
            set_(self, "sm_scale", scale)
        if not isinstance(self.causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        set_(self, "causal", bool(self.causal))
        window = as_int("window_left", self.window_left)
        if window < -1:
            raise ValueError(f"window_left must be -1 (off) or >= 0, got {window}")
        set_(self, "window_left", window)
        cap = as_real("logits_soft_cap", self.logits_soft_cap)
        if not math.isfinite(cap) or cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 and finite (0 disables it), got {self.logits_soft_cap}")
        set_(self, "logits_soft_cap", cap)
        for name in ("alibi_slopes", "sinks"):
            if getattr(self, name) is not None:
                set_(self, name, _per_head(name, getattr(self, name)))
        if self.sigmoid_bias is not None:
            bias = as_real("sigmoid_bias", self.sigmoid_bias)
            if not math.isfinite(bias):
                raise ValueError(f"sigmoid_bias must be finite, got {self.sigmoid_bias}")
            set_(self, "sigmoid_bias", bias)
            if self.sinks is not None:
                raise ValueError("sinks join a softmax's denominator; FlashSigmoid (sigmoid_bias) has none")
        if self.rope_theta is not None:
            theta = as_real("rope_theta", self.rope_theta)
            if not math.isfinite(theta) or theta <= 0:
                raise ValueError(f"rope_theta must be a positive finite float, got {self.rope_theta}")
            set_(self, "rope_theta", theta)
        rope_scale = as_real("rope_scale", self.rope_scale)
        if not math.isfinite(rope_scale) or rope_scale <= 0:
            raise ValueError(f"rope_scale must be a positive finite float, got {self.rope_scale}")
        if self.rope_theta is None and rope_scale != 1.0:
            raise ValueError(f"rope_scale={self.rope_scale} without rope_theta: set rope_theta to turn fused RoPE on")
        set_(self, "rope_scale", rope_scale)

    @property
    def use_sigmoid(self) -> bool:
        """Whether this is FlashSigmoid (``sigmoid_bias`` set): states then add, and ``lse`` is undefined."""
        return self.sigmoid_bias is not None

    @property
    def use_rope(self) -> bool:
        """Whether fused RoPE is on (``rope_theta`` set)."""
        return self.rope_theta is not None

    def rope_frequencies(self, head_dim: int) -> np.ndarray:
        """Fused RoPE's angle per position of each dimension pair, ``f_i`` of step 0 above.

        Parameters
        ----------
        head_dim : int
            The head dimension of ``q`` and ``k`` (even).

        Returns
        -------
        numpy.ndarray
            ``[head_dim // 2]`` float64: ``rope_theta ** (-2 i / head_dim) / rope_scale``.

        Raises
        ------
        ValueError
            Fused RoPE is off.

        Examples
        --------
        >>> import bsrattn as ba
        >>> ba.Variant(rope_theta=100.0, rope_scale=2.0).rope_frequencies(4).tolist()
        [0.5, 0.05]
        """
        if self.rope_theta is None:
            raise ValueError("rope_frequencies needs rope_theta (fused RoPE is off)")
        return self.rope_theta ** (-2.0 * np.arange(head_dim // 2) / head_dim) / self.rope_scale

    def scale(self, head_dim: int) -> float:
        """The score scale for ``head_dim``.

        Parameters
        ----------
        head_dim : int
            The head dimension of ``q`` and ``k``.

        Returns
        -------
        float
            ``sm_scale``, or ``1 / sqrt(head_dim)`` when it is None.
        """
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def check_heads(self, num_qo_heads: int, head_dim: int | None = None) -> None:
        """Raise unless the variant fits ``num_qo_heads`` query heads (and heads of ``head_dim``).

        Parameters
        ----------
        num_qo_heads : int
            The query heads of the attention.
        head_dim : int, optional
            Their dimension: fused RoPE rotates pairs of dimensions, so it must be even.

        Returns
        -------
        None

        Raises
        ------
        ValueError
            ``alibi_slopes`` or ``sinks`` without one value per query head; fused RoPE on heads of odd
            ``head_dim``.
        """
        for name in ("alibi_slopes", "sinks"):
            values = getattr(self, name)
            if values is not None and len(values) != num_qo_heads:
                raise ValueError(f"{name} has {len(values)} entries, num_qo_heads is {num_qo_heads}")
        if self.use_rope and head_dim is not None and head_dim % 2:
            raise ValueError(f"fused RoPE (rope_theta) rotates pairs of dimensions: head_dim must be even, "
                             f"got {head_dim}")

    def position_mask(self, qo_len: int, kv_len: int, kv_start: int = 0, kv_end: int | None = None) -> np.ndarray:
        """``[qo_len, kv_end - kv_start]`` bool: the causal / window mask of one row's keys in a range.

        Parameters
        ----------
        qo_len, kv_len : int
            The row's query rows and KV slots (queries sit at ``kv_len - qo_len + i``).
        kv_start : int
            The first key position of the range.
        kv_end : int, optional
            One past the last key position of the range; default ``kv_len``.

        Returns
        -------
        numpy.ndarray
            ``[qo_len, kv_end - kv_start]`` bool, True where the key is visible (a read-only broadcast view).
        """
        kv_end = kv_len if kv_end is None else kv_end
        q_pos = indexing.query_position(qo_len, kv_len, np.arange(qo_len))[:, None]
        k_pos = np.arange(kv_start, kv_end)[None, :]
        return np.broadcast_to(indexing.key_visible(q_pos, k_pos, self.causal, self.window_left),
                               (qo_len, kv_end - kv_start))
