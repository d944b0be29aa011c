"""Multi-head latent attention (DeepSeek's MLA) as one more BSR layout: FlashInfer's MLA names, every tier's kernel.

MLA caches one latent vector per token, ``ckv`` (``Dc`` wide, 512 in DeepSeek-V2/V3), and a small rotary key,
``kpe`` (``Dr``, 64), instead of a key and a value per head. With the up-projections absorbed into the queries,
every query head ``h`` scores a slot ``j`` as::

    s_hj = sm_scale * (q_nope[h] . ckv[j] + q_pe[h] . kpe[j])       sm_scale = 1 / sqrt(Dc + Dr) by default

and reads ``ckv`` itself as the value. In BSR words that is attention with **one KV head shared by all
``H`` query heads** (a GQA group of ``H``), whose key is ``ckv ⊕ kpe`` (``Dc + Dr`` wide: the two dot products
are one over the concatenation) and whose value is ``ckv``, narrower than the key. Layouts, the plan, the
scheduler and ⊕ are those of :func:`bsrattn.attention`; only the microkernel reads a value narrower than the
key (``head_dim_vo`` on :meth:`bsrattn.BatchAttention.plan`, on the tiers whose kernels take it:
:attr:`bsrattn.backends.Backend.head_dim_vo`).

:func:`mla_attention` and :class:`BatchMLAAttention` take FlashInfer's operands and shapes:

==========  ==========================================================  ================================
argument    shape                                                       what
==========  ==========================================================  ================================
``q_nope``  ``[nnz_qo, H, Dc]``                                         queries, absorbed into the latent
``q_pe``    ``[nnz_qo, H, Dr]``                                         queries' rotary part (turned)
``ckv``     ``[num_pages, page_size, Dc]`` (``[slots, Dc]``, page 1)    the latent cache: keys and values
``kpe``     ``[num_pages, page_size, Dr]`` (``[slots, Dr]``, page 1)    the rotary keys (turned)
``out``     ``[nnz_qo, H, Dc]``                                         in ``q_nope``'s dtype
``lse``     ``[nnz_qo, H]``                                             float32, natural log
==========  ==========================================================  ================================

The kernel reads the key as one row per slot, ``ckv ⊕ kpe``, and the value ``ckv`` as a view of that row's first
``Dc`` columns. Where ``ckv`` and ``kpe`` are the two parts of one ``[..., Dc + Dr]`` array (``cache[..., :Dc]`` and
``cache[..., Dc:]``, as serving engines keep MLA's cache), that array is the key, read in place; otherwise each call
concatenates them, a copy of the cache. ``q_nope`` and ``q_pe`` likewise. NumPy arrays, or torch tensors on any
device, in the kind they were given.

Examples
--------
>>> import numpy as np, bsrattn as ba
>>> rng = np.random.default_rng(0)
>>> layout = ba.layouts.paged([1, 1], [[0, 2], [1]], kv_lens=[7, 3], page_size=4, num_pages=3)
>>> q_nope, q_pe = rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 8, 4))
>>> ckv, kpe = rng.standard_normal((3, 4, 16)), rng.standard_normal((3, 4, 4))
>>> out, lse = ba.mla_attention(q_nope, q_pe, ckv, kpe, layout, return_lse=True)
>>> out.shape, lse.shape
((2, 8, 16), (2, 8))
"""

from __future__ import annotations

from bsrattn._types import Array, DType
from bsrattn.api import BatchAttention, _levels, attention
from bsrattn.backends import Backend
from bsrattn.cascade import Cascade
from bsrattn.coerce import as_int
from bsrattn.layout import BSRLayout
from bsrattn.validation import check_array, check_scale, dtype_name, shape_of
from bsrattn.variant import Variant

__all__ = ["mla_attention", "BatchMLAAttention"]


