"""The paper's kernel at teaching size: KV tiles gathered through the BSR indices, FlashAttention on them, ⊕.

| stage | what | where | reference (``bsrattn/reference/``) |
|---|---|---|---|
| plan | query tiles x KV chunks, merge lists in chunk order | :func:`plan_options` | ``config.plan_options`` |
| gather | slot ``i``: ``kv_indices[kv_indptr[r] + i // Bc] * Bc + i % Bc`` | :func:`gather_slots` | ``row_slots`` |
| rope | ``q`` turned once per program, each ``k`` tile as it comes | :func:`rope` | ``microkernel.rope`` |
| scores | ``q . k``, scale, soft cap, ALiBi; causal, window, custom mask | :func:`score` | ``microkernel.transform`` |
| softmax | running max, rescale, running sum, ``P @ V``; FlashSigmoid | :func:`attention_kernel` | ``attend`` |
| finish | ``o / l``, natural-log LSE; empty rows 0 / -inf, poisoned NaN | :func:`finish` | ``attend``'s tail |
| merge | split rows' partial states, ⊕ in plan order | :func:`merge_kernel` | ``execute``; ``merge.merge_state`` |

One program per (work item, KV head): the rows of its tile are (query row, query head of the KV head's group) pairs,
so one K/V tile serves the whole group. ``v`` and ``out`` may be narrower than ``q`` and ``k`` (``head_dim_vo``,
multi-head latent attention): the value tile, the accumulator and every state are ``BLOCK_DV`` wide, the score tiles
``BLOCK_D``. An unsplit item writes ``out`` and ``lse``, a split one its workspace rows, which the merge kernel then
folds. Every variant feature is a compile-time switch, a constant or a pointer that is
None, compiled away when off: a model has one of each.
"""

from __future__ import annotations

import os
import types

import numpy as np
import torch
import triton
import triton.language as tl

from bsrattn import indexing, scheduler
from bsrattn.items import ITEM, ITEM_STRIDE, item_table
from bsrattn.state import write_into
from bsrattn.torch_cuda.arrays import SUPPORTED, default_device, to_numpy, to_torch
from bsrattn.validation import dtype_name

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BLOCK_N = 16 if INTERPRETING else 64
"""KV slots per tile, and the plan's chunk unit. Under the interpreter ``tl.dot``'s smallest, so that the tests'
short rows span several tiles; compiled, float32 (IEEE dots on CUDA cores) and heads over 128 wide take 16, which
keeps their tiles in registers."""
MAX_BLOCK_M = 64
BLOCK_R = 32  # (query row, head) pairs per merge program
HEAD_DIM_VO = True  # v and out may be narrower than q and k (multi-head latent attention)
INTERPRETER_SMS = 4  # few programs keep the interpreter fast, and rows still split


def _device_function(fn):
    """A shared index function of :mod:`bsrattn.indexing` as a Triton function (the interpreter wants ``tl`` in its
    globals, which the shared module does not import)."""
    return triton.jit(types.FunctionType(fn.__code__, dict(fn.__globals__, tl=tl), fn.__name__))


query_position, mask_offset, tile_query, tile_head = map(
    _device_function, (indexing.query_position, indexing.mask_offset, indexing.tile_query, indexing.tile_head))
STRIDE = tl.constexpr(ITEM_STRIDE)
QO_START, QO_END, KV_START, KV_END, PARTIAL, QO_FIRST, QO_LEN, KV_LEN, BLOCK_START, MASK_START, ROPE_OFFSET = (
    tl.constexpr(ITEM[name]) for name in ("qo_start", "qo_end", "kv_start", "kv_end", "partial", "qo_first", "qo_len",
                                          "kv_len", "block_start", "mask_start", "rope_offset"))


@triton.jit
def dot(a, b):  # float32 with IEEE products: TF32 would lose float32's accuracy
    return tl.dot(a, b, input_precision="ieee" if a.dtype == tl.float32 else None)


