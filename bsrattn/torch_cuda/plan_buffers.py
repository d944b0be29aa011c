"""Persistent device buffers of a plan: refilled in place, so a captured CUDA graph survives a new plan.

A CUDA graph records device pointers and launch arguments, not values. So everything that changes from
one step to the next (the work items, the layout's indices, the custom mask) lives in device buffers whose
addresses and section offsets depend only on their *capacity*; ``plan`` rewrites their contents with one
host-to-device copy; the partial-state workspace and the merge counters keep fixed offsets. While a new
plan fits the capacity, every pointer and scalar the kernel sees is unchanged.

One int32 buffer holds every plan array, at 64-byte aligned offsets:

| section | shape | content |
|---|---|---|
| ``cta_indptr`` | ``[num_ctas+1]`` | CTA ``c`` runs items ``cta_indptr[c]:cta_indptr[c+1]`` |
| ``items`` | ``[W, ITEM_STRIDE]`` | one row of :data:`ITEM_FIELDS` per work item |
| ``merge_partials`` | ``[P]`` | as in :class:`~bsrattn.scheduler.WorkPlan` |
| ``alibi`` | ``[num_qo_heads]`` | the variant's ALiBi slopes (float32 bits) |
| ``kv_indices`` | ``[nnz]`` | the layout's block ids |

An item row carries everything the kernel needs about its block row and its merge, so a program reads one
64-byte row and no per-row array: one round trip to memory before the KV loop starts, not two.

The custom mask (one byte per element) follows in the same allocation, so one copy moves everything.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields, replace

import numpy as np
import torch

from bsrattn.torch_cuda.config import next_pow2

SECTIONS = ("cta_indptr", "items", "merge_partials", "alibi", "kv_indices")
ITEM_FIELDS = (
    "qo_start", "qo_end",  # the item's query rows (absolute rows of q)
    "kv_start", "kv_end",  # its logical KV slots
    "partial",  # first workspace row of its partial state, -1: it writes the output
    "merge",  # the merge its partial state belongs to, -1: none
    "parts_lo", "parts_hi",  # that merge's partials, merge_partials[parts_lo:parts_hi]
    "qo_first", "qo_len", "kv_len",  # the block row's first query row and lengths
    "block_start",  # kv_indptr of the block row
    "first_slot",  # first pool slot when the row's blocks are consecutive (the dense path), else -1
    "mask_start",  # mask_indptr of the block row
    "row",  # the block row
)
"""The int32 fields of an item row, in order; the kernel reads them by these names (``ITEM``)."""
ITEM = {name: i for i, name in enumerate(ITEM_FIELDS)}
ITEM_STRIDE = 16
"""int32 elements per item row: the fields, padded to 64 bytes."""
WORKSPACE_HEADROOM_BYTES = 64 * 2**20
"""Largest partial-state workspace sized for the worst case of a batch rather than for its first plan."""
_ALIGN = 16  # int32 elements: 64 bytes, so every section pointer keeps Triton's 16-byte alignment
_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class Capacity:
    """Sizes the buffers are allocated for: a plan fits when each of its needs is at most these."""

    num_ctas: int
    items: int
    merges: int
    partials: int
    nnz: int
    mask: int
    partial_rows: int

    @classmethod
    def needed(cls, work_plan, layout) -> "Capacity":
        mask = 0 if layout.custom_mask is None else layout.custom_mask.size
        return cls(work_plan.num_ctas, work_plan.num_items, work_plan.num_merges, work_plan.merge_partials.size,
                   layout.kv_indices.size, mask, work_plan.num_partial_rows)

    def fits(self, need: "Capacity") -> bool:
        return self.num_ctas == need.num_ctas and all(
            getattr(self, f.name) >= getattr(need, f.name) for f in fields(self) if f.name != "num_ctas")

    def grown(self, work_plan, num_qo_heads: int, head_dim: int) -> "Capacity":
        """Headroom for later plans of the same batch, so a captured graph survives a change of lengths.

        A balanced plan cuts KV chunks of at least ``L_kv = total / num_ctas`` slots, so it has at most
        ``num_ctas + n_tiles`` items (``sum ceil(l / L_kv) <= sum (l / L_kv + 1)``), whatever the lengths:
        items, merges and partials are sized for that worst case, and so are the partial-state rows when
        that workspace stays under :data:`WORKSPACE_HEADROOM_BYTES` (decode; prefill keeps its own need).
        Every size is then rounded up to a power of two, at least 16.
        """
        tiles = np.unique(work_plan.item_qo_start).size
        worst = self.num_ctas + tiles
        rows_per_tile = int((work_plan.item_qo_end - work_plan.item_qo_start).max(initial=1))
        partial_rows = max(self.partial_rows, worst * rows_per_tile)
        if partial_rows * num_qo_heads * (head_dim + 1) * 4 > WORKSPACE_HEADROOM_BYTES:
            partial_rows = self.partial_rows
        sizes = replace(self, items=max(self.items, worst), merges=max(self.merges, tiles),
                        partials=max(self.partials, worst), partial_rows=partial_rows)
        return Capacity(self.num_ctas, *(max(16, next_pow2(x)) for x in astuple(sizes)[1:]))

    def section_sizes(self, num_qo_heads: int) -> dict:
        return {"cta_indptr": self.num_ctas + 1, "items": self.items * ITEM_STRIDE, "merge_partials": self.partials,
                "alibi": num_qo_heads, "kv_indices": self.nnz}


def first_slots(layout) -> np.ndarray:
    """``[R]`` first pool slot of each row whose blocks are consecutive pool blocks, -1 for the others.

    Those rows take the dense (affine) load path. The choice is per row and read at run time, so a captured
    CUDA graph stays valid whichever rows a later plan makes affine.
    """
    idx = layout.kv_indices.astype(np.int64)
    starts, ends = layout.kv_indptr[:-1].astype(np.int64), layout.kv_indptr[1:].astype(np.int64)
    # breaks[j]: steps idx[i-1] -> idx[i], i <= j, that are not +1. Row [s, e) is affine when none of its
    # own steps (s < i < e) breaks, i.e. breaks[e-1] == breaks[s]; the step into a row is not its own.
    breaks = np.zeros(max(idx.size, 1), dtype=np.int64)
    np.cumsum(np.diff(idx) != 1, out=breaks[1:])
    affine = (ends > starts) & (breaks[np.maximum(ends - 1, 0)] == breaks[np.minimum(starts, breaks.size - 1)])
    first = idx[np.minimum(starts, max(idx.size - 1, 0))] * layout.block_size if idx.size else np.zeros_like(starts)
    return np.where(affine, first, -1).astype(np.int32)


def item_merges(work_plan) -> np.ndarray:
    """``[W]`` the merge each item's partial state belongs to, -1 for items that write the output."""
    merge_of_start = np.full(max(work_plan.num_partial_rows, 1), -1, dtype=np.int32)
    merge_of_start[work_plan.merge_partials] = np.repeat(np.arange(work_plan.num_merges), np.diff(work_plan.merge_indptr))
    partial = work_plan.item_partial
    return np.where(partial >= 0, merge_of_start[np.maximum(partial, 0)], -1).astype(np.int32)