def mla_attention(q_nope: Array, q_pe: Array, ckv: Array, kpe: Array, layout: BSRLayout | Cascade, *,
                  variant: Variant | None = None, return_lse: bool = False, out: Array | None = None,
                  lse: Array | None = None, ckv_scale: float | None = None, kpe_scale: float | None = None,
                  backend: str | Backend | None = None, deterministic: bool = False, split_size: int | None = None,
                  kernel: str | None = None) -> Array | tuple[Array, Array]:
    """MLA of every query row over its latent KV, for any layout (see the module docstring for the formula).

    Parameters
    ----------
    q_nope, q_pe : arrays, ``[nnz_qo, H, Dc]`` and ``[nnz_qo, H, Dr]``
        The queries' latent and rotary parts, one row per query of every block row (float32, float16 or
        bfloat16, one dtype).
    ckv, kpe : arrays, ``[num_pages, page_size, Dc]`` and ``[num_pages, page_size, Dr]``
        The latent cache and the rotary keys, one dtype (``q_nope``'s, or fp8 with a 16-bit ``q_nope``);
        ``[slots, Dc]`` and ``[slots, Dr]`` where ``layout.block_size == 1``.
    layout : BSRLayout or Cascade
        Which slots each query row reads, as for :func:`bsrattn.attention`.
    variant : Variant, optional
        How scores become weights; ``sm_scale`` defaults to ``1 / sqrt(Dc + Dr)``. Not fused RoPE: ``q_pe`` and
        ``kpe`` come turned.
    return_lse : bool
        Also return ``lse [nnz_qo, H]``, float32, natural log.
    out, lse : arrays, optional
        Buffers to write into: ``out [nnz_qo, H, Dc]`` in ``q_nope``'s dtype, ``lse [nnz_qo, H]``.
    ckv_scale, kpe_scale : float, optional
        Dequantisation scales of an fp8 cache (FlashInfer's names; any KV dtype takes them): the latent is
        ``ckv * ckv_scale`` in the scores and the output alike, the rotary key ``kpe * kpe_scale``. None: 1.
        :func:`_scales` says how they reach the kernel.
    backend, deterministic, split_size, kernel
        As :func:`bsrattn.attention` takes them.

    Returns
    -------
    out or (out, lse)
        ``out [nnz_qo, H, Dc]`` in ``q_nope``'s dtype and array kind; a query that sees no slot gets ``out = 0``
        and ``lse = -inf``.

    Raises
    ------
    TypeError
        An operand that is not an array, or not a NumPy array or a torch tensor; dtypes that differ where they
        must match.
    ValueError
        Shapes that do not fit each other or the layout (the message names the operand), fused RoPE in
        ``variant``, a tier whose kernel takes no value narrower than its key; and what
        :func:`bsrattn.attention` refuses.

    Examples
    --------
    One decode row over 5 slots of a ragged cache, against the formula written out:

    >>> import numpy as np, bsrattn as ba
    >>> rng = np.random.default_rng(0)
    >>> q_nope, q_pe = rng.standard_normal((1, 4, 16)), rng.standard_normal((1, 4, 8))
    >>> ckv, kpe = rng.standard_normal((5, 16)), rng.standard_normal((5, 8))
    >>> out = ba.mla_attention(q_nope, q_pe, ckv, kpe, ba.layouts.ragged([1], [5]))
    >>> s = (q_nope[0] @ ckv.T + q_pe[0] @ kpe.T) / np.sqrt(16 + 8)          # [H, slots]
    >>> p = np.exp(s - s.max(1, keepdims=True))
    >>> np.allclose(out[0], p @ ckv / p.sum(1, keepdims=True))
    True
    """
    _check_operands(q_nope, q_pe, ckv, kpe, _levels(layout)[0])
    q_pe, scale = _scales(q_pe, ckv_scale, kpe_scale)
    q, k, v = _as_attention(q_nope, q_pe, ckv, kpe)
    return attention(q, k, v, layout, variant=variant, backend=backend, return_lse=return_lse, out=out, lse=lse,
                     k_scale=scale, v_scale=scale, deterministic=deterministic, split_size=split_size, kernel=kernel)


