"""The merge operator ⊕ in Triton: a device function, the plan's fold, and the merge kernels.

Must match :mod:`bsrattn.reference.merge` (``merge_state``, ``merge_states``, ``sum_states``): the same max
shift, natural log, a state with ``lse = -inf`` is the identity, and folds run in index order, never in
completion order, so results are deterministic. Arithmetic is float32; ``o`` comes back in its input dtype
and ``lse`` as float32. The merge kernels compile without FMA fusion, as the attention kernel does in
deterministic mode, so that a fold in the kernel and the same ⊕ of :func:`merge_state` round alike: where the
compiler fuses a multiply into an add depends on the code around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bsrattn.indexing import ceil_div
from bsrattn.torch_cuda.config import block_d, interpreter_turn


@triton.jit
def merge_pair(o_a, lse_a, o_b, lse_b):  # o_a, o_b [BLOCK_M, BLOCK_D] f32; lse_a, lse_b [BLOCK_M] f32
    """``(o_a, lse_a) ⊕ (o_b, lse_b)`` (reference ``merge_state``).

    An empty state adds exactly nothing, whatever its ``o``; a NaN or ``+inf`` LSE gives NaN through its own
    weight (``exp(NaN)``, ``exp(inf - inf)``), whichever operand the max keeps.
    """
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    t_a = tl.where((lse_a == float("-inf"))[:, None], 0.0, w_a[:, None] * o_a)
    t_b = tl.where((lse_b == float("-inf"))[:, None], 0.0, w_b[:, None] * o_b)
    total = w_a + w_b
    o = (t_a + t_b) / tl.where(total == 0.0, 1.0, total)[:, None]
    # tl.where computes both sides: log's argument is guarded too, so an empty lane takes no log(0) (the
    # interpreter warns of it; a GPU returns -inf, discarded alike).
    lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    return o, lse


@triton.jit
def _load_partial(part_o, part_lse, first_row, row, head, valid, d,  # row, head, valid [BLOCK_M]; d [BLOCK_D]
                  part_o_strides, part_lse_strides, HEAD_DIM: tl.constexpr):
    r = (first_row + row).to(tl.int64)
    # .cg: read through L2, where the other CTAs' partial states are; never a stale L1 line.
    o = tl.load(part_o + r[:, None] * part_o_strides[0] + head[:, None] * part_o_strides[1] + d[None, :],
                mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
    lse = tl.load(part_lse + r * part_lse_strides[0] + head * part_lse_strides[1], mask=valid, other=float("-inf"),
                  cache_modifier=".cg")
    return o, lse


@triton.jit
def fold_partials(part_o, part_lse, merge_partials, lo, hi, row, head, valid, d,  # row, head, valid [BLOCK_M]
                  part_o_strides, part_lse_strides,  # (row, head) of part_o and of part_lse
                  HEAD_DIM: tl.constexpr, SIGMOID: tl.constexpr):
    """Fold the partial states ``merge_partials[lo:hi]`` in that order: ⊕, or a sum for FlashSigmoid.

    Partial ``j`` of query row ``row`` (relative to the tile) and head ``head`` is workspace row
    ``merge_partials[j] + row`` (the reference executor's merge).
    """
    o, lse = _load_partial(part_o, part_lse, tl.load(merge_partials + lo), row, head, valid, d,
                           part_o_strides, part_lse_strides, HEAD_DIM)
    # Pipelined: the next partial state is in flight while this one is folded, so a merge of S states
    # costs about one L2 round trip, not S of them, on the critical path of the last CTA.
    for j in tl.range(lo + 1, hi, num_stages=2):
        o_b, lse_b = _load_partial(part_o, part_lse, tl.load(merge_partials + j), row, head, valid, d,
                                   part_o_strides, part_lse_strides, HEAD_DIM)
        if SIGMOID:
            o = o + o_b
        else:
            o, lse = merge_pair(o, lse, o_b, lse_b)
    return o, lse


@triton.jit
def last_to_arrive(counter, parts):
    """Whether this program's partial state is the last of its merge's ``parts`` to land: it bumps the merge's
    integer ``counter`` (acquire-release, GPU scope) after every thread's partial-state stores, and the program
    whose bump completes the count, which then folds the merge, sets the counter back to zero for the next
    launch."""
    # Every thread's partial-state stores precede the one release that publishes them.
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == parts - 1
    if last:
        tl.store(counter, 0)
    return last


@triton.jit
def _merge_states_kernel(o_ptr, lse_ptr, o_out, lse_out,  # o [n, S, H, D]; lse [n, S, H]; outputs [n*H, D], [n*H]
                         num_states, num_heads, num_rows,
                         HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Fold ``S`` states of ``BLOCK_R`` (request, head) rows in index order."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < num_rows
    d = tl.arange(0, BLOCK_D)
    n = (rows // num_heads).to(tl.int64)
    h = rows % num_heads
    cols = d[None, :] < HEAD_DIM
    base = n * num_states * num_heads + h
    o = tl.load(o_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None] & cols, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + base, mask=valid, other=float("-inf")).to(tl.float32)
    for s in range(1, num_states):
        row_s = base + s * num_heads
        o_b = tl.load(o_ptr + row_s[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None] & cols, other=0.0)
        lse_b = tl.load(lse_ptr + row_s, mask=valid, other=float("-inf"))
        o, lse = merge_pair(o, lse, o_b.to(tl.float32), lse_b.to(tl.float32))
    out_rows = rows.to(tl.int64)
    tl.store(o_out + out_rows[:, None] * HEAD_DIM + d[None, :], o.to(o_out.dtype.element_ty),
             mask=valid[:, None] & cols)
    tl.store(lse_out + out_rows, lse, mask=valid)


@triton.jit
def _merge_state_kernel(o_a, lse_a, o_b, lse_b, o_out, lse_out,  # o_* [rows, D]; lse_* [rows] (contiguous)
                        num_rows, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(o_a, lse_a) ⊕ (o_b, lse_b)`` for ``BLOCK_R`` rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    valid = rows < num_rows
    mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    at = rows[:, None] * HEAD_DIM + d[None, :]
    o, lse = merge_pair(tl.load(o_a + at, mask=mask, other=0.0).to(tl.float32),
                        tl.load(lse_a + rows, mask=valid, other=float("-inf")).to(tl.float32),
                        tl.load(o_b + at, mask=mask, other=0.0).to(tl.float32),
                        tl.load(lse_b + rows, mask=valid, other=float("-inf")).to(tl.float32))
    tl.store(o_out + at, o.to(o_out.dtype.element_ty), mask=mask)
    tl.store(lse_out + rows, lse, mask=valid)


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """FlashSigmoid's merge of two states: ``a + b`` (float32, then the output's dtype)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + i, mask=i < n).to(tl.float32)
    b = tl.load(b_ptr + i, mask=i < n).to(tl.float32)
    tl.store(out_ptr + i, (a + b).to(out_ptr.dtype.element_ty), mask=i < n)


