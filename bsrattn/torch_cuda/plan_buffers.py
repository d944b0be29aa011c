"""Persistent device buffers of a plan: refilled in place, so a captured CUDA graph survives a new plan.

A CUDA graph records device pointers and launch arguments, not values. So everything that changes from
one step to the next (the work items, the layout's indices, the custom mask) lives in device buffers whose
addresses and section offsets depend only on their *capacity*; ``plan`` rewrites their contents; the
partial-state workspace and the merge counters keep fixed offsets. While a new plan fits the capacity,
every pointer and scalar the kernel sees is unchanged.

One int32 buffer holds every plan array, at 64-byte aligned offsets:

| section | shape | content |
|---|---|---|
| ``cta_indptr`` | ``[num_ctas+1]`` | CTA ``c`` runs items ``cta_indptr[c]:cta_indptr[c+1]`` |
| ``items`` | ``[W, ITEM_STRIDE]`` | one row of :data:`bsrattn.items.ITEM_FIELDS` per work item |
| ``merge_partials`` | ``[P]`` | as in :class:`~bsrattn.scheduler.WorkPlan` |
| ``alibi`` | ``[num_qo_heads]`` | the variant's ALiBi slopes (float32 bits) |
| ``rope`` | ``[head_dim // 2]`` | fused RoPE's frequencies, ``Variant.rope_frequencies`` (float32 bits) |
| ``rope_q`` | ``[nnz_qo]`` | fused RoPE's query positions, ``AttentionSpec.rope_frame`` (with RoPE only) |
| ``kv_indices`` | ``[nnz]`` | the layout's block ids |

An item row carries everything the kernel needs about its block row and its merge, so a program reads one
64-byte row and no per-row array: one round trip to memory before the KV loop starts, not two.

The custom mask (one byte per element) follows in the same allocation.

A refill is one compiled pass (:func:`_pack`, Numba) that writes every section into pinned host staging,
then one asynchronous copy of the bytes the plan uses: the sections up to the end of its ``kv_indices``
(and its mask, when it has one), not the whole capacity.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import astuple, dataclass, replace

import numpy as np
import torch

from bsrattn.compiled import Compiled
from bsrattn.indexing import ceil_div
from bsrattn.items import ITEM_STRIDE, first_slots, mask_starts, pack_items
from bsrattn.torch_cuda.config import next_pow2
from bsrattn.torch_cuda.arrays import canonical_device

SECTIONS = ("cta_indptr", "items", "merge_partials", "alibi", "rope", "rope_q", "kv_indices")
WORKSPACE_HEADROOM_BYTES = 64 * 2**20
"""Largest partial-state workspace sized for the worst case of a batch rather than for its first plan."""
_SERIALS = itertools.count()  # PlanBuffers.serial
_ALIGN = 16  # int32 elements: 64 bytes, so every section pointer keeps Triton's 16-byte alignment


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
    queries: int = 0  # query positions of fused RoPE

    @classmethod
    def needed(cls, work_plan, layout, rope: bool = False) -> "Capacity":
        mask = 0 if layout.custom_mask is None else layout.custom_mask.size
        return cls(work_plan.num_ctas, work_plan.num_items, work_plan.num_merges, work_plan.merge_partials.size,
                   layout.kv_indices.size, mask, work_plan.num_partial_rows, layout.nnz_qo if rope else 0)

    def fits(self, need: "Capacity") -> bool:
        return (self.num_ctas == need.num_ctas and self.items >= need.items and self.merges >= need.merges
                and self.partials >= need.partials and self.nnz >= need.nnz and self.mask >= need.mask
                and self.partial_rows >= need.partial_rows and self.queries >= need.queries)

    def grown(self, work_plan, num_qo_heads: int, head_dim_vo: int) -> "Capacity":
        """Headroom for later plans of the same batch, so a captured graph survives a change of lengths
        (``head_dim_vo``: the partial states' width, ``v``'s head dimension).

        A balanced plan cuts KV chunks of at least ``L_kv = total / num_ctas`` slots, so it has at most
        ``num_ctas + n_tiles`` items (``sum ceil(l / L_kv) <= sum (l / L_kv + 1)``), whatever the lengths:
        items, merges and partials are sized for that worst case, and so are the partial-state rows when
        that workspace stays under :data:`WORKSPACE_HEADROOM_BYTES` (decode; prefill keeps its own need).
        Every size is then :meth:`rounded`.
        """
        tiles = np.unique(work_plan.item_qo_start).size
        worst = self.num_ctas + tiles
        rows_per_tile = int((work_plan.item_qo_end - work_plan.item_qo_start).max(initial=1))
        partial_rows = max(self.partial_rows, worst * rows_per_tile)
        if partial_rows * num_qo_heads * (head_dim_vo + 1) * 4 > WORKSPACE_HEADROOM_BYTES:
            partial_rows = self.partial_rows
        return replace(self, items=max(self.items, worst), merges=max(self.merges, tiles),
                       partials=max(self.partials, worst), partial_rows=partial_rows).rounded()

    def rounded(self) -> "Capacity":
        """Every size rounded up to a power of two, at least 16: few distinct capacities, so few distinct launch
        arguments (the merge rows), whatever the lengths."""
        return Capacity(self.num_ctas, *(max(16, next_pow2(x)) for x in astuple(self)[1:]))

    def section_sizes(self, num_qo_heads: int, head_dim: int) -> dict:
        return {"cta_indptr": self.num_ctas + 1, "items": self.items * ITEM_STRIDE, "merge_partials": self.partials,
                "alibi": num_qo_heads, "rope": head_dim // 2, "rope_q": self.queries, "kv_indices": self.nnz}


# Offsets of the item-row fields, as constants of the compiled pass (as the kernel reads them).
_NONE = np.zeros(0, dtype=np.int32)  # an empty float section (no ALiBi, no RoPE)
_NO_POSITIONS = np.zeros(0, dtype=np.int64)  # no RoPE positions


def _float_bits(values) -> np.ndarray:
    """``values`` as the int32 bits of their float32 values (a float section), or empty for None."""
    return _NONE if values is None else np.asarray(values, dtype=np.float32).view(np.int32)


def _put(out, at, values):
    """``out[at:at + values.size] <- values``, as a loop over a section view: Numba's slice assignment does not
    vectorise, this does (memcpy speed)."""
    section = out[at:at + values.size]
    for i in range(values.size):
        section[i] = values[i]


def _pack(out,  # [plan elements] int32: the host staging of the plan sections
          cta_at, items_at, merge_at, alibi_at, rope_at, rope_q_at, kv_at,  # the sections' offsets, SECTIONS order
          first_slot,  # [R] int64 scratch
          cta_indptr,  # [num_ctas+1]
          item_row, item_qo_start, item_qo_end, item_kv_start, item_kv_end, item_partial,  # [W]
          merge_indptr, merge_partials, num_partial_rows,  # [M+1]; [P]; int
          qo_indptr, kv_indptr,  # [R+1]
          kv_indices,  # [nnz]
          kv_lens,  # [R]
          mask_indptr,  # [R+1] int64
          block_size,
          alibi_bits,  # [num_qo_heads] int32, the slopes' float32 bits ([0] without ALiBi)
          rope_bits,  # [head_dim // 2] int32, RoPE's frequencies' float32 bits ([0] without RoPE)
          rope_q,  # [nnz_qo] int64, RoPE's query positions ([0] without RoPE)
          rope_offsets):  # [R] int64, RoPE's positions of the rows' first slots ([0] without RoPE: zeros)
    """Write every plan section into ``out`` in one pass, with explicit loops (compiled by Numba when present).

    The item rows are :func:`bsrattn.items.pack_items`'s, in CTA order. A row's affine path
    (:func:`~bsrattn.items.first_slots`) is chosen per row and read at run time, so a captured CUDA graph
    stays valid whichever rows a later plan makes affine. Returns whether some row is.
    """
    _put(out, cta_at, cta_indptr)
    _put(out, merge_at, merge_partials)
    _put(out, alibi_at, alibi_bits)
    _put(out, rope_at, rope_bits)
    _put(out, rope_q_at, rope_q)
    _put(out, kv_at, kv_indices)
    any_affine = first_slots(first_slot, kv_indptr, kv_indices, block_size)
    num_items = item_row.size
    pack_items(out[items_at:items_at + num_items * ITEM_STRIDE].reshape((num_items, ITEM_STRIDE)), item_row,
               item_qo_start, item_qo_end, item_kv_start, item_kv_end, item_partial, merge_indptr, merge_partials,
               num_partial_rows, qo_indptr, kv_indptr, kv_lens, mask_indptr, first_slot, rope_offsets)
    return any_affine


_packer = Compiled(_pack, _put, first_slots, pack_items)


class _Ordered:
    """:meth:`PlanBuffers.ordered`'s context: the buffers' lock held, the stream followed."""

    __slots__ = ("buffers",)

    def __init__(self, buffers):
        self.buffers = buffers

    def __enter__(self):
        turn = self.buffers._turn
        turn.acquire()
        try:
            return self.buffers._follow_stream()
        except BaseException:
            turn.release()
            raise

    def __exit__(self, *exc):
        self.buffers._turn.release()


class PlanSections:
    """The plan's sections as the kernels take them, read through ``plan`` (the int32 buffer), ``offsets`` (name ->
    ``(offset, size)``, :data:`SECTIONS`): :class:`PlanBuffers`' accessors, and the custom op's view of its
    arguments (``ops.py``)."""

    plan: torch.Tensor
    offsets: dict

    def section(self, name: str) -> torch.Tensor:
        at, size = self.offsets[name]
        return self.plan[at:at + max(size, 1)]

    @property
    def item_capacity(self) -> int:
        """Work items the buffers hold (the item kernel's launch grid, ``item_kernel.py``)."""
        return self.offsets["items"][1] // ITEM_STRIDE

    @property
    def alibi(self) -> torch.Tensor:
        return self.section("alibi").view(torch.float32)

    @property
    def rope(self) -> torch.Tensor:
        return self.section("rope").view(torch.float32)


class PlanBuffers(PlanSections):
    """The plan arrays, custom mask, partial-state workspace and merge counters of one runner, on ``device``.

    ``part_o [partial_rows, num_qo_heads, head_dim_vo]`` and ``part_lse [partial_rows, num_qo_heads]`` (float32)
    hold split items' partial states, as wide as ``v`` (``head_dim_vo``: ``head_dim`` where None);
    ``sync [3 * merges + items, head_programs]`` (int32, one column a program of the launch grid's second dimension:
    ``LaunchConfig.head_programs``) holds the merge counters, which count the partial states of
    each split tile as they land so that the CTA writing the last one merges, and the flags of the items and merges
    whose output came out non-finite (``executor.py``).
    ``host_staging`` (default: on a CUDA device) fills a host copy, pinned on CUDA, and copies the bytes a
    plan uses to the device; without it the plan is written in place (the CPU, under the Triton interpreter).
    Every buffer but ``sync`` is allocated uninitialised (a one-shot call allocates a set): a launch reads only
    bytes written before it, the plan's by the refill, a partial state by the item that computes it. ``sync``
    is allocated zero, and each launch sets back to zero what it counts or flags.
    """

    def __init__(self, capacity: Capacity, num_qo_heads: int, head_programs: int, head_dim: int,
                 device: torch.device, host_staging: bool | None = None, head_dim_vo: int | None = None):
        device = canonical_device(device)
        self.capacity = capacity
        self.shape_key = (num_qo_heads, head_programs, head_dim, head_dim_vo, device)
        self.offsets = {}
        at = 0
        for name, size in capacity.section_sizes(num_qo_heads, head_dim).items():
            self.offsets[name] = (at, size)
            at += ceil_div(max(size, 1), _ALIGN) * _ALIGN
        # Flat (offset, size) pairs in SECTIONS order, then the merge rows of ``sync``: the form the attention
        # op takes them in.
        pairs = [x for name in SECTIONS for x in self.offsets[name]]
        self._section_at = pairs[::2]
        self.sections = pairs + [capacity.merges]
        self._plan_bytes = 4 * at
        total = self._plan_bytes + max(capacity.mask, 1)
        self.device = device
        self.raw = torch.empty(total, dtype=torch.uint8, device=device)
        if host_staging is None:
            host_staging = device.type == "cuda"
        # Pinned on CUDA, so the refill is one asynchronous copy in stream order.
        self.staging = (torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda") if host_staging
                        else self.raw)
        host = self.staging.numpy()
        self._host_plan = host[:self._plan_bytes].view(np.int32)
        self._host_mask = host[self._plan_bytes:]
        self._copied = torch.cuda.Event() if host_staging and device.type == "cuda" else None
        self.plan = self.raw[:self._plan_bytes].view(torch.int32)
        self.mask = self.raw[self._plan_bytes:]
        rows = max(capacity.partial_rows, 1)
        width = head_dim if head_dim_vo is None else head_dim_vo
        self.part_o = torch.empty((rows, num_qo_heads, width), dtype=torch.float32, device=device)
        self.part_lse = torch.empty((rows, num_qo_heads), dtype=torch.float32, device=device)
        # Merge counters for the first and the second launch, merge flags, item flags (executor.py, REDO).
        self.merge_rows = capacity.merges
        self.sync = torch.zeros((3 * capacity.merges + capacity.items, head_programs), dtype=torch.int32,
                                device=device)
        # Stands in for lse when the caller wants none: a launch always gets a tensor there.
        self.no_lse = torch.empty((1, 1), dtype=torch.float32, device=device)
        # Stands in for the prior state of a call that folds none (prior.prior_state).
        self.no_prior = torch.empty((1, 1), dtype=torch.float32, device=device)
        self.launches = {}  # LaunchConfig -> the launch.Launch bound to these buffers (runner.py)
        self.serial = next(_SERIALS)  # tells these buffers from any allocated before or after (Runner.graph_key)
        self.captured = False  # whether a CUDA graph capture has launched on these buffers (runner.py)
        self.captured_without_merges = False  # whether such a launch's kernel carried no merges (runner.py)
        self._turn = threading.Lock()
        self._stream = None  # the CUDA stream of the last launch or refill
        self._stream_handle = None  # its raw handle
        self._ordered = _Ordered(self)

    def ordered(self):
        """A context for one launch or refill over these buffers: one at a time, each after the last. It gives the
        current CUDA stream's handle (None off CUDA), which it has just read.

        The workspace and counters serve one launch at a time. Calls from several Python threads take
        turns; a call on another CUDA stream than the last one first waits for that stream, so two streams'
        launches cannot overlap on the same buffers. (Inside a CUDA graph capture the wait is left out: the
        capture is ordered by its caller, and so are a captured graph's replays.) The context is an object
        kept with the buffers, and the stream is compared by its raw handle: a ``contextmanager`` generator and
        ``torch.cuda.current_stream`` cost a small decode's ``run`` several µs.
        """
        return self._ordered

    def _follow_stream(self):
        """The current stream's handle, after making it wait for the last launch's stream if that was another."""
        if self.device.type != "cuda":
            return None
        handle = torch._C._cuda_getCurrentRawStream(self.device.index)
        if handle != self._stream_handle:
            stream = torch.cuda.current_stream(self.device)
            if self._stream is not None and not torch.cuda.is_current_stream_capturing():
                stream.wait_stream(self._stream)
            self._stream, self._stream_handle = stream, handle
        return handle

    def idle(self) -> bool:
        """Whether the last refill's copy to the device has finished, so a refill now would not wait for it."""
        return self._copied is None or self._copied.query()

    @property
    def workspace_bytes(self) -> int:
        return (self.part_o.numel() + self.part_lse.numel()) * 4

    def fits(self, need: Capacity, num_qo_heads, head_programs, head_dim, device, head_dim_vo=None) -> bool:
        return (self.shape_key == (num_qo_heads, head_programs, head_dim, head_dim_vo, device)
                and self.capacity.fits(need))

    def used_bytes(self, layout) -> tuple:
        """``(plan, mask)``: the bytes of the plan region and of the mask region that a plan over ``layout`` uses.

        The plan's sections end with ``kv_indices``, so its bytes are a prefix: up to the end of the layout's
        indices. The unused capacity after it, and after the mask, is never copied.
        """
        mask = 0 if layout.custom_mask is None else layout.custom_mask.size
        return 4 * (self.offsets["kv_indices"][0] + layout.kv_indices.size), mask

    def fill(self, work_plan, layout, alibi_slopes=None, rope_freqs=None, rope_positions=None) -> bool:
        """Write ``work_plan``, ``layout``'s arrays, the ALiBi slopes, the RoPE frequencies and positions
        (``AttentionSpec.rope_frame``'s pair) in place; whether some row is affine.

        One compiled pass (:func:`_pack`) writes every section into the host staging; the bytes the plan
        uses (:meth:`used_bytes`) then go to the device in one asynchronous copy (two with a custom mask).
        """
        mask_indptr = mask_starts(layout)
        if self._copied is not None:
            self._copied.synchronize()  # the previous refill's copy must have left the staging buffer
        wp = work_plan
        any_affine = _packer(
            self._host_plan, *self._section_at, np.empty(layout.num_rows, dtype=np.int64), wp.cta_indptr,
            wp.item_row, wp.item_qo_start, wp.item_qo_end,
            wp.item_kv_start, wp.item_kv_end, wp.item_partial, wp.merge_indptr, wp.merge_partials,
            wp.num_partial_rows, layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_lens,
            mask_indptr, layout.block_size, _float_bits(alibi_slopes), _float_bits(rope_freqs),
            *((_NO_POSITIONS, _NO_POSITIONS) if rope_positions is None else rope_positions))
        if layout.custom_mask is not None:
            self._host_mask[:layout.custom_mask.size] = layout.custom_mask.view(np.uint8)
        if self.staging is not self.raw:
            plan_bytes, mask_bytes = self.used_bytes(layout)
            self.raw[:plan_bytes].copy_(self.staging[:plan_bytes], non_blocking=True)
            if mask_bytes:
                at = self._plan_bytes
                self.raw[at:at + mask_bytes].copy_(self.staging[at:at + mask_bytes], non_blocking=True)
            if self._copied is not None:
                self._copied.record(torch.cuda.current_stream(self.device))  # the stream the copies went to
        return bool(any_affine)