class BatchMLAAttention:
    """Plan once per step, run once per layer: :class:`bsrattn.BatchAttention` for MLA (FlashInfer's
    ``BatchMLAPagedAttentionWrapper``).

    Parameters
    ----------
    backend, kernel, cuda_graph
        As :class:`bsrattn.BatchAttention` takes them.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> rng = np.random.default_rng(0)
    >>> layout = ba.layouts.ragged([1, 1], [40, 9])
    >>> attn = ba.BatchMLAAttention(backend="reference")
    >>> attn.plan(layout, num_heads=8, head_dim_ckv=16, head_dim_kpe=4, num_ctas=4)
    >>> q_nope, q_pe = rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 8, 4))
    >>> ckv, kpe = rng.standard_normal((49, 16)), rng.standard_normal((49, 4))
    >>> np.allclose(attn.run(q_nope, q_pe, ckv, kpe), ba.mla_attention(q_nope, q_pe, ckv, kpe, layout))
    True
    """

    def __init__(self, backend: str | Backend | None = None, kernel: str | None = None,
                 cuda_graph: bool = False) -> None:
        self._attn = BatchAttention(backend, kernel, cuda_graph)
        self._dims: tuple | None = None  # (layout's first level, H, Dc, Dr) of the plan

    @property
    def backend(self) -> Backend:
        """The tier that plans and runs."""
        return self._attn.backend

    def plan(self, layout: BSRLayout | Cascade, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, *,
             variant: Variant | None = None, q_dtype: DType | None = None, kv_dtype: DType | None = None,
             num_ctas: int | None = None, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             deterministic: bool = False, split_size: int | None = None) -> None:
        """Compute the step's plan: :meth:`bsrattn.BatchAttention.plan` with ``num_heads`` query heads over one
        KV head, keys ``head_dim_ckv + head_dim_kpe`` wide and values ``head_dim_ckv``.

        Parameters
        ----------
        layout : BSRLayout or Cascade
            The step's layout.
        num_heads : int
            Query heads, ``H``.
        head_dim_ckv, head_dim_kpe : int
            ``Dc`` and ``Dr``.
        variant, q_dtype, kv_dtype, num_ctas, fixed_split_size, disable_split_kv, deterministic, split_size
            As :meth:`bsrattn.BatchAttention.plan` takes them; ``sm_scale`` defaults to ``1 / sqrt(Dc + Dr)``.

        Raises
        ------
        TypeError, ValueError
            As :meth:`bsrattn.BatchAttention.plan` raises them, and for fused RoPE or a tier whose kernel takes
            no value narrower than its key.
        """
        num_heads = as_int("num_heads", num_heads, minimum=1)
        dc = as_int("head_dim_ckv", head_dim_ckv, minimum=1)
        dr = as_int("head_dim_kpe", head_dim_kpe, minimum=0)  # 0: MLA without a rotary part, as FlashInfer takes it
        self._attn.plan(layout, num_heads, 1, dc + dr, variant=variant, q_dtype=q_dtype, kv_dtype=kv_dtype,
                        num_ctas=num_ctas, fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                        deterministic=deterministic, split_size=split_size, head_dim_vo=dc)
        self._dims = (_levels(layout)[0], num_heads, dc, dr)

    @property
    def work_plans(self) -> list:
        """The current plan of each level (:attr:`bsrattn.BatchAttention.work_plans`)."""
        return self._attn.work_plans

    @property
    def graph_key(self) -> tuple | None:
        """:attr:`bsrattn.BatchAttention.graph_key` of the plan."""
        return self._attn.graph_key

    def run(self, q_nope: Array, q_pe: Array, ckv: Array, kpe: Array, *, out: Array | None = None,
            lse: Array | None = None, return_lse: bool = False, ckv_scale: float | None = None,
            kpe_scale: float | None = None) -> Array | tuple[Array, Array]:
        """Execute the plan (operands and scales as :func:`mla_attention` takes them); may be called many times.

        Raises
        ------
        RuntimeError
            ``run`` called before :meth:`plan`.
        TypeError, ValueError
            Operands that do not fit each other or the plan (the message names the operand).
        """
        if self._dims is None:
            raise RuntimeError("BatchMLAAttention.run called before plan()")
        level, num_heads, dc, dr = self._dims
        got = _check_operands(q_nope, q_pe, ckv, kpe, level)
        if got != (num_heads, dc, dr):
            raise ValueError(f"q_nope, q_pe, ckv and kpe have H={got[0]}, Dc={got[1]}, Dr={got[2]}; the plan is for "
                             f"num_heads={num_heads}, head_dim_ckv={dc}, head_dim_kpe={dr}")
        q_pe, scale = _scales(q_pe, ckv_scale, kpe_scale)
        q, k, v = _as_attention(q_nope, q_pe, ckv, kpe)
        return self._attn.run(q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=scale, v_scale=scale)


def _check_operands(q_nope, q_pe, ckv, kpe, level: BSRLayout) -> tuple:
    """``(H, Dc, Dr)`` of operands that fit each other and ``level``'s pool; else an error naming the operand."""
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv", ckv), ("kpe", kpe)):
        check_array(name, x)
        if _kind(x) is None:
            raise TypeError(f"{name} is a {type(x).__name__}; MLA takes NumPy arrays or torch tensors")
    qn, qp, c, p = map(shape_of, (q_nope, q_pe, ckv, kpe))
    if len(qn) != 3:
        raise ValueError(f"q_nope must be [nnz_qo, num_heads, head_dim_ckv], got shape {qn}")
    if len(qp) != 3 or qp[:2] != qn[:2]:
        raise ValueError(f"q_pe has shape {qp}; expected [nnz_qo, num_heads, head_dim_kpe] with q_nope's "
                         f"nnz_qo and num_heads {qn[:2]}")
    if qn[0] != level.nnz_qo:
        raise ValueError(f"q_nope has {qn[0]} query rows; the layout has nnz_qo={level.nnz_qo}")
    pool = (level.num_blocks, level.block_size)
    if c[:-1] != pool and not (level.block_size == 1 and c[:-1] == pool[:1]):
        raise ValueError(f"ckv has shape {c}; the layout's pool is [num_pages, page_size, head_dim_ckv] = "
                         f"{pool + (qn[2],)}" + (f" (or [{pool[0]}, {qn[2]}])" if level.block_size == 1 else ""))
    if c[-1] != qn[2]:
        raise ValueError(f"ckv has head_dim_ckv {c[-1]}; q_nope has {qn[2]}")
    if p != c[:-1] + (qp[2],):
        raise ValueError(f"kpe has shape {p}; expected ckv's slots with q_pe's head_dim_kpe: {c[:-1] + (qp[2],)}")
    for (a, x), (b, y) in ((("q_pe", q_pe), ("q_nope", q_nope)), (("kpe", kpe), ("ckv", ckv))):
        if dtype_name(x) != dtype_name(y):
            raise TypeError(f"{a} has dtype {dtype_name(x)} but {b} has {dtype_name(y)}; they must match")
        if _kind(x) is not _kind(y):
            raise TypeError(f"{a} is a {type(x).__name__} but {b} a {type(y).__name__}; they must be of one kind")
    return qn[1], qn[2], qp[2]


