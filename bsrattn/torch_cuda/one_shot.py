"""The one-shot call's host caches: the last call's runner and finished calls' buffers, kept so that a model's
layers neither plan nor allocate again for every call.

Over the core, which plans, allocates and binds a launch on every call, :func:`attention` keeps the runner of the
last call of each (heads, head dimensions, device) and runs its plan again for a call of the same spec, and refills the
buffers of earlier calls (the spares) rather than allocating new ones: allocating them and binding their launch
cost more host time than a small decode. Nothing here changes an answer; two calls at once never share a runner or
buffers, and under CUDA graph capture every call gets buffers of its own.
"""

from __future__ import annotations

import threading

import torch

from bsrattn import scheduler
from bsrattn.torch_cuda.arrays import canonical_device, device_of
from bsrattn.torch_cuda.config import head_groups, plan_options
from bsrattn.torch_cuda.plan_buffers import Capacity
from bsrattn.torch_cuda.runner import Runner

SPARES_PER_SHAPE = 4
"""Buffers of finished one-shot calls kept per (heads, head dimensions, device), for the next calls to refill."""
SPARE_WORKSPACE_BYTES = 256 * 2**20
"""At most this much partial-state workspace is kept in spares per (heads, head dimensions, device); the oldest go."""
_spares = {}  # PlanBuffers.shape_key -> [PlanBuffers], most recently used last
_spares_turn = threading.Lock()


def _take_spare(need, shape_key):
    """An idle spare of ``shape_key`` that ``need`` fits, taken out of the pool (so no other call refills it)."""
    with _spares_turn:
        spares = _spares.get(shape_key, [])
        for i in range(len(spares) - 1, -1, -1):
            if spares[i].capacity.fits(need) and spares[i].idle():
                return spares.pop(i)
    return None


def _give_back(buffers):
    with _spares_turn:
        spares = _spares.setdefault(buffers.shape_key, [])
        spares.append(buffers)
        del spares[:-SPARES_PER_SHAPE]
        while spares and sum(b.workspace_bytes for b in spares) > SPARE_WORKSPACE_BYTES:
            del spares[0]  # back to the allocator


_kept = {}  # PlanBuffers.shape_key -> the Runner of the last one-shot call, for a next call of the same spec


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None, prior=None):
    """One-shot attention: plan with :func:`~bsrattn.torch_cuda.config.plan_options`, then run once (``prior``: a
    state folded in, as :meth:`Runner.run` takes it).

    The runner of the last call of the same heads, head dimensions and device is kept: a call of the same spec (the
    same layout object, heads, variant, dtypes and view, as a model's layers make with one layout in a step)
    runs its plan again without planning; layouts are immutable, so the plan is still theirs. Otherwise the plan
    goes into the buffers of an earlier call when one is idle (its plan's copy to the device has finished) and
    large enough: allocating them and binding their launch cost more host time than a small decode. Two calls
    at once never share a runner or buffers; under CUDA graph capture every call gets buffers of its own, kept
    by nobody else (a captured graph reads them at replay). The spares stay allocated: at most
    :data:`SPARES_PER_SHAPE` sets holding :data:`SPARE_WORKSPACE_BYTES` of workspace per (heads, head_dim,
    device), and the kept runner's.
    """
    device = canonical_device(device_of(q, k, v, out, lse))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    shape_key = (spec.num_qo_heads, spec.num_kv_heads * head_groups(spec), spec.head_dim, spec.head_dim_vo,
                 device)  # as PlanBuffers'
    runner = None if capturing else _kept.pop(shape_key, None)  # taken: no other call runs it meanwhile
    if runner is not None and not _same_spec(runner.spec, spec):
        _give_back(runner.buffers)
        runner = None
    if runner is None:
        work_plan = scheduler._plan_valid(spec.layout.qo_lens, spec.layout.kv_lens, **plan_options(spec, device))
        spare = None if capturing else _take_spare(Capacity.needed(work_plan, spec.layout, spec.variant.use_rope),
                                                   shape_key)
        runner = Runner(spec, work_plan, device, spare, headroom=False)
    try:
        return runner.run(q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
                          prior=prior)
    finally:
        if not capturing:
            earlier = _kept.pop(shape_key, None)  # a call that ran meanwhile kept its own
            _kept[shape_key] = runner
            if earlier is not None:
                _give_back(earlier.buffers)


def _same_spec(a, b) -> bool:
    """Whether specs ``a`` and ``b`` plan alike: the same layout object (layouts are immutable), heads, variant,
    dtypes, view and split size, and the same RoPE positions object (which spec equality leaves out)."""
    return a == b and a.rope_positions is b.rope_positions