@triton.jit
def load_tile(ptr, offsets, valid, cols, HEAD_DIM: tl.constexpr):  # offsets, valid [R] (int64 elements); cols [BD]
    """``[R, BLOCK_D]`` rows at ``offsets`` from ``ptr`` (unit stride along the head), 0 outside ``valid`` and
    ``HEAD_DIM``."""
    return tl.load(ptr + offsets[:, None] + cols[None, :], mask=valid[:, None] & (cols[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def store_state(o_ptr, lse_ptr, rows, valid, d, o, lse, HEAD_DIM: tl.constexpr):  # rows [R] int64; o [R, BLOCK_D]
    """``o``, ``lse`` into rows ``rows`` (flat (query row, head) pairs) of ``o_ptr [rows, HEAD_DIM]``, ``lse_ptr``."""
    tl.store(o_ptr + rows[:, None] * HEAD_DIM + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & (d[None, :] < HEAD_DIM))
    tl.store(lse_ptr + rows, lse, mask=valid)


@triton.jit
def gather_slots(kv_indices, block_start, block_size, i, valid):  # i, valid [BLOCK_N]
    """``(block, slot within it)`` of a row's logical KV slots ``i`` in the pool (:func:`bsrattn.indexing.sparse_slot`):
    slot ``i % Bc`` of block ``kv_indices[kv_indptr[r] + i // Bc]``, whatever ``Bc`` (1: ragged, a page: paged). K's
    element offsets are ``block * stride_block + slot * stride_slot``, V's the same in its own strides."""
    block = tl.load(kv_indices + block_start + i // block_size, mask=valid, other=0)
    return block.to(tl.int64), i % block_size


@triton.jit
def rope(x, ptr, offsets, valid, pos, freqs, d, HEAD_DIM: tl.constexpr):  # x [R, BLOCK_D]; offsets, valid, pos [R]
    """``x`` (the rows at ``offsets`` from ``ptr``) turned at positions ``pos`` (reference ``rope``): dims ``i`` and
    ``i + D/2`` by ``pos * freqs[i]``, ``freqs [D/2]`` f32. With each dim's pair loaded as a tile of its own
    (``partner``), the turn is ``x cos + sign partner sin``, the sign -1 in the first half."""
    half: tl.constexpr = HEAD_DIM // 2
    partner = load_tile(ptr, offsets, valid, tl.where(d < HEAD_DIM, (d + half) % HEAD_DIM, d), HEAD_DIM)
    angle = pos.to(tl.float32)[:, None] * tl.load(freqs + d % half, mask=d < HEAD_DIM, other=0.0)[None, :]
    sign = tl.where(d < half, -1.0, 1.0)[None, :]
    return (x.to(tl.float32) * tl.cos(angle) + sign * partner.to(tl.float32) * tl.sin(angle)).to(x.dtype)


@triton.jit
def score(q, k, q_pos, k_pos, visible, qk_scale, alibi, head, mask, mask_row,  # q [M, BD]; k [N, BD]; visible [M, N]
          CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, SOFT_CAP: tl.constexpr):
    """The variant: ``[BLOCK_M, BLOCK_N]`` scores, ``-inf`` where hidden, and which of ``visible`` (the pairs in
    range) a query sees.

    ``s = qk_scale * q . k``, soft cap ``cap * tanh(s / cap)``, ALiBi ``+ slope * (k_pos - q_pos)`` (reference
    ``transform``); the masks of :func:`bsrattn.indexing.key_visible` and the layout's custom mask (a query's row of
    it from element ``mask_row``). ``alibi`` and ``mask`` are None when off.
    """
    s = dot(q, tl.trans(k)) * qk_scale
    if SOFT_CAP > 0:  # tanh from exp: saturates to +-1 where exp overflows
        s = SOFT_CAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFT_CAP) + 1.0))
    if alibi is not None:
        s += tl.load(alibi + head)[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    if CAUSAL:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if WINDOW_LEFT >= 0:
        visible &= q_pos[:, None] - k_pos[None, :] <= WINDOW_LEFT
    if mask is not None:
        visible &= tl.load(mask + mask_row[:, None] + k_pos[None, :], mask=visible, other=0) != 0
    return tl.where(visible, s, float("-inf")), visible


@triton.jit
def finish(acc, m_i, l_i, poisoned, v_scale, SIGMOID: tl.constexpr):  # acc [M, BLOCK_D]; m_i, l_i, poisoned [M]
    """``(o, lse)`` of the running state (reference ``attend``'s tail). A row that saw a non-finite ``v`` of a
    visible key (``poisoned``) is all NaN, unless its weights are all 0: then it is empty, ``o = 0``,
    ``lse = -inf``. A NaN or ``+inf`` score made ``l`` NaN, which is not 0: such a row is NaN, never empty."""
    if SIGMOID:  # no normalisation, and no LSE
        o = tl.where(poisoned[:, None] != 0, float("nan"), acc * v_scale)
        return o, tl.full(m_i.shape, float("nan"), tl.float32)
    seen = l_i != 0.0
    o = tl.where((seen & (poisoned != 0))[:, None], float("nan"), acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None])
    return o, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))