def _scales(q_pe, ckv_scale, kpe_scale) -> tuple:
    """``(q_pe, scale)``: ``ckv_scale`` and ``kpe_scale`` as attention's ``k_scale = v_scale = scale``.

    The key ``ckv ⊕ kpe`` has one scale in attention, ``ckv_scale`` (the value, ``ckv``, has it too); a different
    ``kpe_scale`` goes into the queries' rotary part instead, ``q_pe * (kpe_scale / ckv_scale)``, since
    ``q_pe . (kpe * kpe_scale) = (q_pe * kpe_scale / ckv_scale) . kpe * ckv_scale``: a copy of ``q_pe``, rounded to
    its dtype, and never of the cache. Either scale None is 1; each must be a positive finite float.
    """
    ckv_scale, kpe_scale = check_scale("ckv_scale", ckv_scale), check_scale("kpe_scale", kpe_scale)
    if kpe_scale != ckv_scale:  # the product in float64, then rounded once to q_pe's dtype
        ratio = kpe_scale / ckv_scale
        if _is_torch(q_pe):
            q_pe = (q_pe.double() * ratio).to(q_pe.dtype)
        else:
            q_pe = (q_pe.astype("float64") * ratio).astype(q_pe.dtype)
    return q_pe, None if ckv_scale == 1.0 else ckv_scale


def _is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"


def _kind(x):
    """The concatenation of ``x``'s array kind: NumPy's or torch's (None for another kind)."""
    if _is_torch(x):
        import torch

        return torch.cat
    if type(x).__module__.split(".")[0] == "numpy":
        import numpy as np

        return np.concatenate
    return None


def _as_attention(q_nope, q_pe, ckv, kpe):
    """The operands of :func:`bsrattn.attention`: ``q = q_nope ⊕ q_pe``, the key ``ckv ⊕ kpe`` of one KV head,
    and the value ``ckv``, a view of the key's first ``Dc`` columns. Each join is a view where :func:`_adjacent`
    finds one, else a copy."""
    cat = _kind(q_nope)
    q = _adjacent(q_nope, q_pe)
    q = cat([q_nope, q_pe], -1) if q is None else q
    k = _adjacent(ckv, kpe)
    k = cat([ckv, kpe], -1) if k is None else k
    k = k.reshape(shape_of(k)[:-1] + (1, shape_of(k)[-1]))
    return q, k, k[..., :shape_of(ckv)[-1]]


def _adjacent(a, b):
    """``a ⊕ b`` along the last axis as a view of the memory they both lie in, when ``b``'s columns follow ``a``'s
    in every row (``a = x[..., :n]``, ``b = x[..., n:]`` of one array ``x``); None otherwise.

    Both have unit last strides and the same other strides, and ``b`` starts ``a.shape[-1]`` elements after ``a``
    in one buffer (NumPy: the same base array; torch: the same storage), so every row of the view is a row of
    ``a`` followed by the same row of ``b``: memory they already cover, whatever the strides.
    """
    if shape_of(a)[:-1] != shape_of(b)[:-1] or 0 in shape_of(a) + shape_of(b):
        return None
    if _is_torch(a):
        if (a.stride() != b.stride() or a.stride(-1) != 1 or a.device != b.device
                or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                or b.data_ptr() != a.data_ptr() + a.shape[-1] * a.element_size()):
            return None
        return a.as_strided(a.shape[:-1] + (a.shape[-1] + b.shape[-1],), a.stride())
    import numpy as np

    if (a.strides != b.strides or a.strides[-1] != a.itemsize or _root(a) is not _root(b)
            or b.ctypes.data != a.ctypes.data + a.shape[-1] * a.itemsize):
        return None
    return np.lib.stride_tricks.as_strided(a, a.shape[:-1] + (a.shape[-1] + b.shape[-1],), a.strides,
                                           writeable=False)


def _root(x):
    """The array that owns ``x``'s memory (a NumPy view's first base that is not itself a view)."""
    while getattr(x, "base", None) is not None:
        x = x.base
    return x
