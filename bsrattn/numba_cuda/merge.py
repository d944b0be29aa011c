"""The attention-state merge ⊕ as kernels: the plan's merge, and ``merge_state`` / ``merge_states`` / ``add_states``.

Matches :mod:`bsrattn.reference.merge` (and the merge loop of :func:`bsrattn.reference.executor.execute`):

    m = max(lse_a, lse_b),  w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
    o = (w_a o_a + w_b o_b) / (w_a + w_b),  lse = m + log(w_a + w_b)

Each output element belongs to one thread, which folds its states **in index order** (the plan's order for
split tiles): no atomics, no order that depends on timing, so the same inputs give the same bits on every
run. Arithmetic is float32 (float64 when any input is float64); ``o`` comes out in the inputs' promoted dtype
and ``lse`` in float32 (float64), as in the reference.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from bsrattn.numba_cuda import arrays, launch
from bsrattn.numba_cuda.formats import OUTPUT_FORMATS, compute_format, decoder, encoder, format_of, numpy_dtype
from bsrattn.numba_cuda.config import MERGE_THREADS, blocks_for
from bsrattn.numba_cuda.launch import device, ops
from bsrattn.validation import lse_dtype


def make_merge_pair(compute):
    """Device function ``(o_a, s_a, o_b, s_b) -> (o, s)``: ⊕ of two states of one element.

    An empty state (``s = -inf``) adds exactly nothing, whatever its ``o``; a NaN or ``+inf`` ``s`` gives NaN
    (through ``exp(NaN)`` and ``exp(inf - inf)``), whichever operand the max keeps.

    ``w_a o_a + w_b o_b`` is one explicit FMA: left to the compiler, whether it fuses the two depends on the code
    around it, and the plan's fold and :func:`merge_state`'s kernel rounded one ⊕ differently (deterministic
    mode needs them to agree, bit for bit).
    """
    neg_inf, zero = compute(-math.inf), compute(0.0)

    @device
    def merge_pair(o_a, s_a, o_b, s_b):
        if s_a == neg_inf and s_b == neg_inf:
            return zero, neg_inf
        m = s_a if s_a > s_b else s_b
        w_a, w_b = math.exp(s_a - m), math.exp(s_b - m)
        t_b = zero if s_b == neg_inf else w_b * o_b
        weighted = t_b if s_a == neg_inf else ops.fma(w_a, o_a, t_b)
        total = w_a + w_b
        return weighted / total, m + math.log(total)

    return merge_pair


@functools.cache
def plan_merge_kernel(compute_name: str, out_format: str, dim_vo: int, sigmoid: bool, threads: int):
    """The kernel folding each split tile's partial states in the plan's order, one block per (merge, head);
    ``dim_vo``: the head dimension of the states' ``o`` (of ``v`` and ``out``)."""
    compute = np.dtype(compute_name).type
    merge_pair, encode = make_merge_pair(compute), encoder(out_format)
    zero = compute(0.0)

    @cuda.jit
    def fold_partials(part_o, part_lse, out, lse, merge_indptr, merge_partials, merge_qo_start, merge_qo_end):
        """``part_o [P, Hq, Dv]``, ``part_lse [P, Hq]`` -> ``out [nnz_qo, Hq, Dv]``, ``lse [nnz_qo, Hq]``.

        Merge ``m`` covers query rows ``merge_qo_start[m]:merge_qo_end[m]``; row ``i`` of it folds workspace
        rows ``merge_partials[merge_indptr[m]:merge_indptr[m+1]] + i`` in that order.
        """
        m, head = cuda.blockIdx.x, cuda.blockIdx.y
        q0 = merge_qo_start[m]
        first, last = merge_indptr[m], merge_indptr[m + 1]
        for e in range(cuda.threadIdx.x, (merge_qo_end[m] - q0) * dim_vo, threads):
            i, d = e // dim_vo, e % dim_vo
            p = merge_partials[first] + i
            o = part_o[p, head, d]
            s = zero if sigmoid else part_lse[p, head]
            for n in range(first + 1, last):
                p = merge_partials[n] + i
                if sigmoid:
                    o += part_o[p, head, d]
                else:
                    o, s = merge_pair(o, s, part_o[p, head, d], part_lse[p, head])
            out[q0 + i, head, d] = encode(o)
            if not sigmoid and d == 0:
                lse[q0 + i, head] = s

    return fold_partials


@functools.cache
def merge_state_kernel(fmt_o_a, fmt_lse_a, fmt_o_b, fmt_lse_b, fmt_out, compute_name):
    """``o_a, o_b [N, D]``, ``lse_a, lse_b [N]`` -> ``o [N, D]``, ``lse [N]``, one thread per element of ``o``."""
    compute = np.dtype(compute_name).type
    merge_pair, encode = make_merge_pair(compute), encoder(fmt_out)
    dec_o_a, dec_lse_a = decoder(fmt_o_a, compute), decoder(fmt_lse_a, compute)
    dec_o_b, dec_lse_b = decoder(fmt_o_b, compute), decoder(fmt_lse_b, compute)

    @cuda.jit
    def merge_state(o_a, lse_a, o_b, lse_b, o, lse):
        e = cuda.grid(1)
        head_dim = o.shape[1]
        if e < o.shape[0] * head_dim:
            n, d = e // head_dim, e % head_dim
            value, s = merge_pair(dec_o_a(o_a[n, d]), dec_lse_a(lse_a[n]), dec_o_b(o_b[n, d]), dec_lse_b(lse_b[n]))
            o[n, d] = encode(value)
            if d == 0:
                lse[n] = s

    return merge_state


