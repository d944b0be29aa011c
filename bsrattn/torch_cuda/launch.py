"""Launches that skip Triton's per-call dispatch, whose host time is several times a small decode's GPU time, by
calling its compiled kernels' launchers directly: Triton internals, checked on Triton 3.6 (the H200's) and 3.9.

Over a plain ``kernel[launch_grid](*args, **constexprs)``, which binds its arguments, works out what to specialise
the kernel on and looks the kernel up on every call, a :class:`Launch` reads the arguments its buffers fix
(:func:`~bsrattn.torch_cuda.kernel_args.plan_args`) once. The first launch of a new kind goes through Triton, and
the compiled kernels it returns are kept for the process (:data:`_COMPILED`: a later plan's buffers find them too);
a launch of a kind seen before hands their launchers its arguments directly, pointers as addresses (through
Triton's runner only while a launch hook is set, :func:`_no_launch_hooks`). The call's own arguments (pointers,
strides) are classified only when they differ from the last call's: a model's layers share them. Which kernels a
call launches, and with what, is the executor's (:func:`~bsrattn.torch_cuda.executor.passes`); the arguments are
:data:`~bsrattn.torch_cuda.kernel_args.RUNTIME_ARGS`, in that order, for every kernel.

What is relied on: a compiled kernel's ``run`` (its launcher), ``function`` and ``packed_metadata``, the
launcher's arguments (the launch grid, the stream, the function, the metadata, the launch metadata and the two
hooks, then the kernel's arguments, tuples as tuples: Triton 3.3 on), and where the launch hooks live
(:func:`_hook_holder`).

Eager calls launch through a :class:`Launch` kept with the plan's buffers; ``torch.compile``'d calls go through the
custom op and :func:`launch`, a :class:`Launch` made for the one call.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from operator import attrgetter
from typing import Callable, NamedTuple

import torch
import triton

from bsrattn.torch_cuda import executor, item_kernel
from bsrattn.torch_cuda.config import interpreter_turn, interpreting
from bsrattn.torch_cuda.gather import block_size_constexpr
from bsrattn.torch_cuda.kernel_args import CALL_INTS, CALL_TENSORS, call_args, constexpr_names, plan_args

_TENSORS = len(CALL_TENSORS)
_FLOATS = _TENSORS + len(CALL_INTS)  # where call_args' floats start
_dtype = attrgetter("dtype")
_NO_SCRATCH = contextlib.nullcontext()  # reusable: a launch of a kernel without tensor descriptors makes none


def launch(q, k, v, out, lse, prior_o, prior_lse, buffers, config, scalars):
    """Launch each of :func:`~bsrattn.torch_cuda.executor.passes` (arguments as
    :func:`~bsrattn.torch_cuda.kernel_args.call_args` takes them): a :class:`Launch` made for the one call (the
    custom op's path, which ``torch.compile``'d code takes)."""
    Launch(buffers, config)(q, k, v, out, lse, prior_o, prior_lse, scalars)


def _specialised(x):
    """What Triton's NVIDIA backend specialises a kernel on for argument ``x``: for a pointer, its dtype and whether
    it is 16-byte aligned; for an int, whether it is 1, whether 16 divides it, and the integer type it is
    passed as; for a tuple, each element's; a float, nothing."""
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    if isinstance(x, int):
        return x == 1, x % 16 == 0, -2**31 <= x < 2**31, x < 2**63
    if isinstance(x, tuple):
        return tuple(map(_specialised, x))
    return None


class KeptKernel(NamedTuple):
    """A pass Triton compiled, kept to be launched without it: its runner (``compiled[launch_grid]``, which reads the
    launch hooks and, given no stream, the current one) and what that runner hands the compiled launcher."""

    run: Callable
    launcher: Callable
    launch_grid: tuple
    function: int
    metadata: object
    tail: tuple  # the constexpr values, the launcher's last arguments
    descriptors: bool  # whether the kernel makes tensor descriptors (it then needs Triton's allocator set)

    @classmethod
    def of(cls, compiled, launch_grid, tail, descriptors) -> "KeptKernel":
        launch_grid = (*launch_grid, 1)  # a compiled kernel's launcher takes all three grid dimensions
        run = compiled[launch_grid]  # loads the module: the function handle exists from here on
        return cls(run, compiled.run, launch_grid, compiled.function, compiled.packed_metadata, tail, descriptors)


