"""A plan bound to persistent device buffers: ``run`` is one launch of a fixed launch grid, capturable in a CUDA graph.

``make_runner(spec, work_plan, previous)`` writes the plan into device buffers — ``previous``'s, in place,
when they are large enough — so a CUDA graph captured around ``run`` replays the new plan: the launch grid
(``num_ctas x num_kv_heads x head groups``), the buffer addresses, the workspace offsets and every scalar argument
stay the same. What a graph does record, and what must therefore not change between the plans it replays:
the launch configuration (:class:`~bsrattn.torch_cuda.config.LaunchConfig`: tile sizes from ``tile_q``,
the variant, dtypes, the KV view) and the tensors passed to ``run``. A re-plan over buffers that a launch
inside a graph capture used warns when it changes the variant, the block size or whether a custom mask is
read, or splits rows when the captured kernel carries no merges (``LaunchConfig.merges``; a plan for another
launch grid never fits the buffers: it gets new ones, and a warning too); tile shapes may change, since the kernel
runs any plan of its buffers correctly with any. ``run`` allocates nothing but the
outputs it is not given, and never synchronises with the host. The refill is an asynchronous copy on the
current stream at ``plan`` time: run on that stream (or order the two), as with any stream-ordered write.
One runner's workspace serves one launch at a time: calls from several threads or CUDA streams take turns
(:meth:`~bsrattn.torch_cuda.plan_buffers.PlanBuffers.ordered`), and every launch leaves the merge counters and
flags at zero as it found them (``executor.py``), so none depends on what an earlier one did.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from bsrattn.torch_cuda.arrays import SUPPORTED, TORCH_DTYPES, canonical_device, check_device, check_interpretable, \
    default_device, to_numpy, to_torch, write_back
from bsrattn.torch_cuda import config
from bsrattn.torch_cuda.config import LaunchConfig, Scalars, block_d, block_m, causal_hides_keys, num_sms
from bsrattn.torch_cuda.launch import Launch
from bsrattn.torch_cuda.plan_buffers import Capacity, PlanBuffers
from bsrattn.torch_cuda.prior import prior_state, prior_tensors
from bsrattn.validation import dtype_name


class Runner:
    """A :class:`~bsrattn.scheduler.WorkPlan` for ``spec`` on ``device``, ready to run.

    Parameters
    ----------
    spec : AttentionSpec
    work_plan : WorkPlan
    device : torch.device
        Where the plan's buffers live; every tensor given to :meth:`run` must be there.
    previous : Runner or PlanBuffers, optional
        A runner whose buffers may be refilled in place (when they fit) instead of allocating new ones; a
        warning says when they do not fit, since a CUDA graph captured on them would then be stale. Or
        buffers to refill the same way, silently (a one-shot call's spare buffers).
    headroom : bool
        Size new buffers for any later plan of the same batch (see ``Capacity.grown``) rather than for this
        plan alone (its sizes only rounded, ``Capacity.rounded``); a one-shot call passes False.
    """

    def __init__(self, spec, work_plan, device, previous=None, headroom=True):
        device = canonical_device(device)
        replan = isinstance(previous, Runner)
        spare = previous.buffers if replan else previous
        if spare is None or spare.device != device:  # a runner's device was checked when it was made
            check_device(device)
        check_interpretable("q", TORCH_DTYPES.get(spec.q_dtype))  # before any buffer is allocated
        rope = spec.variant.use_rope
        need = Capacity.needed(work_plan, spec.layout, rope)
        self.head_groups = config.head_groups(spec)  # as config.plan_options chose them for work_plan
        shape = (spec.num_qo_heads, spec.num_kv_heads * self.head_groups, spec.head_dim, device)
        if spare is not None and spare.fits(need, *shape, head_dim_vo=spec.head_dim_vo):
            buffers = spare
        else:
            if replan and spare.captured:  # only a captured graph holds the old buffers' addresses
                warnings.warn(f"the plan needs {need}, beyond the previous plan's buffers "
                              f"({spare.capacity}, heads/dims/device {spare.shape_key}); "
                              f"new buffers were allocated, so recapture any CUDA graph taken on the old ones "
                              f"(plan the largest step first to avoid this)", RuntimeWarning, stacklevel=3)
            # Headroom keeps later re-plans (CUDA graphs) in place; a one-shot call needs none.
            capacity = need.grown(work_plan, spec.num_qo_heads, spec.dim_vo) if headroom else need.rounded()
            buffers = PlanBuffers(capacity, *shape, head_dim_vo=spec.head_dim_vo)
        if replan and buffers is spare and buffers.captured:
            changed = [name for name, was, now in zip(_RECORDED, _recorded(previous.spec),
                                                      _recorded(spec)) if was != now]
            if buffers.captured_without_merges and work_plan.num_merges:
                changed.append("a kernel without merges, and the new plan splits rows")
            if changed:
                warnings.warn(f"a CUDA graph was captured on these buffers, and the new plan changes what it "
                              f"recorded ({', '.join(changed)}); its replays would run the old plan's launch on "
                              f"the new plan's buffers, so recapture it", RuntimeWarning, stacklevel=3)
        # The kernel carries the affine load path only for a plan with affine rows (LaunchConfig.affine_rows).
        with buffers.ordered():
            self.affine_rows = buffers.fill(work_plan, spec.layout, spec.variant.alibi_slopes,
                                           spec.variant.rope_frequencies(spec.head_dim) if rope else None,
                                           spec.rope_frame() if rope else None)
        self.spec = spec
        self.work_plan = work_plan
        self.device = device
        self.buffers = buffers
        self._configs = {}  # launch_config's arguments -> LaunchConfig
        self._launches = {}  # the same keys -> launch.Launch
        self._unit_scales = Scalars(spec.sm_scale, 1.0, float(spec.variant.logits_soft_cap),
                                        float(spec.variant.sigmoid_bias or 0.0))

    def launch_config(self, q_dtype: str, kv_view: str, store_lse: bool, prior: bool = False,
                      value_in_key: bool = False) -> LaunchConfig:
        """The launch configuration for inputs of ``q_dtype`` stored as ``kv_view``, folding a prior state or not,
        with ``v`` the first columns of ``k`` or not (:attr:`LaunchConfig.value_in_key`)."""
        key = (q_dtype, kv_view, store_lse, prior, value_in_key)
        if key not in self._configs:
            spec, variant, groups = self.spec, self.spec.variant, self.head_groups
            group = spec.group_size // groups  # the query heads of a tile's query row
            programs = int(np.count_nonzero(np.diff(self.work_plan.cta_indptr))) * spec.num_kv_heads * groups
            # Through the module: benchmarks/tune.py sweeps its choices.
            t = config.tiles(block_m(self.work_plan.tile_q, group), spec.head_dim, q_dtype,
                             few_items=programs < num_sms(self.device), head_dim_vo=spec.head_dim_vo,
                             value_in_key=value_in_key)
            self._configs[key] = LaunchConfig(
                num_ctas=self.work_plan.num_ctas, num_kv_heads=spec.num_kv_heads, group_size=spec.group_size,
                head_groups=groups,
                head_dim=spec.head_dim, head_dim_vo=spec.dim_vo, block_size=spec.layout.block_size,
                block_m=t.block_m, block_n=t.block_n,
                block_d=block_d(spec.dim_vo if value_in_key else spec.head_dim), block_dv=block_d(spec.dim_vo),
                value_in_key=value_in_key, num_warps=t.num_warps, num_stages=t.num_stages,
                kv_view=kv_view, causal=causal_hides_keys(spec), window_left=variant.window_left,
                soft_cap=variant.logits_soft_cap > 0, alibi=variant.alibi_slopes is not None,
                sigmoid=variant.use_sigmoid, rope=variant.use_rope, custom_mask=spec.layout.custom_mask is not None,
                store_lse=store_lse, affine_rows=self.affine_rows,
                merges=self.work_plan.num_merges > 0 or spec.split_size is not None or spec.cuda_graph,
                item_kernel=0 if spec.cuda_graph or value_in_key else config.item_kernel_for(
                    spec, self.work_plan, q_dtype, self.affine_rows, group),
                split_size=spec.split_size or 0, prior=prior)
        return self._configs[key]

    def graph_key(self) -> tuple:
        """What a CUDA graph captured around :meth:`run` records of this plan beyond its buffers' contents: the
        buffers themselves (a serial number: new buffers, new key) and :data:`_RECORDED`. Under
        ``spec.cuda_graph`` the kernel runs any plan of its buffers, so an equal key means the graph replays."""
        return (self.buffers.serial,) + _recorded(self.spec)

    def _launch(self, key) -> Launch:
        """The eager launch of configuration ``key`` (as :meth:`launch_config` takes it) over this runner's
        buffers: one per configuration, kept with the buffers, so that later plans refilled into them find it."""
        launch = self._launches.get(key)
        if launch is None:
            settings = self.launch_config(*key)
            launch = self.buffers.launches.get(settings)
            if launch is None:
                launch = self.buffers.launches[settings] = Launch(self.buffers, settings)
            self._launches[key] = launch
        return launch

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None, prior=None):
        """Attention of the plan on ``q [nnz_qo, Hq, D]``, ``k``/``v`` (a storage view; ``v`` may be a strided view,
        such as multi-head latent attention's value ``k[..., :Dv]``); returns ``(out [nnz_qo, Hq, Dv], lse or None)``,
        ``Dv`` the head dimension of ``v`` (``spec.dim_vo``).

        Inputs are torch tensors on this runner's device, or NumPy arrays (moved there; the results then
        come back as NumPy). ``out``/``lse`` buffers are written in place and returned. ``prior``, a state
        ``(o [nnz_qo, Hq, Dv], lse [nnz_qo, Hq])`` of the same query rows (an earlier Cascade level's), is folded
        in by the kernel: the result is ``prior ⊕`` this plan's state, as ``merge_state`` would give it, with no
        launch of its own. Called eagerly, the kernel is launched through the buffers'
        :class:`~bsrattn.torch_cuda.launch.Launch`; traced by ``torch.compile``, through the custom op
        (:mod:`bsrattn.torch_cuda.ops`).
        """
        as_numpy = not isinstance(q, torch.Tensor)
        q_t, k_t, v_t = to_torch("q", q, self.device), to_torch("k", k, self.device), to_torch("v", v, self.device)
        key, scalars, want_lse = self._prepare(q_t, k_t, out, lse, return_lse, k_scale, v_scale, prior is not None)
        out_shape = q_t.shape if self.spec.head_dim_vo is None else (*q_t.shape[:2], self.spec.head_dim_vo)
        if prior is not None:
            prior = prior_tensors(prior, out_shape, self.device)
        out_t = self._output("out", out, as_numpy, out_shape, q_t.dtype)
        lse_t = self._output("lse", lse, as_numpy, q_t.shape[:2], torch.float32) if want_lse else None
        self._launch_on(key, q_t, k_t, v_t, out_t, lse_t, scalars, prior)
        if as_numpy:
            o = write_back(out, out_t) if out is not None else to_numpy(out_t)
            s = None if lse_t is None else (write_back(lse, lse_t) if lse is not None else to_numpy(lse_t))
            return o, s
        return out_t, lse_t

    def bind(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """``call(q, k, v, out, lse) -> (out, lse or None)``: :meth:`run` with these keyword arguments, for arguments
        of the kinds of these (each array's type, shape, dtype and device, ``out`` and ``lse`` given or not).

        What :meth:`run` works out from the arguments' kinds (dtypes supported, the launch configuration, the
        scales) is worked out here once, so each call does only what its own tensors need: a serving loop's
        ``BatchAttention.run``, whose check key guarantees the kinds, calls it. NumPy inputs, and a bind traced
        by ``torch.compile``, take :meth:`run`; a bound call traced by it puts the custom op in the graph
        (:meth:`_launch_on`).
        """
        def general(q, k, v, out, lse):
            return self.run(q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)

        if not isinstance(q, torch.Tensor) or torch.compiler.is_compiling():
            return general
        q_t, k_t = to_torch("q", q, self.device), to_torch("k", k, self.device)
        to_torch("v", v, self.device)
        key, scalars, want_lse = self._prepare(q_t, k_t, out, lse, return_lse, k_scale, v_scale)
        out_shape, lse_shape, dtype, device = (*q_t.shape[:2], self.spec.dim_vo), q_t.shape[:2], q_t.dtype, self.device
        if out is not None:
            self._output("out", out, False, out_shape, q_t.dtype)
        if want_lse and lse is not None:
            self._output("lse", lse, False, lse_shape, torch.float32)

        def call(q, k, v, out, lse):
            if out is None:
                out = torch.empty(out_shape, dtype=dtype, device=device)
            if want_lse and lse is None:
                lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
            self._launch_on(key, q, k, v, out, lse if want_lse else None, scalars)
            return out, lse if want_lse else None

        return call

    def _prepare(self, q_t, k_t, out, lse, return_lse, k_scale, v_scale, prior=False):
        """``(key, scalars, want_lse)`` of a call (folding a prior state or not): ``key`` its launch configuration's
        (as :meth:`launch_config` takes it, but for ``value_in_key``, which :meth:`_launch_on` adds from the tensors
        of each call), ``scalars`` its :class:`~bsrattn.torch_cuda.config.Scalars`,
        ``want_lse`` whether it writes an LSE."""
        spec = self.spec
        q_dtype = dtype_name(q_t)
        for name, dtype in (("q", q_dtype), ("k", dtype_name(k_t))):
            if dtype not in SUPPORTED:
                raise TypeError(f"{name} has dtype {dtype}; the torch tier supports {SUPPORTED} "
                                f"(use backend='reference' for float64)")
        want_lse = (return_lse or lse is not None) and not spec.variant.use_sigmoid
        # fp8 KV is dequantised by folding k_scale into the score scale and v_scale into the output.
        scalars = self._unit_scales
        if k_scale is not None or v_scale is not None:
            scalars = scalars._replace(qk_scale=spec.sm_scale * (1.0 if k_scale is None else float(k_scale)),
                                       v_scale=1.0 if v_scale is None else float(v_scale))
        return (q_dtype, spec.kv_view_of(k_t), want_lse, prior), scalars, want_lse

    def _launch_on(self, key, q, k, v, out, lse, scalars, prior=None):
        """Launch configuration ``key`` (as :meth:`_prepare` gives it) on the call's tensors, or put the custom op
        in the graph that ``torch.compile`` traces."""
        b = self.buffers
        lse_arg = b.no_lse if lse is None else lse
        prior_o, prior_lse = prior_state(b, prior)
        if torch.compiler.is_compiling():  # traced: the compiled graph orders its launches
            torch.ops.bsrattn.attention_run(q, k, v, out, lse_arg, prior_o, prior_lse, b.plan, b.mask, b.part_o,
                                            b.part_lse, b.sync, b.sections, self.launch_config(*key).to_list(),
                                            list(scalars))
            return
        launch = self._launch((*key, _value_in_key(self.spec, k, v)))
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            b.captured = True  # a later re-plan checks it keeps what the graph recorded
            b.captured_without_merges |= not launch.config.merges
        with b.ordered() as stream:
            launch(q, k, v, out, lse_arg, prior_o, prior_lse, scalars, stream)

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
    previous = previous if isinstance(previous, Runner) else None
    device = default_device() if previous is None else previous.device
    return Runner(spec, work_plan, device, previous)


def _value_in_key(spec, k, v) -> bool:
    """Whether ``v`` is the first ``spec.dim_vo`` columns of ``k`` (:attr:`LaunchConfig.value_in_key`): a view of
    ``k``'s memory from its first element with ``k``'s strides, narrower than ``k``, as multi-head latent attention
    passes its value, where the spec allows it (:func:`~bsrattn.torch_cuda.config.value_may_be_in_key`)."""
    return (config.value_may_be_in_key(spec) and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
            and v.shape[:-1] == k.shape[:-1] and v.dtype == k.dtype and v.device == k.device)


# ---- CUDA graphs: what a capture recorded, which a re-plan over its buffers must keep (Runner's warning) ----

_RECORDED = ("block_size", "whether a custom mask is read", "the score scale", "the causal mask", "the window",
             "the soft cap", "whether ALiBi is on", "the sigmoid bias", "the sinks", "whether RoPE is on")


def _recorded(spec) -> tuple:
    """What a CUDA graph captured around :meth:`Runner.run` records of a plan, beyond the buffers' contents that
    a re-plan refills (:data:`_RECORDED` names them): the kernel's compile-time switches and scalar arguments.
    (The launch grid is the buffers' own: a plan for another ``num_ctas`` never fits them.) Tile shapes and warps may
    change: the kernel runs any plan of the buffers correctly with any."""
    variant = spec.variant
    return (spec.layout.block_size, spec.layout.custom_mask is not None, spec.sm_scale,
            causal_hides_keys(spec), variant.window_left, variant.logits_soft_cap, variant.alibi_slopes is not None,
            variant.sigmoid_bias, variant.sinks, variant.use_rope)