@functools.cache
def merge_states_kernel(fmt_o, fmt_lse, fmt_out, compute_name):
    """``o [n, S, H, D]``, ``lse [n, S, H]`` -> ``o [n, H, D]``, ``lse [n, H]``: one thread per output element
    folds its ``S`` states in index order."""
    compute = np.dtype(compute_name).type
    merge_pair, encode = make_merge_pair(compute), encoder(fmt_out)
    dec_o, dec_lse = decoder(fmt_o, compute), decoder(fmt_lse, compute)

    @cuda.jit
    def merge_states(o, lse, out, out_lse):
        e = cuda.grid(1)
        num_heads, head_dim = o.shape[2], o.shape[3]
        if e < o.shape[0] * num_heads * head_dim:
            b, h, d = e // (num_heads * head_dim), e // head_dim % num_heads, e % head_dim
            value, s = dec_o(o[b, 0, h, d]), dec_lse(lse[b, 0, h])
            for state in range(1, o.shape[1]):
                value, s = merge_pair(value, s, dec_o(o[b, state, h, d]), dec_lse(lse[b, state, h]))
            out[b, h, d] = encode(value)
            if d == 0:
                out_lse[b, h] = s

    return merge_states


@functools.cache
def add_states_kernel(fmt_a, fmt_b, fmt_out, compute_name):
    """``o_a, o_b [N]`` -> ``o_a + o_b``: FlashSigmoid's merge (unnormalised outputs add)."""
    compute = np.dtype(compute_name).type
    dec_a, dec_b, encode = decoder(fmt_a, compute), decoder(fmt_b, compute), encoder(fmt_out)

    @cuda.jit
    def add_states(o_a, o_b, out):
        e = cuda.grid(1)
        if e < out.shape[0]:
            out[e] = encode(dec_a(o_a[e]) + dec_b(o_b[e]))

    return add_states


# ---- host wrappers (the backend module's merge_state, merge_states, add_states) -------------------------

def _promoted(*xs) -> str:
    fmt = np.result_type(*(numpy_dtype(format_of(x)) for x in xs)).name
    if fmt not in OUTPUT_FORMATS:
        raise TypeError(f"the numba tier cannot write merged states of dtype {fmt}; it writes {OUTPUT_FORMATS}")
    return fmt


def merge_state(o_a, lse_a, o_b, lse_b):
    """``(o_a, lse_a) ⊕ (o_b, lse_b)`` for ``o [..., H, D]``, ``lse [..., H]``; see :func:`bsrattn.merge_state`."""
    fmts = tuple(format_of(x) for x in (o_a, lse_a, o_b, lse_b))
    fmt_out, compute = _promoted(o_a, o_b), compute_format(*fmts)
    shape = tuple(int(s) for s in o_a.shape)
    rows, head_dim = int(np.prod(shape[:-1])), shape[-1]
    dev = [arrays.device_array(x, name) for x, name in zip((o_a, lse_a, o_b, lse_b), ("o_a", "lse_a", "o_b", "lse_b"))]
    o_dev, lse_dev = arrays.empty((rows, head_dim), fmt_out), arrays.empty((rows,), lse_dtype(compute))
    if rows * head_dim:
        kernel = merge_state_kernel(*fmts, fmt_out, compute)
        launch.run(kernel, blocks_for(rows * head_dim), MERGE_THREADS,
            dev[0].reshape(rows, head_dim), dev[1].reshape(rows), dev[2].reshape(rows, head_dim), dev[3].reshape(rows),
            o_dev, lse_dev)
    return (arrays.deliver(o_dev.reshape(*shape), fmt_out, o_a),
            arrays.deliver(lse_dev.reshape(*shape[:-1]), lse_dtype(compute), o_a))


def merge_states(o, lse):
    """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order; see :func:`bsrattn.merge_states`."""
    fmt_o, fmt_lse = format_of(o), format_of(lse)
    fmt_out, compute = _promoted(o), compute_format(fmt_o, fmt_lse)
    n, _, heads, head_dim = (int(s) for s in o.shape)
    o_dev, lse_dev = arrays.device_array(o, "o"), arrays.device_array(lse, "lse")
    out, out_lse = arrays.empty((n, heads, head_dim), fmt_out), arrays.empty((n, heads), lse_dtype(compute))
    if n * heads * head_dim:
        kernel = merge_states_kernel(fmt_o, fmt_lse, fmt_out, compute)
        launch.run(kernel, blocks_for(n * heads * head_dim), MERGE_THREADS, o_dev, lse_dev, out, out_lse)
    return arrays.deliver(out, fmt_out, o), arrays.deliver(out_lse, lse_dtype(compute), o)


def add_states(o_a, o_b):
    """``o_a + o_b`` (FlashSigmoid's merge), elementwise, in ``o_a``'s kind."""
    fmt_a, fmt_b = format_of(o_a), format_of(o_b)
    fmt_out, compute = _promoted(o_a, o_b), compute_format(fmt_a, fmt_b)
    shape = tuple(int(s) for s in o_a.shape)
    size = int(np.prod(shape))
    a_dev, b_dev = arrays.device_array(o_a, "o_a"), arrays.device_array(o_b, "o_b")
    out = arrays.empty((size,), fmt_out)
    if size:
        launch.run(add_states_kernel(fmt_a, fmt_b, fmt_out, compute), blocks_for(size), MERGE_THREADS,
                   a_dev.reshape(size), b_dev.reshape(size), out)
    return arrays.deliver(out.reshape(*shape), fmt_out, o_a)