@triton.jit
def attention_kernel(
        q, k, v, out, lse,  # q [nnz_qo, Hq, D], out [nnz_qo, Hq, Dv]; k, v: the pool in its storage view; lse f32
        part_o, part_lse,  # [partial_rows, Hq, Dv], [partial_rows, Hq] f32: the split items' states
        items, kv_indices, mask,  # [W, ITEM_STRIDE] i32 (bsrattn.items); [nnz] i32; custom mask u8 or None
        alibi, rope_freqs, rope_q,  # [Hq] f32, [D/2] f32, [nnz_qo] i32 (fused RoPE's query positions), or None
        stride_block, stride_slot, stride_head, block_size,  # slot i of block b, KV head h: b, i, h strides of k
        stride_v_block, stride_v_slot, stride_v_head,  # the same of v
        qk_scale, v_scale,  # sm_scale * k_scale; v_scale
        HEAD_DIM: tl.constexpr, HEAD_DIM_VO: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
        WINDOW_LEFT: tl.constexpr, SOFT_CAP: tl.constexpr, SIGMOID_BIAS: tl.constexpr):
    """Work item ``program_id(0)`` for KV head ``program_id(1)``: ``BLOCK_M`` of its rows (from ``program_id(2) *
    BLOCK_M``) over its KV range, a tile at a time (reference ``attend_range``)."""
    item = items + tl.program_id(0) * STRIDE
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    qo_start, qo_end = tl.load(item + QO_START), tl.load(item + QO_END)
    kv_start, kv_end, block_start = tl.load(item + KV_START), tl.load(item + KV_END), tl.load(item + BLOCK_START)
    qo_first, qo_len, kv_len = tl.load(item + QO_FIRST), tl.load(item + QO_LEN), tl.load(item + KV_LEN)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row = qo_start + tile_query(m, GROUP)  # query-major: the group's heads of one query are adjacent rows
    head = tile_head(kv_head, GROUP, m)
    valid = row < qo_end
    q_pos = query_position(qo_len, kv_len, row - qo_first)
    mask_row = mask_offset(tl.load(item + MASK_START), kv_len, row - qo_first, 0)
    at = row.to(tl.int64) * num_heads + head  # flat (query row, head) rows of q, out and lse
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    qt = load_tile(q, at * HEAD_DIM, valid, d, HEAD_DIM)
    if rope_freqs is not None:
        qt = rope(qt, q, at * HEAD_DIM, valid, tl.load(rope_q + row, mask=valid, other=0), rope_freqs, d, HEAD_DIM)
    k_head, v_head = k + kv_head * stride_head, v + kv_head * stride_v_head
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(s - m_i)
    poisoned = tl.zeros([BLOCK_M], tl.int32)  # saw a NaN or an infinity in a visible key's v
    for start in range(kv_start, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        in_range = k_pos < kv_end
        block, slot = gather_slots(kv_indices, block_start, block_size, k_pos, in_range)
        offsets = block * stride_block + slot * stride_slot
        kt = load_tile(k_head, offsets, in_range, d, HEAD_DIM).to(qt.dtype)  # fp8 KV: exact in fp16 and bf16
        if rope_freqs is not None:
            kt = rope(kt, k_head, offsets, in_range, k_pos + tl.load(item + ROPE_OFFSET), rope_freqs, d, HEAD_DIM)
        s, vis = score(qt, kt, q_pos, k_pos, valid[:, None] & in_range[None, :], qk_scale, alibi, head, mask,
                       mask_row, CAUSAL, WINDOW_LEFT, SOFT_CAP)
        # A hidden key weighs 0, but 0 * NaN is NaN in P @ V: every non-finite v becomes 0, and the queries that
        # see such a key are marked instead.
        vt = load_tile(v_head, block * stride_v_block + slot * stride_v_slot, in_range, dv, HEAD_DIM_VO).to(qt.dtype)
        finite = tl.abs(vt.to(tl.float32)) < float("inf")
        poisoned |= tl.max(tl.where(vis, tl.max(tl.where(finite, 0, 1), 1)[None, :], 0), 1)
        vt = tl.where(finite, vt, 0.0)
        if SIGMOID_BIAS is not None:
            acc += dot(tl.sigmoid(s + SIGMOID_BIAS).to(vt.dtype), vt)  # a hidden key: sigmoid(-inf) = 0
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: shift by 0, not by -inf
            alpha = tl.exp(m_i - m_safe)  # rescales what was summed under the old max
            p = tl.exp(s - m_safe[:, None])  # a +inf score: exp(inf - inf) = NaN, as it must
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt)
            m_i = m_new
    o, s_out = finish(acc, m_i, l_i, poisoned, v_scale, SIGMOID_BIAS is not None)
    partial = tl.load(item + PARTIAL)
    if partial < 0:
        store_state(out, lse, at, valid, dv, o, s_out, HEAD_DIM_VO)
    else:  # workspace rows partial + (query row - qo_start), laid out as out's
        part = (partial + row - qo_start).to(tl.int64) * num_heads + head
        store_state(part_o, part_lse, part, valid, dv, o, s_out, HEAD_DIM_VO)


