"""The prior-state fold: an earlier Cascade level's state folded into every row a launch writes, with no merge launch.

Over the core, which stores each finished row's state (:func:`~bsrattn.torch_cuda.microkernel.store_state`), a
launch with ``LaunchConfig.prior`` computes ``prior ⊕ (o, lse)`` first, in the epilogue both attention kernels share
(:func:`store_output`: an unsplit item's store and a merge's). A Cascade's last level folds the levels before it
this way, in level order, as ``api._merge_levels`` folds them; the call decides it, not the plan, so a CUDA graph
captured on a cascade's levels replays its re-plans. On the host, :func:`prior_state` gives a launch its two
arguments and :func:`prior_tensors` checks ``Runner.run``'s ``prior``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bsrattn.torch_cuda.arrays import to_torch
from bsrattn.torch_cuda.merge import merge_pair
from bsrattn.torch_cuda.microkernel import store_state
from bsrattn.validation import dtype_name


@triton.jit
def fold_prior(prior_o, prior_lse, rows, head, valid, d, o, lse,  # rows, head, valid [BLOCK_M]; o [M, BLOCK_D]
               num_heads, HEAD_DIM: tl.constexpr):
    """``prior ⊕ (o, lse)`` for a tile's query rows ``rows`` of heads ``head``: ``prior_o [nnz_qo, num_heads,
    HEAD_DIM]`` and ``prior_lse [nnz_qo, num_heads]`` (contiguous) hold an earlier level's state of the same
    rows (``HEAD_DIM``: the output's width, ``v``'s head dimension)."""
    at = rows.to(tl.int64) * num_heads + head
    o_prior = tl.load(prior_o + at[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None] & (d[None, :] < HEAD_DIM),
                      other=0.0)
    lse_prior = tl.load(prior_lse + at, mask=valid, other=float("-inf"))
    return merge_pair(o_prior.to(tl.float32), lse_prior, o, lse)


@triton.jit
def store_output(out_ptr, lse_ptr, out_strides, lse_strides, prior_o, prior_lse,  # kernel_args' names
                 rows, head, valid, d, o, lse, num_heads,  # rows, head, valid [BLOCK_M]; o [BLOCK_M, BLOCK_D]
                 HEAD_DIM: tl.constexpr, STORE_LSE: tl.constexpr, PRIOR: tl.constexpr):
    """The attention kernels' epilogue: a tile's rows of the output written out, ``prior ⊕`` them first with
    ``PRIOR`` (:func:`fold_prior`)."""
    if PRIOR:
        o, lse = fold_prior(prior_o, prior_lse, rows, head, valid, d, o, lse, num_heads, HEAD_DIM)
    store_state(out_ptr, lse_ptr, rows, head, valid, d, o, lse, out_strides, lse_strides, HEAD_DIM, STORE_LSE)


def prior_state(buffers, prior) -> tuple:
    """``(prior_o, prior_lse)`` as a launch takes them (:data:`~bsrattn.torch_cuda.kernel_args.CALL_TENSORS`):
    ``prior``, or the buffers' ``no_prior`` twice for a call that folds none."""
    return (buffers.no_prior, buffers.no_prior) if prior is None else prior


def prior_tensors(prior, shape, device) -> tuple:
    """``Runner.run``'s ``prior`` as the kernels read it: contiguous tensors on ``device``, ``o`` of the output's
    ``shape`` (``[nnz_qo, Hq, Dv]``) and ``lse`` float32 of its rows x heads."""
    if not isinstance(prior, tuple) or len(prior) != 2:
        raise TypeError(f"prior must be a state (o, lse), got {type(prior).__name__}")
    o, s = to_torch("prior o", prior[0], device), to_torch("prior lse", prior[1], device)
    if tuple(o.shape) != tuple(shape) or tuple(s.shape) != tuple(shape[:2]):
        raise ValueError(f"prior must be o {tuple(shape)} and lse {tuple(shape[:2])} (the output's rows, heads "
                         f"and width), got {tuple(o.shape)} and {tuple(s.shape)}")
    if not o.is_floating_point():
        raise TypeError(f"prior o has dtype {dtype_name(o)}; a state's o is floating point")
    return o.contiguous(), s.to(torch.float32).contiguous()
