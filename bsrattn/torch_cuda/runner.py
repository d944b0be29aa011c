"""A plan bound to persistent device buffers: ``run`` is one launch of a fixed grid, capturable in a CUDA graph.

``make_runner(spec, work_plan, previous)`` writes the plan into device buffers — ``previous``'s, in place,
when they are large enough — so a CUDA graph captured around ``run`` replays the new plan: the grid
(``num_ctas x num_kv_heads``), the buffer addresses, the workspace offsets and every scalar argument stay
the same. What a graph does record, and what must therefore not change between the plans it replays:
the launch configuration (:class:`~bsrattn.torch_cuda.config.LaunchConfig`: tile sizes from ``tile_q``,
the variant, dtypes, the KV view) and the tensors passed to ``run``. ``run`` allocates nothing but the
outputs it is not given, and never synchronises with the host. The refill is an asynchronous copy on the
current stream at ``plan`` time: run on that stream (or order the two), as with any stream-ordered write.
One runner's workspace serves one launch at a time: calls from several threads or CUDA streams take turns
(:meth:`~bsrattn.torch_cuda.plan_buffers.PlanBuffers.ordered`), and every launch clears its merge counters
and flags first, so none depends on what an earlier one left behind.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from bsrattn import scheduler
from bsrattn.torch_cuda import config as cfg
from bsrattn.torch_cuda.plan_buffers import Capacity, PlanBuffers
from bsrattn.torch_cuda.tensors import SUPPORTED, TORCH_DTYPES, canonical_device, check_device, check_interpretable, \
    default_device, device_of, to_numpy, to_torch, write_back
from bsrattn.validation import dtype_name


class Runner:
    """A :class:`~bsrattn.scheduler.WorkPlan` for ``spec`` on ``device``, ready to run.

    Parameters
    ----------
    spec : AttentionSpec
    work_plan : WorkPlan
    device : torch.device
        Where the plan's buffers live; every tensor given to :meth:`run` must be there.
    previous : Runner, optional
        A runner whose buffers may be refilled in place (when they fit) instead of allocating new ones.
    headroom : bool
        Size new buffers for any later plan of the same batch (see ``Capacity.grown``) rather than for this
        plan alone; a one-shot call passes False.
    """

    def __init__(self, spec, work_plan, device, previous=None, headroom=True):
        device = canonical_device(device)
        previous = previous if isinstance(previous, Runner) else None
        if previous is None or previous.device != device:  # a runner's device was checked when it was made
            check_device(device)
        check_interpretable("q", TORCH_DTYPES.get(spec.q_dtype))  # before any buffer is allocated
        need = Capacity.needed(work_plan, spec.layout)
        shape = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, device)
        if previous is not None and previous.buffers.fits(need, *shape):
            buffers = previous.buffers
        else:
            if previous is not None:
                warnings.warn(f"the plan needs {need}, beyond the previous plan's buffers "
                              f"({previous.buffers.capacity}, heads/dim/device {previous.buffers.shape_key}); "
                              f"new buffers were allocated, so recapture any CUDA graph taken on the old ones "
                              f"(plan the largest step first to avoid this)", RuntimeWarning, stacklevel=3)
            # Headroom keeps later re-plans (CUDA graphs) in place; a one-shot call needs none.
            capacity = need.grown(work_plan, spec.num_qo_heads, spec.head_dim) if headroom else need
            buffers = PlanBuffers(capacity, *shape)
        # The kernel carries the dense load path only for a plan with affine rows (LaunchConfig.dense_rows).
        with buffers.ordered():
            self.dense_rows = buffers.fill(work_plan, spec.layout, spec.variant.alibi_slopes)
        self.spec = spec
        self.work_plan = work_plan
        self.device = device
        self.buffers = buffers
        self._configs = {}

    def launch_config(self, q_dtype: str, kv_view: str, store_lse: bool) -> cfg.LaunchConfig:
        """The launch configuration for inputs of ``q_dtype`` stored as ``kv_view``."""
        key = (q_dtype, kv_view, store_lse)
        if key not in self._configs:
            spec, variant = self.spec, self.spec.variant
            busy = self.work_plan.num_items * spec.num_kv_heads  # programs with work
            t = cfg.tiles(cfg.block_m(self.work_plan.tile_q, spec.group_size), spec.head_dim, q_dtype,
                          few_items=busy < cfg.num_sms(self.device))
            self._configs[key] = cfg.LaunchConfig(
                num_ctas=self.work_plan.num_ctas, num_kv_heads=spec.num_kv_heads, group_size=spec.group_size,
                head_dim=spec.head_dim, block_size=spec.layout.block_size, block_m=t.block_m, block_n=t.block_n,
                block_d=cfg.block_d(spec.head_dim), num_warps=t.num_warps, num_stages=t.num_stages,
                kv_view=kv_view, causal=variant.causal, window_left=variant.window_left,
                soft_cap=variant.logits_soft_cap > 0, alibi=variant.alibi_slopes is not None,
                sigmoid=variant.use_sigmoid, custom_mask=spec.layout.custom_mask is not None, store_lse=store_lse,
                dense_rows=self.dense_rows)
        return self._configs[key]

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """Attention of the plan on ``q [nnz_qo, Hq, D]``, ``k``/``v`` (a storage view); returns ``(out, lse or None)``.

        Inputs are torch tensors on this runner's device, or NumPy arrays (moved there; the results then
        come back as NumPy). ``out``/``lse`` buffers are written in place and returned.
        """
        spec = self.spec
        as_numpy = not isinstance(q, torch.Tensor)
        q_t, k_t, v_t = (to_torch(name, x, self.device) for name, x in (("q", q), ("k", k), ("v", v)))
        for name, x in (("q", q_t), ("k", k_t)):
            if dtype_name(x) not in SUPPORTED:
                raise TypeError(f"{name} has dtype {dtype_name(x)}; the torch tier supports {SUPPORTED} "
                                f"(use backend='reference' for float64)")
        want_lse = (return_lse or lse is not None) and not spec.variant.use_sigmoid
        out_t = self._output("out", out, as_numpy, q_t.shape, q_t.dtype)
        lse_t = self._output("lse", lse, as_numpy, q_t.shape[:2], torch.float32) if want_lse else None
        config = self.launch_config(dtype_name(q_t), spec.kv_view_of(k_t), want_lse)
        # fp8 KV is dequantised by folding k_scale into the score scale and v_scale into the output.
        scalars = [spec.sm_scale * (1.0 if k_scale is None else float(k_scale)),
                   1.0 if v_scale is None else float(v_scale),
                   float(spec.variant.logits_soft_cap), float(spec.variant.sigmoid_bias or 0.0)]
        b = self.buffers
        args = (q_t, k_t, v_t, out_t, b.no_lse if lse_t is None else lse_t, b.plan, b.mask, b.part_o, b.part_lse,
                b.sync, b.sections, config.to_list(), scalars)
        if torch.compiler.is_compiling():  # traced: the compiled graph orders its launches
            torch.ops.bsrattn.attention_run(*args)
        else:
            with b.ordered():
                torch.ops.bsrattn.attention_run(*args)
        if as_numpy:
            o = write_back(out, out_t) if out is not None else to_numpy(out_t)
            s = None if lse_t is None else (write_back(lse, lse_t) if lse is not None else to_numpy(lse_t))
            return o, s
        return out_t, lse_t

    def _output(self, name, given, as_numpy, shape, dtype):
        """The tensor the kernel writes ``name`` into: the caller's tensor, or a new one."""
        if given is None or as_numpy:
            if given is not None and not isinstance(given, np.ndarray):
                raise TypeError(f"{name} must be a NumPy array when q is one, got {type(given).__name__}")
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor when q is one, got {type(given).__name__}")
        if given.device != self.device:
            raise ValueError(f"{name} is on {given.device}, the inputs and the plan on {self.device}")
        if given.dtype != dtype:
            raise TypeError(f"{name} has dtype {dtype_name(given)}, expected {str(dtype).removeprefix('torch.')}")
        return given


def make_runner(spec, work_plan, previous=None) -> Runner:
    """Bind ``work_plan`` to device buffers, reusing ``previous``'s in place when they fit (CUDA graphs)."""
    device = previous.device if isinstance(previous, Runner) else default_device()
    return Runner(spec, work_plan, device, previous)


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """One-shot attention: plan with :func:`~bsrattn.torch_cuda.config.plan_options`, then run once."""
    device = device_of(q, k, v, out, lse)
    work_plan = scheduler._plan_valid(spec.layout.qo_lens, spec.layout.kv_lens, **cfg.plan_options(spec, device))
    return Runner(spec, work_plan, device, headroom=False).run(q, k, v, out=out, lse=lse, return_lse=return_lse,
                                                               k_scale=k_scale, v_scale=v_scale)