@triton.jit
def merge_pair(o_a, lse_a, o_b, lse_b):  # o_a, o_b [R, BLOCK_D] f32; lse_a, lse_b [R] f32
    """``(o_a, lse_a) ⊕ (o_b, lse_b)`` (reference ``merge_state``): an empty state adds exactly nothing, whatever
    its ``o``; a NaN or ``+inf`` LSE gives NaN through its own weight."""
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    t_a = tl.where((lse_a == float("-inf"))[:, None], 0.0, w_a[:, None] * o_a)
    t_b = tl.where((lse_b == float("-inf"))[:, None], 0.0, w_b[:, None] * o_b)
    total = w_a + w_b
    empty = total == 0.0
    o = (t_a + t_b) / tl.where(empty, 1.0, total)[:, None]
    return o, tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))


@triton.jit
def merge_kernel(part_o, part_lse, out, lse,  # [partial_rows, Hq, Dv], [partial_rows, Hq] f32; out, lse as above
                 merge_qo_start, merge_qo_end, merge_indptr, merge_partials,  # the WorkPlan's merge arrays
                 num_heads, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 SIGMOID: tl.constexpr):
    """Merge ``program_id(0)``: its partial states folded in the plan's order, ⊕ or a sum for FlashSigmoid, for
    ``BLOCK_R`` of its (query row, head) pairs (reference ``execute``'s merge loop). ``HEAD_DIM`` is the states'
    width, ``v``'s."""
    merge = tl.program_id(0)
    qo_start = tl.load(merge_qo_start + merge)
    i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # pair i: query row qo_start + i // Hq, head i % Hq
    valid = i < (tl.load(merge_qo_end + merge) - qo_start) * num_heads
    d = tl.arange(0, BLOCK_D)
    lo, hi = tl.load(merge_indptr + merge), tl.load(merge_indptr + merge + 1)
    rows = tl.load(merge_partials + lo).to(tl.int64) * num_heads + i  # a partial's pairs are laid out as out's
    o = load_tile(part_o, rows * HEAD_DIM, valid, d, HEAD_DIM)
    s = tl.load(part_lse + rows, mask=valid, other=float("-inf"))
    for j in range(lo + 1, hi):
        rows = tl.load(merge_partials + j).to(tl.int64) * num_heads + i
        o_b = load_tile(part_o, rows * HEAD_DIM, valid, d, HEAD_DIM)
        if SIGMOID:
            o += o_b
        else:
            o, s = merge_pair(o, s, o_b, tl.load(part_lse + rows, mask=valid, other=float("-inf")))
    store_state(out, lse, qo_start.to(tl.int64) * num_heads + i, valid, d, o, s, HEAD_DIM)


