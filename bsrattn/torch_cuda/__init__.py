"""The torch tier: Triton kernels on PyTorch tensors, registered as custom ops, capturable in CUDA graphs.

Files match the reference's: :mod:`.gather` (the load module: KV tiles gathered through the BSR indices,
or loaded affinely), :mod:`.microkernel` (the online-softmax core on ``tl.dot``), :mod:`.merge` (⊕ and its
kernels), :mod:`.executor` (one persistent kernel per plan, the merge folded in), plus :mod:`.config`
(tiles, ``plan_options``), :mod:`.plan_buffers` (device buffers refilled in place), :mod:`.runner`
(plan/run), :mod:`.ops` (``torch.library`` custom ops) and :mod:`.arrays` (NumPy in, NumPy out).
:mod:`.item_kernel` runs plans of one-tile items one program per item, and :mod:`.kernel_args` declares both
kernels' runtime arguments. The serving layer's rooms, each over the core (:mod:`.core`): :mod:`.deterministic`
(the chunk grid), :mod:`.prior` (a prior state folded in), :mod:`.launch` (launches past Triton's dispatch),
:mod:`.one_shot` (the one-shot call's caches).

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``).

Examples
--------
>>> import numpy as np, bsrattn as ba
>>> rng = np.random.default_rng(0)
>>> layout = ba.layouts.paged([1, 2], [[2, 0], [1]], kv_lens=[20, 7], page_size=16, num_pages=3)
>>> q = rng.standard_normal((3, 4, 16)).astype(np.float32)
>>> k, v = rng.standard_normal((2, 3, 16, 2, 16)).astype(np.float32)
>>> out = ba.attention(q, k, v, layout, variant=ba.Variant(causal=True), backend="torch")
>>> np.allclose(out, ba.attention(q, k, v, layout, variant=ba.Variant(causal=True)), atol=1e-5)
True
"""

from __future__ import annotations

import torch

from bsrattn.torch_cuda import ops
from bsrattn.torch_cuda.config import plan_options
from bsrattn.torch_cuda.one_shot import attention
from bsrattn.torch_cuda.runner import Runner, make_runner
from bsrattn.torch_cuda.arrays import device_of, to_numpy, to_torch

__all__ = ["attention", "merge_state", "merge_states", "add_states", "plan_options", "make_runner", "Runner"]

FOLDS_PRIOR = True
"""``attention`` and ``Runner.run`` take ``prior=(o, lse)``, folded in by the kernel (``Backend.folds_prior``)."""
BINDS_RUNS = True
"""Runners have ``bind``: a serving loop's call does the work that follows from its arguments' kinds once."""
HEAD_DIM_VO = True
"""``v`` and ``out`` may be narrower than ``q`` and ``k`` (``head_dim_vo``: multi-head latent attention), in both
kernels; ``v`` may be a strided view (MLA's value, the key's first ``Dv`` elements)."""
KERNELS = ("shipped", "core")
"""The serving kernels, and :mod:`.core`, the paper's kernel at teaching size (``kernel="core"``)."""


def _tensors(named):
    """The named arrays as tensors on one device, and whether the caller gave NumPy (to hand NumPy back)."""
    device = device_of(*named.values())
    as_numpy = not isinstance(next(iter(named.values())), torch.Tensor)
    return [to_torch(name, x, device) for name, x in named.items()], as_numpy


def merge_state(o_a, lse_a, o_b, lse_b):
    """``(o_a, lse_a) ⊕ (o_b, lse_b)`` (reference :func:`~bsrattn.reference.merge.merge_state`), float32 inside.

    >>> import numpy as np
    >>> o, s = merge_state(np.ones((1, 1, 2), np.float32), np.zeros((1, 1), np.float32),
    ...                    3 * np.ones((1, 1, 2), np.float32), np.zeros((1, 1), np.float32))
    >>> o.tolist(), round(float(s[0, 0]), 4)
    ([[[2.0, 2.0]]], 0.6931)
    """
    (o_a, lse_a, o_b, lse_b), as_numpy = _tensors(dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b))
    o, s = ops.merge_state(o_a, lse_a, o_b, lse_b)
    return (to_numpy(o), to_numpy(s)) if as_numpy else (o, s)


def merge_states(o, lse):
    """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order (reference ``merge_states``).

    >>> import numpy as np
    >>> o, s = merge_states(np.ones((2, 3, 1, 4), np.float32), np.zeros((2, 3, 1), np.float32))
    >>> np.allclose(s, np.log(3)), o.shape
    (True, (2, 1, 4))
    """
    (o, lse), as_numpy = _tensors(dict(o=o, lse=lse))
    o, s = ops.merge_states(o, lse)
    return (to_numpy(o), to_numpy(s)) if as_numpy else (o, s)


def add_states(o_a, o_b):
    """FlashSigmoid's merge: ``o_a + o_b`` (reference ``sum_states`` of two states).

    >>> import numpy as np
    >>> add_states(np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32)).tolist()
    [[[2.0, 2.0]]]
    """
    (o_a, o_b), as_numpy = _tensors(dict(o_a=o_a, o_b=o_b))
    o = ops.add_states(o_a, o_b)
    return to_numpy(o) if as_numpy else o
