"""The attention kernels' runtime arguments, declared once by name: their order, their packers, the checks.

Both attention kernels, :func:`~bsrattn.torch_cuda.executor.persistent_attention` and
:func:`~bsrattn.torch_cuda.item_kernel.item_attention`, take :data:`RUNTIME_ARGS` first, in this order, then their
compile-time constants by keyword, so that one launcher call serves either (:mod:`~bsrattn.torch_cuda.launch`).
:func:`call_args` packs the arguments a call gives (:data:`CALL_ARGS`), :func:`plan_args` those the plan's buffers
and the launch configuration fix (:data:`PLAN_ARGS`); the tests hold both kernels' signatures
(:func:`runtime_names`) and both packers to these names. Values that travel together, a tensor's strides or the
float scalars, are one argument, a tuple: Triton passes and specialises its elements as it would separate
arguments (16-byte divisibility, a stride of 1 folded in), so the compiled code is the same.
"""

from __future__ import annotations

import inspect

from bsrattn.torch_cuda.gather import kv_strides

CALL_TENSORS = (
    "q_ptr",  # [nnz_qo, Hq, D]
    "k_ptr", "v_ptr",  # the KV pool in its storage view (gather.py)
    "out_ptr",  # [nnz_qo, Hq, Dv], q's dtype (Dv: v's head dimension, LaunchConfig.head_dim_vo)
    "lse_ptr",  # [nnz_qo, Hq] f32; the buffers' no_lse when the call stores none
    "prior_o", "prior_lse",  # [nnz_qo, Hq, Dv], [nnz_qo, Hq] f32: an earlier level's state (prior.py), or no_prior
)
"""The call's tensors: a launch passes their addresses."""
CALL_INTS = (
    "q_strides",  # (row, head, dim) of q
    "k_strides", "v_strides",  # (block, slot, head, dim) of each in the view (gather.kv_strides): v may be a view
    # into k's rows (multi-head latent attention's value, the key's first Dv elements)
    "out_strides",  # (row, head, dim) of out
    "lse_strides",  # (row, head) of lse
    "block_size",  # Bc, read where the BLOCK_SIZE constexpr is 0 (gather.block_size_constexpr)
)
"""The call's integers: what Triton specialises the kernel on, beyond the tensors' dtypes and alignment."""
CALL_FLOATS = (
    "scalars",  # config.Scalars: (qk_scale, v_scale, soft_cap, sigmoid_bias)
)
CALL_ARGS = CALL_TENSORS + CALL_INTS + CALL_FLOATS
"""The arguments a call gives (:func:`call_args`)."""
PLAN_ARGS = (
    "part_o", "part_lse",  # [partial_rows, Hq, Dv], [partial_rows, Hq] f32: split items' partial states
    "sync",  # [3 * merge_rows + W, head_programs] i32: merge counters of each launch, merge flags, item flags
    "cta_indptr",  # [num_ctas + 1]: CTA c runs items cta_indptr[c]:cta_indptr[c + 1]
    "items",  # [W, ITEM_STRIDE]: one item row each (bsrattn.items.ITEM_FIELDS)
    "merge_partials",  # [P]: each merge's partial states, in fold order
    "kv_indices",  # [nnz] i32: the layout's block ids
    "mask_ptr",  # [mask elements] u8: the custom mask
    "alibi_ptr",  # [Hq] f32: ALiBi slopes
    "rope_ptr",  # [D / 2] f32: fused RoPE's frequencies
    "rope_q",  # [nnz_qo] i32: fused RoPE's query positions
    "part_o_strides", "part_lse_strides",  # (row, head) of part_o and of part_lse
    "window_left",  # the sliding window, -1 for none
    "head_programs",  # the launch grid's second dimension: Hkv x head groups (LaunchConfig.head_groups)
    "merge_rows",  # sync's merge capacity: the rows of each of its first three blocks
)
"""The arguments the plan's buffers and the launch configuration fix (:func:`plan_args`): the same for every call
over the buffers, and for every plan they are refilled with."""
RUNTIME_ARGS = CALL_ARGS + PLAN_ARGS


def call_args(q, k, v, out, lse, prior_o, prior_lse, config, scalars) -> tuple:
    """:data:`CALL_ARGS` of a call: its tensors, their strides, the block size, the scalars.

    ``config`` is a :class:`~bsrattn.torch_cuda.config.LaunchConfig` and ``scalars`` a
    :class:`~bsrattn.torch_cuda.config.Scalars`; ``lse`` is the buffers' ``no_lse`` when ``config.store_lse`` is
    false, ``prior_o`` and ``prior_lse`` their ``no_prior`` when ``config.prior`` is false
    (:func:`~bsrattn.torch_cuda.prior.prior_state`). Shapes, dtypes and devices are the caller's to check.
    """
    return (q, k, v, out, lse, prior_o, prior_lse, q.stride(), kv_strides(k, config.kv_view),
            kv_strides(v, config.kv_view), out.stride(), lse.stride(), config.block_size, scalars)


def plan_args(buffers, config) -> tuple:
    """:data:`PLAN_ARGS` of the plan's buffers (a :class:`~bsrattn.torch_cuda.plan_buffers.PlanBuffers`, or the
    custom op's view of one) under ``config``."""
    sec = buffers.section
    return (buffers.part_o, buffers.part_lse, buffers.sync, sec("cta_indptr"), sec("items"), sec("merge_partials"),
            sec("kv_indices"), buffers.mask, buffers.alibi, buffers.rope, sec("rope_q"), buffers.part_o.stride()[:2],
            buffers.part_lse.stride(), config.window_left, config.head_programs, buffers.merge_rows)


def runtime_names(kernel) -> tuple:
    """The runtime parameters of ``kernel`` (a ``triton.jit`` function), in order: :data:`RUNTIME_ARGS` for both
    attention kernels."""
    return tuple(name for name, p in inspect.signature(kernel.fn).parameters.items()
                 if "constexpr" not in str(p.annotation))


def constexpr_names(kernel) -> tuple:
    """The compile-time parameters of ``kernel``, in order (they follow the runtime ones)."""
    return tuple(name for name, p in inspect.signature(kernel.fn).parameters.items()
                 if "constexpr" in str(p.annotation))  # a string here, as annotations are in the kernels' modules