def _strides(x, view) -> tuple:
    """``(stride_block, stride_slot, stride_head)`` of ``k`` or ``v`` stored as ``view``."""
    st = x.stride()
    return {"NHD": (st[0], st[1], st[2]), "HND": (st[0], st[2], st[1]), "NHD3": (st[0], 0, st[1])}[view]


def plan_options(spec) -> dict:
    """Scheduler options: chunks of whole KV tiles, split for one program per SM and KV head, query tiles of at
    most ``MAX_BLOCK_M`` rows x group heads. Every way to a run plans here first, so the spec is checked here."""
    if spec.split_size is not None:
        raise ValueError("the torch core has no deterministic mode (deterministic=True, split_size): use the "
                         "shipped kernel")
    sms = INTERPRETER_SMS if INTERPRETING or not torch.cuda.is_available() else \
        torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return dict(num_ctas=max(1, sms // spec.num_kv_heads), tile_q=max(1, MAX_BLOCK_M // spec.group_size),
                min_split_size=BLOCK_N, kv_align=BLOCK_N)


class Runner:
    """``work_plan`` for ``spec``, its arrays on ``device``; ``run`` launches the attention kernel, then the merge."""

    def __init__(self, spec, work_plan, device):
        layout, variant, wp = spec.layout, spec.variant, work_plan
        self.spec, self.work_plan, self.device = spec, work_plan, device
        q_turn, k_offsets = spec.rope_frame() if variant.use_rope else (None, None)
        up = self._upload
        self.items, self.kv_indices = up(item_table(wp, layout, k_offsets)), up(layout.kv_indices)
        self.mask = None if layout.custom_mask is None else up(layout.custom_mask, np.uint8)
        self.alibi = None if variant.alibi_slopes is None else up(variant.alibi_slopes, np.float32)
        self.rope_freqs = None if q_turn is None else up(variant.rope_frequencies(spec.head_dim), np.float32)
        self.rope_q = None if q_turn is None else up(q_turn)
        self.merges = [up(x) for x in (wp.merge_qo_start, wp.merge_qo_end, wp.merge_indptr, wp.merge_partials)]
        rows = int(np.max(wp.item_qo_end - wp.item_qo_start, initial=1)) * spec.group_size  # an item's tile rows
        self.block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
        self.grid = (wp.num_items, spec.num_kv_heads, triton.cdiv(rows, self.block_m))
        pairs = int(np.max(wp.merge_qo_end - wp.merge_qo_start, initial=1)) * spec.num_qo_heads
        self.merge_grid = (wp.num_merges, triton.cdiv(pairs, BLOCK_R))

    def _upload(self, x, dtype=np.int32) -> torch.Tensor:
        x = np.array(x, dtype=dtype)  # a copy: the layout's arrays are read-only
        return torch.from_numpy(x if x.size else np.zeros(1, dtype)).to(self.device)  # no kernel gets a null pointer

    def launches(self, q, k, v, out, lse, k_scale=None, v_scale=None) -> list:
        """``(kernel, grid, args, kwargs)`` of each launch on contiguous tensors on the device: ``q``, ``k``/``v`` in
        a storage view, ``out [nnz_qo, Hq, Dv]`` in ``q``'s dtype (``Dv``: ``spec.dim_vo``), ``lse [nnz_qo, Hq]``
        float32 (the sm_90 compile check compiles these)."""
        spec, variant = self.spec, self.spec.variant
        rows = (max(self.work_plan.num_partial_rows, 1), spec.num_qo_heads)
        part_o, part_lse = (torch.empty(shape, dtype=torch.float32, device=q.device) for shape in
                            (rows + (spec.dim_vo,), rows))
        view = spec.kv_view_of(k)
        args = (q, k, v, out, lse, part_o, part_lse, self.items, self.kv_indices, self.mask, self.alibi,
                self.rope_freqs, self.rope_q, *_strides(k, view), spec.layout.block_size, *_strides(v, view),
                spec.sm_scale * (1.0 if k_scale is None else k_scale), 1.0 if v_scale is None else v_scale)
        block_d, block_dv = (max(16, triton.next_power_of_2(n)) for n in (spec.head_dim, spec.dim_vo))
        kwargs = dict(HEAD_DIM=spec.head_dim, HEAD_DIM_VO=spec.dim_vo, GROUP=spec.group_size, BLOCK_M=self.block_m,
                      BLOCK_D=block_d, BLOCK_DV=block_dv,
                      BLOCK_N=16 if q.dtype == torch.float32 or spec.head_dim > 128 else BLOCK_N,
                      CAUSAL=variant.causal, WINDOW_LEFT=variant.window_left, SOFT_CAP=variant.logits_soft_cap,
                      SIGMOID_BIAS=variant.sigmoid_bias, num_warps=8 if self.block_m > 16 else 4)  # registers
        merge = ((part_o, part_lse, out, lse, *self.merges, spec.num_qo_heads),
                 dict(HEAD_DIM=spec.dim_vo, BLOCK_R=BLOCK_R, BLOCK_D=block_dv, SIGMOID=variant.use_sigmoid))
        return [(attention_kernel, self.grid, args, kwargs), (merge_kernel, self.merge_grid, *merge)]

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """Attention of the plan on ``q [nnz_qo, Hq, D]``, ``k``/``v`` (a storage view): ``(out [nnz_qo, Hq, Dv],
        lse or None)`` in the kind ``q`` came in (NumPy in, NumPy out), written into ``out``/``lse`` where given."""
        as_numpy = not isinstance(q, torch.Tensor)
        q, k, v = (to_torch(name, x, self.device).contiguous() for name, x in zip("qkv", (q, k, v)))
        if dtype_name(q) not in SUPPORTED:  # k and v were checked against q (validation.py)
            raise TypeError(f"q has dtype {dtype_name(q)}; the torch core supports {SUPPORTED}")
        o = torch.empty(q.shape[:2] + (self.spec.dim_vo,), dtype=q.dtype, device=self.device)
        s = torch.empty(q.shape[:2], dtype=torch.float32, device=self.device)
        for kernel, grid, args, kwargs in self.launches(q, k, v, o, s, k_scale, v_scale):
            if grid[0]:
                kernel[grid](*args, **kwargs)
        s = None if self.spec.variant.use_sigmoid else s
        if as_numpy:
            o, s = to_numpy(o), None if s is None else to_numpy(s)
        o, s = write_into(o, s, out, lse)
        return o, (s if return_lse or lse is not None else None)


def make_runner(spec, work_plan, previous=None) -> Runner:
    """``work_plan`` bound to ``spec`` on the default device (``previous`` is not reused: the core keeps nothing)."""
    return Runner(spec, work_plan, default_device())


def attention(spec, q, k, v, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
    """One shot: plan with :func:`plan_options`, then run."""
    work_plan = scheduler.plan(spec.layout.qo_lens, spec.layout.kv_lens, **plan_options(spec))
    return make_runner(spec, work_plan).run(q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale,
                                            v_scale=v_scale)