def _hook_holder():
    """Where this Triton keeps its launch hooks, which its runners read: its runtime knobs (Triton 3.4 on), or
    before them ``CompiledKernel``'s class attributes."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if hasattr(runtime, "launch_enter_hook"):
        return runtime
    from triton.compiler.compiler import CompiledKernel

    return CompiledKernel


_HOOKS = _hook_holder()


def _no_launch_hooks() -> bool:
    """Whether no launch hook is set (a profiler's): a kept kernel's launcher is then called directly, with what
    its runner would pass it without hooks (no launch metadata), which saves the runner's own host time; with a hook
    set, launches go through the runner, which calls it."""
    return not (_calls_something(_HOOKS.launch_enter_hook) or _calls_something(_HOOKS.launch_exit_hook))


def _calls_something(hook) -> bool:
    """Whether a launch hook calls anything: None, or an empty chain of hooks (Triton 3.5 on), does not."""
    return hook is not None and bool(getattr(hook, "calls", True))


_COMPILED = {}
"""What Triton compiled, found again without it: per kind of launch (the configuration, the device, and what
Triton specialises on in every argument, :func:`_specialised`), a :class:`KeptKernel` for each pass."""
_KEEPS_KERNELS = torch.version.hip is None and not interpreting()
"""Whether launches go to kept kernels: on NVIDIA GPUs, compiled (AMD's backend specialises on more, such as
whether a tensor's offsets fit 32 bits; the interpreter compiles nothing)."""


class Launch:
    """:func:`launch` for one plan's buffers and one launch configuration, with Triton's per-call work done once."""

    __slots__ = ("config", "item_capacity", "sync", "plan", "_plan_ptrs", "_plan_kind", "_last", "_scratch")

    def __init__(self, buffers, config):
        self.config = config
        self.item_capacity = buffers.item_capacity
        self.sync = buffers.sync
        self.plan = plan_args(buffers, config)
        self._plan_ptrs = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in self.plan)
        # Block sizes that are not powers of two share one kernel (gather.block_size_constexpr).
        kernel_config = replace(config, block_size=block_size_constexpr(config.block_size))
        # A kept kernel carries its launch grid, and the item kernel's is the buffers' item capacity: buffers of
        # another capacity are another kind, or a later plan's items past the first capacity would never run.
        item_grid = self.item_capacity if config.item_kernel else 0
        self._plan_kind = (kernel_config, item_grid, self.sync.device, *map(_specialised, self.plan))
        self._last = (None, None)  # the last call's (dtypes, pointers' alignment, integers) and its kernels
        self._scratch = None

    def scratch(self, size: int, alignment: int, stream) -> torch.Tensor:
        """Triton's allocator for the global scratch of a kernel that makes tensor descriptors
        (``item_kernel.descriptor_scratch``): one buffer, grown when a launch needs more."""
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8, device=self.sync.device)
        return self._scratch

    def __call__(self, q, k, v, out, lse, prior_o, prior_lse, scalars, stream=None):
        """Launch each pass on the call's tensors (as :func:`~bsrattn.torch_cuda.kernel_args.call_args` takes them),
        on ``stream`` (a raw CUDA stream handle; None: the current stream, which Triton then reads itself)."""
        call = call_args(q, k, v, out, lse, prior_o, prior_lse, self.config, scalars)
        tensors, ints = call[:_TENSORS], call[_TENSORS:_FLOATS]
        ptrs = tuple(map(torch.Tensor.data_ptr, tensors))
        exact = (*map(_dtype, tensors), *(p % 16 for p in ptrs), *ints)
        last, kernels = self._last
        if last != exact:
            # Whether K and V go through tensor descriptors follows from what `exact` holds, beyond what Triton
            # specialises on (a stride's value), so it is part of the kind.
            tma = item_kernel.tma_ready(self.config, q, k, v)
            kind = (self._plan_kind, *exact[:_TENSORS], *(p % 16 == 0 for p in ptrs), *map(_specialised, ints), tma)
            kernels = _COMPILED.get(kind)
        try:
            if kernels is None:
                kernels = self._through_triton(call, tma)
                if not _KEEPS_KERNELS:
                    return
                _COMPILED[kind] = kernels
            else:
                args = (*ptrs, *call[_TENSORS:], *self._plan_ptrs)
                direct = stream is not None and _no_launch_hooks()
                for kernel in kernels:
                    with self._scratch_turn(kernel.descriptors):  # the launcher asks Triton's allocator
                        if direct:
                            kernel.launcher(*kernel.launch_grid, stream, kernel.function, kernel.metadata, None,
                                            None, None, *args, *kernel.tail)
                        else:
                            kernel.run(*args, *kernel.tail, stream=stream)
        except BaseException:
            # A first pass launched without its second may leave flags set: cleared in stream order, so that
            # the next launch, or a captured graph's next replay, starts from zeros.
            self.sync.zero_()
            raise
        self._last = (exact, kernels)

    def _scratch_turn(self, descriptors: bool):
        """The context of one kernel's launch: :meth:`scratch` as Triton's allocator for a kernel that makes
        tensor descriptors, nothing for the others."""
        return item_kernel.descriptor_scratch(self.scratch) if descriptors else _NO_SCRATCH

    def _through_triton(self, call, tma: bool) -> list:
        """Launch each pass through Triton's JIT with the call's arguments (``call_args``; the item kernel with
        tensor descriptors when ``tma``); its compiled kernels' launchers, each with its constexpr values and
        whether it makes tensor descriptors."""
        kernels = []
        with interpreter_turn():
            for fn, launch_grid, tail in executor.passes(self.config, call[0].dtype, self.item_capacity, tma):
                descriptors = bool(tail.get("TMA"))
                with self._scratch_turn(descriptors):
                    kernel = fn[launch_grid](*call, *self.plan, **tail, num_warps=self.config.num_warps,
                                             num_stages=self.config.num_stages,
                                             enable_fp_fusion=not self.config.deterministic)
                if _KEEPS_KERNELS:
                    kernels.append(KeptKernel.of(kernel, launch_grid, tuple(tail[name] for name in constexpr_names(fn)),
                                                 descriptors))
        return kernels
