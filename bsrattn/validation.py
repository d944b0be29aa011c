"""Input checks shared by every tier: each entry point validates here before it launches anything.

Works on any array kind through ``.shape`` and ``.dtype`` (NumPy, PyTorch, Numba device arrays), so it
imports neither torch nor numba.

Numbers follow one rule everywhere: an int argument takes a Python or NumPy integer (never a bool, never a
float, not even ``2.0``); a float argument takes any Python or NumPy real number (never a bool).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import numpy as np

from bsrattn.coerce import INT32_MAX, as_index_array, as_int, as_real
from bsrattn.layout import BSRLayout
from bsrattn.variant import Variant

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
SPLIT_ALIGN = 64
"""Deterministic mode's ``split_size`` is a multiple of this: every tier's KV tile (the torch tier's 32 or 64
keys, the numba tier's at most 64) then starts at the same absolute positions in every chunk."""
DEFAULT_SPLIT_SIZE = 1024
"""Deterministic mode's chunk grid when the call gives none: a constant, so that calls that leave it out agree."""
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
KV_LAYOUTS = ("NHD", "HND")


def dtype_name(x) -> str:
    """``'float16'``, ``'bfloat16'``, ``'float8_e4m3fn'``…: the dtype of a NumPy (with ml_dtypes), torch or
    numba array, or a dtype itself (a torch dtype, a NumPy dtype or scalar type such as ``np.float16`` or
    ``ml_dtypes.bfloat16``, or a name).

    Examples
    --------
    >>> import ml_dtypes, numpy as np
    >>> dtype_name(np.zeros(2, np.float16)), dtype_name(np.float16), dtype_name(ml_dtypes.bfloat16)
    ('float16', 'float16', 'bfloat16')
    """
    if isinstance(x, type):  # a scalar type; its ``dtype`` attribute is a descriptor, not a dtype
        x = np.dtype(x)
    dtype = getattr(x, "dtype", x)
    # NumPy dtypes apart: torch.compile (2.11) cannot trace a lookup in a dict that holds them.
    names = _NUMPY_NAMES if isinstance(dtype, np.dtype) else _OTHER_NAMES
    name = names.get(dtype)
    if name is None:
        name = names[dtype] = str(dtype).removeprefix("torch.")
    return name


_NUMPY_NAMES: dict = {}  # dtype -> name: every call of a run checks a dozen dtypes
_OTHER_NAMES: dict = {}  # torch dtypes and names


def lse_dtype(dtype) -> str:
    """The dtype of the LSE that goes with states or queries of ``dtype``: float32, float64 for float64.

    >>> import numpy as np
    >>> lse_dtype("float16"), lse_dtype(np.float64)
    ('float32', 'float64')
    """
    return "float64" if dtype_name(dtype) == "float64" else "float32"


def shape_of(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def check_array(name: str, x) -> None:
    """Raise unless ``x`` is an array with data: anything with ``.shape`` and ``.dtype`` (NumPy, a torch
    tensor, a Numba device array…) that is not a torch tensor on the meta device."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array (NumPy, torch tensor, or a device array), got {type(x).__name__}")
    if getattr(x, "is_meta", False):
        raise ValueError(f"{name} is on meta, a device that holds no data; pass a tensor with values")


def check_writable(name: str, x) -> None:
    """Raise unless ``x`` can be written into (a NumPy array may be read-only)."""
    check_array(name, x)
    if not getattr(getattr(x, "flags", None), "writeable", True):
        raise ValueError(f"{name} is read-only (a NumPy array with flags.writeable False); pass a writable buffer")


@dataclass(frozen=True)
class AttentionSpec:
    """The shape of one attention call: what ``plan`` fixes and ``run`` must match.

    ``kv_view`` says how ``k``/``v`` are stored: ``"NHD"`` ``[num_blocks, block_size, Hkv, D]``,
    ``"HND"`` ``[num_blocks, Hkv, block_size, D]`` or ``"NHD3"`` ``[N, Hkv, D]`` (``block_size == 1``).
    """

    layout: BSRLayout
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    variant: Variant
    q_dtype: str | None
    kv_dtype: str | None
    kv_view: str
    # Where fused RoPE turns the queries and keys when not at the layout's own positions: a Cascade level's
    # (q_positions [nnz_qo], kv_offsets [R]), Cascade.rope_positions. None: rope_frame's default.
    rope_positions: tuple | None = field(default=None, compare=False)
    # Deterministic mode's chunk grid (KV slots per chunk, at absolute positions; check_deterministic), or None.
    split_size: int | None = None
    # BatchAttention(cuda_graph=True): every launch is one that runs any later plan of the same buffers, so a CUDA
    # graph captured once replays every re-plan that fits them (a tier with no persistent buffers ignores it).
    cuda_graph: bool = False
    # The head dimension of v and out when it is not head_dim's (MLA: keys ckv ⊕ kpe, values ckv); None: the same.
    head_dim_vo: int | None = None

    @property
    def dim_vo(self) -> int:
        """The head dimension of ``v`` and ``out``: ``head_dim_vo``, or ``head_dim`` where it is None."""
        return self.head_dim if self.head_dim_vo is None else self.head_dim_vo

    def rope_frame(self) -> tuple:
        """``(q_positions [nnz_qo], kv_offsets [R])`` int64: the position fused RoPE turns each query row at, and
        the position of each block row's first slot (its slot ``j`` at ``kv_offsets[r] + j``). The layout's own
        positions (``BSRLayout.query_positions``, offsets 0) unless ``rope_positions`` says otherwise."""
        if self.rope_positions is not None:
            return self.rope_positions
        return self.layout.query_positions, np.zeros(self.layout.num_rows, dtype=np.int64)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.variant.scale(self.head_dim)

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype in FP8_DTYPES

    def kv_view_of(self, k) -> str:
        """The storage of this ``k``: an NHD spec with ``block_size == 1`` also takes 3-D ``[N, Hkv, D]``."""
        if self.kv_view in ("NHD", "NHD3") and self.layout.block_size == 1:
            return "NHD3" if len(shape_of(k)) == 3 else "NHD"
        return self.kv_view

    def kv_shape(self, view=None, head_dim=None) -> tuple:
        """The shape of ``k`` stored in ``view`` (default ``kv_view``); of ``v`` with ``head_dim=dim_vo``."""
        lay, d = self.layout, self.head_dim if head_dim is None else head_dim
        return {"NHD": (lay.num_blocks, lay.block_size, self.num_kv_heads, d),
                "HND": (lay.num_blocks, self.num_kv_heads, lay.block_size, d),
                "NHD3": (lay.num_blocks, self.num_kv_heads, d)}[view or self.kv_view]

    def check_run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """Raise unless ``q``, ``k``, ``v`` (and ``out``/``lse``, writable) match this spec."""
        check_array("q", q)
        check_array("k", k)
        check_array("v", v)
        self._check_fits(q, k, v, out, lse, return_lse, k_scale, v_scale)

    def _check_fits(self, q, k, v, out, lse, return_lse, k_scale=None, v_scale=None, dtypes_checked=False):
        """:meth:`check_run` past the arrays' kinds; ``dtypes_checked``: the inputs' dtypes and the scales were
        checked already (:func:`spec_from_inputs`, which read the spec off them)."""
        if out is not None:
            check_writable("out", out)
        if lse is not None:
            check_writable("lse", lse)
        want_q = (self.layout.nnz_qo, self.num_qo_heads, self.head_dim)
        if shape_of(q) != want_q:
            raise ValueError(f"q has shape {shape_of(q)}, the plan expects [nnz_qo, num_qo_heads, head_dim]={want_q}")
        view = self.kv_view_of(k)
        for name, x, d in (("k", k, self.head_dim), ("v", v, self.dim_vo)):
            if shape_of(x) != self.kv_shape(view, d):
                raise ValueError(f"{name} has shape {shape_of(x)}, the plan expects {self.kv_shape(view, d)} ({view})")
        if not dtypes_checked:
            _check_dtypes(q, k, v, k_scale, v_scale)
        if self.q_dtype is not None and dtype_name(q) != self.q_dtype:
            raise TypeError(f"q has dtype {dtype_name(q)}, the plan expects {self.q_dtype}")
        if self.kv_dtype is not None and dtype_name(k) != self.kv_dtype:
            raise TypeError(f"k has dtype {dtype_name(k)}, the plan expects {self.kv_dtype}")
        if self.variant.use_sigmoid and (return_lse or lse is not None):
            raise ValueError("lse is undefined for sigmoid attention (Variant.sigmoid_bias); do not ask for it")
        want_out = want_q[:2] + (self.dim_vo,)
        if out is not None and shape_of(out) != want_out:
            raise ValueError(f"out has shape {shape_of(out)}, expected [nnz_qo, num_qo_heads, head_dim_vo]={want_out}")
        if out is not None and dtype_name(out) != dtype_name(q):
            raise TypeError(f"out has dtype {dtype_name(out)}, expected q's dtype {dtype_name(q)}")
        if lse is not None and shape_of(lse) != want_q[:2]:
            raise ValueError(f"lse has shape {shape_of(lse)}, expected [nnz_qo, num_qo_heads]={want_q[:2]}")
        lse_dtypes = tuple(dict.fromkeys(("float32", lse_dtype(q))))  # float64 q: either
        if lse is not None and dtype_name(lse) not in lse_dtypes:
            raise TypeError(f"lse has dtype {dtype_name(lse)}, expected one of {lse_dtypes} (natural-log LSE "
                            f"is float32, float64 for a float64 q)")


def _check_dtypes(q, k, v, k_scale, v_scale):
    qd, kd, vd = dtype_name(q), dtype_name(k), dtype_name(v)
    if qd not in FLOAT_DTYPES:
        raise TypeError(f"q has dtype {qd}; supported: {FLOAT_DTYPES}")
    if kd != vd:
        raise TypeError(f"k has dtype {kd} but v has {vd}; they must match")
    if kd in FP8_DTYPES:
        if qd not in ("float16", "bfloat16"):
            raise TypeError(f"fp8 KV ({kd}) needs a float16 or bfloat16 q, got {qd}")
    elif kd != qd:
        raise TypeError(f"q has dtype {qd} but k/v have {kd}; they must match (or k/v be fp8)")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_scale(name, scale)


def check_scale(name: str, scale) -> float:
    """A dequantisation scale ``name`` as a float: 1 for None, else a positive finite real, or an error naming it."""
    if scale is None:
        return 1.0
    value = as_real(name, scale)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite float, got {scale!r}")
    return value


def _kv_view(k, kv_layout, block_size):
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    ndim = len(shape_of(k))
    if ndim == 3:
        if kv_layout != "NHD" or block_size != 1:
            raise ValueError(f"3-D k/v ([N, Hkv, D]) need kv_layout='NHD' and block_size 1; "
                             f"got kv_layout={kv_layout!r}, block_size={block_size}")
        return "NHD3"
    if ndim != 4:
        raise ValueError(f"k must be 4-D [num_blocks, block_size, Hkv, D] (or 3-D with block_size 1), "
                         f"got shape {shape_of(k)}")
    return kv_layout


def make_spec(layout, num_qo_heads, num_kv_heads, head_dim, variant=None, q_dtype=None, kv_dtype=None,
              kv_view="NHD", head_dim_vo=None) -> AttentionSpec:
    """Validate plan-time arguments and return the spec ``run`` is checked against.

    The head counts, ``head_dim`` and ``head_dim_vo`` are ints (NumPy integers too; see the module docstring).
    ``q_dtype`` and ``kv_dtype`` may be names (``'float16'``), torch dtypes or NumPy dtypes (``np.float16``,
    ``ml_dtypes.bfloat16``); the spec holds the name. ``head_dim_vo`` equal to ``head_dim`` is held as None.
    """
    if not isinstance(layout, BSRLayout):
        raise TypeError(f"layout must be a BSRLayout, got {type(layout).__name__}")
    variant = Variant() if variant is None else variant
    if not isinstance(variant, Variant):
        raise TypeError(f"variant must be a bsrattn.Variant, got {type(variant).__name__}")
    num_qo_heads = as_int("num_qo_heads", num_qo_heads, minimum=1)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    head_dim = as_int("head_dim", head_dim, minimum=1)
    if head_dim_vo is not None:
        head_dim_vo = as_int("head_dim_vo", head_dim_vo, minimum=1)
        if head_dim_vo == head_dim:
            head_dim_vo = None
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    variant.check_heads(num_qo_heads, head_dim)
    if head_dim_vo is not None and variant.use_rope:
        raise ValueError(f"fused RoPE (rope_theta={variant.rope_theta}) turns q and k as one head of head_dim "
                         f"{head_dim}; with head_dim_vo={head_dim_vo} (MLA) the rotary part is its own piece (kpe, "
                         f"q_pe), turned before the call")
    q_dtype = None if q_dtype is None else _dtype_arg("q_dtype", q_dtype, FLOAT_DTYPES)
    kv_dtype = None if kv_dtype is None else _dtype_arg("kv_dtype", kv_dtype, FLOAT_DTYPES + FP8_DTYPES)
    if kv_view not in ("NHD", "HND", "NHD3"):
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_view!r}")
    return AttentionSpec(layout, num_qo_heads, num_kv_heads, head_dim, variant, q_dtype, kv_dtype, kv_view,
                         head_dim_vo=head_dim_vo)


def check_rope_positions(layout: BSRLayout, variant: Variant, rope_positions) -> tuple | None:
    """``rope_positions`` (a call's or a plan's argument) checked against ``layout`` and ``variant``.

    Returns None for None, else ``(q_positions [nnz_qo], kv_offsets [R])`` as int64 arrays: where fused RoPE
    turns each query row, and the position of each block row's first slot (slot ``j`` at ``kv_offsets[r] + j``).
    Raises ``TypeError``/``ValueError`` naming the argument: not a pair of integer arrays, the wrong lengths, a
    negative position or one past int32, or fused RoPE off.
    """
    if rope_positions is None:
        return None
    if not variant.use_rope:
        raise ValueError("rope_positions is given but fused RoPE is off: set variant.rope_theta, or drop it")
    if isinstance(rope_positions, (str, bytes)) or not hasattr(rope_positions, "__len__") or len(rope_positions) != 2:
        raise TypeError(f"rope_positions must be a pair (q_positions [nnz_qo], kv_offsets [R]), got "
                        f"{type(rope_positions).__name__}")
    pair = []
    for i, (what, want) in enumerate((("q_positions", layout.nnz_qo), ("kv_offsets", layout.num_rows))):
        name = f"rope_positions[{i}] ({what})"
        arr = as_index_array(name, rope_positions[i])
        if arr.shape != (want,):
            raise ValueError(f"{name} has shape {arr.shape}, the layout needs ({want},)")
        if arr.size and arr.min() < 0:
            raise ValueError(f"{name} must be non-negative, got {name}[{int(np.argmin(arr))}]={int(arr.min())}")
        pair.append(arr.astype(np.int64))
    ends = pair[1] + layout.kv_lens
    if ends.size and int(ends.max()) > INT32_MAX + 1:
        r = int(np.argmax(ends))
        raise ValueError(f"rope_positions[1] (kv_offsets) puts row {r}'s last slot at {int(ends[r]) - 1}, past int32")
    return tuple(pair)


def check_deterministic(deterministic, split_size, fixed_split_size=None, disable_split_kv=False) -> int | None:
    """Deterministic mode's chunk grid for a call's or a plan's arguments: None when the mode is off.

    ``split_size`` (default :data:`DEFAULT_SPLIT_SIZE`) must be a multiple of :data:`SPLIT_ALIGN`; it comes only
    with ``deterministic=True``, and the mode cuts KV on its own grid, so ``fixed_split_size`` and
    ``disable_split_kv`` are refused beside it. Errors name the argument and its value.

    >>> check_deterministic(True, None), check_deterministic(False, None)
    (1024, None)
    """
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not deterministic:
        if split_size is not None:
            raise ValueError(f"split_size={split_size!r} is deterministic mode's chunk grid: pass deterministic=True "
                             f"with it (fixed_split_size fixes the chunks of a normal plan)")
        return None
    if fixed_split_size is not None:
        raise ValueError(f"fixed_split_size={fixed_split_size!r} with deterministic=True: deterministic mode cuts KV "
                         f"on its own grid; give split_size instead")
    if disable_split_kv:
        raise ValueError("disable_split_kv=True with deterministic=True: deterministic mode cuts every row on its "
                         "chunk grid (split_size); a split_size as long as the longest row splits none")
    size = DEFAULT_SPLIT_SIZE if split_size is None else as_int("split_size", split_size, minimum=1,
                                                                  maximum=INT32_MAX)
    if size % SPLIT_ALIGN:
        raise ValueError(f"split_size={size} must be a multiple of {SPLIT_ALIGN}, so that the chunk grid falls on "
                         f"every tier's KV tiles")
    return size


def check_on_grid(kv_offsets, split_size: int, what: str) -> None:
    """Raise unless every row's first slot (``kv_offsets [R]``, absolute positions) lies on deterministic mode's
    chunk grid: a row that starts between two grid points would be cut at other places than the same keys in
    one call, and its bits would differ. ``what`` names where the offsets come from."""
    offsets = np.asarray(kv_offsets, dtype=np.int64)
    off = np.flatnonzero(offsets % split_size)
    if off.size:
        r = int(off[0])
        at = int(offsets[r])
        raise ValueError(f"{what}: row {r} starts at KV position {at}, not on the deterministic chunk grid (every "
                         f"{split_size} slots: {at // split_size * split_size} or {(at // split_size + 1) * split_size})")


def _dtype_arg(name, dtype, supported) -> str:
    resolved = dtype_name(dtype)
    if resolved not in supported:
        raise TypeError(f"{name} {dtype!r} is not supported; choose from {supported}")
    return resolved


def spec_from_inputs(q, k, v, layout, variant=None, kv_layout="NHD", **run_kwargs) -> AttentionSpec:
    """Validate a one-shot call's inputs; the spec is read off the arrays."""
    if not isinstance(layout, BSRLayout):
        raise TypeError(f"layout must be a BSRLayout, got {type(layout).__name__}")
    check_array("q", q)
    check_array("k", k)
    check_array("v", v)
    if len(shape_of(q)) != 3:
        raise ValueError(f"q must be [nnz_qo, num_qo_heads, head_dim], got shape {shape_of(q)}")
    view = _kv_view(k, kv_layout, layout.block_size)
    head_axis = 1 if view in ("HND", "NHD3") else 2
    _check_dtypes(q, k, v, run_kwargs.get("k_scale"), run_kwargs.get("v_scale"))
    _check_kv_order(shape_of(q)[1], shape_of(k), view, layout.block_size)
    spec = make_spec(layout, shape_of(q)[1], shape_of(k)[head_axis], shape_of(q)[2], variant, dtype_name(q),
                     dtype_name(k), view, head_dim_vo=shape_of(v)[-1] if shape_of(v) else None)
    spec._check_fits(q, k, v, run_kwargs.get("out"), run_kwargs.get("lse"), run_kwargs.get("return_lse", False),
                     dtypes_checked=True)
    return spec


_ORDERS = {"NHD": "[num_blocks, block_size, num_kv_heads, head_dim]",
           "HND": "[num_blocks, num_kv_heads, block_size, head_dim]"}


def _check_kv_order(num_qo_heads, k_shape, view, block_size):
    """Raise, naming the ``kv_layout`` that fits, when ``k`` read in ``view``'s order has a head count that cannot
    be (not dividing ``num_qo_heads``) while read in the other order it fits the layout's ``block_size``: a pool
    stored in the other order, whose error would otherwise be about the heads."""
    if view not in _ORDERS:
        return
    other = "HND" if view == "NHD" else "NHD"
    heads = {"NHD": k_shape[2], "HND": k_shape[1]}
    blocks = {"NHD": k_shape[1], "HND": k_shape[2]}
    if num_qo_heads % heads[view] and not num_qo_heads % heads[other] and blocks[other] == block_size:
        raise ValueError(f"k has shape {k_shape}: read as kv_layout={view!r} ({_ORDERS[view]}) it has {heads[view]} "
                         f"KV heads, which do not divide num_qo_heads={num_qo_heads}; it fits kv_layout={other!r} "
                         f"({_ORDERS[other]}, {heads[other]} KV heads of block_size={block_size}): pass "
                         f"kv_layout={other!r}")