BLOCK_R = 16
ADD_BLOCK = 1024


def merge_states(o: torch.Tensor, lse: torch.Tensor):
    """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order; returns ``(o [n, H, D], lse [n, H])``."""
    n, num_states, num_heads, head_dim = o.shape
    o, lse = o.contiguous(), lse.contiguous()
    o_out = torch.empty((n, num_heads, head_dim), dtype=o.dtype, device=o.device)
    lse_out = torch.empty((n, num_heads), dtype=torch.float32, device=o.device)
    rows = n * num_heads
    if rows:
        with interpreter_turn():
            _merge_states_kernel[(ceil_div(rows, BLOCK_R),)](o, lse, o_out, lse_out, num_states, num_heads, rows,
                                                            HEAD_DIM=head_dim, BLOCK_R=BLOCK_R,
                                                            BLOCK_D=block_d(head_dim), enable_fp_fusion=False)
    return o_out, lse_out


def merge_state(o_a, lse_a, o_b, lse_b):
    """``(o_a, lse_a) ⊕ (o_b, lse_b)`` for ``o [..., H, D]``, ``lse [..., H]``; ``o`` in the promoted dtype."""
    dtype = torch.promote_types(o_a.dtype, o_b.dtype)
    head_dim = o_a.shape[-1]
    o_out = torch.empty(o_a.shape, dtype=dtype, device=o_a.device)
    lse_out = torch.empty(lse_a.shape, dtype=torch.float32, device=o_a.device)
    rows = lse_out.numel()
    if rows:
        with interpreter_turn():
            _merge_state_kernel[(ceil_div(rows, BLOCK_R),)](
                o_a.contiguous(), lse_a.contiguous(), o_b.contiguous(), lse_b.contiguous(), o_out, lse_out, rows,
                HEAD_DIM=head_dim, BLOCK_R=BLOCK_R, BLOCK_D=block_d(head_dim), enable_fp_fusion=False)
    return o_out, lse_out


def add_states(o_a, o_b):
    """``o_a + o_b`` (FlashSigmoid's merge), in the inputs' common dtype."""
    dtype = torch.promote_types(o_a.dtype, o_b.dtype)
    a, b = o_a.to(dtype).contiguous(), o_b.to(dtype).contiguous()
    out = torch.empty_like(a)
    if a.numel():
        with interpreter_turn():
            _add_kernel[(ceil_div(a.numel(), ADD_BLOCK),)](a, b, out, a.numel(), BLOCK=ADD_BLOCK)
    return out
