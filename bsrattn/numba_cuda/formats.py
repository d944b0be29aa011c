"""Storage formats: how each dtype's bits become compute floats inside a kernel, and back.

float16, float32 and float64 are Numba types: loading one is a cast. Numba has no bfloat16 or fp8 array
type that both the GPU and the simulator know, so those arrays travel as their raw bits (``uint16`` /
``uint8`` views of the ml_dtypes arrays) and the kernel decodes the bits itself:

- **bfloat16** is the top half of a float32: shift the 16 bits up by 16 and reinterpret them. Encoding
  rounds the low 16 bits of the float32 to nearest, ties to even (add ``0x7FFF`` plus the lowest kept bit,
  then truncate), which is what ml_dtypes and the hardware do.
- **fp8** e4m3fn and e5m2 are minifloats: a sign bit, ``E`` exponent bits with bias ``2**(E-1) - 1``, and
  ``M`` mantissa bits. A normal value is ``±2**(e - bias) * (1 + m / 2**M)``; ``e == 0`` is subnormal,
  ``±2**(1 - bias) * m / 2**M``. e5m2 keeps IEEE infinities and NaNs (``e == 31``); e4m3fn ("fn": finite,
  NaN) has no infinity and a single NaN (``e == 15, m == 7``), which buys it the range up to 448.

Host side: :func:`format_of` names an array's format and :func:`storage_dtype` gives the dtype its bits
travel as. Device side: :func:`decoder` and :func:`encoder` build the per-format device functions.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from bsrattn.numba_cuda.launch import device
from bsrattn.validation import dtype_name

NATIVE = ("float16", "float32", "float64")
BITS = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}
FP8_LAYOUT = {"float8_e4m3fn": (4, 3, False), "float8_e5m2": (5, 2, True)}  # exponent bits, mantissa bits, has inf
OUTPUT_FORMATS = NATIVE + ("bfloat16",)
"""Formats a kernel can write (fp8 is an input format only)."""


def format_of(x) -> str:
    """``'float16'``, ``'bfloat16'``, ``'float8_e4m3fn'``… for any array kind, or TypeError if unsupported.

    Examples
    --------
    >>> import ml_dtypes, numpy as np
    >>> format_of(np.zeros(2, np.float16)), format_of(np.zeros(2, ml_dtypes.float8_e5m2))
    ('float16', 'float8_e5m2')
    """
    name = dtype_name(x)
    if name not in NATIVE and name not in BITS:
        raise TypeError(f"the numba tier does not support dtype {name}; supported: {NATIVE + tuple(BITS)}")
    return name


def storage_dtype(fmt: str):
    """The NumPy dtype a kernel sees for ``fmt``: itself for native floats, the raw bits otherwise.

    Examples
    --------
    >>> storage_dtype("float32").__name__, storage_dtype("bfloat16").__name__, storage_dtype("float8_e4m3fn").__name__
    ('float32', 'uint16', 'uint8')
    """
    return BITS[fmt] if fmt in BITS else np.dtype(fmt).type


def numpy_dtype(fmt: str) -> np.dtype:
    """The NumPy dtype named ``fmt`` (ml_dtypes for bfloat16 and fp8)."""
    return np.dtype(getattr(ml_dtypes, fmt) if fmt in BITS else fmt)


def compute_format(*fmts) -> str:
    """What kernels compute in: ``"float64"`` when any input is float64 (the reference's precision), else
    ``"float32"``.

    Examples
    --------
    >>> compute_format("float16", "float8_e4m3fn"), compute_format("float64", "float64")
    ('float32', 'float64')
    """
    return "float64" if "float64" in fmts else "float32"


def decoder(fmt: str, compute):
    """Device function ``decode(x) -> compute``: one stored element of ``fmt`` as a compute float.

    ``compute`` is a NumPy scalar type (``np.float32``), which serves as a cast in kernels and in the simulator.
    """
    if fmt in NATIVE:
        def decode(x):
            return compute(x)
    elif fmt == "bfloat16":
        def decode(bits):
            return compute(np.uint32(np.uint32(bits) << 16).view(np.float32))
    elif fmt in FP8_LAYOUT:
        exp_bits, mant_bits, has_inf = FP8_LAYOUT[fmt]
        bias = (1 << (exp_bits - 1)) - 1
        exp_max, mant_max = (1 << exp_bits) - 1, (1 << mant_bits) - 1
        rebias = 127 - bias  # float32's exponent bias is 127
        subnormal_unit = compute(2.0 ** (1 - bias - mant_bits))
        inf, nan = compute(math.inf), compute(math.nan)

        def decode(bits):
            b = np.int32(bits)
            e = (b >> mant_bits) & exp_max
            m = b & mant_max
            if has_inf and e == exp_max:
                magnitude = inf if m == 0 else nan
            elif not has_inf and e == exp_max and m == mant_max:
                magnitude = nan
            elif e == 0:
                magnitude = compute(m) * subnormal_unit  # m / 2**M * 2**(1 - bias), exact
            else:  # the same exponent and mantissa, moved into float32's fields
                magnitude = compute(np.uint32(((e + rebias) << 23) | (m << (23 - mant_bits))).view(np.float32))
            return -magnitude if b >> 7 else magnitude
    else:
        raise TypeError(f"the numba tier cannot read dtype {fmt}")
    return device(decode)


def encoder(fmt: str):
    """Device function ``encode(x) -> stored element of fmt`` (round to nearest even)."""
    if fmt in NATIVE:
        store = getattr(np, fmt)

        def encode(x):
            return store(x)
    elif fmt == "bfloat16":
        def encode(x):
            f = np.float32(x)
            if math.isnan(f):
                return np.uint16(0x7FC0)  # the canonical quiet NaN
            bits = f.view(np.uint32)
            return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    else:
        raise TypeError(f"the numba tier cannot write dtype {fmt}; it writes {OUTPUT_FORMATS}")
    return device(encode)
