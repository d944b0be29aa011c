"""The tier's entry points as PyTorch custom ops (``torch.library``), so ``torch.compile`` sees them whole.

Each op has a fake (meta) implementation that only describes its outputs, so ``torch.compile(fn,
fullgraph=True)`` traces a function calling them without a graph break and without running a kernel.

| op | what it does |
|---|---|
| ``bsrattn::attention_run`` | a plan's attention launches over its buffers, an earlier level's state folded in or not; writes ``out``/``lse`` (and the workspace) in place |
| ``bsrattn::merge_state`` | ``(o_a, lse_a) ⊕ (o_b, lse_b)`` |
| ``bsrattn::merge_states`` | fold ``[n, S, H, D]`` states over ``S`` in order |
| ``bsrattn::add_states`` | ``o_a + o_b`` (FlashSigmoid's merge) |

``attention_run`` takes the plan's buffers as tensors and its :class:`~bsrattn.torch_cuda.config.LaunchConfig`,
section offsets (then the merge rows of ``sync``) and :class:`~bsrattn.torch_cuda.config.Scalars` as lists,
the only argument kinds an op schema has. Validation happens before the op is called (:mod:`bsrattn.torch_cuda.runner`).
"""

from __future__ import annotations

import torch

from bsrattn.torch_cuda import launch, merge
from bsrattn.torch_cuda.config import LaunchConfig, Scalars
from bsrattn.torch_cuda.plan_buffers import SECTIONS, PlanSections


class _BufferView(PlanSections):
    """The :class:`~bsrattn.torch_cuda.plan_buffers.PlanBuffers` a launch reads, from the op's arguments."""

    def __init__(self, plan, mask, part_o, part_lse, sync, sections):
        self.plan, self.mask, self.part_o, self.part_lse, self.sync = plan, mask, part_o, part_lse, sync
        self.merge_rows = sections[-1]
        self.offsets = {name: (sections[2 * i], sections[2 * i + 1]) for i, name in enumerate(SECTIONS)}


@torch.library.custom_op("bsrattn::attention_run", mutates_args=("out", "lse", "part_o", "part_lse", "sync"))
def attention_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  prior_o: torch.Tensor, prior_lse: torch.Tensor, plan: torch.Tensor, mask: torch.Tensor,
                  part_o: torch.Tensor, part_lse: torch.Tensor, sync: torch.Tensor, sections: list[int],
                  config: list[int], scalars: list[float]) -> None:
    """Run a plan's attention launches (``executor.passes``); ``out [nnz_qo, Hq, Dv]`` (``Dv``: ``v``'s head
    dimension) and ``lse [nnz_qo, Hq]`` are written in place, ``(prior_o, prior_lse)`` folded into them first where
    the configuration's ``prior`` says so."""
    buffers = _BufferView(plan, mask, part_o, part_lse, sync, sections)
    launch.launch(q, k, v, out, lse, prior_o, prior_lse, buffers, LaunchConfig.from_list(config), Scalars(*scalars))


@attention_run.register_fake
def _(q, k, v, out, lse, prior_o, prior_lse, plan, mask, part_o, part_lse, sync, sections, config, scalars):
    return None


@torch.library.custom_op("bsrattn::merge_state", mutates_args=())
def merge_state(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o_a, lse_a) ⊕ (o_b, lse_b)``: ``o [..., H, D]``, ``lse [..., H]``."""
    return merge.merge_state(o_a, lse_a, o_b, lse_b)


@merge_state.register_fake
def _(o_a, lse_a, o_b, lse_b):
    dtype = torch.promote_types(o_a.dtype, o_b.dtype)
    return o_a.new_empty(o_a.shape, dtype=dtype), lse_a.new_empty(lse_a.shape, dtype=torch.float32)


@torch.library.custom_op("bsrattn::merge_states", mutates_args=())
def merge_states(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order."""
    return merge.merge_states(o, lse)


@merge_states.register_fake
def _(o, lse):
    n, _, h, d = o.shape
    return o.new_empty((n, h, d)), lse.new_empty((n, h), dtype=torch.float32)


@torch.library.custom_op("bsrattn::add_states", mutates_args=())
def add_states(o_a: torch.Tensor, o_b: torch.Tensor) -> torch.Tensor:
    """``o_a + o_b``: FlashSigmoid's merge of two states."""
    return merge.add_states(o_a, o_b)


@add_states.register_fake
def _(o_a, o_b):
    return o_a.new_empty(o_a.shape, dtype=torch.promote_types(o_a.dtype, o_b.dtype))