def item_rows(work_plan, layout) -> np.ndarray:
    """``[W, ITEM_STRIDE]`` int32: the item table the kernel reads (:data:`ITEM_FIELDS`)."""
    row = work_plan.item_row
    merge = item_merges(work_plan)
    split = merge >= 0
    at = np.maximum(merge, 0)
    bounds = np.append(work_plan.merge_indptr, 0)  # a plan without merges still indexes at 0 and 1
    qo_first = layout.qo_indptr[row]
    columns = {"qo_start": work_plan.item_qo_start, "qo_end": work_plan.item_qo_end,
               "kv_start": work_plan.item_kv_start, "kv_end": work_plan.item_kv_end,
               "partial": work_plan.item_partial, "merge": merge,
               "parts_lo": np.where(split, bounds[at], 0), "parts_hi": np.where(split, bounds[at + 1], 0),
               "qo_first": qo_first, "qo_len": layout.qo_indptr[row + 1] - qo_first, "kv_len": layout.kv_lens[row],
               "block_start": layout.kv_indptr[row], "first_slot": first_slots(layout)[row],
               "mask_start": layout.mask_indptr[row], "row": row}
    table = np.zeros((work_plan.num_items, ITEM_STRIDE), dtype=np.int32)
    for name, column in columns.items():
        table[:, ITEM[name]] = column
    return table


class PlanBuffers:
    """The plan arrays, custom mask, partial-state workspace and merge counters of one runner, on ``device``.

    ``part_o [partial_rows, num_qo_heads, head_dim]`` and ``part_lse [partial_rows, num_qo_heads]`` (float32)
    hold split items' partial states; ``counters [merges, num_kv_heads]`` (int32, zero between launches)
    count the partial states of each split tile as they land, so the CTA that writes the last one merges.
    """

    def __init__(self, capacity: Capacity, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device):
        self.capacity = capacity
        self.shape_key = (num_qo_heads, num_kv_heads, head_dim, device)
        self.offsets = {}
        at = 0
        for name, size in capacity.section_sizes(num_qo_heads).items():
            self.offsets[name] = (at, size)
            at += -(-max(size, 1) // _ALIGN) * _ALIGN
        self._plan_bytes = 4 * at
        total = self._plan_bytes + max(capacity.mask, 1)
        self.device = device
        self.raw = torch.zeros(total, dtype=torch.uint8, device=device)
        # Host staging in pinned memory, so the refill is one asynchronous copy in stream order.
        self.staging = (torch.zeros(total, dtype=torch.uint8, pin_memory=True) if device.type == "cuda"
                        else self.raw)
        self._copied = None
        self.plan = self.raw[:self._plan_bytes].view(torch.int32)
        self.mask = self.raw[self._plan_bytes:]
        rows = max(capacity.partial_rows, 1)
        self.part_o = torch.zeros((rows, num_qo_heads, head_dim), dtype=torch.float32, device=device)
        self.part_lse = torch.zeros((rows, num_qo_heads), dtype=torch.float32, device=device)
        self.counters = torch.zeros((max(capacity.merges, 1), num_kv_heads), dtype=torch.int32, device=device)
        # Stands in for lse when the caller wants none: a launch always gets a tensor there.
        self.no_lse = torch.zeros((1, 1), dtype=torch.float32, device=device)

    def section(self, name: str) -> torch.Tensor:
        at, size = self.offsets[name]
        return self.plan[at:at + max(size, 1)]

    def fits(self, need: Capacity, num_qo_heads, num_kv_heads, head_dim, device) -> bool:
        return self.shape_key == (num_qo_heads, num_kv_heads, head_dim, device) and self.capacity.fits(need)

    @property
    def alibi(self) -> torch.Tensor:
        return self.section("alibi").view(torch.float32)

    def fill(self, work_plan, layout, alibi_slopes=None) -> None:
        """Write ``work_plan``, ``layout``'s arrays and the ALiBi slopes in place (one host-to-device copy)."""
        mask_indptr = layout.mask_indptr
        if mask_indptr[-1] > _INT32_MAX:
            raise ValueError(f"custom_mask has {mask_indptr[-1]} elements; the torch tier indexes it with int32")
        values = {"cta_indptr": work_plan.cta_indptr, "items": item_rows(work_plan, layout).reshape(-1),
                  "merge_partials": work_plan.merge_partials, "kv_indices": layout.kv_indices}
        if alibi_slopes is not None:
            values["alibi"] = np.asarray(alibi_slopes, dtype=np.float32).view(np.int32)
        if self._copied is not None:
            self._copied.synchronize()  # the previous refill's copy must have left the staging buffer
        host = self.staging.numpy()
        host_plan = host[:self._plan_bytes].view(np.int32)
        for name, value in values.items():
            at, _ = self.offsets[name]
            host_plan[at:at + value.size] = value
        if layout.custom_mask is not None:
            host[self._plan_bytes:self._plan_bytes + layout.custom_mask.size] = layout.custom_mask
        if self.staging is not self.raw:
            self.raw.copy_(self.staging, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
